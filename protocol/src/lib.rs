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
pub use v1::Frame;
pub use v1::frame::Kind;

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
        }
    }
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
