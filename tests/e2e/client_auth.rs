//! Client authentication end to end (issue 10): the real binary trusting a
//! key file, a token made by `wasmrelay token issue`, the example client
//! with `--token-file` admitted and served, processes without a valid token
//! refused at once with the node's reason, counted in `/metrics`, and no
//! token or key in the node's log; `client_auth = "none"` warns at start.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use support::processes::node_config;
use support::relay::{RelayProcess, http_get};
use support::tansu::{Tansu, TestRecord};

use wasmrelay_test_support as support;

const DEBUG: &[(&str, &str)] = &[("RUST_LOG", "debug")];

/// Runs the example client: (success, stdout, stderr).
async fn relay_client(addr: &str, process_id: &str, args: &[&str]) -> (bool, String, String) {
    let run = support::run_relay_client(addr, process_id, args).await;
    (run.ok, run.stdout, run.stderr)
}

/// `wasmrelay token issue` with `args`; the token it printed.
fn issue(key: &Path, args: &[&str]) -> String {
    let output = std::process::Command::new(support::wasmrelay_binary())
        .args(["token", "issue", "--key"])
        .arg(key)
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "wasmrelay token issue failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap().trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_process_with_a_token_for_its_id_is_admitted_and_refusals_are_counted_not_logged() {
    let kafka = Tansu::start();
    kafka.create_topic("business", 1).await;
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("client-token.key");
    let key = support::client_tokens::key();
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let inline = support::client_tokens::cluster_keys();
    let base = node_config("node-a", &kafka.bootstrap(), "");
    let config = base.replace(
        &inline,
        &format!(
            "client_token_keys = [{{ alg = \"HS256\", path = \"{}\" }}]",
            key_file.display()
        ),
    );
    assert_ne!(config, base, "node_config no longer holds {inline}");
    let node = RelayProcess::start(&config, DEBUG);
    let addr = node.client_addr().unwrap();

    // An operator's token, from the command line tool.
    let token = issue(&key_file, &["--process", "cli-1", "--ttl", "10m"]);
    let token_file = keys.path().join("cli-1.token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let other_token = issue(&key_file, &["--process", "cli-2", "--ttl", "10m"]);

    // No token: the client stops at once with the node's reason.
    let (ok, _, stderr) = relay_client(&addr, "cli-1", &["--count", "1"]).await;
    assert!(!ok, "admitted without a token: {stderr}");
    assert!(
        stderr.contains("ERROR_CODE_UNAUTHORIZED") && stderr.contains("a token is required"),
        "{stderr}"
    );
    // A token for another process id: refused too.
    let (ok, _, stderr) =
        relay_client(&addr, "cli-1", &["--token", &other_token, "--count", "1"]).await;
    assert!(!ok, "admitted with another process's token: {stderr}");
    assert!(
        stderr.contains("the token is for process `cli-2`, not `cli-1`"),
        "{stderr}"
    );
    assert_eq!(
        http_get(&format!("{}/processes?id=cli-1", node.admin))
            .unwrap()
            .0,
        404,
        "a refused process is not registered"
    );

    // The token file: admitted, and served.
    let token_arg = token_file.display().to_string();
    let args = ["--token-file", &token_arg, "--count", "1"];
    let admitted = relay_client(&addr, "cli-1", &args);
    let produce = async {
        node.wait_for("cli-1 registered", Duration::from_secs(20), || {
            http_get(&format!("{}/processes?id=cli-1", node.admin))
                .unwrap()
                .0
                == 200
        })
        .await;
        kafka
            .produce("business", [TestRecord::keyed("cli-1", "{\"n\":1}")])
            .await;
    };
    let ((ok, stdout, stderr), ()) = tokio::join!(admitted, produce);
    assert!(ok, "relay-client with a token file failed: {stderr}");
    let line: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(line["value"], "{\"n\":1}", "{line}");

    assert_eq!(
        node.metric(r#"wasmrelay_client_auth_refused_total{reason="missing"}"#),
        1
    );
    assert_eq!(
        node.metric(r#"wasmrelay_client_auth_refused_total{reason="wrong_process"}"#),
        1
    );
    let log = node.log();
    assert!(log.contains("refusing a client"), "{log}");
    for (what, secret) in [
        ("token", &token),
        ("token", &other_token),
        ("key", &key.to_string()),
    ] {
        assert!(
            !log.contains(secret.as_str()),
            "the {what} is in the node's log"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_client_auth_warns_at_start_and_admits_any_process() {
    let kafka = Tansu::start();
    kafka.create_topic("business", 1).await;
    // Development mode: no keys, no check.
    let config = node_config("node-dev", &kafka.bootstrap(), "client_auth = \"none\"")
        .replace(&support::client_tokens::cluster_keys(), "");
    let node = RelayProcess::start(&config, &[]);
    assert!(
        node.log().contains("clients are not authenticated"),
        "no warning at start:\n{}",
        node.log()
    );
    let (ok, _, stderr) =
        relay_client(&node.client_addr().unwrap(), "anyone", &["--count", "0"]).await;
    assert!(ok, "refused without client authentication: {stderr}");
}
