//! A message on its way to a process, shared by every attempt to deliver
//! it: the `Deliver` frame to a process's connection and the `Forward`
//! frame to another node are encoded straight from one [`Parcel`] behind an
//! `Arc`, so an attempt (and a retry) costs a reference count, not a copy
//! of the message (its topic, headers, key and value).
//!
//! The bytes are exactly those of the equivalent [`Frame`], which is what a
//! receiver decodes; the tests hold the two equal.

use std::sync::Arc;

use bytes::{Buf, BufMut};
use prost::DecodeError;
use prost::encoding::{DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint};

use crate::wire_message::WireMessage;
use crate::{Frame, v1};

/// What a delivery carries to its process, whichever way it goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Parcel {
    /// The process it is for (in a `Forward`).
    pub process_id: String,
    /// The delivery's id (in a `Deliver` and a `Forward`).
    pub delivery_id: String,
    /// The message: made here, or as a peer node forwarded it.
    pub message: WireMessage,
}

/// Tags of `Frame.deliver` and `Frame.forward`.
const DELIVER_TAG: u32 = 4;
const FORWARD_TAG: u32 = 22;

/// A `Deliver` frame (`seq`, the parcel's delivery id and message) or a
/// `Forward` frame (`seq`, the parcel's process id, delivery id and
/// message), encoded from the shared parcel. Encoding only: decoding one
/// gives the [`Frame`] it stands for.
#[derive(Debug, Clone)]
pub struct ParcelFrame {
    /// The frame's sequence number on its connection or link.
    pub seq: u64,
    /// `Forward` when true, `Deliver` when false.
    pub forward: bool,
    /// What it carries.
    pub parcel: Arc<Parcel>,
}

impl ParcelFrame {
    /// A `Deliver` of `parcel` with `seq`.
    pub fn deliver(seq: u64, parcel: Arc<Parcel>) -> ParcelFrame {
        ParcelFrame {
            seq,
            forward: false,
            parcel,
        }
    }

    /// A `Forward` of `parcel` with `seq`.
    pub fn forward(seq: u64, parcel: Arc<Parcel>) -> ParcelFrame {
        ParcelFrame {
            seq,
            forward: true,
            parcel,
        }
    }

    /// The equivalent frame (a copy of the message), for tests and logs.
    pub fn to_frame(&self) -> Frame {
        let parcel = &*self.parcel;
        Frame::of(if self.forward {
            crate::Kind::Forward(v1::Forward {
                seq: self.seq,
                process_id: parcel.process_id.clone(),
                delivery_id: parcel.delivery_id.clone(),
                message: Some(parcel.message.to_bytes()),
            })
        } else {
            crate::Kind::Deliver(v1::Deliver {
                seq: self.seq,
                delivery_id: parcel.delivery_id.clone(),
                // Tests and logs: an encoding that does not decode shows
                // as an empty message.
                message: Some(
                    parcel
                        .message
                        .decoded()
                        .map(std::borrow::Cow::into_owned)
                        .unwrap_or_default(),
                ),
            })
        })
    }

    /// The inner message's fields: the length of the `Deliver` or
    /// `Forward`, given the parcel message's own length.
    fn body_len(&self, message_len: usize) -> usize {
        let parcel = &*self.parcel;
        let mut len = 0;
        if self.seq != 0 {
            len += 1 + encoded_len_varint(self.seq);
        }
        if self.forward {
            len += string_field_len(&parcel.process_id);
        }
        len += string_field_len(&parcel.delivery_id);
        len + 1 + encoded_len_varint(message_len as u64) + message_len
    }

    fn tag(&self) -> u32 {
        if self.forward {
            FORWARD_TAG
        } else {
            DELIVER_TAG
        }
    }
}

/// The length of a string field with a one-byte tag (0 when empty: proto3
/// leaves it out).
fn string_field_len(value: &str) -> usize {
    if value.is_empty() {
        0
    } else {
        1 + encoded_len_varint(value.len() as u64) + value.len()
    }
}

fn encode_string(tag: u32, value: &str, buf: &mut impl BufMut) {
    if !value.is_empty() {
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(value.len() as u64, buf);
        buf.put_slice(value.as_bytes());
    }
}

impl prost::Message for ParcelFrame {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        let parcel = &*self.parcel;
        let message_len = parcel.message.encoded_len();
        encode_key(self.tag(), WireType::LengthDelimited, buf);
        encode_varint(self.body_len(message_len) as u64, buf);
        if self.seq != 0 {
            prost::encoding::uint64::encode(1, &self.seq, buf);
        }
        let (delivery_id_tag, message_tag) = if self.forward {
            encode_string(2, &parcel.process_id, buf);
            (3, 4)
        } else {
            (2, 3)
        };
        encode_string(delivery_id_tag, &parcel.delivery_id, buf);
        encode_key(message_tag, WireType::LengthDelimited, buf);
        encode_varint(message_len as u64, buf);
        parcel.message.encode_raw(buf);
    }

    /// Only encoded: what is decoded into it is skipped (decode the bytes
    /// as a [`Frame`]).
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        let body = self.body_len(self.parcel.message.encoded_len());
        prost::encoding::key_len(self.tag()) + encoded_len_varint(body as u64) + body
    }

    fn clear(&mut self) {
        self.seq = 0;
    }
}

/// A frame to send on a mesh link: any frame, or a `Forward` encoded from
/// a shared parcel.
#[derive(Debug, Clone)]
pub enum Outgoing {
    /// A frame built for this send.
    Frame(Frame),
    /// A `Deliver` or `Forward` of a shared parcel.
    Parcel(ParcelFrame),
}

impl From<Frame> for Outgoing {
    fn from(frame: Frame) -> Outgoing {
        Outgoing::Frame(frame)
    }
}

impl prost::Message for Outgoing {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        match self {
            Outgoing::Frame(frame) => frame.encode_raw(buf),
            Outgoing::Parcel(parcel) => parcel.encode_raw(buf),
        }
    }

    /// Only encoded: what is decoded into it is skipped (decode the bytes
    /// as a [`Frame`]).
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        match self {
            Outgoing::Frame(frame) => frame.encoded_len(),
            Outgoing::Parcel(parcel) => parcel.encoded_len(),
        }
    }

    fn clear(&mut self) {
        *self = Outgoing::Frame(Frame::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use prost::Message as _;

    fn parcel(process_id: &str, delivery_id: &str, value_len: usize, headers: usize) -> Parcel {
        Parcel {
            process_id: process_id.to_string(),
            delivery_id: delivery_id.to_string(),
            message: WireMessage::new(v1::Message {
                key: Some(Bytes::from_static(b"key")),
                value: vec![7u8; value_len].into(),
                headers: (0..headers)
                    .map(|n| v1::Header {
                        name: format!("h{n}"),
                        value: Bytes::from(vec![n as u8; n]),
                    })
                    .collect(),
                topic: "business".to_string(),
                partition: 3,
                offset: 12,
                timestamp_ms: -1,
            }),
        }
    }

    #[test]
    fn a_parcel_frame_encodes_to_the_bytes_of_its_frame() {
        for (process_id, delivery_id) in [("p-1", "business/3/12"), ("", ""), ("p", "")] {
            for value_len in [0, 1, 127, 128, 16_384, 300_000] {
                for (headers, encoded) in [(0, false), (1, false), (3, false), (3, true)] {
                    let mut parcel = parcel(process_id, delivery_id, value_len, headers);
                    if encoded {
                        // As a peer forwarded it: the same bytes go out.
                        let bytes = parcel.message.to_bytes();
                        parcel.message =
                            WireMessage::Encoded(crate::EncodedMessage::check(bytes).unwrap());
                    }
                    let parcel = Arc::new(parcel);
                    for seq in [0, 1, 127, 128, u64::MAX] {
                        for frame in [
                            ParcelFrame::deliver(seq, parcel.clone()),
                            ParcelFrame::forward(seq, parcel.clone()),
                        ] {
                            let expected = frame.to_frame();
                            assert_eq!(frame.encoded_len(), expected.encoded_len());
                            let bytes = frame.encode_to_vec();
                            assert_eq!(bytes, expected.encode_to_vec());
                            assert_eq!(Frame::decode(&bytes[..]).unwrap(), expected);
                            let outgoing = Outgoing::Parcel(frame);
                            assert_eq!(outgoing.encode_to_vec(), bytes);
                            assert_eq!(outgoing.encoded_len(), bytes.len());
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn an_outgoing_frame_encodes_as_the_frame() {
        let frame = Frame::of(crate::Kind::Ping(v1::Ping { nonce: 9 }));
        let outgoing = Outgoing::from(frame.clone());
        assert_eq!(outgoing.encode_to_vec(), frame.encode_to_vec());
        assert_eq!(outgoing.encoded_len(), frame.encoded_len());
    }

    #[test]
    fn decoding_into_a_parcel_frame_changes_nothing() {
        let mut frame = ParcelFrame::deliver(1, Arc::new(parcel("p", "d", 1, 0)));
        let bytes = frame.encode_to_vec();
        let other = ParcelFrame::forward(9, Arc::new(parcel("q", "e", 2, 1))).encode_to_vec();
        frame.merge(&other[..]).unwrap();
        assert_eq!(frame.encode_to_vec(), bytes);
    }
}
