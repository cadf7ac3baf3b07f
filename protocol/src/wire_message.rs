//! A [`v1::Message`] as a delivery holds it: as the relay made it
//! ([`WireMessage::Decoded`]), or as another node forwarded it
//! ([`WireMessage::Encoded`]): its protobuf encoding, checked once and then
//! passed on to the process byte for byte, never decoded into fields
//! (topic, headers, key and value would each be an allocation on the node
//! that only hands the message on).
//!
//! [`EncodedMessage::check`] accepts an encoding only when a protobuf
//! decoder takes it as a `Message`: every field well formed, the known ones
//! (1-7) of their declared wire type, strings UTF-8, the headers themselves
//! well formed. It is stricter than prost where the relay never sends
//! something: groups are refused.

use std::borrow::Cow;

use bytes::{BufMut, Bytes};
use prost::Message as _;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};

use crate::v1;

/// A message on its way to a process (see the module).
#[derive(Debug, Clone, PartialEq)]
pub enum WireMessage {
    /// Made here; `len` is its encoded length, counted once.
    Decoded {
        /// The message.
        message: v1::Message,
        /// `message.encoded_len()`.
        len: usize,
    },
    /// As a peer node sent it, checked.
    Encoded(EncodedMessage),
}

impl WireMessage {
    /// A message made here.
    pub fn new(message: v1::Message) -> WireMessage {
        let len = message.encoded_len();
        WireMessage::Decoded { message, len }
    }

    /// The length of its encoding.
    pub fn encoded_len(&self) -> usize {
        match self {
            WireMessage::Decoded { len, .. } => *len,
            WireMessage::Encoded(encoded) => encoded.0.len(),
        }
    }

    /// Writes its encoding (without tag or length).
    pub fn encode_raw(&self, buf: &mut impl BufMut) {
        match self {
            WireMessage::Decoded { message, .. } => message.encode_raw(buf),
            WireMessage::Encoded(encoded) => buf.put_slice(&encoded.0),
        }
    }

    /// Its encoding.
    pub fn to_bytes(&self) -> Bytes {
        match self {
            WireMessage::Decoded { message, .. } => message.encode_to_vec().into(),
            WireMessage::Encoded(encoded) => encoded.0.clone(),
        }
    }

    /// The message itself: borrowed when made here, decoded when it is
    /// encoded. An encoded message was checked or made by
    /// [`WireMessage::encode`], so it decodes (the tests and the
    /// `check_message` fuzz target hold this); the error is returned, not
    /// hidden, should it ever not.
    pub fn decoded(&self) -> Result<Cow<'_, v1::Message>, prost::DecodeError> {
        match self {
            WireMessage::Decoded { message, .. } => Ok(Cow::Borrowed(message)),
            WireMessage::Encoded(encoded) => v1::Message::decode(encoded.0.clone()).map(Cow::Owned),
        }
    }
}

/// The fields of a message, borrowed, for [`WireMessage::encode`].
#[derive(Debug, Clone, Copy)]
pub struct MessageParts<'a, H> {
    /// `Message.key`.
    pub key: Option<&'a [u8]>,
    /// `Message.value`.
    pub value: &'a [u8],
    /// `Message.headers`: name and value of each, in order.
    pub headers: &'a [H],
    /// `Message.topic`.
    pub topic: &'a str,
    /// `Message.partition`.
    pub partition: i32,
    /// `Message.offset`.
    pub offset: i64,
    /// `Message.timestamp_ms`.
    pub timestamp_ms: i64,
}

impl WireMessage {
    /// A message made here from borrowed parts, encoded at once (the bytes
    /// prost writes for the same `v1::Message`): one allocation, where the
    /// decoded message costs one for its topic, one for its list of
    /// headers and one for each header's name.
    pub fn encode<N: AsRef<str>, V: AsRef<[u8]>>(parts: MessageParts<'_, (N, V)>) -> WireMessage {
        let field = |len: usize| 1 + encoded_len_varint(len as u64) + len;
        let header_len = |(name, value): &(N, V)| {
            let (name, value) = (name.as_ref().len(), value.as_ref().len());
            (if name == 0 { 0 } else { field(name) }) + if value == 0 { 0 } else { field(value) }
        };
        let varint_field = |value: u64| {
            if value == 0 {
                0
            } else {
                1 + encoded_len_varint(value)
            }
        };
        let len = parts.key.map_or(0, |key| field(key.len()))
            + if parts.value.is_empty() { 0 } else { field(parts.value.len()) }
            + parts
                .headers
                .iter()
                .map(|header| field(header_len(header)))
                .sum::<usize>()
            + if parts.topic.is_empty() { 0 } else { field(parts.topic.len()) }
            // int32 and int64 go as the varint of their 64-bit two's complement.
            + varint_field(i64::from(parts.partition) as u64)
            + varint_field(parts.offset as u64)
            + varint_field(parts.timestamp_ms as u64);
        let mut buf = Vec::with_capacity(len);
        let bytes = |tag: u32, value: &[u8], buf: &mut Vec<u8>| {
            encode_key(tag, WireType::LengthDelimited, buf);
            encode_varint(value.len() as u64, buf);
            buf.put_slice(value);
        };
        let varint = |tag: u32, value: u64, buf: &mut Vec<u8>| {
            if value != 0 {
                encode_key(tag, WireType::Varint, buf);
                encode_varint(value, buf);
            }
        };
        if let Some(key) = parts.key {
            bytes(1, key, &mut buf);
        }
        if !parts.value.is_empty() {
            bytes(2, parts.value, &mut buf);
        }
        for header in parts.headers {
            encode_key(3, WireType::LengthDelimited, &mut buf);
            encode_varint(header_len(header) as u64, &mut buf);
            let (name, value) = (header.0.as_ref(), header.1.as_ref());
            if !name.is_empty() {
                bytes(1, name.as_bytes(), &mut buf);
            }
            if !value.is_empty() {
                bytes(2, value, &mut buf);
            }
        }
        if !parts.topic.is_empty() {
            bytes(4, parts.topic.as_bytes(), &mut buf);
        }
        varint(5, i64::from(parts.partition) as u64, &mut buf);
        varint(6, parts.offset as u64, &mut buf);
        varint(7, parts.timestamp_ms as u64, &mut buf);
        debug_assert_eq!(buf.len(), len, "a message's encoded length");
        // Made here: a Message by construction.
        WireMessage::Encoded(EncodedMessage(Bytes::from(buf)))
    }
}

impl From<v1::Message> for WireMessage {
    fn from(message: v1::Message) -> WireMessage {
        WireMessage::new(message)
    }
}

/// The encoding of a `Message` that [`EncodedMessage::check`] accepted.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedMessage(Bytes);

impl EncodedMessage {
    /// Takes `bytes` when they are a well-formed `Message` (see the
    /// module); the error says what is wrong.
    pub fn check(bytes: Bytes) -> Result<EncodedMessage, String> {
        check_fields(&bytes, MESSAGE_FIELDS).map_err(|e| format!("not a valid Message: {e}"))?;
        Ok(EncodedMessage(bytes))
    }

    /// The encoding.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }
}

/// What a known field must be.
#[derive(Clone, Copy)]
enum Field {
    Varint,
    Bytes,
    String,
    Header,
}

/// `Message`'s fields by number (1 to 7).
const MESSAGE_FIELDS: &[Field] = &[
    Field::Bytes,  // key
    Field::Bytes,  // value
    Field::Header, // headers
    Field::String, // topic
    Field::Varint, // partition
    Field::Varint, // offset
    Field::Varint, // timestamp_ms
];

/// `Header`'s fields by number (1 and 2).
const HEADER_FIELDS: &[Field] = &[Field::String, Field::Bytes];

const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LENGTH_DELIMITED: u64 = 2;
const FIXED32: u64 = 5;

/// Walks the fields of one message whose known fields are `known`.
fn check_fields(mut buf: &[u8], known: &[Field]) -> Result<(), String> {
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        let number = key >> 3;
        let wire_type = key & 7;
        if number == 0 || number > u64::from(u32::MAX >> 3) {
            return Err(format!("field number {number} is out of range"));
        }
        let expected = usize::try_from(number - 1)
            .ok()
            .and_then(|at| known.get(at));
        let want = match expected {
            None => None,
            Some(Field::Varint) => Some(VARINT),
            Some(_) => Some(LENGTH_DELIMITED),
        };
        if let Some(want) = want
            && want != wire_type
        {
            return Err(format!(
                "field {number} has wire type {wire_type}, not {want}"
            ));
        }
        match wire_type {
            VARINT => {
                varint(&mut buf)?;
            }
            FIXED64 => take(&mut buf, 8, number)?,
            FIXED32 => take(&mut buf, 4, number)?,
            LENGTH_DELIMITED => {
                let len = varint(&mut buf)?;
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&len| len <= buf.len())
                    .ok_or_else(|| format!("field {number} is longer than what is left"))?;
                let (value, rest) = buf.split_at(len);
                buf = rest;
                match expected {
                    Some(Field::String) => {
                        std::str::from_utf8(value)
                            .map_err(|_| format!("field {number} is not UTF-8"))?;
                    }
                    Some(Field::Header) => {
                        check_fields(value, HEADER_FIELDS).map_err(|e| format!("header: {e}"))?
                    }
                    _ => {}
                }
            }
            other => return Err(format!("field {number} has wire type {other}")),
        }
    }
    Ok(())
}

/// Takes `n` bytes of field `number`.
fn take(buf: &mut &[u8], n: usize, number: u64) -> Result<(), String> {
    if buf.len() < n {
        return Err(format!("field {number} is cut short"));
    }
    *buf = &buf[n..];
    Ok(())
}

/// Reads a varint: at most ten bytes, the tenth at most 1 (as prost).
fn varint(buf: &mut &[u8]) -> Result<u64, String> {
    let mut value = 0u64;
    for (at, &byte) in buf.iter().enumerate().take(10) {
        if at == 9 && byte > 1 {
            return Err("a varint overflows 64 bits".to_string());
        }
        value |= u64::from(byte & 0x7f) << (7 * at);
        if byte < 0x80 {
            *buf = &buf[at + 1..];
            return Ok(value);
        }
    }
    Err("a varint is cut short or too long".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(headers: usize) -> v1::Message {
        v1::Message {
            key: Some(Bytes::from_static(b"k\xff")),
            value: Bytes::from(vec![9u8; 300]),
            headers: (0..headers)
                .map(|n| v1::Header {
                    name: format!("h-{n}-é"),
                    value: Bytes::from(vec![0xfe; n]),
                })
                .collect(),
            topic: "business".to_string(),
            partition: -3,
            offset: i64::MAX,
            timestamp_ms: -1,
        }
    }

    #[test]
    fn a_message_made_here_and_its_encoding_are_the_same_on_the_wire() {
        for headers in [0, 1, 5] {
            let made = WireMessage::new(message(headers));
            let bytes = made.to_bytes();
            assert_eq!(made.encoded_len(), bytes.len());
            let encoded = WireMessage::Encoded(EncodedMessage::check(bytes.clone()).unwrap());
            assert_eq!(encoded.encoded_len(), bytes.len());
            let mut written = Vec::new();
            encoded.encode_raw(&mut written);
            assert_eq!(written, bytes);
            assert_eq!(encoded.decoded().unwrap().into_owned(), message(headers));
            assert_eq!(made.decoded().unwrap().into_owned(), message(headers));
        }
        // The empty message (every field at its default).
        assert!(EncodedMessage::check(Bytes::new()).is_ok());
    }

    #[test]
    fn bad_encodings_are_refused_with_the_reason() {
        let cases: &[(&[u8], &str)] = &[
            (&[0x22, 0x02, 0xff, 0xfe], "field 4 is not UTF-8"),
            (&[0x22, 0x05, b'a'], "field 4 is longer than what is left"),
            (&[0x28, 0x80], "a varint is cut short"),
            (&[0x2a, 0x00], "field 5 has wire type 2, not 0"),
            (&[0x10, 0x01], "field 2 has wire type 0, not 2"),
            (&[0x00, 0x01], "field number 0 is out of range"),
            (&[0x43], "field 8 has wire type 3"),
            (
                &[0x1a, 0x02, 0x0a, 0x01],
                "header: field 1 is longer than what is left",
            ),
            (
                &[0x1a, 0x03, 0x0a, 0x01, 0xc0],
                "header: field 1 is not UTF-8",
            ),
            (
                &[
                    0x28, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
                ],
                "overflows 64 bits",
            ),
            (&[0x41, 1, 2, 3], "field 8 is cut short"),
        ];
        for (bytes, reason) in cases {
            let error = EncodedMessage::check(Bytes::copy_from_slice(bytes)).unwrap_err();
            assert!(error.contains(reason), "{bytes:?}: {error}");
            assert!(error.starts_with("not a valid Message: "), "{error}");
        }
        // Unknown fields of the four plain wire types pass, as a newer
        // node's message would.
        let newer: &[u8] = &[
            0x40, 0x01, 0x49, 0, 0, 0, 0, 0, 0, 0, 0, 0x52, 0x01, 0x00, 0x5d, 0, 0, 0, 0,
        ];
        assert!(EncodedMessage::check(Bytes::from_static(newer)).is_ok());
    }

    #[test]
    fn a_message_encoded_from_its_parts_is_the_one_prost_writes() {
        for headers in [0, 1, 4] {
            for (key, value, topic, partition, offset, timestamp_ms) in [
                (
                    Some(&b"k"[..]),
                    &b"value"[..],
                    "business",
                    3,
                    12,
                    1_700_000_000_000,
                ),
                (Some(&b""[..]), &b""[..], "", 0, 0, 0),
                (None, &[7u8; 300][..], "t", -1, -1, -1),
                (None, &b"v"[..], "topic", i32::MIN, i64::MIN, i64::MAX),
            ] {
                let pairs: Vec<(String, Vec<u8>)> = (0..headers)
                    .map(|n| {
                        (
                            if n == 2 {
                                String::new()
                            } else {
                                format!("h{n}")
                            },
                            vec![n as u8; n],
                        )
                    })
                    .collect();
                let made = WireMessage::encode(MessageParts {
                    key,
                    value,
                    headers: &pairs,
                    topic,
                    partition,
                    offset,
                    timestamp_ms,
                });
                let expected = v1::Message {
                    key: key.map(Bytes::copy_from_slice),
                    value: Bytes::copy_from_slice(value),
                    headers: pairs
                        .iter()
                        .map(|(name, value)| v1::Header {
                            name: name.clone(),
                            value: Bytes::copy_from_slice(value),
                        })
                        .collect(),
                    topic: topic.to_string(),
                    partition,
                    offset,
                    timestamp_ms,
                };
                assert_eq!(made.to_bytes(), expected.encode_to_vec());
                assert_eq!(made.encoded_len(), expected.encoded_len());
                assert_eq!(made.decoded().unwrap().into_owned(), expected);
            }
        }
    }

    /// Whatever the check accepts, prost decodes: random changes to valid
    /// encodings (a fixed seed, so a failure repeats).
    #[test]
    fn what_the_check_accepts_decodes() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let valid: Vec<Vec<u8>> = (0..4).map(|h| message(h).encode_to_vec()).collect();
        let (mut accepted, mut refused) = (0, 0);
        for round in 0..200_000 {
            let mut bytes = valid[round % valid.len()].clone();
            for _ in 0..=(next() % 3) {
                let at = (next() as usize) % bytes.len();
                match next() % 4 {
                    0 => bytes[at] = next() as u8,
                    1 => bytes.truncate(at),
                    2 => bytes.insert(at, next() as u8),
                    _ => bytes[at] ^= 1 << (next() % 8),
                }
                if bytes.is_empty() {
                    break;
                }
            }
            match EncodedMessage::check(Bytes::from(bytes.clone())) {
                Ok(_) => {
                    accepted += 1;
                    assert!(
                        v1::Message::decode(&bytes[..]).is_ok(),
                        "accepted but does not decode: {bytes:?}"
                    );
                }
                Err(_) => refused += 1,
            }
        }
        // Both sides were exercised.
        assert!(
            accepted > 1_000 && refused > 1_000,
            "{accepted} / {refused}"
        );
    }
}
