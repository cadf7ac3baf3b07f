//! The messages that cross the connection: [`IncomingMessage`] (delivered
//! to the process, as Kafka held it) and [`OutgoingMessage`] (sent upstream),
//! and their conversion to and from the wire types.

use bytes::Bytes;
use wasmrelay_protocol::v1;

/// A message delivered to the process: a Kafka record after the node's
/// plugin chain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IncomingMessage {
    /// The record key, if it has one.
    pub key: Option<Bytes>,
    /// The record value.
    pub value: Bytes,
    /// The record headers, in order (a name may repeat).
    pub headers: Vec<(String, Bytes)>,
    /// The topic it was read from (empty when it did not come from Kafka).
    pub topic: String,
    /// Its partition (-1 when it did not come from Kafka).
    pub partition: i32,
    /// Its offset (-1 when it did not come from Kafka).
    pub offset: i64,
    /// Its timestamp, ms since the Unix epoch.
    pub timestamp_ms: i64,
}

impl IncomingMessage {
    /// The value of the first header called `name`.
    pub fn header(&self, name: &str) -> Option<&Bytes> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, value)| value)
    }
}

impl From<v1::Message> for IncomingMessage {
    fn from(message: v1::Message) -> IncomingMessage {
        IncomingMessage {
            key: message.key,
            value: message.value,
            headers: message
                .headers
                .into_iter()
                .map(|header| (header.name, header.value))
                .collect(),
            topic: message.topic,
            partition: message.partition,
            offset: message.offset,
            timestamp_ms: message.timestamp_ms,
        }
    }
}

/// A message the process sends upstream (a `Send` frame): it goes through
/// the node's data-return chain to the output topic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The record key, if any.
    pub key: Option<Bytes>,
    /// The record value.
    pub value: Bytes,
    /// Record headers, in order.
    pub headers: Vec<(String, Bytes)>,
    /// When this answers a delivery: its
    /// [`delivery_id`](crate::Delivery::delivery_id); the node adds the
    /// correlation headers from it.
    pub in_reply_to: Option<String>,
}

impl OutgoingMessage {
    /// A message with this value, no key, no headers.
    pub fn new(value: impl Into<Bytes>) -> OutgoingMessage {
        OutgoingMessage {
            value: value.into(),
            ..OutgoingMessage::default()
        }
    }

    /// An answer to `delivery`: this value, the delivery's key, and
    /// `in_reply_to` set to its delivery id.
    pub fn reply_to(delivery: &crate::Delivery, value: impl Into<Bytes>) -> OutgoingMessage {
        OutgoingMessage {
            key: delivery.message.key.clone(),
            value: value.into(),
            headers: Vec::new(),
            in_reply_to: Some(delivery.delivery_id.clone()),
        }
    }

    /// Sets the key.
    pub fn with_key(mut self, key: impl Into<Bytes>) -> OutgoingMessage {
        self.key = Some(key.into());
        self
    }

    /// Adds a header.
    pub fn with_header(
        mut self,
        name: impl Into<String>,
        value: impl Into<Bytes>,
    ) -> OutgoingMessage {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the delivery id this message answers.
    pub fn with_in_reply_to(mut self, delivery_id: impl Into<String>) -> OutgoingMessage {
        self.in_reply_to = Some(delivery_id.into());
        self
    }

    /// The `Send` frame body for this message with sequence number `seq`.
    pub(crate) fn into_send(self, seq: u64) -> v1::Send {
        v1::Send {
            seq,
            key: self.key,
            value: self.value,
            headers: self
                .headers
                .into_iter()
                .map(|(name, value)| v1::Header { name, value })
                .collect(),
            in_reply_to: self.in_reply_to.unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outgoing_messages_become_send_frames() {
        let send = OutgoingMessage::new("v")
            .with_key("k")
            .with_header("h", "1")
            .with_in_reply_to("t/0/5")
            .into_send(3);
        assert_eq!(send.seq, 3);
        assert_eq!(send.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(&send.value[..], b"v");
        assert_eq!(send.headers.len(), 1);
        assert_eq!(send.in_reply_to, "t/0/5");
        assert_eq!(OutgoingMessage::new("v").into_send(1).in_reply_to, "");
    }

    #[test]
    fn wire_messages_become_incoming_messages() {
        let message = IncomingMessage::from(v1::Message {
            key: None,
            value: Bytes::from_static(b"v"),
            headers: vec![v1::Header {
                name: "h".to_string(),
                value: Bytes::from_static(b"1"),
            }],
            topic: "t".to_string(),
            partition: 2,
            offset: 9,
            timestamp_ms: 5,
        });
        assert_eq!(message.header("h").map(|v| &v[..]), Some(&b"1"[..]));
        assert_eq!(message.header("x"), None);
        assert_eq!((message.partition, message.offset), (2, 9));
    }
}
