//! Cost per message of calling a Wasm plugin, against the same step done
//! natively, for 100 B and 1 KiB messages.
//!
//! Three ways of doing the same work (pass the message on as a new output
//! message) are measured in one run on the same machine:
//! - `native`: a Rust function doing what `passthrough` does (copy key,
//!   value and headers into an output message);
//! - `wasm-single`: `process`, one call per message;
//! - `wasm-batch-64`: `process-batch` with 64 messages per call.
//!
//! After criterion's own report, a table prints ns per message, the ns each
//! Wasm mode adds over native, and the ratio. Run with
//! `cargo bench -p wasmrelay --bench plugin_call`.

#![allow(clippy::unwrap_used, clippy::print_stdout, missing_docs)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BatchSize, Criterion, Throughput, criterion_group};
use wasmrelay::plugin::{
    Header, Message, Outcome, OutputMessage, PluginConfig, PluginLimits, PluginRuntime, World,
};

const SIZES: [(&str, usize); 2] = [("100B", 100), ("1KiB", 1024)];
const BATCH: usize = 64;

fn message(size: usize, n: usize) -> Message {
    Message {
        key: Some(format!("key-{n}").into_bytes()),
        value: Some(vec![b'x'; size]),
        headers: vec![Header {
            name: "traceparent".into(),
            value: b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec(),
        }],
        topic: "bench".into(),
        partition: 0,
        offset: n as i64,
        timestamp_ms: Some(1_700_000_000_000),
    }
}

/// What the passthrough plugin does, as a native step.
fn native_passthrough(msg: &Message) -> Outcome {
    Outcome::Emit(vec![OutputMessage {
        key: msg.key.clone(),
        value: msg.value.clone(),
        headers: msg.headers.clone(),
    }])
}

fn bench_plugin_call(c: &mut Criterion) {
    let runtime = PluginRuntime::new(PluginLimits::default()).unwrap();
    let plugin = Arc::new(
        runtime
            .load_file(
                "passthrough",
                &support::plugin("passthrough"),
                Arc::new(PluginConfig::new()),
                Some(World::Processor),
            )
            .unwrap(),
    );
    for (label, size) in SIZES {
        let mut group = c.benchmark_group(format!("plugin_call/{label}"));
        let one = message(size, 1);
        group.throughput(Throughput::Elements(1));
        group.bench_function("native", |b| b.iter(|| native_passthrough(black_box(&one))));
        group.bench_function("wasm-single", |b| {
            b.iter(|| plugin.process(black_box(&one)).unwrap())
        });
        let batch: Vec<Message> = (0..BATCH).map(|n| message(size, n)).collect();
        group.throughput(Throughput::Elements(BATCH as u64));
        group.bench_function("native-batch-64", |b| {
            b.iter_batched_ref(
                || (),
                |_| batch.iter().map(native_passthrough).collect::<Vec<_>>(),
                BatchSize::SmallInput,
            )
        });
        group.bench_function("wasm-batch-64", |b| {
            b.iter(|| plugin.process_batch(black_box(&batch)).unwrap())
        });
        group.finish();
    }
}

criterion_group!(benches, bench_plugin_call);

fn print_summary() {
    println!();
    println!("plugin call cost per message (mean of criterion's samples)");
    println!(
        "{:<6} {:>14} {:>14} {:>12} {:>8}",
        "size", "mode", "ns/message", "added ns", "ratio"
    );
    for (label, _) in SIZES {
        let group = format!("plugin_call/{label}");
        let Some(native) = support::criterion_mean_ns(&group, "native") else {
            println!("{label}: no results (was the benchmark filtered out?)");
            continue;
        };
        let native_batch =
            support::criterion_mean_ns(&group, "native-batch-64").map(|ns| ns / BATCH as f64);
        let single = support::criterion_mean_ns(&group, "wasm-single");
        let batch = support::criterion_mean_ns(&group, "wasm-batch-64").map(|ns| ns / BATCH as f64);
        let rows = [
            ("native", Some(native), native),
            ("wasm-single", single, native),
            ("native-batch", native_batch, native_batch.unwrap_or(native)),
            ("wasm-batch-64", batch, native_batch.unwrap_or(native)),
        ];
        for (mode, ns, baseline) in rows {
            if let Some(ns) = ns {
                println!(
                    "{label:<6} {mode:>14} {ns:>14.1} {:>12.1} {:>7.2}x",
                    ns - baseline,
                    ns / baseline
                );
            }
        }
    }
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    print_summary();
}
