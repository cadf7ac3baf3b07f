//! The test support the host shares with the end-to-end tests: the
//! `wasmrelay_test_support` library (`tests/support`), under the name the
//! host's tests (`tests/all`) and benches (`benches/*.rs`, which include
//! this file by path) use.

#![allow(unused_imports, unreachable_pub)]

pub use wasmrelay_test_support::*;
