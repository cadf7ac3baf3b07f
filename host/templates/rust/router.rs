//! {{name}}: a wasmrelay router plugin.
//!
//! `route`: the process id is the value of the header named by the config
//! value `header` (default `process-id`); no such header, no process.
//! `place`: leaves placement to the relay's built-in policy.

mod bindings {
    wit_bindgen::generate!({ path: "wit", world: "router" });
}

use bindings::wasmrelay::plugin::host;
use bindings::wasmrelay::plugin::types::{Message, NodeLoad};

struct Plugin;

impl bindings::Guest for Plugin {
    fn route(msg: Message) -> Result<Option<String>, String> {
        let header = host::config_get("header").unwrap_or_else(|| "process-id".to_string());
        match msg.headers.iter().find(|h| h.name == header) {
            Some(h) => String::from_utf8(h.value.clone())
                .map(Some)
                .map_err(|_| format!("{{name}}: header `{header}` is not UTF-8")),
            None => Ok(None),
        }
    }

    fn place(_process_id: String, _nodes: Vec<NodeLoad>) -> Result<Option<String>, String> {
        Ok(None)
    }
}

bindings::export!(Plugin with_types_in bindings);
