//! `wasmrelay plugin bench PLUGIN.wasm`: what a processor plugin costs, in
//! the relay's runtime: component size, compile time at load, instantiation
//! time and linear memory of a fresh instance, and time per `process` call
//! on a JSON object value of a given size. Prints one JSON line, so that a
//! script can tabulate several plugins measured in one run
//! (`bench/polyglot/run.sh`).
//!
//! Owns only measuring; loading and calling are [`crate::plugin`]'s.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::PluginBenchArgs;
use crate::plugin::{Message, Outcome, PluginLimits, PluginRuntime, World};

/// A JSON object of exactly `size` bytes (at least 32): `{"order":42,"pad":"xxxx"}`.
pub(crate) fn json_value_of_size(size: usize) -> Vec<u8> {
    let frame = r#"{"order":42,"pad":""}"#.len();
    let pad = size.max(32) - frame;
    format!(r#"{{"order":42,"pad":"{}"}}"#, "x".repeat(pad)).into_bytes()
}

fn message(value: Vec<u8>) -> Message {
    Message {
        key: Some(b"key-1".to_vec()),
        value: Some(value),
        headers: vec![crate::plugin::Header {
            name: "traceparent".into(),
            value: b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec(),
        }],
        topic: "bench".into(),
        partition: 0,
        offset: 1,
        timestamp_ms: None,
    }
}

pub(super) fn run(args: PluginBenchArgs) -> ExitCode {
    match measure(&args) {
        Ok(line) => {
            let mut out = std::io::stdout().lock();
            if writeln!(out, "{line}").is_err() {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn measure(args: &PluginBenchArgs) -> Result<serde_json::Value, String> {
    let runtime = PluginRuntime::new(PluginLimits {
        call_deadline: Duration::from_secs(10),
        memory_cap_bytes: args.memory_mib.saturating_mul(1024 * 1024),
        max_instances: 8,
        max_idle_instances: 1,
    })
    .map_err(|e| format!("{e:#}"))?;
    let name = args
        .plugin
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("plugin")
        .to_string();
    let config = Arc::new(args.config.iter().cloned().collect());
    let plugin = runtime
        .load_file(&name, &args.plugin, config, Some(World::Processor))
        .map_err(|e| e.to_string())?;

    // Instantiation: the best of a few fresh instances (the first ones also
    // fault in the pooling allocator's slots).
    let mut probes = Vec::new();
    for _ in 0..5 {
        probes.push(plugin.probe_instance().map_err(|e| e.to_string())?);
    }
    let instantiate = probes
        .iter()
        .map(|p| p.instantiate)
        .min()
        .unwrap_or_default();
    let memory_bytes = probes.iter().map(|p| p.memory_bytes).max().unwrap_or(0);

    let msg = message(json_value_of_size(args.value_bytes));
    // Warm up (and check that the plugin emits something for this input).
    for _ in 0..args.warmup {
        match plugin.process(&msg).map_err(|e| e.to_string())? {
            Outcome::Emit(out) if !out.is_empty() => {}
            other => return Err(format!("the plugin did not emit a message: {other:?}")),
        }
    }
    let started = Instant::now();
    let mut calls: u64 = 0;
    while calls < args.min_calls || started.elapsed() < Duration::from_millis(args.min_ms) {
        plugin.process(&msg).map_err(|e| e.to_string())?;
        calls += 1;
    }
    let elapsed = started.elapsed();
    Ok(json!({
        "plugin": name,
        "size_bytes": plugin.size_bytes(),
        "compile_ms": plugin.compile_time().as_secs_f64() * 1e3,
        "instantiate_us": instantiate.as_secs_f64() * 1e6,
        "memory_bytes": memory_bytes,
        "value_bytes": msg.value.as_ref().map_or(0, Vec::len),
        "calls": calls,
        "ns_per_call": elapsed.as_nanos() as f64 / calls as f64,
        "pooling": runtime.uses_pooling_allocator(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_have_the_size_asked_for_and_are_json_objects() {
        for size in [32, 100, 1024, 4096] {
            let value = json_value_of_size(size);
            assert_eq!(value.len(), size);
            let parsed: serde_json::Value = serde_json::from_slice(&value).unwrap();
            assert_eq!(parsed["order"], 42);
        }
    }
}
