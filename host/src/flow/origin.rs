//! The origin headers a flow puts on every record it produces: where its
//! input came from (topic, partition, offset, key) and the delivery id
//! (`topic/partition/offset`). They are rendered from the input on the
//! stack, and copied into librdkafka's headers when the record is enqueued,
//! so a produced record costs no allocation for them (they used to be five
//! `String`s and five `Vec`s a record, a third of a transform flow's
//! allocations).

use std::fmt::Write as _;

use super::headers;
use crate::kafka::InputRecord;

/// The most origin headers a record carries.
pub const MAX_ORIGIN_HEADERS: usize = 5;

/// A delivery id fits here when its topic is a valid Kafka topic name (at
/// most 249 characters): `/`, a partition (at most 11 characters), `/`, an
/// offset (at most 20).
const DELIVERY_ID_BYTES: usize = 249 + 1 + 11 + 1 + 20;

/// The origin headers of one input, rendered.
pub struct OriginHeaders<'a> {
    input: &'a InputRecord,
    partition: StackText<11>,
    offset: StackText<20>,
    /// The delivery id, on the stack when it fits (always, for a topic
    /// name Kafka allows).
    delivery_id: StackText<DELIVERY_ID_BYTES>,
    /// The delivery id otherwise (a longer topic, which only a test makes).
    long_delivery_id: Option<String>,
}

impl std::fmt::Debug for OriginHeaders<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OriginHeaders")
            .field("topic", &self.input.topic)
            .field("partition", &self.input.partition)
            .field("offset", &self.input.offset)
            .finish_non_exhaustive()
    }
}

impl<'a> OriginHeaders<'a> {
    /// The origin headers of records made from `input`.
    pub fn of(input: &'a InputRecord) -> Self {
        let mut partition = StackText::new();
        let mut offset = StackText::new();
        // Cannot overflow: an i32 takes at most 11 characters, an i64 20.
        let _ = write!(partition, "{}", input.partition);
        let _ = write!(offset, "{}", input.offset);
        let mut delivery_id = StackText::new();
        let long_delivery_id = write!(
            delivery_id,
            "{}/{}/{}",
            input.topic, input.partition, input.offset
        )
        .is_err()
        .then(|| input.delivery_id());
        OriginHeaders {
            input,
            partition,
            offset,
            delivery_id,
            long_delivery_id,
        }
    }

    /// The headers as `(name, value)`, in the order they are written, and
    /// how many there are (no `wasmrelay-origin-key` for an input without
    /// a key).
    pub fn pairs(&self) -> ([(&'static str, &[u8]); MAX_ORIGIN_HEADERS], usize) {
        let delivery_id = match &self.long_delivery_id {
            Some(long) => long.as_bytes(),
            None => self.delivery_id.as_bytes(),
        };
        let mut pairs = [
            (headers::ORIGIN_TOPIC, self.input.topic.as_bytes()),
            (headers::ORIGIN_PARTITION, self.partition.as_bytes()),
            (headers::ORIGIN_OFFSET, self.offset.as_bytes()),
            (headers::ORIGIN_KEY, &[][..]),
            (headers::DELIVERY_ID, delivery_id),
        ];
        match &self.input.key {
            Some(key) => {
                pairs[3].1 = key.as_slice();
                (pairs, MAX_ORIGIN_HEADERS)
            }
            None => {
                pairs[3] = pairs[4];
                (pairs, MAX_ORIGIN_HEADERS - 1)
            }
        }
    }
}

/// Text of at most `N` bytes, kept inline.
struct StackText<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> StackText<N> {
    fn new() -> Self {
        StackText {
            bytes: [0; N],
            len: 0,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl<const N: usize> std::fmt::Write for StackText<N> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        if end > N {
            return Err(std::fmt::Error);
        }
        self.bytes[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(topic: &str, partition: i32, offset: i64, key: Option<&[u8]>) -> InputRecord {
        InputRecord {
            topic: topic.into(),
            partition,
            offset,
            key: key.map(<[u8]>::to_vec),
            value: None,
            headers: Vec::new(),
            timestamp_ms: None,
        }
    }

    fn rendered(input: &InputRecord) -> Vec<(String, Vec<u8>)> {
        let origin = OriginHeaders::of(input);
        let (pairs, count) = origin.pairs();
        pairs[..count]
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_vec()))
            .collect()
    }

    #[test]
    fn the_origin_headers_say_where_the_input_came_from() {
        let with_key = input("orders", 3, 12, Some(b"k-1"));
        assert_eq!(
            rendered(&with_key),
            vec![
                (headers::ORIGIN_TOPIC.to_string(), b"orders".to_vec()),
                (headers::ORIGIN_PARTITION.to_string(), b"3".to_vec()),
                (headers::ORIGIN_OFFSET.to_string(), b"12".to_vec()),
                (headers::ORIGIN_KEY.to_string(), b"k-1".to_vec()),
                (headers::DELIVERY_ID.to_string(), b"orders/3/12".to_vec()),
            ]
        );
        let without_key = input("orders", 0, 7, None);
        assert_eq!(
            rendered(&without_key),
            vec![
                (headers::ORIGIN_TOPIC.to_string(), b"orders".to_vec()),
                (headers::ORIGIN_PARTITION.to_string(), b"0".to_vec()),
                (headers::ORIGIN_OFFSET.to_string(), b"7".to_vec()),
                (headers::DELIVERY_ID.to_string(), b"orders/0/7".to_vec()),
            ]
        );
    }

    #[test]
    fn the_widest_numbers_and_longest_topics_are_rendered_whole() {
        let topic = "t".repeat(249);
        let widest = input(&topic, i32::MIN, i64::MIN, None);
        let headers = rendered(&widest);
        assert_eq!(headers[1].1, i32::MIN.to_string().into_bytes());
        assert_eq!(headers[2].1, i64::MIN.to_string().into_bytes());
        assert_eq!(headers[3].1, widest.delivery_id().into_bytes());
        // Longer than Kafka allows: still whole, from the heap.
        let longer = input(&"t".repeat(400), i32::MAX, i64::MAX, None);
        assert_eq!(rendered(&longer)[3].1, longer.delivery_id().into_bytes());
    }
}
