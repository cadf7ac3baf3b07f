//! The Rust SDK for business processes connected to a wasmrelay cluster
//! (being written; see `protocol/proto/wasmrelay.proto` for the protocol).
