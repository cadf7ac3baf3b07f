//! `json-enrich`: parses the message value as a JSON object, adds a field to
//! it and adds a header to the message. The key and the other headers are
//! kept; the object keeps its key order (an existing field of the same name
//! is overwritten in place).
//!
//! A value that is not a JSON object (not JSON, another JSON type, or a
//! tombstone) is dead-lettered with the reason
//! `json-enrich: value is not a JSON object: <detail>`.
//!
//! Config keys:
//!
//! | key            | default          | meaning                                   |
//! |----------------|------------------|-------------------------------------------|
//! | `field`        | `enriched_by`    | name of the field added to the object     |
//! | `value`        | `wasmrelay`      | its (string) value                        |
//! | `header`       | `x-enriched-by`  | name of the header set on the message     |
//! | `header-value` | same as `value`  | value of that header                      |

use std::sync::OnceLock;

use serde_json::{Map, Value};
use wasmrelay_plugin_sdk::prelude::*;

struct Config {
    field: String,
    value: String,
    header: String,
    header_value: Vec<u8>,
}

impl Config {
    fn load() -> Self {
        let value = config::get_or("value", "wasmrelay");
        Config {
            field: config::get_or("field", "enriched_by"),
            header: config::get_or("header", "x-enriched-by"),
            header_value: config::get("header-value")
                .unwrap_or_else(|| value.clone())
                .into_bytes(),
            value,
        }
    }
}

/// Config is fixed for the life of an instance, so it is read once.
fn cfg() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(Config::load)
}

fn not_an_object(detail: impl std::fmt::Display) -> Outcome {
    Outcome::dead_letter(format!("json-enrich: value is not a JSON object: {detail}"))
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

struct JsonEnrich;

impl Processor for JsonEnrich {
    fn process(msg: Message) -> Result<Outcome, String> {
        let cfg = cfg();
        let Some(bytes) = msg.value.as_deref() else {
            return Ok(not_an_object("no value (tombstone)"));
        };
        let mut object: Map<String, Value> = match serde_json::from_slice(bytes) {
            Ok(Value::Object(object)) => object,
            Ok(other) => return Ok(not_an_object(format!("got {}", kind(&other)))),
            Err(e) => return Ok(not_an_object(e)),
        };
        object.insert(cfg.field.clone(), Value::String(cfg.value.clone()));
        let value = serde_json::to_vec(&object).map_err(|e| format!("json-enrich: {e}"))?;

        let mut out = msg.into_output();
        out.value = Some(value);
        out.set_header(cfg.header.as_str(), cfg.header_value.as_slice());
        Ok(Outcome::one(out))
    }
}

export_processor!(JsonEnrich);
