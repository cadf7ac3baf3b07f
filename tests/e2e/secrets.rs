//! Secrets never show (issue 9): a secret set in the config file or in a
//! center value appears in no log line (at debug level), no `/links` body
//! and no error text, not even librdkafka's own errors that quote property
//! values.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::processes::node_config;
use support::relay::{RelayProcess, http_get, http_get_with_token};
use support::tansu::{Tansu, TestRecord};

use wasmrelay_test_support as support;

/// A secret property librdkafka refuses in this build (OAuth/OIDC needs
/// libcurl, which rdkafka is built without), quoting its value in the
/// error: what the relay must scrub.
const OIDC_SECRET: &str = "sasl.oauthbearer.client.secret";

/// Every log line, debug ones included.
const DEBUG: &[(&str, &str)] = &[("RUST_LOG", "debug")];

/// A relay config with one transform flow `raw` -> `cooked` on link `main`;
/// `link` is the body of `[links.main]` and what follows it.
fn transform_config(link: &str) -> String {
    let plugins = support::plugins_dist().display();
    format!(
        r#"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
{link}
[[flows]]
name = "transform"
link = "main"
input_topic = "raw"
service_call = ["passthrough"]
output_topic = "cooked"
dead_letter_topic = "raw.dlq"
"#
    )
}

/// `[links.main]` on `kafka` with the option `name = value`.
fn link_with_option(kafka: &Tansu, name: &str, value: &str) -> String {
    format!(
        r#"
[links.main]
bootstrap_servers = "{bootstrap}"
[links.main.options]
"fetch.wait.max.ms" = "10"
"{name}" = "{value}"
"#,
        bootstrap = kafka.bootstrap()
    )
}

/// Fails if `secret` is anywhere in `text` (`what` says where that text
/// came from), showing the lines that hold it.
fn assert_absent(secret: &str, what: &str, text: &str) {
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(secret)).collect();
    assert!(
        lines.is_empty() && !text.contains(secret),
        "the secret shows in {what}:\n{}",
        lines.join("\n")
    );
}

/// How a `wasmrelay run` that was expected to fail ended.
struct Exit {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `wasmrelay run` on `config` at debug level until it exits (fails
/// the test after 60 s); stdout and stderr go to files, so a long debug
/// log cannot block it.
fn run_to_exit(config: &str) -> Exit {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(&path, config).unwrap();
    let out = dir.path().join("stdout");
    let err = dir.path().join("stderr");
    let mut child = Command::new(support::wasmrelay_binary())
        .args(["run", "--config"])
        .arg(&path)
        .envs(DEBUG.iter().copied())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "wasmrelay was expected to fail its start but still ran after 60 s:\n{}",
                read(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Exit {
        code: status.code(),
        stdout: read(&out),
        stderr: read(&err),
    }
}

/// The start failed (exit 1 or 2, not a signal), its error names
/// `property`, and `secret` shows nowhere in the output.
fn assert_refused_without_the_secret(exit: &Exit, property: &str, secret: &str) {
    assert!(
        matches!(exit.code, Some(1 | 2)),
        "expected the start to fail with exit 1 or 2, got {:?}:\n{}",
        exit.code,
        exit.stderr
    );
    assert!(
        exit.stderr.contains(property),
        "the error does not name `{property}`:\n{}",
        exit.stderr
    );
    // librdkafka quotes the value: the relay shows it as stars.
    assert!(
        exit.stderr.contains("***"),
        "the error does not show the value as `***`:\n{}",
        exit.stderr
    );
    assert!(
        exit.stderr.contains(" DEBUG "),
        "no debug line: was the log at debug level?\n{}",
        exit.stderr
    );
    assert_absent(secret, "stderr (the log and the error)", &exit.stderr);
    assert_absent(secret, "stdout", &exit.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_option_in_the_config_shows_in_no_log_line_and_as_stars_in_links() {
    const SECRET: &str = "Sup3r-s3cret-sasl-password-in-config";
    let kafka = Tansu::start();
    kafka.create_topic("raw", 1).await;
    let config = transform_config(&link_with_option(&kafka, "sasl.password", SECRET));
    let relay = RelayProcess::start(&config, DEBUG);
    // The link with the secret option works: a record goes through.
    kafka
        .produce("raw", [TestRecord::keyed("k", "{\"n\":1}")])
        .await;
    let cooked = kafka
        .consume_all("cooked", 1, Duration::from_secs(60))
        .await;
    assert_eq!(cooked.len(), 1, "relay log:\n{}", relay.log());

    let (status, body) = http_get(&format!("{}/links", relay.admin)).unwrap();
    assert_eq!(status, 200, "{body}");
    assert_absent(SECRET, "/links", &body);
    let links: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        links["links"][0]["current"]["options"]["sasl.password"], "***",
        "{body}"
    );
    let log = relay.log();
    assert!(log.contains(" DEBUG "), "no debug line in the log:\n{log}");
    assert_absent(SECRET, "the relay's log", &log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_secret_option_in_the_config_is_named_without_its_value() {
    // librdkafka without libcurl (this build) refuses the OIDC client
    // secret, and its error quotes the value.
    const SECRET: &str = "Sup3r-s3cret-oidc-client-secret-in-config";
    let kafka = Tansu::start();
    let config = transform_config(&link_with_option(&kafka, OIDC_SECRET, SECRET));
    let exit = run_to_exit(&config);
    assert_refused_without_the_secret(&exit, OIDC_SECRET, SECRET);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_secret_option_in_a_center_value_is_named_without_its_value() {
    // The center may set the OIDC client secret (a credential); this build
    // of librdkafka then refuses it, quoting the value.
    const SECRET: &str = "Sup3r-s3cret-oidc-client-secret-in-center";
    let kafka = Tansu::start();
    let center = tempfile::tempdir().unwrap();
    let value = serde_json::json!({
        "bootstrap.servers": kafka.bootstrap(),
        OIDC_SECRET: SECRET,
    });
    std::fs::write(center.path().join("kafka.main"), value.to_string()).unwrap();
    let config = transform_config(&format!(
        "[center]\nkind = \"dir\"\ndir = \"{}\"\nwait_for_key = \"5s\"\n[links.main]\nfrom_center = true",
        center.path().display()
    ));
    let exit = run_to_exit(&config);
    assert_refused_without_the_secret(&exit, OIDC_SECRET, SECRET);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_and_cluster_secret_show_in_no_log_line_and_the_token_guards_metrics() {
    const TOKEN: &str = "Sup3r-s3cret-admin-token-0123456789";
    const CLUSTER_SECRET: &str = "Sup3r-s3cret-cluster-secret-0123456789";
    let kafka = Tansu::start();
    kafka.create_topic("business", 1).await;
    let base = node_config("node-a", &kafka.bootstrap(), "");
    let config = base
        .replace("[admin]\n", &format!("[admin]\ntoken = \"{TOKEN}\"\n"))
        .replace(
            "secret = \"test-cluster-secret-0123456789abcdef\"",
            &format!("secret = \"{CLUSTER_SECRET}\""),
        );
    assert!(
        config.contains(TOKEN) && config.contains(CLUSTER_SECRET) && config != base,
        "node_config changed: the secrets were not set\n{config}"
    );
    let node = RelayProcess::start(&config, DEBUG);
    // A few heartbeats (500 ms) so the cluster's own paths have logged too.
    let cluster = format!("{}/cluster", node.admin);
    node.wait_for("the node live in /cluster", Duration::from_secs(20), || {
        http_get_with_token(&cluster, Some(TOKEN)).is_some_and(|(status, body)| {
            status == 200
                && serde_json::from_str::<Value>(&body).is_ok_and(|view| view["live"] == 1)
        })
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let metrics = format!("{}/metrics", node.admin);
    let status = |token| http_get_with_token(&metrics, token).map(|(status, _)| status);
    assert_eq!(status(None), Some(401), "/metrics without the token");
    assert_eq!(
        status(Some("not-the-token")),
        Some(401),
        "/metrics with a wrong token"
    );
    let (code, body) = http_get_with_token(&metrics, Some(TOKEN)).unwrap();
    assert_eq!(code, 200, "/metrics with the token: {body}");
    assert!(body.contains("wasmrelay_"), "{body}");
    assert_eq!(
        http_get_with_token(&cluster, None).map(|(status, _)| status),
        Some(401),
        "/cluster without the token"
    );
    let (_, links) = http_get_with_token(&format!("{}/links", node.admin), Some(TOKEN)).unwrap();
    assert_absent(TOKEN, "/links", &links);
    assert_absent(CLUSTER_SECRET, "/links", &links);
    let (_, cluster_body) = http_get_with_token(&cluster, Some(TOKEN)).unwrap();
    assert!(cluster_body.contains("\"live\""), "{cluster_body}");
    assert_absent(TOKEN, "/cluster", &cluster_body);
    assert_absent(CLUSTER_SECRET, "/cluster", &cluster_body);

    let log = node.log();
    assert!(log.contains(" DEBUG "), "no debug line in the log:\n{log}");
    assert_absent(TOKEN, "the node's log", &log);
    assert_absent(CLUSTER_SECRET, "the node's log", &log);
}
