//! Secured Kafka: the sidecar reaching brokers over TLS with SASL/SCRAM
//! (librdkafka with OpenSSL), with its link from the config file and from
//! the config center, switching to a second TLS broker; wrong CA and wrong
//! password refused with a clear error while the current link keeps
//! serving; zstd batches consumed and produced; no secret in any log line or
//! `/links` body.
//!
//! Each broker is tansu with `--authentication` behind a TLS terminator
//! (see `support::tls_terminator` for why), with its own test CA.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};
use support::app::TestApp;
use support::pki::TestPki;
use support::relay::{RelayProcess, http_get};
use support::tansu::{Security, Tansu, TestRecord};

use wasmrelay_test_support as support;

const INPUT: &str = "service-calls";
const OUTPUT: &str = "data-returns";

/// A broker with TLS (a certificate of its own CA) and SCRAM user `user`.
fn secured_broker(name: &str, user: &str, password: &str) -> (Tansu, TestPki) {
    let pki = TestPki::new(name);
    let cert = pki.server_cert(name);
    let kafka = Tansu::start_secured(Security {
        tls: Some(cert),
        trust_ca_pem: Some(pki.ca_pem().to_owned()),
        scram_user: Some((user.to_owned(), password.to_owned())),
    });
    (kafka, pki)
}

fn relay_config(app_url: &str, center: Option<&Path>, link: &str) -> String {
    let plugins = support::plugins_dist().display();
    let center = center
        .map(|dir| format!("[center]\nkind = \"dir\"\ndir = \"{}\"\n", dir.display()))
        .unwrap_or_default();
    format!(
        r#"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
{center}
[links.main]
{link}
[[flows]]
name = "orders"
link = "main"
input_topic = "{INPUT}"
service_call = ["json-enrich"]
output_topic = "{OUTPUT}"
dead_letter_topic = "service-calls.dlq"
retry = {{ initial_backoff = "10ms", max_backoff = "100ms", budget = "20s" }}
[flows.deliver.app]
url = "{app_url}"
"#
    )
}

/// librdkafka options every link of these tests has (fast against tansu).
const FAST_OPTIONS: &str = r#""fetch.wait.max.ms" = "10"
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
"batch.num.messages" = "1""#;

fn links(relay: &RelayProcess) -> Value {
    let (status, body) = http_get(&format!("{}/links", relay.admin)).unwrap();
    assert_eq!(status, 200);
    serde_json::from_str(&body).unwrap()
}

fn links_body(relay: &RelayProcess) -> String {
    http_get(&format!("{}/links", relay.admin)).unwrap().1
}

fn numbered(range: std::ops::Range<u64>) -> Vec<TestRecord> {
    range
        .map(|n| TestRecord::keyed(format!("k{}", n % 7), json!({"n": n}).to_string()))
        .collect()
}

fn received(app: &TestApp) -> HashSet<u64> {
    app.receipts()
        .iter()
        .filter_map(|r| serde_json::from_slice::<Value>(&r.body).ok()?["n"].as_u64())
        .collect()
}

/// Produces `records` in zstd-compressed batches.
async fn produce_zstd(kafka: &Tansu, records: Vec<TestRecord>) {
    let producer: FutureProducer = kafka
        .producer_config()
        .set("compression.type", "zstd")
        .set("linger.ms", "20")
        .create()
        .expect("a zstd producer (librdkafka built with zstd)");
    let sends = records.iter().map(|record| {
        producer.send(
            FutureRecord::<Vec<u8>, Vec<u8>>::to(INPUT)
                .key(record.key.as_ref().unwrap())
                .payload(record.value.as_ref().unwrap()),
            Duration::from_secs(30),
        )
    });
    for result in futures::future::join_all(sends).await {
        result.expect("a zstd record produced");
    }
}

fn assert_no_secret(texts: &[(&str, &str)], secrets: &[&str]) {
    for (what, text) in texts {
        for secret in secrets {
            assert!(
                !text.contains(secret),
                "a secret value appears in {what}:\n{text}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_relays_over_sasl_ssl_from_the_config_file_with_zstd() {
    let password = "file-link-Pa55word-7d1c";
    let (kafka, pki) = secured_broker("kafka-file", "relay", password);
    kafka.create_topic(INPUT, 2).await;
    let app = TestApp::start(|receipt| {
        (
            200,
            format!("ok {}", receipt.delivery_id).into_bytes(),
            vec![],
        )
    })
    .await;
    let link = format!(
        r#"bootstrap_servers = "{bootstrap}"
[links.main.options]
{FAST_OPTIONS}
"compression.type" = "zstd"
"security.protocol" = "sasl_ssl"
"ssl.ca.location" = "{ca}"
"sasl.mechanism" = "SCRAM-SHA-256"
"sasl.username" = "relay"
"sasl.password" = "${{KAFKA_PASSWORD}}""#,
        bootstrap = kafka.bootstrap(),
        ca = pki.ca_path().display(),
    );
    let relay = RelayProcess::start(
        &relay_config(&app.url, None, &link),
        &[("KAFKA_PASSWORD", password)],
    );

    produce_zstd(&kafka, numbered(0..40)).await;
    relay
        .wait_for(
            "every zstd input message at the app",
            Duration::from_secs(60),
            || received(&app).len() == 40,
        )
        .await;
    let returned = kafka.consume_all(OUTPUT, 40, Duration::from_secs(60)).await;
    assert_eq!(
        returned.len(),
        40,
        "the data returns, produced with zstd over TLS"
    );
    assert!(
        returned
            .iter()
            .all(|r| r.value.as_deref().is_some_and(|v| v.starts_with(b"ok "))),
        "the application's answers are relayed"
    );

    let body = links_body(&relay);
    assert_eq!(
        links(&relay)["links"][0]["current"]["options"]["sasl.password"],
        "***"
    );
    assert_no_secret(
        &[("the relay log", &relay.log()), ("/links", &body)],
        &[password],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn center_switches_between_tls_brokers_and_refuses_a_wrong_ca_or_password() {
    let (password1, password2) = ("center-one-Pa55-91af", "center-two-Pa55-22be");
    let (kafka1, pki1) = secured_broker("kafka-one", "relay-one", password1);
    let (kafka2, pki2) = secured_broker("kafka-two", "relay-two", password2);
    kafka1.create_topic(INPUT, 2).await;
    kafka2.create_topic(INPUT, 2).await;
    let value = |kafka: &Tansu, ca: &TestPki, user: &str, password: &str| {
        json!({
            "bootstrap.servers": kafka.bootstrap(),
            "security.protocol": "sasl_ssl",
            "ssl.ca.pem": ca.ca_pem(),
            "sasl.mechanism": "SCRAM-SHA-256",
            "sasl.username": user,
            "sasl.password": password,
        })
        .to_string()
    };
    let center = tempfile::tempdir().unwrap();
    let key = center.path().join("kafka.main");
    let put = |value: String| {
        let tmp = center.path().join(".tmp");
        std::fs::write(&tmp, value).unwrap();
        std::fs::rename(&tmp, &key).unwrap();
    };
    put(value(&kafka1, &pki1, "relay-one", password1));
    let app = TestApp::start(|_| (200, b"ok".to_vec(), vec![])).await;
    let link = format!("from_center = true\n[links.main.options]\n{FAST_OPTIONS}");
    let relay = RelayProcess::start(&relay_config(&app.url, Some(center.path()), &link), &[]);
    assert_eq!(
        links(&relay)["links"][0]["current"]["bootstrap_servers"],
        kafka1.bootstrap()
    );
    kafka1.produce(INPUT, numbered(0..20)).await;
    relay
        .wait_for(
            "traffic on the first TLS broker",
            Duration::from_secs(60),
            || received(&app).len() == 20,
        )
        .await;

    // Broker two with broker one's CA: its certificate does not verify.
    // Then broker two's CA with a wrong password: SCRAM refuses the login.
    let wrong_password = "not-the-Pa55word-0000";
    let refusals = [
        (
            value(&kafka2, &pki1, "relay-two", password2),
            "certificate verify failed",
        ),
        (
            value(&kafka2, &pki2, "relay-two", wrong_password),
            "SASL SCRAM authentication failed",
        ),
    ];
    let mut sent = 20;
    for (bad, reason) in refusals {
        put(bad);
        relay
            .wait_for(reason, Duration::from_secs(60), || {
                links(&relay)["links"][0]["status"]["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains(reason) && e.contains("link `main`"))
            })
            .await;
        assert_eq!(
            links(&relay)["links"][0]["current"]["bootstrap_servers"],
            kafka1.bootstrap(),
            "a refused value leaves the current link in place"
        );
        kafka1.produce(INPUT, numbered(sent..sent + 10)).await;
        sent += 10;
        relay
            .wait_for(
                "traffic on the current link",
                Duration::from_secs(60),
                || received(&app).len() as u64 == sent,
            )
            .await;
    }

    put(value(&kafka2, &pki2, "relay-two", password2));
    relay
        .wait_for(
            "the switch to the second TLS broker",
            Duration::from_secs(60),
            || links(&relay)["links"][0]["current"]["bootstrap_servers"] == kafka2.bootstrap(),
        )
        .await;
    kafka2.produce(INPUT, numbered(sent..sent + 20)).await;
    relay
        .wait_for(
            "traffic on the second TLS broker",
            Duration::from_secs(60),
            || received(&app).len() as u64 == sent + 20,
        )
        .await;
    let returned = kafka2
        .consume_all(OUTPUT, 20, Duration::from_secs(60))
        .await;
    assert_eq!(
        returned.len(),
        20,
        "data returns produced on the second broker"
    );

    assert_no_secret(
        &[
            ("the relay log", &relay.log()),
            ("/links", &links_body(&relay)),
        ],
        &[password1, password2, wrong_password],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_runs_over_sasl_ssl() {
    use support::processes::{ProcessPool, node_config};

    let password = "cluster-link-Pa55-3a7e";
    let (kafka, pki) = secured_broker("kafka-cluster", "relay", password);
    kafka.create_topic("business", 2).await;
    // The node's link: TLS with the test CA, SCRAM login, the password from
    // the environment.
    let security = format!(
        "\"batch.num.messages\" = \"1\"\n\
         \"security.protocol\" = \"sasl_ssl\"\n\
         \"ssl.ca.location\" = \"{}\"\n\
         \"sasl.mechanism\" = \"SCRAM-SHA-256\"\n\
         \"sasl.username\" = \"relay\"\n\
         \"sasl.password\" = \"${{KAFKA_PASSWORD}}\"\n",
        pki.ca_path().display()
    );
    let config = node_config("secure-node", &kafka.bootstrap(), "").replacen(
        "\"batch.num.messages\" = \"1\"\n",
        &security,
        1,
    );
    assert!(
        config.contains("sasl_ssl"),
        "the node config changed shape:\n{config}"
    );
    let relay = RelayProcess::start(&config, &[("KAFKA_PASSWORD", password)]);

    // Heartbeats and routes go through the secured link: the node sees
    // itself live and the process's route.
    let mut pool = ProcessPool::default();
    pool.connect(&[relay.client_addr().unwrap()], "p-secure", true)
        .await;
    let records: Vec<TestRecord> = (0..10)
        .map(|n| TestRecord::keyed("p-secure", format!("call {n}")))
        .collect();
    kafka.produce("business", records).await;
    relay
        .wait_for(
            "every delivery to the process",
            Duration::from_secs(60),
            || pool.count() == 10,
        )
        .await;
    let replies = kafka
        .consume_all("business.replies", 10, Duration::from_secs(60))
        .await;
    assert_eq!(
        replies.len(),
        10,
        "the process's replies, produced over TLS"
    );
    let (status, cluster) = http_get(&format!("{}/cluster", relay.admin)).unwrap();
    assert_eq!(status, 200, "{cluster}");
    let cluster_view: Value = serde_json::from_str(&cluster).unwrap();
    assert_eq!(cluster_view["live"], 1, "{cluster_view}");

    assert_no_secret(
        &[
            ("the relay log", &relay.log()),
            ("/links", &links_body(&relay)),
            ("/cluster", &cluster),
        ],
        &[password],
    );
}
