//! A plugin chain applied to a batch of records at once
//! (`PluginChain::apply_batch`, what a transform flow does with the ready
//! records of a partition), on real plugin components: one call per plugin
//! for the whole batch, each record's result the same as when it runs alone,
//! a dead-letter verdict kept to its own record, and a call that fails as a
//! whole (a trap) or a plugin not loaded leaving every record to run alone.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use wasmrelay::flow::chain::PluginChain;
use wasmrelay::flow::retry::Attempt;
use wasmrelay::kafka::{InputRecord, OutputRecord};
use wasmrelay::plugin::{PluginLimits, PluginRegistry, PluginRuntime};
use wasmrelay::telemetry::metrics::RelayMetrics;

use crate::support;

/// A registry with the named example plugins loaded.
async fn registry(plugins: &[&str]) -> (Arc<PluginRegistry>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    for name in plugins {
        std::fs::copy(
            support::plugin(name),
            dir.path().join(format!("{name}.wasm")),
        )
        .unwrap();
    }
    // The deadline is not under test; a loaded machine can stall a call.
    let runtime = PluginRuntime::new(PluginLimits {
        call_deadline: Duration::from_secs(5),
        ..PluginLimits::default()
    })
    .unwrap();
    let registry = Arc::new(PluginRegistry::new(runtime, dir.path(), BTreeMap::new()));
    let report = registry.scan().await;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    (registry, dir)
}

fn input(offset: i64, value: &str) -> InputRecord {
    InputRecord {
        topic: "calls".into(),
        partition: 1,
        offset,
        key: Some(format!("k{offset}").into_bytes()),
        value: Some(value.as_bytes().to_vec()),
        headers: vec![("h".into(), b"v".to_vec())],
        timestamp_ms: Some(1),
    }
}

fn message(input: &InputRecord) -> OutputRecord {
    OutputRecord {
        key: input.key.clone(),
        value: input.value.clone(),
        headers: input.headers.clone(),
    }
}

/// Every item's message came back from `apply_batch` as it was given (a
/// record's retry and dead letter need it; nothing was copied for them).
fn assert_handed_back(inputs: &[InputRecord], given: &[Option<OutputRecord>]) {
    assert_eq!(given.len(), inputs.len());
    for (input, given) in inputs.iter().zip(given) {
        assert_eq!(
            given.as_ref(),
            Some(&message(input)),
            "offset {}",
            input.offset
        );
    }
}

/// Every third record is not JSON (json-enrich dead-letters it).
fn inputs(count: i64) -> Vec<InputRecord> {
    (0..count)
        .map(|n| {
            if n % 3 == 2 {
                input(n, "not json")
            } else {
                input(n, &format!("{{\"n\":{n}}}"))
            }
        })
        .collect()
}

fn value_of(attempt: &Attempt<Vec<OutputRecord>, wasmrelay::flow::chain::ChainFailure>) -> String {
    match attempt {
        Attempt::Success(outputs) => outputs
            .iter()
            .map(|o| String::from_utf8(o.value.clone().unwrap_or_default()).unwrap())
            .collect::<Vec<_>>()
            .join("|"),
        Attempt::GiveUp(failure) => format!("give up: {} {}", failure.plugin, failure.reason),
        Attempt::Retry(failure) => format!("retry: {} {}", failure.plugin, failure.reason),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_gets_each_record_what_it_gets_alone_from_one_call_per_plugin() {
    let (registry, _dir) = registry(&["passthrough", "json-enrich"]).await;
    let metrics = Arc::new(RelayMetrics::new());
    let chain = PluginChain::new(
        vec!["passthrough".into(), "json-enrich".into()],
        registry,
        metrics.clone(),
    );
    let inputs = inputs(90);
    let items = inputs.iter().map(|i| (i, message(i))).collect();
    let (batched, given) = chain.apply_batch(items).await;
    assert_handed_back(&inputs, &given);
    let text = metrics.render();
    for plugin in ["passthrough", "json-enrich"] {
        assert!(
            text.contains(&format!(
                "wasmrelay_plugin_call_seconds_count{{plugin=\"{plugin}\"}} 1\n"
            )),
            "one call of {plugin} for the whole batch:\n{text}"
        );
    }
    assert_eq!(batched.len(), inputs.len());
    let mut dead_lettered = 0;
    for (input, batched) in inputs.iter().zip(&batched) {
        let batched = batched
            .as_ref()
            .unwrap_or_else(|| panic!("offset {} not settled by the batch", input.offset));
        let alone = chain.apply(input, message(input)).await;
        assert_eq!(
            value_of(batched),
            value_of(&alone),
            "offset {}",
            input.offset
        );
        if let Attempt::GiveUp(failure) = batched {
            dead_lettered += 1;
            assert_eq!(input.offset % 3, 2, "only the records that are not JSON");
            assert!(
                failure.plugin.starts_with("json-enrich@"),
                "{}",
                failure.plugin
            );
            assert!(
                failure.reason.contains("not a JSON object"),
                "{}",
                failure.reason
            );
        } else {
            assert!(value_of(batched).contains("\"enriched_by\":\"wasmrelay\""));
        }
    }
    assert_eq!(dead_lettered, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_traps_leaves_every_record_of_the_batch_to_run_alone() {
    let (registry, _dir) = registry(&["passthrough", "fault-panic"]).await;
    let chain = PluginChain::new(
        vec!["passthrough".into(), "fault-panic".into()],
        registry,
        Arc::new(RelayMetrics::new()),
    );
    let inputs = inputs(10);
    let items = inputs.iter().map(|i| (i, message(i))).collect();
    let (batched, given) = chain.apply_batch(items).await;
    // The trapped call hands the messages back too.
    assert_handed_back(&inputs, &given);
    assert_eq!(batched.len(), 10);
    assert!(
        batched.iter().all(Option::is_none),
        "a trap cannot say whose message caused it: {:?}",
        batched
            .iter()
            .map(|b| b.as_ref().map(value_of))
            .collect::<Vec<_>>()
    );
    // Alone, the record's own call gives the verdict.
    match chain.apply(&inputs[0], message(&inputs[0])).await {
        Attempt::GiveUp(failure) => assert!(
            failure.reason.contains("deliberate panic"),
            "{}",
            failure.reason
        ),
        other => panic!(
            "expected the trap as a final failure, got {}",
            value_of(&other)
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_not_loaded_leaves_every_record_of_the_batch_to_retry_alone() {
    let (registry, _dir) = registry(&["passthrough"]).await;
    let chain = PluginChain::new(
        vec!["passthrough".into(), "not-there".into()],
        registry,
        Arc::new(RelayMetrics::new()),
    );
    let inputs = inputs(5);
    let items = inputs.iter().map(|i| (i, message(i))).collect();
    let (batched, given) = chain.apply_batch(items).await;
    assert!(batched.iter().all(Option::is_none));
    assert_handed_back(&inputs, &given);
    assert!(matches!(
        chain.apply(&inputs[0], message(&inputs[0])).await,
        Attempt::Retry(_)
    ));
    // The first plugin not loaded: no call is made, and the messages are
    // handed back as they were given.
    let (first_missing, _first_missing_dir) = self::registry(&["passthrough"]).await;
    let chain = PluginChain::new(
        vec!["not-there".into(), "passthrough".into()],
        first_missing,
        Arc::new(RelayMetrics::new()),
    );
    let items = inputs.iter().map(|i| (i, message(i))).collect();
    let (batched, given) = chain.apply_batch(items).await;
    assert!(batched.iter().all(Option::is_none));
    assert_handed_back(&inputs, &given);
}
