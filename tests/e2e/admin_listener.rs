//! The admin listener of the real binary, off loopback (issue 10, item 6):
//! a config that would serve it there without a token does not start; with
//! the explicit opt-in it starts and warns; with a token only the probes
//! answer without it; and a relay with admin connections that never finish
//! a request still stops within its grace period.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use support::relay::{RelayProcess, http_get, http_get_with_token};
use support::tansu::Tansu;

use wasmrelay_test_support as support;

const TOKEN: &str = "e2e-admin-token-5f0c3a9e1d7b4c2a";

/// A transform flow `raw` -> `cooked` on `bootstrap`, with `admin` as the
/// body of `[admin]` and a shutdown grace of `grace`.
fn config(bootstrap: &str, admin: &str, grace: &str) -> String {
    let plugins = support::plugins_dist().display();
    format!(
        r#"
shutdown_grace = "{grace}"
[admin]
{admin}
[plugins]
dir = "{plugins}"
[links.main]
bootstrap_servers = "{bootstrap}"
[links.main.options]
"fetch.wait.max.ms" = "10"
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

/// `127.0.0.1:PORT` for the relay's admin URL (`http://0.0.0.0:PORT`).
fn loopback(relay: &RelayProcess) -> String {
    let port = relay.admin.rsplit(':').next().unwrap();
    format!("127.0.0.1:{port}")
}

#[test]
fn an_admin_api_off_loopback_without_a_token_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    // Nothing answers on port 9: validation must refuse before any connect.
    std::fs::write(&path, config("127.0.0.1:9", "listen = \"0.0.0.0:0\"", "5s")).unwrap();
    let output = Command::new(support::wasmrelay_binary())
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    for needle in [
        "admin.listen",
        "0.0.0.0:0",
        "not a loopback address",
        "admin.token",
        "allow_unauthenticated",
    ] {
        assert!(stderr.contains(needle), "no `{needle}` in:\n{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_loopback_the_token_guards_all_but_the_probes_and_the_opt_in_warns() {
    let kafka = Tansu::start();
    kafka.create_topic("raw", 1).await;

    let guarded = RelayProcess::start(
        &config(
            &kafka.bootstrap(),
            &format!("listen = \"0.0.0.0:0\"\ntoken = \"{TOKEN}\""),
            "10s",
        ),
        &[],
    );
    assert!(guarded.admin.contains("0.0.0.0:"), "{}", guarded.admin);
    let url = |path: &str| format!("http://{}{path}", loopback(&guarded));
    assert_eq!(http_get(&url("/healthz")).map(|(s, _)| s), Some(200));
    assert_eq!(http_get(&url("/readyz")).map(|(s, _)| s), Some(200));
    for path in ["/metrics", "/links", "/plugins"] {
        assert_eq!(http_get(&url(path)).map(|(s, _)| s), Some(401), "{path}");
        assert_eq!(
            http_get_with_token(&url(path), Some("wrong")).map(|(s, _)| s),
            Some(401),
            "{path} with a wrong token"
        );
        assert_eq!(
            http_get_with_token(&url(path), Some(TOKEN)).map(|(s, _)| s),
            Some(200),
            "{path} with the token"
        );
    }
    assert!(
        !guarded.log().contains("allow_unauthenticated"),
        "a warning without the opt-in:\n{}",
        guarded.log()
    );
    drop(guarded);

    let open = RelayProcess::start(
        &config(
            &kafka.bootstrap(),
            "listen = \"0.0.0.0:0\"\nallow_unauthenticated = true",
            "10s",
        ),
        &[],
    );
    let metrics = format!("http://{}/metrics", loopback(&open));
    assert_eq!(http_get(&metrics).map(|(s, _)| s), Some(200));
    let log = open.log();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("allow_unauthenticated")),
        "no warning about the unauthenticated admin API:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stops_within_its_grace_period_with_stalled_admin_connections_open() {
    let kafka = Tansu::start();
    kafka.create_topic("raw", 1).await;
    // Timeouts far beyond the grace period: only shutdown can end these
    // connections in time.
    let admin = format!(
        "listen = \"0.0.0.0:0\"\ntoken = \"{TOKEN}\"\nheader_timeout = \"10m\"\nidle_timeout = \"10m\""
    );
    let grace = Duration::from_secs(10);
    let mut relay = RelayProcess::start(&config(&kafka.bootstrap(), &admin, "10s"), &[]);
    let addr = loopback(&relay);

    let mut stalled: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    let mut half = TcpStream::connect(&addr).unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: relay\r\nAuthorization: Bea")
        .unwrap();
    stalled.push(half);
    // A keep-alive connection left open after an answered request.
    let mut kept = TcpStream::connect(&addr).unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n")
        .unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = [0u8; 256];
    let n = kept.read(&mut answer).unwrap();
    assert!(
        answer[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        &answer[..n]
    );
    stalled.push(kept);
    let open = "wasmrelay_admin_connections ";
    let metrics = format!("http://{addr}/metrics");
    let count = || {
        http_get_with_token(&metrics, Some(TOKEN))
            .and_then(|(_, body)| {
                body.lines()
                    .find_map(|l| l.strip_prefix(open)?.trim().parse::<u64>().ok())
            })
            .unwrap_or(0)
    };
    // The stalled ones and the request asking.
    relay
        .wait_for(
            "7 stalled admin connections",
            Duration::from_secs(10),
            || count() == 8,
        )
        .await;

    relay.sigterm();
    // `wait` fails the test if the relay has not exited within the grace.
    let status = relay.wait(grace);
    assert!(status.success(), "exit {status}:\n{}", relay.log());
    let log = relay.log();
    assert!(log.contains("relay stopped"), "{log}");
    // Stopped in order, not cancelled at the end of the grace period.
    assert!(
        !log.contains("tasks still running at the end of the grace period"),
        "{log}"
    );
    drop(stalled);
}
