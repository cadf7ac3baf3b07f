//! Owned Kafka records as the relay moves them: [`InputRecord`] (consumed,
//! with where it came from) and [`OutputRecord`] (to be produced).

use rdkafka::Message as _;
use rdkafka::message::{BorrowedMessage, Header, Headers as _, OwnedHeaders};

/// A consumed record, detached from the consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputRecord {
    /// Topic it was consumed from.
    pub topic: String,
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

    /// Copies a consumed message.
    pub fn from_borrowed(msg: &BorrowedMessage<'_>) -> Self {
        InputRecord {
            topic: msg.topic().to_string(),
            partition: msg.partition(),
            offset: msg.offset(),
            key: msg.key().map(<[u8]>::to_vec),
            value: msg.payload().map(<[u8]>::to_vec),
            headers: msg
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
                .unwrap_or_default(),
            timestamp_ms: msg.timestamp().to_millis(),
        }
    }

    /// `topic/partition/offset`: the same for every redelivery of this
    /// record, so a receiver can drop duplicates.
    pub fn delivery_id(&self) -> String {
        format!("{}/{}/{}", self.topic, self.partition, self.offset)
    }

    /// The first header with this name.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
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

    pub(crate) fn rdkafka_headers(&self) -> OwnedHeaders {
        self.headers.iter().fold(
            OwnedHeaders::new_with_capacity(self.headers.len()),
            |acc, (name, value)| {
                acc.insert(Header {
                    key: name,
                    value: Some(value.as_slice()),
                })
            },
        )
    }
}
