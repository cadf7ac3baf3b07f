//! wasmrelay: a Kafka message relay with WebAssembly plugins.
//!
//! This library is the `wasmrelay` binary's implementation; `main.rs` only
//! parses the command line and calls into [`cli`].

pub mod cli;
pub mod plugin;
pub mod telemetry;
