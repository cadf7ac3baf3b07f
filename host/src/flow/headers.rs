//! Every header name the relay reads or writes, in one place: on HTTP
//! requests to the application, on data-return records, and on dead-letter
//! records.

/// HTTP: `topic/partition/offset` of the input; the same on every redelivery.
pub const HTTP_DELIVERY_ID: &str = "x-wasmrelay-delivery-id";
/// HTTP: the flow's name.
pub const HTTP_FLOW: &str = "x-wasmrelay-flow";
/// HTTP: input topic.
pub const HTTP_TOPIC: &str = "x-wasmrelay-topic";
/// HTTP: input partition.
pub const HTTP_PARTITION: &str = "x-wasmrelay-partition";
/// HTTP: input offset.
pub const HTTP_OFFSET: &str = "x-wasmrelay-offset";
/// HTTP: the record key, when it is valid UTF-8 and a valid header value.
pub const HTTP_KEY: &str = "x-wasmrelay-key";
/// HTTP: the record key in base64, when it is not.
pub const HTTP_KEY_B64: &str = "x-wasmrelay-key-b64";
/// HTTP prefix: each Kafka header `name` travels as `x-kafka-header-name`,
/// both ways (request: the message's headers; response: headers for the
/// data-return record).
pub const HTTP_KAFKA_HEADER_PREFIX: &str = "x-kafka-header-";
/// W3C trace context, carried as is from Kafka to HTTP and back.
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// Data-return and dead-letter records: where the input came from.
pub const ORIGIN_TOPIC: &str = "wasmrelay-origin-topic";
/// Input partition.
pub const ORIGIN_PARTITION: &str = "wasmrelay-origin-partition";
/// Input offset.
pub const ORIGIN_OFFSET: &str = "wasmrelay-origin-offset";
/// Input key (raw bytes), when the input had one.
pub const ORIGIN_KEY: &str = "wasmrelay-origin-key";
/// `topic/partition/offset` of the input.
pub const DELIVERY_ID: &str = "wasmrelay-delivery-id";

/// Dead letters: why the record could not be handled.
pub const DLQ_REASON: &str = "wasmrelay-dlq-reason";
/// Dead letters: at which stage (`plugin:<name>@<sha256>`, `app`, `produce`).
pub const DLQ_STAGE: &str = "wasmrelay-dlq-stage";
/// Dead letters: the flow.
pub const DLQ_FLOW: &str = "wasmrelay-dlq-flow";
/// Dead letters: when, in ms since the Unix epoch.
pub const DLQ_TIME_MS: &str = "wasmrelay-dlq-time-ms";
/// Dead letters: the node that gave up.
pub const DLQ_NODE: &str = "wasmrelay-dlq-node";

/// Upstream records from business processes: the process that sent it.
pub const ORIGIN_PROCESS: &str = "wasmrelay-origin-process";
/// Upstream records: the node the process was connected to.
pub const ORIGIN_NODE: &str = "wasmrelay-origin-node";

/// The prefix of every header the relay sets on records: a header a
/// business process sends may not start with it (any case), so that no
/// client can pass for the relay (an origin, a delivery id, a dead letter's
/// reason, a MAC).
pub const RESERVED_PREFIX: &str = "wasmrelay-";

/// True for a header name only the relay may set.
pub fn is_reserved(name: &str) -> bool {
    name.len() >= RESERVED_PREFIX.len()
        && name.as_bytes()[..RESERVED_PREFIX.len()].eq_ignore_ascii_case(RESERVED_PREFIX.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_header_the_relay_sets_on_records_is_reserved_in_any_case() {
        for name in [
            ORIGIN_TOPIC,
            ORIGIN_PARTITION,
            ORIGIN_OFFSET,
            ORIGIN_KEY,
            DELIVERY_ID,
            DLQ_REASON,
            DLQ_STAGE,
            DLQ_FLOW,
            DLQ_TIME_MS,
            DLQ_NODE,
            ORIGIN_PROCESS,
            ORIGIN_NODE,
            "wasmrelay-mac",
            "WasmRelay-Delivery-Id",
        ] {
            assert!(is_reserved(name), "{name}");
        }
        for name in ["trace", "wasmrelay", "x-wasmrelay-flow", "traceparent", ""] {
            assert!(!is_reserved(name), "{name}");
        }
    }
}
