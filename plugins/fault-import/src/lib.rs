//! `fault-import` (test plugin): a processor that imports an interface the
//! relay does not provide, `wasmrelay:forbidden/net` (`connect: func(addr:
//! string) -> bool`), and calls it from `process`. Everything else is a
//! correct processor (`process` and `process-batch` with the exact types of
//! `wit/plugin.wit`), so the only thing wrong with it is that import: the
//! relay must refuse to load it.
//!
//! It does not use the SDK: its world (`wit/world.wit`) includes the
//! `processor` world of the repository's `wit/plugin.wit` and adds the
//! import (defined in `wit/deps/forbidden/net.wit`).
//!
//! Config keys: none.

#[allow(clippy::too_many_arguments)]
mod bindings {
    wit_bindgen::generate!({
        // The real contract first, then this crate's world (which refers to
        // it by package name).
        path: ["../../wit", "wit"],
        world: "wasmrelay:fault-import/fault-import",
        generate_all,
    });
}

use bindings::wasmrelay::forbidden::net;
use bindings::wasmrelay::plugin::types::{Message, Outcome, OutputMessage};

struct FaultImport;

impl bindings::Guest for FaultImport {
    fn process(msg: Message) -> Result<Outcome, String> {
        let connected = net::connect("127.0.0.1:9");
        let mut out = OutputMessage {
            key: msg.key,
            value: msg.value,
            headers: msg.headers,
        };
        out.headers
            .push(bindings::wasmrelay::plugin::types::Header {
                name: "net".to_owned(),
                value: if connected {
                    b"connected".to_vec()
                } else {
                    b"refused".to_vec()
                },
            });
        Ok(Outcome::Emit(vec![out]))
    }

    fn process_batch(batch: Vec<Message>) -> Vec<Result<Outcome, String>> {
        batch.into_iter().map(Self::process).collect()
    }
}

bindings::export!(FaultImport with_types_in bindings);
