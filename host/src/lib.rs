//! wasmrelay: a Kafka message relay with WebAssembly plugins.
//!
//! This library is the `wasmrelay` binary's implementation; `main.rs` only
//! parses the command line and calls into [`cli`].

pub mod admin;
pub mod center;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod flow;
#[doc(hidden)]
pub mod fuzzing;
pub mod gateway;
pub mod kafka;
pub mod link;
pub mod net;
pub mod node;
pub mod pending;
pub mod plugin;
pub mod telemetry;
pub mod text;
pub mod tls;
pub mod work_set;
