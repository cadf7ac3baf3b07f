//! `wasmrelay demo` as a new user runs it: messages flow through the
//! embedded development broker, the demo app and both example plugins.

use std::process::Command;

use wasmrelay_test_support as support;

#[test]
fn demo_shows_messages_flowing_through_both_plugins() {
    let output = Command::new(support::wasmrelay_binary())
        .args(["demo", "--messages", "200", "--rate", "500", "--plugins"])
        .arg(support::plugins_dist())
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("mock cluster"),
        "the development broker is not labelled:\n{stdout}"
    );
    assert!(
        stdout.contains("\"handled_by\":\"wasmrelay-demo\""),
        "json-enrich not shown:\n{stdout}"
    );
    assert!(
        stdout.contains("\"card_number\":\"***\""),
        "mask-fields not shown:\n{stdout}"
    );
    // 200 orders, every 20th rejected by the demo app: 190 returned, 10 dead letters.
    assert!(
        stdout.contains("done: 190 delivered to the app, 190 data-returns, 10 dead letters"),
        "{stdout}"
    );
}

#[test]
fn demo_without_plugins_says_how_to_build_them() {
    let empty = tempfile::tempdir().unwrap();
    let output = Command::new(support::wasmrelay_binary())
        .args(["demo", "--messages", "1", "--plugins"])
        .arg(empty.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("plugins/build.sh"), "{stderr}");
}
