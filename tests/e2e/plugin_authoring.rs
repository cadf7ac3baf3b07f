//! A plugin author's first steps with the real binary, in a temporary
//! directory: `wasmrelay plugin wit` writes the contract, and
//! `wasmrelay plugin new --lang L NAME` writes a project whose printed build
//! command builds a component that `plugin test` runs on the project's
//! sample input with the expected result, for every language.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};
use support::polyglot::path_with_tools;

use wasmrelay_test_support as support;

fn wasmrelay(args: &[&str], cwd: &Path) -> std::process::Output {
    Command::new(support::wasmrelay_binary())
        .args(args)
        .current_dir(cwd)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn plugin_wit_writes_the_contract_this_binary_implements() {
    let tmp = tempfile::tempdir().unwrap();
    let out = wasmrelay(&["plugin", "wit", "contract/wit"], tmp.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = std::fs::read_to_string(tmp.path().join("contract/wit/plugin.wit")).unwrap();
    let source = std::fs::read_to_string(support::repo_root().join("wit/plugin.wit")).unwrap();
    assert_eq!(written, source);

    // Without DIR: ./wit.
    let out = wasmrelay(&["plugin", "wit"], tmp.path());
    assert!(out.status.success());
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("wit/plugin.wit")).unwrap(),
        source
    );

    // A file where the directory should be: a clear error, exit 1.
    std::fs::write(tmp.path().join("taken"), "x").unwrap();
    let out = wasmrelay(&["plugin", "wit", "taken"], tmp.path());
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("taken") && stderr.contains("not a directory"),
        "{stderr}"
    );
}

#[test]
fn plugin_new_refuses_a_bad_name_and_an_existing_project() {
    let tmp = tempfile::tempdir().unwrap();
    let out = wasmrelay(&["plugin", "new", "--lang", "js", "Bad_Name"], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`Bad_Name` is not a plugin name"));

    assert!(
        wasmrelay(&["plugin", "new", "--lang", "c", "mine"], tmp.path())
            .status
            .success()
    );
    let again = wasmrelay(&["plugin", "new", "--lang", "c", "mine"], tmp.path());
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));

    let bad_lang = wasmrelay(&["plugin", "new", "--lang", "cobol", "x"], tmp.path());
    assert_eq!(bad_lang.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_lang.stderr).contains("cobol"));
}

/// The command printed after `label` (the next line, indented).
fn printed_command(stdout: &str, label: &str) -> String {
    let mut lines = stdout.lines();
    lines
        .by_ref()
        .find(|line| line.trim() == label)
        .unwrap_or_else(|| panic!("no `{label}` in:\n{stdout}"));
    lines
        .next()
        .unwrap_or_else(|| panic!("nothing after `{label}` in:\n{stdout}"))
        .trim()
        .to_string()
}

fn sh(command: &str, cwd: &Path, what: &str) -> String {
    let bin_dir = support::wasmrelay_binary().parent().unwrap().to_path_buf();
    let mut paths = vec![bin_dir];
    paths.extend(std::env::split_paths(&path_with_tools()));
    // A shared target dir for the Rust template, so that its dependencies
    // are built once, not once per run.
    let rust_target = support::repo_root().join("target/plugin-new-rust");
    let out = Command::new("bash")
        .args(["-c", command])
        .current_dir(cwd)
        .env("PATH", std::env::join_paths(paths).unwrap())
        .env("CARGO_TARGET_DIR", rust_target)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{what}: `{command}` failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `plugin new`, then the printed build and test commands, in a temporary
/// directory; returns the test's output lines.
fn new_build_test(lang: &str, world: &str) -> Vec<Value> {
    let tmp = tempfile::tempdir().unwrap();
    let name = format!("my-{lang}-{world}");
    let out = wasmrelay(
        &["plugin", "new", "--lang", lang, "--world", world, &name],
        tmp.path(),
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let build = printed_command(&stdout, "build it:");
    let test = printed_command(&stdout, "test it:");
    assert!(test.contains("wasmrelay plugin test"), "{test}");
    sh(
        &build,
        tmp.path(),
        &format!("building the {lang} {world} template"),
    );
    let output = sh(
        &test,
        tmp.path(),
        &format!("testing the {lang} {world} template"),
    );
    output
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad output line {l}: {e}")))
        .collect()
}

fn assert_processor_template_output(lang: &str) {
    let name = format!("my-{lang}-processor");
    let lines = new_build_test(lang, "processor");
    assert_eq!(
        lines,
        vec![
            json!({"input": 1, "key": "k1", "value": "{\"order\": 42}",
                   "headers": {"traceparent": "00-abc-01", "x-processed-by": name}}),
            json!({"input": 2, "dead_letter": format!("{name}: no value")}),
        ]
    );
}

fn assert_router_template_output(lang: &str) {
    let lines = new_build_test(lang, "router");
    assert_eq!(
        lines,
        vec![
            json!({"input": 1, "route": "p-1"}),
            json!({"input": 2, "route": null}),
            json!({"input": 3, "place": null}),
        ]
    );
}

#[test]
fn plugin_new_rust_processor_builds_and_passes_plugin_test() {
    assert_processor_template_output("rust");
}

#[test]
fn plugin_new_js_processor_builds_and_passes_plugin_test() {
    assert_processor_template_output("js");
}

#[test]
fn plugin_new_python_processor_builds_and_passes_plugin_test() {
    assert_processor_template_output("python");
}

#[test]
fn plugin_new_c_processor_builds_and_passes_plugin_test() {
    assert_processor_template_output("c");
}

#[test]
fn plugin_new_c_router_builds_and_passes_plugin_test() {
    assert_router_template_output("c");
}

#[test]
fn plugin_new_python_router_builds_and_passes_plugin_test() {
    assert_router_template_output("python");
}

#[test]
fn plugin_new_js_router_builds_and_passes_plugin_test() {
    assert_router_template_output("js");
}

#[test]
fn plugin_new_rust_router_builds_and_passes_plugin_test() {
    assert_router_template_output("rust");
}
