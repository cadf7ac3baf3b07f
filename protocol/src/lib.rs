//! The wasmrelay wire protocol, shared by relay nodes and client SDKs.
//!
//! The schema is [`proto/wasmrelay.proto`](../proto/wasmrelay.proto): one
//! file, documented well enough to write a client in another language from
//! it alone. This crate holds the Rust types generated from it ([`v1`]), the
//! frame codec ([`FrameCodec`]: a big-endian `u32` length, then a protobuf
//! [`v1::Frame`]), the mesh authentication codes ([`mesh_auth`]), and the
//! retry pacing both ends use ([`Backoff`]).

pub mod backoff;
pub mod codec;
pub mod io;
pub mod mesh_auth;
pub mod parcel;
pub mod wire_message;

/// Types generated from `proto/wasmrelay.proto` (package `wasmrelay.v1`).
#[allow(
    missing_docs,
    unreachable_pub,
    clippy::all,
    missing_debug_implementations
)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/wasmrelay.v1.rs"));
}

pub use backoff::{Backoff, jitter};
pub use codec::{CodecError, FrameCodec};
pub use parcel::{Outgoing, Parcel, ParcelFrame};
pub use v1::Frame;
pub use v1::frame::Kind;
pub use wire_message::{EncodedMessage, MessageParts, WireMessage};

/// The protocol version this crate speaks (in `Hello` and `MeshHello`).
pub const PROTOCOL_VERSION: u32 = 1;

/// The default maximum frame size, length prefix excluded: 1 MiB.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1024 * 1024;

/// The longest process id a node accepts, in bytes.
pub const MAX_PROCESS_ID_BYTES: usize = 256;

impl Frame {
    /// A frame of this kind.
    pub fn of(kind: Kind) -> Frame {
        Frame { kind: Some(kind) }
    }

    /// An `Error` frame.
    pub fn error(code: v1::ErrorCode, message: impl Into<String>) -> Frame {
        Frame::of(Kind::Error(v1::Error {
            code: code as i32,
            message: message.into(),
        }))
    }

    /// The name of the frame's kind, for logs and errors (`"hello"`, ...).
    pub fn kind_name(&self) -> &'static str {
        match &self.kind {
            None => "empty",
            Some(kind) => kind.name(),
        }
    }
}

impl Kind {
    /// The kind's name as in the schema, in snake case.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Hello(_) => "hello",
            Kind::Welcome(_) => "welcome",
            Kind::Redirect(_) => "redirect",
            Kind::Deliver(_) => "deliver",
            Kind::Ack(_) => "ack",
            Kind::Nack(_) => "nack",
            Kind::Send(_) => "send",
            Kind::SendAck(_) => "send_ack",
            Kind::Rebalance(_) => "rebalance",
            Kind::Replaced(_) => "replaced",
            Kind::Ping(_) => "ping",
            Kind::Pong(_) => "pong",
            Kind::Error(_) => "error",
            Kind::MeshHello(_) => "mesh_hello",
            Kind::MeshWelcome(_) => "mesh_welcome",
            Kind::Forward(_) => "forward",
            Kind::ForwardAck(_) => "forward_ack",
            Kind::MeshSealed(_) => "mesh_sealed",
            Kind::MeshLookup(_) => "mesh_lookup",
            Kind::MeshLookupAnswer(_) => "mesh_lookup_answer",
            Kind::MeshRecordsMissed(_) => "mesh_records_missed",
        }
    }
}

/// The encoded length of the `Deliver` frame that carries a message of
/// `message_len` encoded bytes with `delivery_id`, whatever its sequence number (counted at its largest):
/// what a node checks against a connection's frame limit before it hands a
/// message to the connection, so that a message that can never fit is
/// refused at once rather than ending the connection.
pub fn deliver_frame_len(delivery_id: &str, message_len: usize) -> usize {
    use prost::encoding::encoded_len_varint;
    // Field tags of 1..15 take one byte; a `u64` varint at most ten.
    let deliver_len = 1
        + 10
        + 1
        + encoded_len_varint(delivery_id.len() as u64)
        + delivery_id.len()
        + 1
        + encoded_len_varint(message_len as u64)
        + message_len;
    1 + encoded_len_varint(deliver_len as u64) + deliver_len
}

/// Checks a process id: not empty, at most [`MAX_PROCESS_ID_BYTES`], no
/// control characters.
pub fn check_process_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("the process id is empty".to_string());
    }
    if id.len() > MAX_PROCESS_ID_BYTES {
        return Err(format!(
            "the process id is {} bytes long; at most {MAX_PROCESS_ID_BYTES} are allowed",
            id.len()
        ));
    }
    if id.chars().any(char::is_control) {
        return Err(format!("the process id {id:?} contains control characters"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn the_deliver_frame_length_is_the_encoded_one_at_the_largest_sequence_number() {
        for value_len in [0, 1, 127, 128, 16_383, 16_384, 1_100_000] {
            let message = v1::Message {
                key: Some(bytes::Bytes::from_static(b"key")),
                value: vec![7u8; value_len].into(),
                topic: "business".to_string(),
                offset: 12,
                ..v1::Message::default()
            };
            let frame = |seq| {
                Frame::of(Kind::Deliver(v1::Deliver {
                    seq,
                    delivery_id: "business/0/12".to_string(),
                    message: Some(message.clone()),
                }))
                .encoded_len()
            };
            let counted = deliver_frame_len("business/0/12", message.encoded_len());
            assert_eq!(counted, frame(u64::MAX), "value of {value_len} bytes");
            assert!(counted >= frame(1));
        }
    }
}
