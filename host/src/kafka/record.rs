//! Kafka records as the relay moves them: [`InputRecord`] (consumed, with
//! where it came from), [`RecordView`] (a consumed record read in place,
//! from librdkafka's buffer or an [`InputRecord`]) and [`OutputRecord`] (to
//! be produced).

use std::sync::Arc;

use rdkafka::Message as _;
use rdkafka::message::{BorrowedHeaders, BorrowedMessage, Header, Headers as _, OwnedHeaders};

/// A message's headers, copied; a header without a value gets an empty one.
fn copied_headers(message: &impl rdkafka::Message) -> Vec<(String, Vec<u8>)> {
    message
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|h| {
                    (
                        h.key.to_string(),
                        h.value.map(<[u8]>::to_vec).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A consumed record, detached from the consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputRecord {
    /// Topic it was consumed from (shared by the records of a consumer).
    pub topic: Arc<str>,
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Key, if any.
    pub key: Option<Vec<u8>>,
    /// Value; `None` for a tombstone.
    pub value: Option<Vec<u8>>,
    /// Headers, in order; a header without a value has an empty value.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Record timestamp in ms since the Unix epoch, when the broker gave one.
    pub timestamp_ms: Option<i64>,
}

impl InputRecord {
    /// The bytes of its key, value and headers (what holding it costs,
    /// roughly).
    pub fn size_bytes(&self) -> usize {
        self.key.as_ref().map_or(0, Vec::len)
            + self.value.as_ref().map_or(0, Vec::len)
            + self
                .headers
                .iter()
                .map(|(name, value)| name.len() + value.len())
                .sum::<usize>()
    }

    /// Copies a consumed message of `topic` (its topic, shared).
    pub fn from_borrowed(msg: &BorrowedMessage<'_>, topic: &Arc<str>) -> Self {
        debug_assert_eq!(msg.topic(), &**topic, "a message of another topic");
        InputRecord {
            topic: topic.clone(),
            partition: msg.partition(),
            offset: msg.offset(),
            key: msg.key().map(<[u8]>::to_vec),
            value: msg.payload().map(<[u8]>::to_vec),
            headers: copied_headers(msg),
            timestamp_ms: msg.timestamp().to_millis(),
        }
    }

    /// `topic/partition/offset`: the same for every redelivery of this
    /// record, so a receiver can drop duplicates.
    pub fn delivery_id(&self) -> String {
        use std::fmt::Write as _;
        // Sized once (the two numbers take at most 11 and 20 characters):
        // `format!` grows it step by step, one reallocation a delivery.
        let mut id = String::with_capacity(self.topic.len() + 33);
        let _ = write!(id, "{}/{}/{}", self.topic, self.partition, self.offset);
        id
    }

    /// The first header with this name.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// The record as a [`RecordView`].
    pub fn view(&self) -> RecordView<'_> {
        RecordView {
            topic: &self.topic,
            partition: self.partition,
            offset: self.offset,
            key: self.key.as_deref(),
            value: self.value.as_deref(),
            headers: HeadersView::Owned(&self.headers),
        }
    }
}

/// A consumed record read where it is, without a copy: what a reader that
/// only looks at each record once (the route table) takes.
#[derive(Clone, Copy, Debug)]
pub struct RecordView<'a> {
    /// Topic it was consumed from.
    pub topic: &'a str,
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Key, if any.
    pub key: Option<&'a [u8]>,
    /// Value; `None` for a tombstone.
    pub value: Option<&'a [u8]>,
    headers: HeadersView<'a>,
}

#[derive(Clone, Copy)]
enum HeadersView<'a> {
    Kafka(Option<&'a BorrowedHeaders>),
    Owned(&'a [(String, Vec<u8>)]),
}

impl std::fmt::Debug for HeadersView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = match self {
            HeadersView::Kafka(headers) => headers
                .iter()
                .flat_map(|headers| headers.iter().map(|h| h.key))
                .collect(),
            HeadersView::Owned(headers) => headers.iter().map(|(n, _)| n.as_str()).collect(),
        };
        f.debug_struct("Headers").field("names", &names).finish()
    }
}

impl<'a> RecordView<'a> {
    /// A consumed message, in librdkafka's buffer.
    pub fn of_message(message: &'a BorrowedMessage<'_>) -> RecordView<'a> {
        RecordView {
            topic: message.topic(),
            partition: message.partition(),
            offset: message.offset(),
            key: message.key(),
            value: message.payload(),
            headers: HeadersView::Kafka(message.headers()),
        }
    }

    /// The first header with this name (a header without a value has an
    /// empty one).
    pub fn header(&self, name: &str) -> Option<&'a [u8]> {
        match self.headers {
            HeadersView::Kafka(headers) => headers?
                .iter()
                .find(|h| h.key == name)
                .map(|h| h.value.unwrap_or_default()),
            HeadersView::Owned(headers) => headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_slice()),
        }
    }
}

/// A record to produce.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutputRecord {
    /// Key, if any (also picks the partition).
    pub key: Option<Vec<u8>>,
    /// Value; `None` for a tombstone.
    pub value: Option<Vec<u8>>,
    /// Headers, in order.
    pub headers: Vec<(String, Vec<u8>)>,
}

impl OutputRecord {
    /// Copies a message as librdkafka holds it (key, value, headers): a
    /// produced record handed back by a failed delivery report.
    pub fn from_message(message: &impl rdkafka::Message) -> Self {
        OutputRecord {
            key: message.key().map(<[u8]>::to_vec),
            value: message.payload().map(<[u8]>::to_vec),
            headers: copied_headers(message),
        }
    }

    /// Sets a header, replacing any of the same name.
    pub fn set_header(&mut self, name: &str, value: impl Into<Vec<u8>>) {
        self.headers.retain(|(n, _)| n != name);
        self.headers.push((name.to_string(), value.into()));
    }

    /// The first header with this name.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Its headers for librdkafka, followed by `extra` (which replace any
    /// of its own with the same names, as [`OutputRecord::set_header`]
    /// would); `None` when there are none at all.
    pub(crate) fn rdkafka_headers(&self, extra: &[(&str, &[u8])]) -> Option<OwnedHeaders> {
        if self.headers.is_empty() && extra.is_empty() {
            return None;
        }
        let mut headers = OwnedHeaders::new_with_capacity(self.headers.len() + extra.len());
        for (name, value) in &self.headers {
            if extra.iter().any(|(extra_name, _)| extra_name == name) {
                continue;
            }
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_slice()),
            });
        }
        for (name, value) in extra {
            headers = headers.insert(Header {
                key: name,
                value: Some(*value),
            });
        }
        Some(headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names_and_values(headers: &OwnedHeaders) -> Vec<(String, Vec<u8>)> {
        headers
            .iter()
            .map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec()))
            .collect()
    }

    #[test]
    fn extra_headers_follow_the_records_own_and_replace_those_of_their_names() {
        let record = OutputRecord {
            key: None,
            value: None,
            headers: vec![
                ("traceparent".into(), b"00-1".to_vec()),
                ("wasmrelay-origin-topic".into(), b"forged".to_vec()),
                ("app".into(), b"x".to_vec()),
            ],
        };
        let extra: [(&str, &[u8]); 2] = [
            ("wasmrelay-origin-topic", b"orders"),
            ("wasmrelay-delivery-id", b"orders/0/1"),
        ];
        let headers = record.rdkafka_headers(&extra).expect("headers");
        assert_eq!(
            names_and_values(&headers),
            vec![
                ("traceparent".to_string(), b"00-1".to_vec()),
                ("app".to_string(), b"x".to_vec()),
                ("wasmrelay-origin-topic".to_string(), b"orders".to_vec()),
                ("wasmrelay-delivery-id".to_string(), b"orders/0/1".to_vec()),
            ]
        );
        // Without extra headers the record's own go as they are.
        assert_eq!(
            names_and_values(&record.rdkafka_headers(&[]).expect("headers")),
            record.headers
        );
        // Nothing at all: no headers for librdkafka to allocate.
        assert!(OutputRecord::default().rdkafka_headers(&[]).is_none());
    }

    #[test]
    fn the_delivery_id_is_topic_partition_offset() {
        let record = |topic: &str, partition, offset| InputRecord {
            topic: topic.into(),
            partition,
            offset,
            key: None,
            value: None,
            headers: Vec::new(),
            timestamp_ms: None,
        };
        assert_eq!(record("orders", 3, 12).delivery_id(), "orders/3/12");
        let widest = record("t", i32::MIN, i64::MIN).delivery_id();
        assert_eq!(widest, format!("t/{}/{}", i32::MIN, i64::MIN));
        // Sized once, however wide the numbers.
        assert!(widest.capacity() >= widest.len() && widest.capacity() <= 1 + 33);
    }
}
