//! Building dead-letter records: the message as it was at the failing stage,
//! plus headers saying why, where, when, and where the input came from.

use super::headers;
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

/// Adds the origin headers of `input` to `record` (data-returns and dead letters).
pub fn add_origin_headers(record: &mut OutputRecord, input: &InputRecord) {
    record.set_header(headers::ORIGIN_TOPIC, input.topic.as_bytes());
    record.set_header(headers::ORIGIN_PARTITION, input.partition.to_string());
    record.set_header(headers::ORIGIN_OFFSET, input.offset.to_string());
    if let Some(key) = &input.key {
        record.set_header(headers::ORIGIN_KEY, key.clone());
    }
    record.set_header(headers::DELIVERY_ID, input.delivery_id());
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
    record.set_header(headers::DLQ_REASON, reason.as_bytes());
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
}
