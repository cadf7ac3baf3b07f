//! `mask-fields`: masks named JSON fields at any depth. Every object member
//! whose name is listed, in objects nested in objects and arrays alike, has
//! its value (whatever its type) replaced by the mask string. Meant for
//! data-return messages that must not carry sensitive fields further.
//!
//! The key and headers are kept. A value in which nothing was masked is
//! passed on byte for byte; otherwise it is re-serialised (key order kept).
//! A tombstone (no value) is passed on: there is nothing to mask. A value
//! that is not JSON is dead-lettered ("mask-fields: value is not JSON;
//! refusing to pass it unmasked").
//!
//! Config keys:
//!
//! | key      | default    | meaning                                           |
//! |----------|------------|---------------------------------------------------|
//! | `fields` | (required) | comma-separated field names, e.g. `ssn,password`  |
//! | `mask`   | `***`      | the string that replaces a masked field's value   |
//!
//! Without `fields` (or with no name in it) every call fails with
//! `mask-fields: config `fields` is required`.

use std::sync::OnceLock;

use serde_json::Value;
use wasmrelay_plugin_sdk::prelude::*;

struct Config {
    fields: Vec<String>,
    mask: String,
}

impl Config {
    fn load() -> Result<Self, String> {
        let fields: Vec<String> = config::get("fields")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(str::to_owned)
            .collect();
        if fields.is_empty() {
            return Err("mask-fields: config `fields` is required".to_owned());
        }
        Ok(Config {
            fields,
            mask: config::get_or("mask", "***"),
        })
    }

    fn is_masked(&self, name: &str) -> bool {
        self.fields.iter().any(|f| f == name)
    }
}

/// Config is fixed for the life of an instance, so it is read once.
fn cfg() -> Result<&'static Config, String> {
    static CONFIG: OnceLock<Result<Config, String>> = OnceLock::new();
    CONFIG
        .get_or_init(Config::load)
        .as_ref()
        .map_err(Clone::clone)
}

/// Masks in place; returns whether anything was masked.
fn mask(value: &mut Value, cfg: &Config) -> bool {
    let mut changed = false;
    match value {
        Value::Object(object) => {
            for (name, member) in object.iter_mut() {
                if cfg.is_masked(name) {
                    *member = Value::String(cfg.mask.clone());
                    changed = true;
                } else {
                    changed |= mask(member, cfg);
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                changed |= mask(item, cfg);
            }
        }
        _ => {}
    }
    changed
}

struct MaskFields;

impl Processor for MaskFields {
    fn process(msg: Message) -> Result<Outcome, String> {
        let cfg = cfg()?;
        let Some(bytes) = msg.value.as_deref() else {
            return Ok(Outcome::one(msg.into_output()));
        };
        let Ok(mut value) = serde_json::from_slice::<Value>(bytes) else {
            return Ok(Outcome::dead_letter(
                "mask-fields: value is not JSON; refusing to pass it unmasked",
            ));
        };
        if !mask(&mut value, cfg) {
            return Ok(Outcome::one(msg.into_output()));
        }
        let masked = serde_json::to_vec(&value).map_err(|e| format!("mask-fields: {e}"))?;
        let mut out = msg.into_output();
        out.value = Some(masked);
        Ok(Outcome::one(out))
    }
}

export_processor!(MaskFields);
