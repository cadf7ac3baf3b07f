//! The JSON-lines message format of `wasmrelay plugin test`:
//! `{"key": "...", "value": "...", "headers": {"name": "value"}}`, with
//! `key_b64` / `value_b64` for binary data and optional `topic`,
//! `partition`, `offset`, `timestamp_ms`.
//!
//! Parsing is strict (an unknown field is an error naming it) so that a typo
//! such as `"vaule"` is caught instead of silently testing an empty message.

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::plugin::{Header, Message, NodeLoad, OutputMessage};

/// One parsed input line.
#[derive(Debug)]
pub enum MessageLine {
    /// A message to process or route.
    Message(Message),
    /// A placement question for a router plugin.
    Place {
        /// The process asking to connect.
        process_id: String,
        /// What is known of each node.
        nodes: Vec<NodeLoad>,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageJson {
    /// Output lines carry the input number; accepting it lets one
    /// `plugin test` feed the next.
    #[serde(default)]
    input: Option<u64>,
    key: Option<String>,
    key_b64: Option<String>,
    value: Option<String>,
    value_b64: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    headers_b64: BTreeMap<String, String>,
    topic: Option<String>,
    partition: Option<i32>,
    offset: Option<i64>,
    timestamp_ms: Option<i64>,
    place: Option<PlaceJson>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlaceJson {
    process_id: String,
    nodes: Vec<NodeJson>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeJson {
    node_id: String,
    #[serde(default = "default_live")]
    live: bool,
    connections: u64,
    quota: u64,
}

fn default_live() -> bool {
    true
}

/// Parses one input line; the error says what is wrong with it.
pub fn parse_message_line(line: &str) -> Result<MessageLine, String> {
    let parsed: MessageJson = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let _ = parsed.input;
    if let Some(place) = parsed.place {
        return Ok(MessageLine::Place {
            process_id: place.process_id,
            nodes: place
                .nodes
                .into_iter()
                .map(|n| NodeLoad {
                    node_id: n.node_id,
                    live: n.live,
                    connections: n.connections,
                    quota: n.quota,
                })
                .collect(),
        });
    }
    let key = text_or_b64("key", parsed.key, parsed.key_b64)?;
    let value = text_or_b64("value", parsed.value, parsed.value_b64)?;
    let mut headers: Vec<Header> = parsed
        .headers
        .into_iter()
        .map(|(name, value)| Header {
            name,
            value: value.into_bytes(),
        })
        .collect();
    for (name, encoded) in parsed.headers_b64 {
        let value = BASE64
            .decode(encoded.as_bytes())
            .map_err(|e| format!("headers_b64.{name}: not valid base64: {e}"))?;
        headers.push(Header { name, value });
    }
    Ok(MessageLine::Message(Message {
        key,
        value,
        headers,
        topic: parsed.topic.unwrap_or_default(),
        partition: parsed.partition.unwrap_or(-1),
        offset: parsed.offset.unwrap_or(-1),
        timestamp_ms: parsed.timestamp_ms,
    }))
}

fn text_or_b64(
    field: &str,
    text: Option<String>,
    b64: Option<String>,
) -> Result<Option<Vec<u8>>, String> {
    match (text, b64) {
        (Some(_), Some(_)) => Err(format!("give either `{field}` or `{field}_b64`, not both")),
        (Some(text), None) => Ok(Some(text.into_bytes())),
        (None, Some(encoded)) => BASE64
            .decode(encoded.as_bytes())
            .map(Some)
            .map_err(|e| format!("{field}_b64: not valid base64: {e}")),
        (None, None) => Ok(None),
    }
}

/// Renders an emitted message as one output line: text fields where the
/// bytes are UTF-8, `*_b64` fields where they are not.
pub fn render_output_message(input: u64, msg: &OutputMessage) -> Value {
    let mut line = Map::new();
    line.insert("input".into(), json!(input));
    put_bytes(&mut line, "key", msg.key.as_deref());
    put_bytes(&mut line, "value", msg.value.as_deref());
    let mut headers = Map::new();
    let mut headers_b64 = Map::new();
    for header in &msg.headers {
        match std::str::from_utf8(&header.value) {
            Ok(text) => headers.insert(header.name.clone(), json!(text)),
            Err(_) => headers_b64.insert(header.name.clone(), json!(BASE64.encode(&header.value))),
        };
    }
    line.insert("headers".into(), Value::Object(headers));
    if !headers_b64.is_empty() {
        line.insert("headers_b64".into(), Value::Object(headers_b64));
    }
    Value::Object(line)
}

fn put_bytes(line: &mut Map<String, Value>, field: &str, bytes: Option<&[u8]>) {
    let Some(bytes) = bytes else {
        return;
    };
    match std::str::from_utf8(bytes) {
        Ok(text) => line.insert(field.into(), json!(text)),
        Err(_) => line.insert(format!("{field}_b64"), json!(BASE64.encode(bytes))),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(line: &str) -> Message {
        match parse_message_line(line).unwrap() {
            MessageLine::Message(m) => m,
            other => panic!("expected a message, got {other:?}"),
        }
    }

    #[test]
    fn parses_text_and_binary_fields() {
        let m =
            message(r#"{"key":"k","value_b64":"AAEC","headers":{"h":"v"},"topic":"t","offset":7}"#);
        assert_eq!(m.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(m.value.as_deref(), Some(&[0u8, 1, 2][..]));
        assert_eq!(m.headers[0].name, "h");
        assert_eq!((m.topic.as_str(), m.partition, m.offset), ("t", -1, 7));
    }

    #[test]
    fn rejects_typos_and_conflicts_by_name() {
        let typo = parse_message_line(r#"{"vaule":"x"}"#).unwrap_err();
        assert!(typo.contains("vaule"), "{typo}");
        let both = parse_message_line(r#"{"key":"a","key_b64":"YQ=="}"#).unwrap_err();
        assert!(both.contains("key_b64"), "{both}");
        let bad = parse_message_line(r#"{"value_b64":"***"}"#).unwrap_err();
        assert!(bad.contains("value_b64"), "{bad}");
        assert!(parse_message_line("not json").is_err());
    }

    #[test]
    fn renders_binary_as_base64() {
        let out = OutputMessage {
            key: None,
            value: Some(vec![0xff, 0x00]),
            headers: vec![Header {
                name: "h".into(),
                value: b"v".to_vec(),
            }],
        };
        let line = render_output_message(3, &out);
        assert_eq!(
            line,
            json!({"input": 3, "value_b64": "/wA=", "headers": {"h": "v"}})
        );
    }
}
