//! Building dead-letter records: the message as it was at the failing stage,
//! plus headers saying why, where, when, and where the input came from.
//!
//! A dead letter must always be writable, or its partition stops there: the
//! reason is cut to [`MAX_REASON_BYTES`], and a dead letter the broker
//! refuses as too large is written again without the message
//! ([`without_the_message`]), saying what was left out.

use super::headers;
use super::origin::OriginHeaders;
use crate::kafka::{InputRecord, OutputRecord};

/// Where in a flow a message failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stage {
    /// A plugin of a chain: `plugin:<name>@<sha256>`.
    Plugin(String),
    /// Delivery to the application.
    App,
    /// Producing the data-return or output record.
    Produce,
    /// Naming the process of a cluster message: `router:<name>@<sha256>` or
    /// `router:built-in`.
    Route(String),
    /// Delivery to a business process in the cluster.
    Deliver,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stage::Plugin(label) => write!(f, "plugin:{label}"),
            Stage::App => f.write_str("app"),
            Stage::Produce => f.write_str("produce"),
            Stage::Route(stage) => f.write_str(stage),
            Stage::Deliver => f.write_str("deliver"),
        }
    }
}

/// The longest reason a dead letter carries, in bytes (the rest is cut).
pub const MAX_REASON_BYTES: usize = 4096;

/// The dead letter header saying what [`without_the_message`] left out.
pub const DROPPED_HEADER: &str = "wasmrelay-dlq-dropped";

/// `dead_letter` as it can still be written when it is too large for the
/// dead-letter topic: no value and no key (each replaced by nothing), only
/// the relay's own headers (origin, delivery id, reason, stage), and
/// [`DROPPED_HEADER`] saying how large what was left out was. The original
/// is still in the input topic at its origin offset.
pub fn without_the_message(dead_letter: &OutputRecord) -> OutputRecord {
    let value_bytes = dead_letter.value.as_ref().map_or(0, Vec::len);
    let key_bytes = dead_letter.key.as_ref().map_or(0, Vec::len);
    let (kept, dropped): (Vec<_>, Vec<_>) = dead_letter
        .headers
        .iter()
        .cloned()
        .partition(|(name, _)| headers::is_reserved(name));
    let header_bytes: usize = dropped.iter().map(|(n, v)| n.len() + v.len()).sum();
    let mut record = OutputRecord {
        key: None,
        value: Some(Vec::new()),
        headers: kept,
    };
    record.set_header(
        DROPPED_HEADER,
        format!(
            "too large for the dead-letter topic: left out a value of {value_bytes} bytes, a key of {key_bytes} bytes and {} headers of {header_bytes} bytes",
            dropped.len()
        ),
    );
    record
}

/// Adds the origin headers of `input` to `record` (dead letters; a flow's
/// outputs get them when enqueued, see [`super::origin`]).
pub fn add_origin_headers(record: &mut OutputRecord, input: &InputRecord) {
    let origin = OriginHeaders::of(input);
    let (pairs, count) = origin.pairs();
    for (name, value) in &pairs[..count] {
        record.set_header(name, *value);
    }
}

/// The dead-letter record for `failed` (the message at the failing stage),
/// which came from `input`.
pub fn dead_letter_record(
    failed: OutputRecord,
    input: &InputRecord,
    flow: &str,
    node: &str,
    stage: &Stage,
    reason: &str,
) -> OutputRecord {
    let mut record = failed;
    add_origin_headers(&mut record, input);
    record.set_header(
        headers::DLQ_REASON,
        crate::text::cut_to(reason, MAX_REASON_BYTES).as_bytes(),
    );
    record.set_header(headers::DLQ_STAGE, stage.to_string());
    record.set_header(headers::DLQ_FLOW, flow.as_bytes());
    record.set_header(headers::DLQ_NODE, node.as_bytes());
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    record.set_header(headers::DLQ_TIME_MS, now_ms.to_string());
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_carries_reason_stage_and_origin() {
        let input = InputRecord {
            topic: "calls".into(),
            partition: 2,
            offset: 41,
            key: Some(b"k".to_vec()),
            value: Some(b"v".to_vec()),
            headers: vec![],
            timestamp_ms: None,
        };
        let failed = OutputRecord {
            key: input.key.clone(),
            value: input.value.clone(),
            headers: vec![("traceparent".into(), b"00-x".to_vec())],
        };
        let record = dead_letter_record(
            failed,
            &input,
            "orders",
            "node-1",
            &Stage::App,
            "app answered 400",
        );
        assert_eq!(
            record.header(headers::DLQ_REASON),
            Some(&b"app answered 400"[..])
        );
        assert_eq!(record.header(headers::DLQ_STAGE), Some(&b"app"[..]));
        assert_eq!(
            record.header(headers::DELIVERY_ID),
            Some(&b"calls/2/41"[..])
        );
        assert_eq!(record.header("traceparent"), Some(&b"00-x"[..]));
        assert!(record.header(headers::DLQ_TIME_MS).is_some());
        assert_eq!(
            Stage::Plugin("mask@abc".into()).to_string(),
            "plugin:mask@abc"
        );
    }

    #[test]
    fn a_long_reason_is_cut_and_a_dead_letter_without_the_message_keeps_only_the_relays_headers() {
        let input = InputRecord {
            topic: "calls".into(),
            partition: 0,
            offset: 9,
            key: Some(b"k".to_vec()),
            value: Some(vec![b'v'; 2_000_000]),
            headers: vec![],
            timestamp_ms: None,
        };
        let failed = OutputRecord {
            key: input.key.clone(),
            value: input.value.clone(),
            headers: vec![("big".into(), vec![b'h'; 1000])],
        };
        let long_reason = "é".repeat(1_000_000);
        let record =
            dead_letter_record(failed, &input, "orders", "n", &Stage::Produce, &long_reason);
        let reason = record.header(headers::DLQ_REASON).unwrap();
        assert!(reason.len() < MAX_REASON_BYTES + 40, "{}", reason.len());
        assert!(std::str::from_utf8(reason).unwrap().ends_with("bytes cut)"));
        let slim = without_the_message(&record);
        assert_eq!(slim.value.as_deref(), Some(&[][..]));
        assert_eq!(slim.key, None);
        assert_eq!(slim.header("big"), None);
        assert_eq!(slim.header(headers::DELIVERY_ID), Some(&b"calls/0/9"[..]));
        assert_eq!(slim.header(headers::DLQ_REASON), Some(reason));
        let dropped = std::str::from_utf8(slim.header(DROPPED_HEADER).unwrap()).unwrap();
        assert!(dropped.contains("a value of 2000000 bytes"), "{dropped}");
        assert!(dropped.contains("1 headers of 1003 bytes"), "{dropped}");
    }
}
