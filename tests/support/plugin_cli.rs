//! `wasmrelay plugin test` run as a plugin author runs it: the built binary,
//! JSON lines in on stdin, JSON lines out.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;

/// What one `wasmrelay plugin test` run gave.
#[derive(Debug)]
pub struct PluginTestRun {
    /// The exit code (-1 when killed by a signal).
    pub code: i32,
    /// Each output line, parsed.
    pub lines: Vec<Value>,
    /// What it wrote to stderr.
    pub stderr: String,
}

/// Runs `wasmrelay plugin test PLUGIN ARGS…` with `input` on stdin; panics
/// on an output line that is not JSON.
pub fn plugin_test(plugin: &Path, args: &[&str], input: &str) -> PluginTestRun {
    let mut child = Command::new(crate::wasmrelay_binary())
        .arg("plugin")
        .arg("test")
        .arg(plugin)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting wasmrelay plugin test");
    child
        .stdin
        .take()
        .expect("its stdin")
        .write_all(input.as_bytes())
        .expect("writing its input");
    let output = child.wait_with_output().expect("waiting for it");
    let stdout = String::from_utf8(output.stdout).expect("UTF-8 output");
    PluginTestRun {
        code: output.status.code().unwrap_or(-1),
        lines: stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad output line {l}: {e}")))
            .collect(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// The `value` of an output line, parsed as JSON.
pub fn value_json(line: &Value) -> Value {
    serde_json::from_str(line["value"].as_str().expect("a text value")).expect("a JSON value")
}
