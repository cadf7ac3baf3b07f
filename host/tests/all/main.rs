//! The host's integration tests, one test binary for all (wasmtime's
//! `tests/all` layout): the `wasmrelay` library's parts (config centers,
//! the gateway, the mesh, the plugin runtime) on real sockets, files,
//! plugins, brokers and etcd, in this process. Scenarios that run the
//! built binary live in the top-level `tests/` crate.

// Tasks a test spawns end with the test's runtime; the test awaits
// those whose outcome it checks.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

#[path = "../support/mod.rs"]
mod support;

mod admin;
mod center_etcd;
mod gateway_protocol;
mod kafka_broker;
mod lane_backpressure;
mod listener_tls;
mod mesh;
mod plugin_chain;
mod plugin_executor;
mod plugin_guard_rails;
mod plugin_hot_reload;
mod producer_groups;
mod producer_start;
