//! The sidecar's application over `https://`: its certificate is verified
//! against the flow's `ca` (besides the system roots); a flow without that
//! CA does not trust it and delivers nothing.

use std::time::Duration;

use support::app::TestApp;
use support::pki::TestPki;
use support::relay::RelayProcess;
use support::tansu::{Tansu, TestRecord};
use support::tls_terminator::TlsTerminator;

use wasmrelay_test_support as support;

fn flow(name: &str, input: &str, url: &str, ca: Option<&std::path::Path>) -> String {
    let ca = ca
        .map(|ca| format!("ca = \"{}\"\n", ca.display()))
        .unwrap_or_default();
    format!(
        r#"
[[flows]]
name = "{name}"
link = "main"
input_topic = "{input}"
service_call = []
output_topic = "{input}.returns"
dead_letter_topic = "{input}.dlq"
retry = {{ initial_backoff = "10ms", max_backoff = "100ms", budget = "1s" }}
[flows.deliver.app]
url = "{url}"
{ca}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_application_is_verified_with_the_flows_ca() {
    let kafka = Tansu::start();
    kafka.create_topic("trusted", 1).await;
    kafka.create_topic("untrusted", 1).await;
    let app = TestApp::start(|_| (200, b"ok".to_vec(), vec![])).await;
    let pki = TestPki::new("app");
    let app_addr = app
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/calls")
        .parse()
        .unwrap();
    let tls = TlsTerminator::start(
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        TestPki::server_config(&pki.server_cert("app")),
        app_addr,
    );
    let url = format!("https://localhost:{}/calls", tls.addr().port());
    let plugins = support::plugins_dist().display();
    let config = format!(
        r#"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
[links.main]
bootstrap_servers = "{bootstrap}"
[links.main.options]
"fetch.wait.max.ms" = "10"
"batch.num.messages" = "1"
{trusted}{untrusted}"#,
        bootstrap = kafka.bootstrap(),
        trusted = flow("trusted", "trusted", &url, Some(&pki.ca_path())),
        untrusted = flow("untrusted", "untrusted", &url, None),
    );
    let relay = RelayProcess::start(&config, &[]);
    kafka
        .produce(
            "trusted",
            (0..5).map(|n| TestRecord::keyed("k", format!("t{n}"))),
        )
        .await;
    kafka
        .produce("untrusted", [TestRecord::keyed("k", "u0")])
        .await;
    relay
        .wait_for(
            "the trusted flow's calls over https",
            Duration::from_secs(60),
            || app.count() == 5,
        )
        .await;
    // The flow without the CA cannot verify the certificate: its call is
    // dead-lettered after its retry budget, and never reaches the app.
    let dead = kafka
        .consume_all("untrusted.dlq", 1, Duration::from_secs(60))
        .await;
    assert_eq!(dead.len(), 1, "the untrusted call is dead-lettered");
    assert_eq!(app.count(), 5, "nothing reached the app without the CA");
    let reason =
        String::from_utf8_lossy(dead[0].header("wasmrelay-dlq-reason").unwrap_or_default())
            .to_ascii_lowercase();
    assert!(
        reason.contains("certificate") || reason.contains("issuer"),
        "the dead-letter reason names the certificate problem: {reason}"
    );
}
