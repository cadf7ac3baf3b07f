//! Plugins in JavaScript, Python and C (`plugins/polyglot`), built from
//! source with the pinned toolchains, run by the real binary: `plugin test`
//! gives what `json-enrich` gives, a JavaScript router routes and places,
//! the guard rails hold for JavaScript (deadline, memory cap, exception), and
//! each language's json-enrich serves a sidecar flow on tansu while a new
//! version in the same language is swapped in under load, with no failed
//! call.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::app::{Receipt, TestApp};
use support::polyglot::{build_polyglot_version, polyglot_plugin};
use support::relay::{RelayProcess, http_get};
use support::tansu::{Tansu, TestRecord};

use support::plugin_cli::{plugin_test, value_json};
use wasmrelay_test_support as support;

const ENRICH_INPUT: &str = r#"{"key":"a","value":"{\"order\":42,\"source\":\"old\",\"z\":[1,{\"q\":null}]}","headers":{"traceparent":"00-abc-01","x-enriched-by":"stale"}}
{"key":"b","value":"[1,2]"}
{"key":"c","value":"not json"}
{"key":"d"}
{"value":"{}"}
"#;

/// What every json-enrich gives on [`ENRICH_INPUT`] with
/// `field=source value=edge-7`: the field set in place, the header set
/// once, the others kept, non-objects and tombstones dead-lettered.
///
/// With `also_batch_and_defaults`, a second run checks the defaults through
/// the `process-batch` export (the relay always calls that one, so the
/// sidecar tests cover it too; compiling a JavaScript or Python component
/// in a debug build takes most of a minute, hence the choice).
fn assert_enriches_like_json_enrich(plugin: &Path, also_batch_and_defaults: bool) {
    let run = plugin_test(
        plugin,
        &["--config", "field=source", "--config", "value=edge-7"],
        ENRICH_INPUT,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.lines.len(), 5, "{:?}\n{}", run.lines, run.stderr);
    let enriched = &run.lines[0];
    assert_eq!(enriched["input"], 1);
    assert_eq!(enriched["key"], "a");
    assert_eq!(
        value_json(enriched),
        json!({"order": 42, "source": "edge-7", "z": [1, {"q": null}]})
    );
    // Key order kept: the overwritten field stays where it was.
    assert!(
        enriched["value"]
            .as_str()
            .unwrap()
            .starts_with(r#"{"order":42,"source":"edge-7""#),
        "{enriched}"
    );
    assert_eq!(enriched["headers"]["x-enriched-by"], "edge-7");
    assert_eq!(enriched["headers"]["traceparent"], "00-abc-01");
    assert_eq!(enriched["headers"]["x-plugin-version"], "1");
    for (line, input) in [(&run.lines[1], 2), (&run.lines[2], 3), (&run.lines[3], 4)] {
        assert_eq!(line["input"], input, "{line}");
        let reason = line["dead_letter"]
            .as_str()
            .unwrap_or_else(|| panic!("input {input} not dead-lettered: {line}"));
        assert!(
            reason.starts_with("json-enrich: value is not a JSON object"),
            "{reason}"
        );
    }
    assert!(
        run.lines[3]["dead_letter"]
            .as_str()
            .unwrap()
            .contains("tombstone")
    );
    assert_eq!(value_json(&run.lines[4]), json!({"source": "edge-7"}));

    if !also_batch_and_defaults {
        return;
    }
    // Defaults, and the batch export gives the same answers.
    let defaults = plugin_test(plugin, &["--batch", "3"], ENRICH_INPUT);
    assert_eq!(defaults.code, 0, "{}", defaults.stderr);
    assert_eq!(defaults.lines.len(), 5, "{:?}", defaults.lines);
    assert_eq!(
        value_json(&defaults.lines[4]),
        json!({"enriched_by": "wasmrelay"})
    );
    assert_eq!(defaults.lines[4]["headers"]["x-enriched-by"], "wasmrelay");
    assert!(defaults.lines[1]["dead_letter"].is_string());
}

#[test]
fn c_json_enrich_in_plugin_test_gives_what_json_enrich_gives() {
    assert_enriches_like_json_enrich(&polyglot_plugin("c-json-enrich"), true);
}

#[test]
fn js_json_enrich_in_plugin_test_gives_what_json_enrich_gives() {
    assert_enriches_like_json_enrich(&polyglot_plugin("js-json-enrich"), false);
}

#[test]
fn python_json_enrich_in_plugin_test_gives_what_json_enrich_gives() {
    assert_enriches_like_json_enrich(&polyglot_plugin("python-json-enrich"), false);
}

#[test]
fn js_router_routes_by_header_then_field_and_pins_placement() {
    let plugin = polyglot_plugin("js-route-by-field");
    let nodes = r#"[{"node_id":"a","live":true,"connections":90,"quota":100},{"node_id":"b","live":true,"connections":10,"quota":100}]"#;
    let input = format!(
        r#"{{"value":"{{\"process_id\":\"p-7\"}}"}}
{{"value":"{{\"process_id\":\"p-7\"}}","headers":{{"process-id":"p-9"}}}}
{{"value":"{{\"other\":1}}"}}
{{"value":"{{\"process_id\":12}}"}}
{{"value":"not json"}}
{{"place":{{"process_id":"a-1","nodes":{nodes}}}}}
{{"place":{{"process_id":"b-1","nodes":{nodes}}}}}
"#
    );
    let run = plugin_test(
        &plugin,
        &[
            "--world",
            "router",
            "--config",
            "pin_prefix=a-",
            "--config",
            "pin_node=a",
        ],
        &input,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        run.lines,
        vec![
            json!({"input": 1, "route": "p-7"}),
            json!({"input": 2, "route": "p-9"}),
            json!({"input": 3, "route": null}),
            json!({"input": 4, "route": "12"}),
            json!({"input": 5, "route": null}),
            json!({"input": 6, "place": "a"}),
            json!({"input": 7, "place": null}),
        ]
    );
}

#[test]
fn js_faults_hit_the_deadline_the_memory_cap_and_become_errors_naming_the_plugin() {
    let plugin = polyglot_plugin("js-fault");
    let input = "{\"value\":\"loop\"}\n{\"value\":\"fine\"}\n{\"value\":\"alloc\"}\n{\"value\":\"throw\"}\n{\"value\":\"fine again\"}\n";
    let started = Instant::now();
    let run = plugin_test(
        &plugin,
        &["--deadline-ms", "500", "--memory-mib", "96"],
        input,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.lines.len(), 5, "{:?}\n{}", run.lines, run.stderr);
    let error = |n: usize| run.lines[n]["error"].as_str().unwrap_or("").to_string();

    assert_eq!(run.lines[0]["kind"], "timeout", "{}", run.lines[0]);
    assert!(error(0).contains("js-fault@"), "{}", error(0));
    assert!(error(0).contains("deadline"), "{}", error(0));

    // The instance that was stopped is discarded; a fresh one serves.
    assert_eq!(run.lines[1]["value"], "fine", "{}", run.lines[1]);

    assert_eq!(run.lines[2]["kind"], "memory-limit", "{}", run.lines[2]);
    assert!(error(2).contains("js-fault@"), "{}", error(2));
    assert!(
        error(2).contains(&(96u64 << 20).to_string()),
        "{}",
        error(2)
    );

    let thrown = &run.lines[3];
    assert!(
        thrown["kind"] == "trap" || thrown["kind"] == "failed",
        "an exception must be an error: {thrown}"
    );
    assert!(error(3).contains("js-fault@"), "{}", error(3));
    assert_eq!(run.lines[4]["value"], "fine again", "{}", run.lines[4]);
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
}

/// A sidecar flow whose service-call chain is the one plugin `enrich`,
/// loaded from `plugins_dir`.
fn flow_config(kafka: &Tansu, app_url: &str, plugins_dir: &Path) -> String {
    format!(
        r#"
shutdown_grace = "20s"
[node]
id = "polyglot-node"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
# The deadline is not under test here: a loaded 2-core machine can stall a
# call of a large component for longer than the default 100 ms.
call_deadline = "5s"
[plugins.config.enrich]
field = "handled_by"
value = "polyglot"
[links.main]
bootstrap_servers = "{bootstrap}"
[links.main.options]
"fetch.wait.max.ms" = "10"
"batch.num.messages" = "1"
[[flows]]
name = "orders"
link = "main"
input_topic = "calls"
service_call = ["enrich"]
output_topic = "returns"
dead_letter_topic = "calls.dlq"
retry = {{ initial_backoff = "10ms", max_backoff = "100ms", budget = "20s" }}
[flows.deliver.app]
url = "{app_url}"
timeout = "10s"
"#,
        plugins = plugins_dir.display(),
        bootstrap = kafka.bootstrap(),
    )
}

fn plugin_version_of(receipt: &Receipt) -> String {
    receipt
        .headers
        .get("x-kafka-header-x-plugin-version")
        .cloned()
        .unwrap_or_else(|| panic!("no x-plugin-version header: {:?}", receipt.headers))
}

/// The scenario for one language: `example` (e.g. `js/json-enrich`) serves
/// a sidecar flow; while records keep arriving, version 2 (built from the
/// same source with `PLUGIN_VERSION` 2) is renamed over it. Every record
/// reaches the app exactly once, enriched by exactly one version, version 2
/// takes over, nothing is retried or dead-lettered.
async fn hot_swap_under_load(example: &str, dist_name: &str) {
    let plugins = tempfile::tempdir().unwrap();
    let staging = tempfile::tempdir().unwrap();
    let v2 = staging.path().join("enrich-v2.wasm");
    build_polyglot_version(example, "processor", 2, &v2);
    std::fs::copy(
        polyglot_plugin(dist_name),
        plugins.path().join("enrich.wasm"),
    )
    .unwrap();

    let kafka = Tansu::start();
    kafka.create_topic("calls", 2).await;
    let app = TestApp::start(|receipt| (200, receipt.body.clone(), vec![])).await;
    let relay = RelayProcess::start_within(
        &flow_config(&kafka, &app.url, plugins.path()),
        &[],
        Duration::from_secs(300),
    );

    // The load: about 50 records a second, produced in small chunks until
    // told to stop (a debug build compiles a JavaScript or Python version
    // for most of a minute meanwhile).
    let stop = Arc::new(AtomicBool::new(false));
    let produced = Arc::new(AtomicUsize::new(0));
    let kafka = Arc::new(kafka);
    let producer = {
        let (kafka, stop, produced) = (kafka.clone(), stop.clone(), produced.clone());
        // Awaited below.
        #[allow(clippy::disallowed_methods)]
        tokio::spawn(async move {
            let started = Instant::now();
            while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(400) {
                let from = produced.load(Ordering::Relaxed);
                let records: Vec<TestRecord> = (from..from + 5)
                    .map(|n| {
                        TestRecord::keyed(format!("key-{}", n % 31), json!({"n": n}).to_string())
                    })
                    .collect();
                kafka.produce("calls", records).await;
                produced.fetch_add(5, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    relay
        .wait_for("version 1 serving", Duration::from_secs(120), || {
            app.count() >= 100
        })
        .await;
    let swapped_at = app.count();
    support::write_then_rename(plugins.path(), "enrich.wasm", &std::fs::read(&v2).unwrap());
    relay
        .wait_for("version 2 serving", Duration::from_secs(300), || {
            app.receipts().iter().any(|r| plugin_version_of(r) == "2")
        })
        .await;
    let v2_seen_at = app.count();
    relay
        .wait_for("more load on version 2", Duration::from_secs(120), || {
            app.count() >= v2_seen_at + 100
        })
        .await;
    stop.store(true, Ordering::Relaxed);
    producer.await.unwrap();
    let total = produced.load(Ordering::Relaxed);
    relay
        .wait_for("every record delivered", Duration::from_secs(180), || {
            app.distinct_deliveries() >= total
        })
        .await;

    let receipts = app.receipts();
    assert_eq!(
        receipts.len(),
        total,
        "a record was delivered twice (a retry?); relay log:\n{}",
        relay.log()
    );
    let mut versions: HashMap<String, usize> = HashMap::new();
    let mut ns = HashSet::new();
    for receipt in &receipts {
        let body: Value = serde_json::from_slice(&receipt.body).unwrap();
        assert_eq!(body["handled_by"], "polyglot", "not enriched: {body}");
        assert_eq!(
            receipt
                .headers
                .get("x-kafka-header-x-enriched-by")
                .map(String::as_str),
            Some("polyglot")
        );
        ns.insert(body["n"].as_u64().unwrap());
        *versions.entry(plugin_version_of(receipt)).or_default() += 1;
    }
    assert_eq!(ns.len(), total);
    assert_eq!(
        versions.keys().collect::<HashSet<_>>(),
        HashSet::from([&"1".to_string(), &"2".to_string()]),
        "{versions:?}"
    );
    // The last records were served by version 2 only.
    let tail = &receipts[receipts.len() - 20..];
    assert!(
        tail.iter().all(|r| plugin_version_of(r) == "2"),
        "version 1 still served after the swap"
    );
    assert!(
        versions["2"] >= 100,
        "too little load on version 2: {versions:?}"
    );
    assert!(swapped_at >= 100);

    assert_eq!(
        relay.metric(r#"wasmrelay_retries_total{flow="orders"}"#),
        0,
        "a call failed and was retried; relay log:\n{}",
        relay.log()
    );
    assert!(
        kafka
            .consume_all("calls.dlq", 1, Duration::from_millis(500))
            .await
            .is_empty(),
        "a record was dead-lettered"
    );
    let (status, body) = http_get(&format!("{}/plugins", relay.admin)).unwrap();
    assert_eq!(status, 200);
    let plugins: Value = serde_json::from_str(&body).unwrap();
    let enrich = &plugins["plugins"][0];
    assert_eq!(enrich["name"], "enrich");
    assert_eq!(enrich["swaps"], 1, "{enrich}");
    assert_eq!(enrich["errors"], 0, "{enrich}");
    assert!(enrich["last_failure"].is_null(), "{enrich}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_json_enrich_serves_a_sidecar_flow_and_is_hot_swapped_under_load() {
    hot_swap_under_load("c/json-enrich", "c-json-enrich").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_json_enrich_serves_a_sidecar_flow_and_is_hot_swapped_under_load() {
    hot_swap_under_load("js/json-enrich", "js-json-enrich").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_json_enrich_serves_a_sidecar_flow_and_is_hot_swapped_under_load() {
    hot_swap_under_load("python/json-enrich", "python-json-enrich").await;
}
