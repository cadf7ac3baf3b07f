//! `wasmrelay run` with a bad config: it exits non-zero before starting
//! anything, with a message that names the offending key.

use std::process::Command;

use wasmrelay_test_support as support;

fn base() -> String {
    let plugins = support::plugins_dist().display();
    format!(
        r#"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
[links.main]
bootstrap_servers = "127.0.0.1:9"
[[flows]]
name = "orders"
link = "main"
input_topic = "service-calls"
service_call = ["json-enrich"]
data_return = ["mask-fields"]
output_topic = "data-returns"
dead_letter_topic = "service-calls.dlq"
[flows.deliver.app]
url = "http://127.0.0.1:8080/calls"
"#
    )
}

/// Runs `wasmrelay run` on `config` and returns (exit code, stderr).
fn run(config: &str, env: &[(&str, &str)]) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(&path, config).unwrap();
    let output = Command::new(support::wasmrelay_binary())
        .args(["run", "--config"])
        .arg(&path)
        .env_remove("APP_URL")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

fn assert_rejected(config: &str, env: &[(&str, &str)], expected: &[&str]) {
    let (code, stderr) = run(config, env);
    assert_eq!(code, 2, "expected exit 2, got {code}: {stderr}");
    for needle in expected {
        assert!(
            stderr.contains(needle),
            "stderr does not mention `{needle}`:\n{stderr}"
        );
    }
}

#[test]
fn unknown_key_is_named() {
    let config = base().replace("output_topic =", "outptu_topic = \"x\"\noutput_topic =");
    assert_rejected(&config, &[], &["flows[0]", "outptu_topic"]);
}

#[test]
fn missing_topic_is_named() {
    let config = base().replace("output_topic = \"data-returns\"\n", "");
    assert_rejected(&config, &[], &["output_topic"]);
}

#[test]
fn missing_plugin_file_is_named() {
    let config = base().replace("[\"json-enrich\"]", "[\"json-enrich\", \"no-such-plugin\"]");
    assert_rejected(
        &config,
        &[],
        &["flows[0].service_call[1]", "no-such-plugin.wasm"],
    );
}

#[test]
fn malformed_url_is_named() {
    let config = base().replace("http://127.0.0.1:8080/calls", "http//nowhere");
    assert_rejected(&config, &[], &["flows[0].deliver.app.url"]);
}

#[test]
fn unset_variable_is_named() {
    let config = base().replace("http://127.0.0.1:8080/calls", "${APP_URL}");
    assert_rejected(&config, &[], &["APP_URL", "line"]);
}

#[test]
fn an_etcd_center_without_endpoints_is_named() {
    let config = base()
        .replace("bootstrap_servers = \"127.0.0.1:9\"", "from_center = true")
        .replace("[links.main]", "[center]\nkind = \"etcd\"\n[links.main]");
    assert_rejected(&config, &[], &["center: missing field `endpoints`"]);
}

#[test]
fn an_etcd_center_that_cannot_be_reached_fails_the_start_and_says_why() {
    let dead = support::relay::free_port();
    let config = base()
        .replace("bootstrap_servers = \"127.0.0.1:9\"", "from_center = true")
        .replace(
            "[links.main]",
            &format!(
                "[center]\nkind = \"etcd\"\nendpoints = [\"http://127.0.0.1:{dead}\"]\n\
                 wait_for_key = \"1s\"\n[links.main]"
            ),
        );
    let (code, stderr) = run(&config, &[]);
    assert_eq!(code, 1, "expected exit 1, got {code}: {stderr}");
    for needle in [
        "link `main`",
        "kafka.main",
        "cannot be reached",
        &dead.to_string(),
    ] {
        assert!(
            stderr.contains(needle),
            "stderr does not mention `{needle}`:\n{stderr}"
        );
    }
}

#[test]
fn a_link_option_that_weakens_producer_durability_is_named() {
    for (option, value, key) in [
        ("acks", "0", "links.main.options.acks"),
        (
            "enable.idempotence",
            "false",
            "links.main.options.\"enable.idempotence\"",
        ),
    ] {
        let config = base().replace(
            "bootstrap_servers = \"127.0.0.1:9\"",
            &format!(
                "bootstrap_servers = \"127.0.0.1:9\"\noptions = {{ \"{option}\" = \"{value}\" }}"
            ),
        );
        assert_rejected(&config, &[], &[key, "producer durability is the relay's"]);
    }
}

#[test]
fn a_listener_certificate_that_cannot_be_read_stops_the_start_naming_the_listener_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("admin-missing.pem");
    let config = format!(
        "{}\n[admin.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        base(),
        missing.display(),
        dir.path().join("admin.key").display()
    );
    let (code, stderr) = run(&config, &[("APP_URL", "http://127.0.0.1:9/")]);
    assert_ne!(code, 0, "started without its certificate: {stderr}");
    assert!(
        stderr.contains("admin listener") && stderr.contains("admin-missing.pem"),
        "{stderr}"
    );
}
