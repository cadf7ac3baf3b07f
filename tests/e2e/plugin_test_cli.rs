//! `wasmrelay plugin test` as a plugin author runs it: the built binary, the
//! built example plugins, JSON lines in and out.

use std::process::Command;

use serde_json::json;

use support::plugin_cli::{PluginTestRun, value_json};
use wasmrelay_test_support as support;

/// `plugin test` on an example plugin by name, or on a `.wasm` path.
fn plugin_test(plugin: &str, args: &[&str], input: &str) -> PluginTestRun {
    let path = if plugin.ends_with(".wasm") {
        std::path::PathBuf::from(plugin)
    } else {
        support::plugin(plugin)
    };
    support::plugin_cli::plugin_test(&path, args, input)
}

#[test]
fn passthrough_emits_each_message_unchanged() {
    let input = r#"{"key":"k1","value":"hello","headers":{"h":"v"}}
{"value_b64":"/wA=","topic":"t","partition":2,"offset":9}

{"key":"k3"}
"#;
    let run = plugin_test("passthrough", &[], input);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        run.lines,
        vec![
            json!({"input": 1, "key": "k1", "value": "hello", "headers": {"h": "v"}}),
            json!({"input": 2, "value_b64": "/wA=", "headers": {}}),
            json!({"input": 4, "key": "k3", "headers": {}}),
        ]
    );
    // The batch call gives the same answers.
    let batched = plugin_test("passthrough", &["--batch", "2"], input);
    assert_eq!(batched.code, 0, "{}", batched.stderr);
    assert_eq!(batched.lines, run.lines);
}

#[test]
fn json_enrich_adds_the_configured_field_and_header() {
    let input = r#"{"key":"a","value":"{\"order\":42}","headers":{"traceparent":"00-abc-01"}}
{"key":"b","value":"[1,2]"}
"#;
    let run = plugin_test(
        "json-enrich",
        &["--config", "field=source", "--config", "value=edge-7"],
        input,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.lines.len(), 2, "{:?}", run.lines);
    let enriched = &run.lines[0];
    assert_eq!(enriched["key"], "a");
    assert_eq!(
        value_json(enriched),
        json!({"order": 42, "source": "edge-7"})
    );
    assert_eq!(enriched["headers"]["x-enriched-by"], "edge-7");
    assert_eq!(enriched["headers"]["traceparent"], "00-abc-01");
    assert_eq!(run.lines[1]["input"], 2);
    let reason = run.lines[1]["dead_letter"].as_str().unwrap();
    assert!(reason.contains("not a JSON object"), "{reason}");

    // Defaults when no config is given.
    let defaults = plugin_test("json-enrich", &[], r#"{"value":"{}"}"#);
    assert_eq!(
        value_json(&defaults.lines[0]),
        json!({"enriched_by": "wasmrelay"})
    );
    assert_eq!(defaults.lines[0]["headers"]["x-enriched-by"], "wasmrelay");
}

#[test]
fn mask_fields_masks_named_fields_at_any_depth() {
    let value = json!({
        "user": "bob",
        "password": "hunter2",
        "card": {"number": "4111", "holder": "Bob"},
        "items": [{"password": "x", "sku": 1}]
    });
    let input = format!(
        "{}\n{}\n",
        json!({"key": "r1", "value": value.to_string()}),
        json!({"key": "r2", "value": "not json"})
    );
    let run = plugin_test(
        "mask-fields",
        &["--config", "fields=password,number"],
        &input,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        value_json(&run.lines[0]),
        json!({
            "user": "bob",
            "password": "***",
            "card": {"number": "***", "holder": "Bob"},
            "items": [{"password": "***", "sku": 1}]
        })
    );
    assert!(
        run.lines[1]["dead_letter"]
            .as_str()
            .unwrap()
            .contains("not JSON")
    );

    let custom = plugin_test(
        "mask-fields",
        &["--config", "fields=user", "--config", "mask=[redacted]"],
        &format!("{}\n", json!({"value": value.to_string()})),
    );
    assert_eq!(value_json(&custom.lines[0])["user"], "[redacted]");

    let unconfigured = plugin_test("mask-fields", &[], r#"{"value":"{}"}"#);
    assert_eq!(unconfigured.lines[0]["kind"], "failed");
    let error = unconfigured.lines[0]["error"].as_str().unwrap();
    assert!(error.contains("`fields` is required"), "{error}");
}

#[test]
fn route_by_field_routes_by_header_then_field_and_pins_placement_by_prefix() {
    let input = r#"{"value":"{\"process_id\":\"p-7\"}"}
{"value":"{\"process_id\":\"p-7\"}","headers":{"process-id":"p-9"}}
{"value":"{\"other\":1}"}
{"value":"{\"process_id\":12}"}
{"place":{"process_id":"p-1","nodes":[{"node_id":"a","live":true,"connections":90,"quota":100},{"node_id":"b","live":true,"connections":10,"quota":100},{"node_id":"c","live":false,"connections":0,"quota":100}]}}
"#;
    let run = plugin_test("route-by-field", &["--world", "router"], input);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        run.lines,
        vec![
            json!({"input": 1, "route": "p-7"}),
            json!({"input": 2, "route": "p-9"}),
            json!({"input": 3, "route": null}),
            json!({"input": 4, "route": "12"}),
            // No pin configured: the relay's built-in placement decides.
            json!({"input": 5, "place": null}),
        ]
    );
    let place = |process_id: &str| {
        format!(
            r#"{{"place":{{"process_id":"{process_id}","nodes":[{{"node_id":"a","live":true,"connections":90,"quota":100}},{{"node_id":"b","live":true,"connections":10,"quota":100}}]}}}}"#
        )
    };
    let pinned = plugin_test(
        "route-by-field",
        &["--config", "pin_prefix=a-", "--config", "pin_node=a"],
        &format!("{}\n{}\n", place("a-1"), place("b-1")),
    );
    assert_eq!(
        pinned.lines,
        vec![
            json!({"input": 1, "place": "a"}),
            json!({"input": 2, "place": null}),
        ],
        "{}",
        pinned.stderr
    );
    let by_custom_field = plugin_test(
        "route-by-field",
        &["--config", "field=target"],
        r#"{"value":"{\"target\":\"p-3\"}"}"#,
    );
    assert_eq!(
        by_custom_field.lines,
        vec![json!({"input": 1, "route": "p-3"})]
    );
}

#[test]
fn faults_are_reported_per_message() {
    let run = plugin_test("fault-panic", &[], "{\"value\":\"a\"}\n{\"value\":\"b\"}\n");
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.lines.len(), 2);
    for (i, line) in run.lines.iter().enumerate() {
        assert_eq!(line["input"], i as u64 + 1);
        assert_eq!(line["kind"], "trap");
        assert!(
            line["error"].as_str().unwrap().contains("deliberate panic"),
            "{line}"
        );
    }
    let looping = plugin_test(
        "fault-loop",
        &["--deadline-ms", "50"],
        "{\"value\":\"a\"}\n",
    );
    assert_eq!(looping.lines[0]["kind"], "timeout");
}

#[test]
fn a_plugin_that_cannot_load_exits_1_with_the_reason() {
    let import = plugin_test("fault-import", &[], "");
    assert_eq!(import.code, 1);
    assert!(
        import.stderr.contains("wasmrelay:forbidden/net"),
        "{}",
        import.stderr
    );

    let wrong_world = plugin_test("passthrough", &["--world", "router"], "");
    assert_eq!(wrong_world.code, 1);
    assert!(
        wrong_world.stderr.contains("processor world"),
        "{}",
        wrong_world.stderr
    );

    let missing = plugin_test("/nonexistent/plugin.wasm", &[], "");
    assert_eq!(missing.code, 1);
    assert!(
        missing.stderr.contains("/nonexistent/plugin.wasm"),
        "{}",
        missing.stderr
    );
}

#[test]
fn bad_input_exits_2_naming_the_line() {
    let run = plugin_test(
        "passthrough",
        &[],
        "{\"value\":\"ok\"}\n{\"vaule\":\"typo\"}\n",
    );
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("input line 2"), "{}", run.stderr);
    assert!(run.stderr.contains("vaule"), "{}", run.stderr);
    // What came before the bad line was still processed and printed.
    assert_eq!(run.lines.len(), 1);

    let bad_world = Command::new(support::wasmrelay_binary())
        .args(["plugin", "test", "x.wasm", "--world", "sorter"])
        .output()
        .unwrap();
    assert_eq!(bad_world.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_world.stderr).contains("sorter"));
}
