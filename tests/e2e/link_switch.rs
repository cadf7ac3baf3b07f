//! Live Kafka link switching from a config center, `dir` (a ConfigMap-style
//! directory) and `etcd`: two real brokers, a real etcd, the real binary, a
//! real application.

use std::collections::HashSet;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use support::app::TestApp;
use support::etcd::Etcd;
use support::relay::{RelayProcess, free_port, http_get};
use support::tansu::{Tansu, TestRecord};

use wasmrelay_test_support as support;

const INPUT: &str = "service-calls";

/// A ConfigMap volume update: the values go into a new `..<generation>`
/// directory and `..data` is swapped to it atomically.
fn configmap_update(dir: &Path, generation: u32, values: &[(&str, String)]) {
    let name = format!("..gen_{generation:04}");
    std::fs::create_dir(dir.join(&name)).unwrap();
    for (key, value) in values {
        std::fs::write(dir.join(&name).join(key), value).unwrap();
    }
    let tmp = dir.join("..data_tmp");
    symlink(&name, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for (key, _) in values {
        if std::fs::symlink_metadata(dir.join(key)).is_err() {
            symlink(format!("..data/{key}"), dir.join(key)).unwrap();
        }
    }
}

/// A center value: connection properties only (tuning such as
/// `batch.num.messages` is the config file's, see [`relay_config`]).
fn kafka_value(kafka: &Tansu) -> String {
    json!({"bootstrap.servers": kafka.bootstrap(), "socket.timeout.ms": 10000}).to_string()
}

/// The `[center]` section of a `dir` center.
pub(crate) fn dir_center(dir: &Path) -> String {
    format!("kind = \"dir\"\ndir = \"{}\"", dir.display())
}

/// The etcd prefix of the tests' keys.
const ETCD_PREFIX: &str = "/wasmrelay/";

/// The `[center]` section of an `etcd` center.
fn etcd_center(etcd: &Etcd) -> String {
    format!(
        "kind = \"etcd\"\nendpoints = [\"{}\"]\nprefix = \"{ETCD_PREFIX}\"",
        etcd.endpoint()
    )
}

fn relay_config(center: &str, app_url: &str) -> String {
    center_sidecar_config(center, support::plugins_dist(), "json-enrich", app_url)
}

/// A sidecar config whose link `main` follows the config center `center`
/// (the body of `[center]`), plugins from `plugins`, and flow `orders` from
/// `service-calls` through the plugin `service_call` to the application
/// at `app_url` (also the chaos scenario g's).
pub(crate) fn center_sidecar_config(
    center: &str,
    plugins: &Path,
    service_call: &str,
    app_url: &str,
) -> String {
    let plugins = plugins.display();
    format!(
        r#"
shutdown_grace = "20s"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
[center]
{center}
drain_timeout = "20s"
[links.main]
from_center = true
[links.main.options]
"batch.num.messages" = "1"
"fetch.wait.max.ms" = "10"
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
[[flows]]
name = "orders"
link = "main"
input_topic = "{INPUT}"
service_call = ["{service_call}"]
output_topic = "data-returns"
dead_letter_topic = "service-calls.dlq"
retry = {{ initial_backoff = "10ms", max_backoff = "100ms", budget = "20s" }}
[flows.deliver.app]
url = "{app_url}"
"#
    )
}

fn numbered(range: std::ops::Range<u64>) -> Vec<TestRecord> {
    range
        .map(|n| TestRecord::keyed(format!("k{}", n % 13), json!({"n": n}).to_string()))
        .collect()
}

fn links(relay: &RelayProcess) -> Value {
    let (status, body) = http_get(&format!("{}/links", relay.admin)).unwrap();
    assert_eq!(status, 200);
    serde_json::from_str(&body).unwrap()
}

fn received(app: &TestApp) -> HashSet<u64> {
    app.receipts()
        .iter()
        .map(|r| {
            serde_json::from_slice::<Value>(&r.body).unwrap()["n"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configmap_swap_moves_the_link_to_the_new_cluster_and_loses_nothing() {
    let center = tempfile::tempdir().unwrap();
    let generation = std::sync::atomic::AtomicU32::new(0);
    switch_under_load_loses_nothing(&dir_center(center.path()), async |kafka: &Tansu| {
        let generation = generation.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        configmap_update(
            center.path(),
            generation,
            &[("kafka.main", kafka_value(kafka))],
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_put_moves_the_link_to_the_new_cluster_and_loses_nothing() {
    let etcd = Etcd::start();
    let key = format!("{ETCD_PREFIX}kafka.main");
    switch_under_load_loses_nothing(&etcd_center(&etcd), async |kafka: &Tansu| {
        etcd.put(&key, &kafka_value(kafka)).await;
    })
    .await;
}

/// Numbered messages on cluster 1, a backlog left there, the center's value
/// flipped to cluster 2 by `point_at`, more messages on cluster 2: the one
/// application (never restarted) receives every message, and the switch is
/// recorded in `/links`.
async fn switch_under_load_loses_nothing(center: &str, point_at: impl AsyncFn(&Tansu)) {
    let (kafka1, kafka2) = (Tansu::start(), Tansu::start());
    kafka1.create_topic(INPUT, 3).await;
    kafka2.create_topic(INPUT, 3).await;
    point_at(&kafka1).await;
    let app = TestApp::start(|receipt| {
        (
            200,
            format!("ok {}", receipt.delivery_id).into_bytes(),
            vec![],
        )
    })
    .await;
    let relay = RelayProcess::start(&relay_config(center, &app.url), &[]);
    assert_eq!(
        links(&relay)["links"][0]["current"]["bootstrap_servers"],
        kafka1.bootstrap()
    );

    kafka1.produce(INPUT, numbered(0..300)).await;
    relay
        .wait_for("traffic on cluster 1", Duration::from_secs(60), || {
            app.count() >= 100
        })
        .await;
    // A backlog left on cluster 1 just before the switch.
    kafka1.produce(INPUT, numbered(300..500)).await;
    point_at(&kafka2).await;
    relay
        .wait_for("the switch", Duration::from_secs(60), || {
            links(&relay)["links"][0]["current"]["bootstrap_servers"] == kafka2.bootstrap()
        })
        .await;
    kafka2.produce(INPUT, numbered(500..800)).await;

    relay
        .wait_for(
            "every message of both clusters",
            Duration::from_secs(240),
            || received(&app).len() == 800,
        )
        .await;
    relay
        .wait_for("the switch record", Duration::from_secs(30), || {
            links(&relay)["links"][0]["switches"]
                .as_array()
                .is_some_and(|s| !s.is_empty())
        })
        .await;
    let link = &links(&relay)["links"][0];
    let switch = &link["switches"][0];
    assert_eq!(switch["from"]["bootstrap_servers"], kafka1.bootstrap());
    assert_eq!(switch["to"]["bootstrap_servers"], kafka2.bootstrap());
    assert_eq!(switch["left_behind"], 0, "{link}");
    assert_eq!(switch["drain_timed_out"], false);
    assert!(switch["duration_ms"].as_u64().is_some());
    assert_eq!(link["source"], "center");
    assert_eq!(
        relay.metric(r#"wasmrelay_link_switches_total{link="main"}"#),
        1
    );
    assert_eq!(relay.metric("wasmrelay_center_reachable"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_values_and_a_deleted_key_leave_the_old_link_serving() {
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 1).await;
    let center = tempfile::tempdir().unwrap();
    let key = center.path().join("kafka.main");
    std::fs::write(&key, kafka_value(&kafka)).unwrap();
    let app = TestApp::start(|_| (200, Vec::new(), vec![])).await;
    let relay = RelayProcess::start(&relay_config(&dir_center(center.path()), &app.url), &[]);
    let dead_port = free_port();
    let bad_values = [
        ("kafka:9092".to_string(), "not JSON"),
        (
            r#"{"security.protocol": "plaintext"}"#.to_string(),
            "bootstrap.servers",
        ),
        (
            json!({"bootstrap.servers": format!("127.0.0.1:{dead_port}")}).to_string(),
            "does not answer",
        ),
    ];
    let mut sent = 0;
    for (value, expected) in bad_values {
        let tmp = center.path().join(".tmp");
        std::fs::write(&tmp, &value).unwrap();
        std::fs::rename(&tmp, &key).unwrap();
        relay
            .wait_for(expected, Duration::from_secs(30), || {
                links(&relay)["links"][0]["status"]["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains(expected))
            })
            .await;
        assert_eq!(
            links(&relay)["links"][0]["current"]["bootstrap_servers"],
            kafka.bootstrap()
        );
        // Still serving on the old link.
        kafka.produce(INPUT, numbered(sent..sent + 10)).await;
        sent += 10;
        relay
            .wait_for("traffic on the old link", Duration::from_secs(30), || {
                received(&app).len() as u64 == sent
            })
            .await;
    }
    assert!(relay.log().contains("keeping the current link"));
    assert_eq!(
        relay.metric(r#"wasmrelay_link_switches_refused_total{link="main"}"#),
        3
    );

    std::fs::remove_file(&key).unwrap();
    relay
        .wait_for("the deleted key reported", Duration::from_secs(30), || {
            links(&relay)["links"][0]["status"]["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("deleted"))
        })
        .await;
    kafka.produce(INPUT, numbered(sent..sent + 10)).await;
    relay
        .wait_for(
            "traffic after the deletion",
            Duration::from_secs(30),
            || received(&app).len() as u64 == sent + 10,
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn center_values_that_load_code_read_files_or_weaken_durability_are_refused() {
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 1).await;
    let center = tempfile::tempdir().unwrap();
    // A `files_dir` is set, so `/etc/shadow` is refused for lying outside
    // it (not merely for naming a file).
    let files = tempfile::tempdir().unwrap();
    let key = center.path().join("kafka.main");
    std::fs::write(&key, kafka_value(&kafka)).unwrap();
    let app = TestApp::start(|_| (200, Vec::new(), vec![])).await;
    let center_config = format!(
        "{}\nfiles_dir = \"{}\"",
        dir_center(center.path()),
        files.path().display()
    );
    let relay = RelayProcess::start(
        &relay_config(&center_config, &app.url),
        &[("RUST_LOG", "debug")],
    );
    // Each value carries a secret beside the refused property: the refusal
    // must not show it.
    let secrets = [
        "Sup3r-s3cret-sasl-password-beside-a-plugin",
        "Sup3r-s3cret-ssl-key-password-beside-shadow",
        "Sup3r-s3cret-sasl-password-beside-acks",
    ];
    let refused = [
        (
            "plugin.library.paths",
            json!({
                "bootstrap.servers": kafka.bootstrap(),
                "plugin.library.paths": files.path().join("libevil.so").display().to_string(),
                "sasl.password": secrets[0],
            }),
            "load native code",
        ),
        (
            "ssl.key.location",
            json!({
                "bootstrap.servers": kafka.bootstrap(),
                "ssl.key.location": "/etc/shadow",
                "ssl.key.password": secrets[1],
            }),
            "not inside the center's `files_dir`",
        ),
        (
            "acks",
            json!({
                "bootstrap.servers": kafka.bootstrap(),
                "acks": 0,
                "sasl.password": secrets[2],
            }),
            "durability is the relay's",
        ),
    ];
    let mut sent = 0;
    for (property, value, why) in refused {
        let tmp = center.path().join(".tmp");
        std::fs::write(&tmp, value.to_string()).unwrap();
        std::fs::rename(&tmp, &key).unwrap();
        let named = format!("`{property}`");
        relay
            .wait_for(
                &format!("{property} refused in /links"),
                Duration::from_secs(30),
                || {
                    links(&relay)["links"][0]["status"]["last_error"]
                        .as_str()
                        .is_some_and(|e| e.contains(&named))
                },
            )
            .await;
        let link = &links(&relay)["links"][0];
        let error = link["status"]["last_error"].as_str().unwrap();
        assert!(error.contains("kafka.main"), "{error}");
        assert!(error.contains(why), "{error}");
        // The link was not touched: same cluster, none of the value's options.
        assert_eq!(link["current"]["bootstrap_servers"], kafka.bootstrap());
        let options = link["current"]["options"].as_object().unwrap();
        assert!(!options.contains_key(property), "{link}");
        assert!(!options.contains_key("sasl.password"), "{link}");
        assert_eq!(link["switches"].as_array().map(Vec::len), Some(0), "{link}");
        // And it keeps serving.
        kafka.produce(INPUT, numbered(sent..sent + 10)).await;
        sent += 10;
        relay
            .wait_for(
                "traffic on the current link",
                Duration::from_secs(30),
                || received(&app).len() as u64 == sent,
            )
            .await;
    }
    assert_eq!(
        relay.metric(r#"wasmrelay_link_switches_refused_total{link="main"}"#),
        3
    );
    assert_eq!(
        relay.metric(r#"wasmrelay_link_switches_total{link="main"}"#),
        0
    );
    let log = relay.log();
    for property in ["plugin.library.paths", "ssl.key.location", "acks"] {
        assert!(
            log.lines()
                .any(|l| l.contains("keeping the current link")
                    && l.contains(&format!("`{property}`"))),
            "no log line names `{property}`:\n{log}"
        );
    }
    let (_, body) = http_get(&format!("{}/links", relay.admin)).unwrap();
    assert!(log.contains(" DEBUG "), "the log is not at debug level");
    for secret in secrets {
        assert!(!log.contains(secret), "a secret shows in the log");
        assert!(!body.contains(secret), "a secret shows in /links: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_flips_end_on_the_last_value_in_a_consistent_state() {
    let (kafka1, kafka2) = (Tansu::start(), Tansu::start());
    kafka1.create_topic(INPUT, 2).await;
    kafka2.create_topic(INPUT, 2).await;
    let center = tempfile::tempdir().unwrap();
    configmap_update(center.path(), 1, &[("kafka.main", kafka_value(&kafka1))]);
    let app = TestApp::start(|_| (200, Vec::new(), vec![])).await;
    let relay = RelayProcess::start(&relay_config(&dir_center(center.path()), &app.url), &[]);
    kafka1.produce(INPUT, numbered(0..100)).await;
    relay
        .wait_for("traffic on cluster 1", Duration::from_secs(60), || {
            received(&app).len() == 100
        })
        .await;

    // 1 -> 2 -> 1 within 100 ms.
    configmap_update(center.path(), 2, &[("kafka.main", kafka_value(&kafka2))]);
    tokio::time::sleep(Duration::from_millis(50)).await;
    configmap_update(center.path(), 3, &[("kafka.main", kafka_value(&kafka1))]);

    relay
        .wait_for("settled on cluster 1", Duration::from_secs(60), || {
            let link = &links(&relay)["links"][0];
            link["current"]["bootstrap_servers"] == kafka1.bootstrap()
                && link["status"]["switching"] == false
        })
        .await;
    // Consistent: traffic produced now to the last value's cluster arrives.
    kafka1.produce(INPUT, numbered(100..200)).await;
    relay
        .wait_for("traffic after the flips", Duration::from_secs(60), || {
            received(&app).len() == 200
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_keeps_the_link_serving_and_a_later_change_is_followed() {
    let mut etcd = Etcd::start();
    let (kafka1, kafka2) = (Tansu::start(), Tansu::start());
    kafka1.create_topic(INPUT, 1).await;
    kafka2.create_topic(INPUT, 1).await;
    let key = format!("{ETCD_PREFIX}kafka.main");
    etcd.put(&key, &kafka_value(&kafka1)).await;
    let app = TestApp::start(|_| (200, Vec::new(), vec![])).await;
    let relay = RelayProcess::start(&relay_config(&etcd_center(&etcd), &app.url), &[]);
    assert_eq!(
        links(&relay)["links"][0]["status"]["center_reachable"],
        true
    );
    kafka1.produce(INPUT, numbered(0..50)).await;
    relay
        .wait_for("traffic on cluster 1", Duration::from_secs(60), || {
            received(&app).len() == 50
        })
        .await;

    etcd.stop();
    relay
        .wait_for(
            "the center reported unreachable",
            Duration::from_secs(30),
            || links(&relay)["links"][0]["status"]["center_reachable"] == false,
        )
        .await;
    assert_eq!(relay.metric("wasmrelay_center_reachable"), 0);
    // Still serving on the last value, and still ready.
    kafka1.produce(INPUT, numbered(50..100)).await;
    relay
        .wait_for(
            "traffic while etcd is down",
            Duration::from_secs(60),
            || received(&app).len() == 100,
        )
        .await;
    assert_eq!(
        http_get(&format!("{}/readyz", relay.admin)).map(|(status, _)| status),
        Some(200)
    );
    assert_eq!(
        links(&relay)["links"][0]["current"]["bootstrap_servers"],
        kafka1.bootstrap()
    );

    etcd.restart();
    relay
        .wait_for(
            "the center reachable again",
            Duration::from_secs(30),
            || links(&relay)["links"][0]["status"]["center_reachable"] == true,
        )
        .await;
    etcd.put(&key, &kafka_value(&kafka2)).await;
    relay
        .wait_for(
            "the switch after etcd came back",
            Duration::from_secs(30),
            || links(&relay)["links"][0]["current"]["bootstrap_servers"] == kafka2.bootstrap(),
        )
        .await;
    kafka2.produce(INPUT, numbered(100..150)).await;
    relay
        .wait_for("traffic on cluster 2", Duration::from_secs(60), || {
            received(&app).len() == 150
        })
        .await;
    assert_eq!(relay.metric("wasmrelay_center_reachable"), 1);
}
