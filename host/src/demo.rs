//! `wasmrelay demo`: a self-contained sidecar on a development broker.
//!
//! Everything runs in this process: librdkafka's mock cluster as the Kafka
//! broker (a development broker, not a real one), a demo application that
//! answers service calls over HTTP, a relay node with the example plugins
//! (`json-enrich` on service calls, `mask-fields` on data-returns), and a
//! producer of sample orders. It prints a few messages before and after the
//! plugins and a live summary.

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
use tokio_util::task::TaskTracker;

use crate::config::ValidatedConfig;
use crate::node::Node;
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

    // Every task of the demo (the app, the order producer, the reader of
    // data-returns, the relay) runs here and is awaited before returning.
    let tasks = TaskTracker::new();
    let app_stop = CancellationToken::new();
    let app = DemoApp::start(&tasks, app_stop.clone()).await?;
    say(&format!("demo application listening at {}", app.url));

    let metrics = Arc::new(RelayMetrics::new());
    let relay_stop = CancellationToken::new();
    let config = demo_config(&bootstrap, &app.url, demo_plugins.path())
        .context("the demo's relay config")?;
    let node = Node::build(config, metrics.clone()).await?;
    let relay = tasks.spawn(node.run(relay_stop.clone()));

    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .context("creating the demo producer")?;
    let viewer_stop = CancellationToken::new();
    let returns = watch_data_returns(&bootstrap, &tasks, viewer_stop.clone())?;
    let produce_stop = CancellationToken::new();
    let produced = Arc::new(AtomicU64::new(0));
    let producing = tasks.spawn(produce_orders(
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
    app_stop.cancel();
    tasks.close();
    tasks.wait().await;
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

/// The relay's config, written as a config file would be and read through
/// the same parser and validation as `wasmrelay run`.
fn demo_config(
    bootstrap: &str,
    app_url: &str,
    plugins_dir: &std::path::Path,
) -> Result<ValidatedConfig, crate::config::ConfigError> {
    // JSON string literals are valid TOML basic strings.
    let quote = |text: &str| serde_json::Value::from(text).to_string();
    let text = format!(
        r#"shutdown_grace = "5s"

[node]
id = "demo"

[admin]
listen = "127.0.0.1:0"

[plugins]
dir = {plugins_dir}
call_deadline = "100ms"
memory_cap_mib = 64

[plugins.config.json-enrich]
field = "handled_by"
value = "wasmrelay-demo"

[plugins.config.mask-fields]
fields = "card_number"

[links.main]
bootstrap_servers = {bootstrap}

[[flows]]
name = "orders"
link = "main"
input_topic = "{INPUT}"
service_call = ["json-enrich"]
data_return = ["mask-fields"]
output_topic = "{OUTPUT}"
dead_letter_topic = "{DEAD_LETTERS}"

[flows.deliver.app]
url = {app_url}
timeout = "5s"
concurrency = 16
"#,
        plugins_dir = quote(&plugins_dir.display().to_string()),
        bootstrap = quote(bootstrap),
        app_url = quote(app_url),
    );
    crate::config::parse(&text, "the demo's relay config", &|_| None)
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
    tasks: &TaskTracker,
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
    tasks.spawn(async move {
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
    }))
}

struct ReturnsFeed {
    rx: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Option<String>>>,
}

impl ReturnsFeed {
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
    async fn start(tasks: &TaskTracker, stop: CancellationToken) -> anyhow::Result<DemoApp> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the demo app")?;
        let addr = listener.local_addr()?;
        let router = axum::Router::new().route("/calls", axum::routing::post(answer));
        tasks.spawn(async move {
            let served = axum::serve(listener, router)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(error) = served {
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
