//! `wasmrelay demo`: a self-contained sidecar on a development broker.
//!
//! Everything runs in this process: librdkafka's mock cluster as the Kafka
//! broker (a development broker, not a real one), a demo application that
//! answers service calls over HTTP, a relay node with the example plugins
//! (`json-enrich` on service calls, `mask-fields` on data-returns), and a
//! producer of sample orders. It prints a few messages before and after the
//! plugins and a live summary.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use rdkafka::Message as _;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::config::{
    AdminConfig, AppTarget, DeliverConfig, FlowConfig, LinkConfig, NodeConfig, PluginsConfig,
    RelayConfig, RetryConfig,
};
use crate::telemetry::metrics::RelayMetrics;

const INPUT: &str = "service-calls";
const OUTPUT: &str = "data-returns";
const DEAD_LETTERS: &str = "service-calls.dlq";
/// Partitions of the demo's topics.
const DEMO_PARTITIONS: i32 = 3;
/// How many messages are shown before and after the plugins.
const SHOWN: usize = 3;

/// What the demo runs.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// Stop after this many messages (all accounted for); `None`: until Ctrl-C.
    pub messages: Option<u64>,
    /// Messages produced per second.
    pub rate: u32,
    /// Directory of the example plugins.
    pub plugins_dir: PathBuf,
}

/// Runs the demo until `--messages` are through or `shutdown` is cancelled.
pub async fn run(options: DemoOptions, shutdown: CancellationToken) -> anyhow::Result<()> {
    // The relay gets a directory of its own with just the plugins the demo
    // uses (the example directory also holds the test-only fault plugins).
    let demo_plugins = tempfile::tempdir().context("creating the demo's plugin directory")?;
    for plugin in ["json-enrich", "mask-fields"] {
        let path = options.plugins_dir.join(format!("{plugin}.wasm"));
        anyhow::ensure!(
            path.is_file(),
            "the demo needs the example plugins: {} is missing (build them with plugins/build.sh, \
             or point --plugins at their directory)",
            path.display()
        );
        std::fs::copy(&path, demo_plugins.path().join(format!("{plugin}.wasm")))
            .with_context(|| format!("copying {}", path.display()))?;
    }
    let cluster = MockCluster::new(1).context("starting the embedded development broker")?;
    for topic in [INPUT, OUTPUT, DEAD_LETTERS] {
        cluster
            .create_topic(topic, DEMO_PARTITIONS, 1)
            .with_context(|| format!("creating topic {topic} on the development broker"))?;
    }
    let bootstrap = cluster.bootstrap_servers();
    say(&format!(
        "development broker (librdkafka mock cluster, in this process, not a real Kafka) at {bootstrap}"
    ));

    let app = DemoApp::start().await?;
    say(&format!("demo application listening at {}", app.url));

    let metrics = Arc::new(RelayMetrics::new());
    let relay_stop = CancellationToken::new();
    let relay = tokio::spawn(crate::node::run_with_metrics(
        demo_config(&bootstrap, &app.url, demo_plugins.path()),
        metrics.clone(),
        relay_stop.clone(),
    ));

    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .context("creating the demo producer")?;
    let viewer_stop = CancellationToken::new();
    let returns = watch_data_returns(&bootstrap, viewer_stop.clone())?;
    let produce_stop = CancellationToken::new();
    let produced = Arc::new(AtomicU64::new(0));
    let producing = tokio::spawn(produce_orders(
        producer,
        options.clone(),
        produced.clone(),
        produce_stop.clone(),
    ));

    let flow = metrics.flow("orders");
    let started = Instant::now();
    let mut last = (Instant::now(), 0u64);
    let mut shown_returns = 0;
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    let outcome = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            _ = ticker.tick() => {}
            returned = returns.recv() => {
                if let Ok(Some(value)) = returned && shown_returns < SHOWN {
                    shown_returns += 1;
                    say(&format!("data-return after mask-fields:   {value}"));
                }
                continue;
            }
        }
        if relay.is_finished() {
            break Err(anyhow::anyhow!("the relay stopped unexpectedly"));
        }
        let (returned, dead) = (flow.returned.get(), flow.dead_lettered.get());
        let rate = (flow.consumed.get() - last.1) as f64 / last.0.elapsed().as_secs_f64();
        last = (Instant::now(), flow.consumed.get());
        say(&format!(
            "[{:>4}s] produced {:>6}  consumed {:>6}  delivered {:>6}  returned {:>6}  dead letters {:>4}  retries {:>4}  {:>7.0} msg/s",
            started.elapsed().as_secs(),
            produced.load(Ordering::Relaxed),
            flow.consumed.get(),
            flow.delivered.get(),
            returned,
            dead,
            flow.retried.get(),
            rate,
        ));
        if options.messages.is_some_and(|n| returned + dead >= n) {
            break Ok(());
        }
    };
    // Show the data-returns still on their way (the reader may lag the relay).
    let show_until = Instant::now() + Duration::from_secs(5);
    while shown_returns < SHOWN.min(flow.returned.get() as usize) && Instant::now() < show_until {
        match tokio::time::timeout(Duration::from_millis(200), returns.recv()).await {
            Ok(Ok(Some(value))) => {
                shown_returns += 1;
                say(&format!("data-return after mask-fields:   {value}"));
            }
            Ok(Err(())) => break,
            _ => {}
        }
    }
    produce_stop.cancel();
    let _ = producing.await;
    relay_stop.cancel();
    relay.await.context("the relay task")??;
    viewer_stop.cancel();
    returns.closed().await;
    say(&format!(
        "done: {} delivered to the app, {} data-returns, {} dead letters (orders with quantity 0 are rejected by the app)",
        flow.delivered.get(),
        flow.returned.get(),
        flow.dead_lettered.get()
    ));
    drop(cluster);
    outcome
}

#[allow(clippy::print_stdout)]
fn say(line: &str) {
    println!("{line}");
}

fn demo_config(bootstrap: &str, app_url: &str, plugins_dir: &std::path::Path) -> RelayConfig {
    RelayConfig {
        node: NodeConfig { id: "demo".into() },
        admin: AdminConfig {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            token: None,
        },
        plugins: PluginsConfig {
            dir: plugins_dir.to_path_buf(),
            watch: true,
            call_deadline: Duration::from_millis(100),
            memory_cap_mib: 64,
            config: BTreeMap::from([
                (
                    "json-enrich".to_string(),
                    BTreeMap::from([
                        ("field".to_string(), "handled_by".to_string()),
                        ("value".to_string(), "wasmrelay-demo".to_string()),
                    ]),
                ),
                (
                    "mask-fields".to_string(),
                    BTreeMap::from([("fields".to_string(), "card_number".to_string())]),
                ),
            ]),
        },
        center: None,
        cluster: None,
        links: BTreeMap::from([(
            "main".to_string(),
            LinkConfig {
                bootstrap_servers: bootstrap.to_string(),
                from_center: false,
                options: BTreeMap::new(),
            },
        )]),
        flows: vec![FlowConfig {
            name: "orders".into(),
            link: "main".into(),
            input_topic: INPUT.into(),
            group: None,
            service_call: vec!["json-enrich".into()],
            deliver: Some(DeliverConfig::App(AppTarget {
                url: app_url.to_string(),
                timeout: Duration::from_secs(5),
                concurrency: 16,
            })),
            data_return: vec!["mask-fields".into()],
            output_topic: OUTPUT.into(),
            dead_letter_topic: DEAD_LETTERS.into(),
            retry: RetryConfig::default(),
        }],
        shutdown_grace: Duration::from_secs(5),
    }
}

/// Produces sample orders at the configured rate; every 20th has quantity 0,
/// which the demo application rejects (a dead letter).
async fn produce_orders(
    producer: FutureProducer,
    options: DemoOptions,
    produced: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let interval = Duration::from_secs_f64(1.0 / f64::from(options.rate.max(1)));
    let mut ticker = tokio::time::interval(interval);
    let mut n: u64 = 0;
    while options.messages.is_none_or(|max| n < max) {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let quantity = if n % 20 == 19 { 0 } else { 1 + n % 5 };
        let item = ["book", "lamp", "tea"][(n % 3) as usize];
        let order = json!({"order": n, "item": item, "quantity": quantity, "card_number": "4111111111111111"});
        let value = order.to_string();
        let key = format!("customer-{}", n % 10);
        if (n as usize) < SHOWN {
            say(&format!("service call as produced:        {value}"));
        }
        let record = FutureRecord::to(INPUT).key(&key).payload(&value);
        match producer.send(record, Duration::from_secs(5)).await {
            Ok(_) => {
                produced.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Err((error, _)) => tracing::warn!(%error, "demo producer: retrying"),
        }
    }
}

/// Reads the data-returns topic and hands their values to the summary.
fn watch_data_returns(
    bootstrap: &str,
    stop: CancellationToken,
) -> anyhow::Result<Arc<ReturnsFeed>> {
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "wasmrelay-demo-viewer")
        .set("enable.auto.commit", "false")
        .create()
        .context("creating the demo's data-return reader")?;
    // Assigned, not subscribed: no group join to wait for.
    let mut partitions = rdkafka::TopicPartitionList::new();
    for partition in 0..DEMO_PARTITIONS {
        partitions
            .add_partition_offset(OUTPUT, partition, rdkafka::Offset::Beginning)
            .context("assigning data-returns")?;
    }
    consumer
        .assign(&partitions)
        .context("assigning data-returns")?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let task = tokio::spawn(async move {
        loop {
            let received = tokio::select! {
                _ = stop.cancelled() => return,
                received = consumer.recv() => received,
            };
            match received {
                Ok(message) => {
                    let value = message
                        .payload()
                        .map(|v| String::from_utf8_lossy(v).to_string());
                    // The summary may have stopped listening; keep reading until stopped.
                    let _ = tx.try_send(value);
                }
                Err(error) => tracing::debug!(%error, "demo data-return reader"),
            }
        }
    });
    Ok(Arc::new(ReturnsFeed {
        rx: tokio::sync::Mutex::new(rx),
        task: std::sync::Mutex::new(Some(task)),
    }))
}

struct ReturnsFeed {
    rx: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Option<String>>>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl ReturnsFeed {
    /// Waits until the reader has stopped (and closed its consumer).
    async fn closed(&self) {
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    async fn recv(&self) -> Result<Option<String>, ()> {
        self.rx.lock().await.recv().await.ok_or(())
    }
}

/// The demo application: accepts orders (prints the first few as it got
/// them, after json-enrich) and answers with a confirmation that carries a
/// card number for mask-fields to hide; rejects orders of quantity 0.
struct DemoApp {
    url: String,
}

static SHOWN_CALLS: AtomicU64 = AtomicU64::new(0);

impl DemoApp {
    async fn start() -> anyhow::Result<DemoApp> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the demo app")?;
        let addr = listener.local_addr()?;
        let router = axum::Router::new().route("/calls", axum::routing::post(answer));
        tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, router).await {
                tracing::error!(%error, "demo app stopped");
            }
        });
        Ok(DemoApp {
            url: format!("http://{addr}/calls"),
        })
    }
}

async fn answer(headers: HeaderMap, body: Bytes) -> (StatusCode, String) {
    let order: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if SHOWN_CALLS.fetch_add(1, Ordering::Relaxed) < SHOWN as u64 {
        say(&format!("app received after json-enrich:  {order}"));
    }
    if order["quantity"] == json!(0) {
        return (
            StatusCode::BAD_REQUEST,
            "quantity must be at least 1".into(),
        );
    }
    let delivery = headers
        .get("x-wasmrelay-delivery-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let confirmation = json!({
        "order": order["order"],
        "status": "accepted",
        "delivery_id": delivery,
        "card_number": "4111111111111111",
    });
    (StatusCode::OK, confirmation.to_string())
}
