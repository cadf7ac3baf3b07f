//! `route-by-field` (router world): names the business process a message is
//! for from a header or, failing that, from a top-level JSON field of the
//! value.
//!
//! * `route`: the value of the first header named by `header`, if present
//!   (it must be UTF-8); else the top-level field named by `field` of the
//!   value parsed as a JSON object, if it is a string or a number (rendered
//!   as decimal, e.g. `42`); else `None` (no process: the relay retries and
//!   dead-letters). A value that is not a JSON object also gives `None`.
//!   Only the top level is parsed into values; the rest is skipped.
//! * `place`: a process whose id starts with `pin_prefix` goes to node
//!   `pin_node` (when both are set and that node is among the candidates);
//!   any other is left to the relay's built-in placement (`None`).
//!
//! Config keys:
//!
//! | key          | default      | meaning                                   |
//! |--------------|--------------|-------------------------------------------|
//! | `header`     | `process-id` | header naming the process                 |
//! | `field`      | `process_id` | top-level JSON field naming the process   |
//! | `pin_prefix` | (none)       | process ids placed on `pin_node`          |
//! | `pin_node`   | (none)       | the node those processes are placed on    |

use std::fmt;
use std::sync::OnceLock;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use wasmrelay_plugin_sdk::prelude::*;

struct Config {
    header: String,
    field: String,
    pin: Option<(String, String)>,
}

/// Config is fixed for the life of an instance, so it is read once.
fn cfg() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| Config {
        header: config::get_or("header", "process-id"),
        field: config::get_or("field", "process_id"),
        pin: config::get("pin_prefix").zip(config::get("pin_node")),
    })
}

/// Finds one top-level member of a JSON object without building the rest.
struct FindField<'a>(&'a str);

/// Whether a member name equals the wanted one (no allocation for names
/// without escapes).
struct NameIs<'a>(&'a str);

impl<'de> DeserializeSeed<'de> for NameIs<'_> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameIs<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }
    fn visit_str<E: de::Error>(self, name: &str) -> Result<bool, E> {
        Ok(name == self.0)
    }
}

/// A process id as found in the JSON: a string or a number.
struct ProcessId;

impl<'de> DeserializeSeed<'de> for ProcessId {
    type Value = Option<String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ProcessId {
    type Value = Option<String>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a process id")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Some(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Some(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v.to_string()))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Some(v.to_string()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Some(v.to_string()))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
}

impl<'de> DeserializeSeed<'de> for FindField<'_> {
    type Value = Option<String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FindField<'_> {
    type Value = Option<String>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        // As with any JSON object parsed into a map, the last duplicate wins.
        let mut found = None;
        while let Some(wanted) = map.next_key_seed(NameIs(self.0))? {
            if wanted {
                found = map.next_value_seed(ProcessId)?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// The process id in top-level field `field` of `value`, if `value` is a JSON
/// object with such a string or number member.
fn field_of(value: &[u8], field: &str) -> Option<String> {
    let mut de = serde_json::Deserializer::from_slice(value);
    let found = FindField(field).deserialize(&mut de).ok()?;
    de.end().ok()?;
    found
}

struct RouteByField;

impl Router for RouteByField {
    fn route(msg: Message) -> Result<Option<String>, String> {
        let cfg = cfg();
        if let Some(id) = msg.header(&cfg.header) {
            return match std::str::from_utf8(id) {
                Ok(id) => Ok(Some(id.to_owned())),
                Err(_) => Err(format!(
                    "route-by-field: header `{}` is not UTF-8",
                    cfg.header
                )),
            };
        }
        Ok(msg.value.as_deref().and_then(|v| field_of(v, &cfg.field)))
    }

    fn place(process_id: String, nodes: Vec<NodeLoad>) -> Result<Option<String>, String> {
        Ok(match &cfg().pin {
            Some((prefix, node)) if process_id.starts_with(prefix.as_str()) => nodes
                .iter()
                .find(|n| &n.node_id == node)
                .map(|n| n.node_id.clone()),
            _ => None,
        })
    }
}

export_router!(RouteByField);

#[cfg(test)]
mod tests {
    use super::field_of;

    #[test]
    fn finds_top_level_field() {
        let v = br#"{"a": {"process_id": "inner"}, "process_id": "p-1", "b": [1, {"x": null}]}"#;
        assert_eq!(field_of(v, "process_id").as_deref(), Some("p-1"));
        assert_eq!(
            field_of(br#"{"process_id": 42}"#, "process_id").as_deref(),
            Some("42")
        );
        assert_eq!(
            field_of(br#"{"process_id": -7}"#, "process_id").as_deref(),
            Some("-7")
        );
        assert_eq!(
            field_of(br#"{"pro\u0063ess_id": "e"}"#, "process_id").as_deref(),
            Some("e")
        );
        assert_eq!(
            field_of(br#"{"a": {"process_id": "inner"}}"#, "process_id"),
            None
        );
        assert_eq!(field_of(br#"{"process_id": true}"#, "process_id"), None);
        assert_eq!(field_of(br#"{"process_id": {"a": 1}}"#, "process_id"), None);
        assert_eq!(field_of(br#"["process_id"]"#, "process_id"), None);
        assert_eq!(field_of(b"not json", "process_id"), None);
        assert_eq!(
            field_of(br#"{"process_id": "x"} trailing"#, "process_id"),
            None
        );
    }
}
