//! {{name}}: a wasmrelay processor plugin.
//!
//! Passes each message on with header `x-processed-by` set to the config
//! value `processed-by` (default `{{name}}`); a message without a value (a
//! tombstone) is dead-lettered.

mod bindings {
    wit_bindgen::generate!({ path: "wit", world: "processor" });
}

use bindings::wasmrelay::plugin::host;
use bindings::wasmrelay::plugin::types::{Header, Message, Outcome, OutputMessage};

struct Plugin;

impl bindings::Guest for Plugin {
    fn process(msg: Message) -> Result<Outcome, String> {
        if msg.value.is_none() {
            return Ok(Outcome::DeadLetter("{{name}}: no value".to_string()));
        }
        let stamp = host::config_get("processed-by").unwrap_or_else(|| "{{name}}".to_string());
        let mut headers: Vec<Header> = msg
            .headers
            .into_iter()
            .filter(|h| h.name != "x-processed-by")
            .collect();
        headers.push(Header {
            name: "x-processed-by".to_string(),
            value: stamp.into_bytes(),
        });
        Ok(Outcome::Emit(vec![OutputMessage {
            key: msg.key,
            value: msg.value,
            headers,
        }]))
    }

    fn process_batch(batch: Vec<Message>) -> Vec<Result<Outcome, String>> {
        batch.into_iter().map(Self::process).collect()
    }
}

bindings::export!(Plugin with_types_in bindings);
