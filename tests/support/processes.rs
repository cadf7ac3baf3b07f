//! Business processes for the cluster tests: real SDK clients
//! (`wasmrelay-client`) on real TCP, each recording what it received,
//! replying upstream and acking, and a node config to run them against.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::task::JoinHandle;
use wasmrelay_client::{Client, ClientConfig, Event, OutgoingMessage};

/// One delivery a process received (and acked).
#[derive(Clone, Debug)]
pub struct Received {
    /// The process that got it.
    pub process_id: String,
    /// The node it came through.
    pub node_id: String,
    /// `topic/partition/offset`.
    pub delivery_id: String,
    /// The message value.
    pub value: Vec<u8>,
    /// Input partition and offset.
    pub partition: i32,
    /// Input offset.
    pub offset: i64,
}

/// Many processes, their clients and what they received.
#[derive(Debug, Default)]
pub struct ProcessPool {
    received: Arc<Mutex<Vec<Received>>>,
    events: Arc<Mutex<Vec<(String, String)>>>,
    clients: Vec<(String, Client)>,
    tasks: Vec<JoinHandle<()>>,
}

impl ProcessPool {
    /// Connects `process_id` to `addresses` (tried in order), with a token
    /// for it ([`crate::client_tokens::token`]); with `reply`, each
    /// delivery's value is sent back upstream before the ack.
    pub async fn connect(&mut self, addresses: &[String], process_id: &str, reply: bool) {
        let config = ClientConfig::new(addresses.to_vec(), process_id)
            .with_token(crate::client_tokens::token(process_id));
        self.connect_with(config, reply).await;
    }

    /// Connects the process `config` describes (its backoff shortened for
    /// tests); with `reply`, as [`ProcessPool::connect`].
    pub async fn connect_with(&mut self, config: ClientConfig, reply: bool) {
        self.connect_slow(config, reply, std::time::Duration::ZERO)
            .await;
    }

    /// As [`ProcessPool::connect_with`], for a slow process: it takes
    /// `ack_delay` over each delivery before it acks it.
    pub async fn connect_slow(
        &mut self,
        mut config: ClientConfig,
        reply: bool,
        ack_delay: std::time::Duration,
    ) {
        let process_id = config.process_id.clone();
        let process_id = process_id.as_str();
        config.initial_backoff = std::time::Duration::from_millis(50);
        config.max_backoff = std::time::Duration::from_millis(500);
        let (client, mut events) = Client::connect(config)
            .await
            .unwrap_or_else(|e| panic!("process {process_id} could not connect: {e}"));
        let received = self.received.clone();
        let log = self.events.clone();
        let sender = client.clone();
        let id = process_id.to_string();
        // The pool keeps the handle and aborts the task when it is dropped.
        #[allow(clippy::disallowed_methods)]
        self.tasks.push(tokio::spawn(async move {
            while let Some(event) = events.next().await {
                match event {
                    Event::Delivery(delivery) => {
                        if !ack_delay.is_zero() {
                            tokio::time::sleep(ack_delay).await;
                        }
                        if reply {
                            let answer = OutgoingMessage::reply_to(
                                &delivery,
                                delivery.message.value.clone(),
                            );
                            if sender.send(answer).await.is_err() {
                                continue; // not acked: delivered again
                            }
                        }
                        let record = Received {
                            process_id: id.clone(),
                            node_id: delivery.node_id().to_string(),
                            delivery_id: delivery.delivery_id.clone(),
                            value: delivery.message.value.to_vec(),
                            partition: delivery.message.partition,
                            offset: delivery.message.offset,
                        };
                        if delivery.ack().is_ok() {
                            received.lock().unwrap().push(record);
                        }
                    }
                    other => log.lock().unwrap().push((id.clone(), format!("{other:?}"))),
                }
            }
        }));
        self.clients.push((process_id.to_string(), client));
    }

    /// Everything received so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// How many deliveries were received so far.
    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    /// Events other than deliveries, as (process, debug text).
    pub fn events(&self) -> Vec<(String, String)> {
        self.events.lock().unwrap().clone()
    }

    /// The node each process is connected to now.
    pub fn nodes(&self) -> HashMap<String, Option<String>> {
        self.clients
            .iter()
            .map(|(id, client)| (id.clone(), client.node_id()))
            .collect()
    }

    /// The node each process is connected to, once every one of them is
    /// connected: a process a node redirected is between two connections
    /// for a moment after `connect` returns. Panics after `timeout` with the
    /// processes still without a node.
    pub async fn settled_nodes(&self, timeout: std::time::Duration) -> HashMap<String, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let nodes = self.nodes();
            if nodes.values().all(Option::is_some) {
                return nodes
                    .into_iter()
                    .map(|(id, node)| (id, node.unwrap_or_default()))
                    .collect();
            }
            if tokio::time::Instant::now() >= deadline {
                let waiting: Vec<&String> = nodes
                    .iter()
                    .filter(|(_, node)| node.is_none())
                    .map(|(id, _)| id)
                    .collect();
                panic!("after {timeout:?} these processes are still not connected: {waiting:?}");
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

impl Drop for ProcessPool {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The config of cluster node `node_id` on the broker at `bootstrap`, its
/// cluster flow consuming `business` with the built-in router; every
/// listener on `127.0.0.1:0` (the relay logs what it got, see
/// [`crate::relay::RelayProcess::client_addr`]); clients authenticate with
/// tokens of [`crate::client_tokens`]; `extra_cluster` is appended to
/// `[cluster]`.
pub fn node_config(node_id: &str, bootstrap: &str, extra_cluster: &str) -> String {
    let plugins = crate::plugins_dist().display();
    let client_keys = crate::client_tokens::cluster_keys();
    format!(
        r#"
[node]
id = "{node_id}"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
[links.main]
bootstrap_servers = "{bootstrap}"
[links.main.options]
"fetch.wait.max.ms" = "10"
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
"batch.num.messages" = "1"
[cluster]
link = "main"
client_listen = "127.0.0.1:0"
mesh_listen = "127.0.0.1:0"
secret = "test-cluster-secret-0123456789abcdef"
heartbeat_interval = "500ms"
node_timeout = "3s"
alarm_topic = "wasmrelay.alarms"
{client_keys}
{extra_cluster}
[[flows]]
name = "business"
link = "main"
input_topic = "business"
group = "wasmrelay-cluster"
output_topic = "business.replies"
dead_letter_topic = "business.dlq"
retry = {{ initial_backoff = "20ms", max_backoff = "200ms", budget = "20s" }}
[flows.deliver.cluster]
ttl = "30s"
"#
    )
}
