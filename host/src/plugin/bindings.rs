//! Every `bindgen!` of the plugin contract in one place (`wit/plugin.wit`).
//!
//! The `processor` world owns the generated `types` and `host` interfaces; the
//! `router` world reuses them through `with`, so a `Message` is one Rust type
//! whichever world it is handed to.

#![allow(missing_docs, missing_debug_implementations, unreachable_pub)]

/// Bindings of the `processor` world (and of the shared interfaces).
pub mod processor {
    wasmtime::component::bindgen!({
        world: "processor",
        path: "../wit",
    });
}

/// Bindings of the `router` world.
pub mod router {
    wasmtime::component::bindgen!({
        world: "router",
        path: "../wit",
        with: {
            "wasmrelay:plugin/types": super::processor::wasmrelay::plugin::types,
            "wasmrelay:plugin/host": super::processor::wasmrelay::plugin::host,
        },
    });
}

pub use processor::wasmrelay::plugin::host::{Host, LogLevel};
pub use processor::wasmrelay::plugin::types::{Header, Message, NodeLoad, Outcome, OutputMessage};
