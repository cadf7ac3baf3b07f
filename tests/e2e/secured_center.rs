//! A secured etcd config center: TLS with a client certificate and a
//! password login, the link following `kafka.main` through it; no
//! credential in the log or `/links`. (A password over plaintext is refused
//! by validation: `config::validate`'s tests.)

use std::time::Duration;

use serde_json::{Value, json};
use support::app::TestApp;
use support::etcd::Etcd;
use support::pki::TestPki;
use support::relay::{RelayProcess, http_get};
use support::tansu::{Tansu, TestRecord};

use wasmrelay_test_support as support;

const INPUT: &str = "service-calls";
const PREFIX: &str = "/wasmrelay/";

fn relay_config(center: &str, app_url: &str) -> String {
    let plugins = support::plugins_dist().display();
    format!(
        r#"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
[center]
{center}
[links.main]
from_center = true
[links.main.options]
"fetch.wait.max.ms" = "10"
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
"batch.num.messages" = "1"
[[flows]]
name = "orders"
link = "main"
input_topic = "{INPUT}"
service_call = ["json-enrich"]
output_topic = "data-returns"
dead_letter_topic = "service-calls.dlq"
retry = {{ initial_backoff = "10ms", max_backoff = "100ms", budget = "20s" }}
[flows.deliver.app]
url = "{app_url}"
"#
    )
}

fn kafka_value(kafka: &Tansu) -> String {
    json!({"bootstrap.servers": kafka.bootstrap()}).to_string()
}

fn current_bootstrap(relay: &RelayProcess) -> Value {
    let (_, body) = http_get(&format!("{}/links", relay.admin)).unwrap();
    serde_json::from_str::<Value>(&body).unwrap()["links"][0]["current"]["bootstrap_servers"]
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_center_is_read_over_tls_with_a_client_certificate_and_a_password() {
    let password = "etcd-root-Pa55-5e0f";
    let pki = TestPki::new("etcd");
    let etcd = Etcd::start_secured(&pki, password).await;
    let tls = etcd.client_tls().unwrap();
    let (kafka1, kafka2) = (Tansu::start(), Tansu::start());
    kafka1.create_topic(INPUT, 1).await;
    kafka2.create_topic(INPUT, 1).await;
    let key = format!("{PREFIX}kafka.main");
    etcd.put(&key, &kafka_value(&kafka1)).await;

    let center = format!(
        r#"kind = "etcd"
endpoints = ["{endpoint}"]
prefix = "{PREFIX}"
[center.tls]
ca = "{ca}"
cert = "{cert}"
key = "{key_file}"
[center.auth]
user = "root"
password = "${{ETCD_PASSWORD}}""#,
        endpoint = etcd.endpoint(),
        ca = tls.ca_path.display(),
        cert = tls.cert_path.display(),
        key_file = tls.key_path.display(),
    );
    let app = TestApp::start(|_| (200, b"ok".to_vec(), vec![])).await;
    let relay = RelayProcess::start(
        &relay_config(&center, &app.url),
        &[("ETCD_PASSWORD", password)],
    );
    assert_eq!(current_bootstrap(&relay), kafka1.bootstrap());
    kafka1
        .produce(
            INPUT,
            (0..5).map(|n| TestRecord::keyed("k", format!("{{\"n\":{n}}}"))),
        )
        .await;
    relay
        .wait_for("traffic on cluster 1", Duration::from_secs(60), || {
            app.count() == 5
        })
        .await;

    // A change made in the secured etcd moves the link.
    etcd.put(&key, &kafka_value(&kafka2)).await;
    relay
        .wait_for(
            "the switch through the TLS center",
            Duration::from_secs(60),
            || current_bootstrap(&relay) == kafka2.bootstrap(),
        )
        .await;
    assert_eq!(relay.metric("wasmrelay_center_reachable"), 1);
    let (_, links) = http_get(&format!("{}/links", relay.admin)).unwrap();
    for (what, text) in [("the relay log", relay.log()), ("/links", links)] {
        assert!(
            !text.contains(password),
            "the etcd password appears in {what}:\n{text}"
        );
    }
}
