//! The end-to-end scenarios, one test binary for all (wasmtime's
//! `tests/all` layout): the real `wasmrelay` binary, built by the shared
//! support ([`wasmrelay_test_support::wasmrelay_binary`]), run against real
//! brokers (tansu), a real etcd, a real HTTP application, business processes
//! on the client SDK and the example plugins. One module per scenario area.

#![allow(clippy::unwrap_used)]

mod admin_listener;
mod chaos;
mod client_auth;
mod cluster;
mod cluster_records;
mod demo;
mod faults;
mod harness;
mod key_ordering;
mod link_switch;
mod listener_tls;
mod live_gate;
mod placement;
mod plugin_authoring;
mod plugin_test_cli;
mod plugins_polyglot;
mod rebalance;
mod run_config_errors;
mod secrets;
mod secured_app;
mod secured_center;
mod secured_kafka;
mod sidecar_flow;
mod soak;
