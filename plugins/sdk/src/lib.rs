//! The wasmrelay plugin SDK: write a wasmrelay plugin (a WebAssembly
//! component) in a dozen lines of Rust.
//!
//! A plugin targets one of the two worlds of `wit/plugin.wit`:
//!
//! * **processor**: a processing step of a message flow. Implement
//!   [`Processor`] and export it with [`export_processor!`].
//! * **router**: the routing policy of a relay cluster. Implement [`Router`]
//!   and export it with [`export_router!`].
//!
//! The plugin crate is a `cdylib` built with
//! `cargo build --target wasm32-wasip2 --release`; the `.wasm` that comes out
//! is the component the relay loads.
//!
//! # Example
//!
//! A processor that adds a header to every message, its value taken from the
//! plugin's config (`Cargo.toml`: `crate-type = ["cdylib"]`, a dependency on
//! `wasmrelay-plugin-sdk`):
//!
//! ```no_run
//! use wasmrelay_plugin_sdk::prelude::*;
//!
//! struct Stamp;
//!
//! impl Processor for Stamp {
//!     fn process(msg: Message) -> Result<Outcome, String> {
//!         let stamp = config::get_or("stamp", "seen");
//!         log::debug(&format!("stamping offset {}", msg.offset));
//!         let mut out = msg.into_output();
//!         out.set_header("x-stamp", stamp);
//!         Ok(Outcome::one(out))
//!     }
//! }
//!
//! export_processor!(Stamp);
//! ```
//!
//! `process_batch` has a default (call `process` for each message), and so
//! does [`Router::place`] (most free quota among live nodes).
//!
//! # Notes for plugin authors
//!
//! * Return `Ok(Outcome::DeadLetter(..))` (or [`Outcome::dead_letter`]) for
//!   input that will never succeed; `Err(reason)` means "failed this time" and
//!   the relay retries with backoff.
//! * Instances are reused for many calls, so a plugin may cache parsed config
//!   in a static (e.g. a `std::sync::OnceLock`); it must not rely on state
//!   surviving, because an instance can be replaced at any time.
//! * The relay grants no WASI capabilities (no files, environment, sockets or
//!   stdio). Use [`log`], [`config`] and [`now_ms`] instead.

/// The raw `wit-bindgen` bindings of both worlds. Plugins normally use the
/// re-exports at the crate root instead.
///
/// The `types` and `host` interfaces are generated once, in
/// [`bindings::processor`]; the router bindings refer to them, so a
/// [`Message`] is the same type in both worlds.
#[allow(
    unreachable_pub,
    missing_debug_implementations,
    missing_docs,
    clippy::too_many_arguments
)]
pub mod bindings {
    /// Bindings of the `processor` world (and of the shared `types` and
    /// `host` interfaces).
    pub mod processor {
        wit_bindgen::generate!({
            path: "../../wit",
            world: "processor",
            // `node-load` is used only by the router world, which reuses
            // these types.
            generate_unused_types: true,
            pub_export_macro: true,
            default_bindings_module: "wasmrelay_plugin_sdk::bindings::processor",
            export_macro_name: "export",
        });
    }

    /// Bindings of the `router` world.
    pub mod router {
        wit_bindgen::generate!({
            path: "../../wit",
            world: "router",
            with: {
                "wasmrelay:plugin/types@0.1.0": crate::bindings::processor::wasmrelay::plugin::types,
                "wasmrelay:plugin/host@0.1.0": crate::bindings::processor::wasmrelay::plugin::host,
            },
            pub_export_macro: true,
            default_bindings_module: "wasmrelay_plugin_sdk::bindings::router",
            export_macro_name: "export",
        });
    }
}

use bindings::processor::wasmrelay::plugin::host as raw_host;

pub use bindings::processor::wasmrelay::plugin::host::LogLevel;
pub use bindings::processor::wasmrelay::plugin::types::{
    Header, Message, NodeLoad, Outcome, OutputMessage,
};

/// Everything a plugin usually needs: `use wasmrelay_plugin_sdk::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Header, LogLevel, Message, NodeLoad, Outcome, OutputMessage, Processor, Router, config,
        export_processor, export_router, log, now_ms,
    };
}

/// A processing step of a message flow (the `processor` world).
///
/// Export the implementing type with [`export_processor!`].
pub trait Processor {
    /// Process one message.
    ///
    /// `Ok(outcome)` says what becomes of it: [`Outcome::Emit`] (zero or more
    /// messages to pass on; none filters the input out) or
    /// [`Outcome::DeadLetter`] (never retry). `Err(reason)` means processing
    /// failed this time: the relay retries with backoff, then dead-letters.
    fn process(msg: Message) -> Result<Outcome, String>;

    /// Process a batch: exactly one answer per input, in input order.
    ///
    /// The default calls [`Processor::process`] for each message.
    fn process_batch(batch: Vec<Message>) -> Vec<Result<Outcome, String>> {
        batch.into_iter().map(Self::process).collect()
    }
}

/// The routing policy of a relay cluster (the `router` world).
///
/// Export the implementing type with [`export_router!`].
pub trait Router {
    /// Which business process (by id) a message is for; `None` when the
    /// message names no process. `Err(reason)` is a plugin failure.
    fn route(msg: Message) -> Result<Option<String>, String>;

    /// Which node should accept a new connection of process `process_id`.
    ///
    /// The default is [`most_free_quota`]: the live node with the most free
    /// quota (`quota - connections`), ties going to the smallest node id;
    /// `None` when no live node has free quota.
    fn place(process_id: String, nodes: Vec<NodeLoad>) -> Result<Option<String>, String> {
        let _ = process_id;
        Ok(most_free_quota(&nodes).map(|n| n.node_id.clone()))
    }
}

/// The live node with the most free quota (`quota - connections`, saturating
/// at zero); ties go to the smallest node id. `None` when no live node has
/// free quota. This is [`Router::place`]'s default.
pub fn most_free_quota(nodes: &[NodeLoad]) -> Option<&NodeLoad> {
    nodes
        .iter()
        .filter(|n| n.live)
        .map(|n| (n.quota.saturating_sub(n.connections), n))
        .filter(|(free, _)| *free > 0)
        .fold(
            None,
            |best: Option<(u64, &NodeLoad)>, (free, n)| match best {
                Some((best_free, best_node))
                    if best_free > free
                        || (best_free == free && best_node.node_id <= n.node_id) =>
                {
                    best
                }
                _ => Some((free, n)),
            },
        )
        .map(|(_, n)| n)
}

#[doc(hidden)]
pub mod __private {
    //! Glue between the SDK traits and the generated `Guest` traits. Not API.
    use super::*;

    /// Adapts a [`Processor`] to the generated processor `Guest` trait.
    #[derive(Debug)]
    pub struct ProcessorAdapter<T>(core::marker::PhantomData<T>);

    impl<T: Processor> bindings::processor::Guest for ProcessorAdapter<T> {
        #[inline]
        fn process(msg: Message) -> Result<Outcome, String> {
            T::process(msg)
        }
        #[inline]
        fn process_batch(batch: Vec<Message>) -> Vec<Result<Outcome, String>> {
            T::process_batch(batch)
        }
    }

    /// Adapts a [`Router`] to the generated router `Guest` trait.
    #[derive(Debug)]
    pub struct RouterAdapter<T>(core::marker::PhantomData<T>);

    impl<T: Router> bindings::router::Guest for RouterAdapter<T> {
        #[inline]
        fn route(msg: Message) -> Result<Option<String>, String> {
            T::route(msg)
        }
        #[inline]
        fn place(process_id: String, nodes: Vec<NodeLoad>) -> Result<Option<String>, String> {
            T::place(process_id, nodes)
        }
    }
}

/// Exports a [`Processor`] implementation as the plugin's `processor` world.
///
/// Use it once, at the root of a `cdylib` crate: `export_processor!(MyType);`
/// (`MyType` must be a plain identifier; use a type alias for anything
/// else).
#[macro_export]
macro_rules! export_processor {
    ($ty:ident) => {
        const _: () = {
            type __WasmrelayProcessorExport = $crate::__private::ProcessorAdapter<$ty>;
            $crate::__export_processor_impl!(
                __WasmrelayProcessorExport with_types_in $crate::bindings::processor
            );
        };
    };
}

/// Exports a [`Router`] implementation as the plugin's `router` world.
///
/// Use it once, at the root of a `cdylib` crate: `export_router!(MyType);`
/// (`MyType` must be a plain identifier; use a type alias for anything
/// else).
#[macro_export]
macro_rules! export_router {
    ($ty:ident) => {
        const _: () = {
            type __WasmrelayRouterExport = $crate::__private::RouterAdapter<$ty>;
            $crate::__export_router_impl!(
                __WasmrelayRouterExport with_types_in $crate::bindings::router
            );
        };
    };
}

fn find_header<'a>(headers: &'a [Header], name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.value.as_slice())
}

impl Message {
    /// Turns the message into an [`OutputMessage`] with the same key, value
    /// and headers (no copy).
    #[inline]
    pub fn into_output(self) -> OutputMessage {
        OutputMessage {
            key: self.key,
            value: self.value,
            headers: self.headers,
        }
    }

    /// The value of the first header named `name` (names are
    /// case-sensitive, as in Kafka).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find_header(&self.headers, name)
    }

    /// The value of the first header named `name`, if it is UTF-8.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| std::str::from_utf8(v).ok())
    }
}

impl From<Message> for OutputMessage {
    #[inline]
    fn from(msg: Message) -> Self {
        msg.into_output()
    }
}

impl OutputMessage {
    /// A message with this key and value and no headers.
    pub fn new(key: Option<Vec<u8>>, value: Option<Vec<u8>>) -> Self {
        OutputMessage {
            key,
            value,
            headers: Vec::new(),
        }
    }

    /// The value of the first header named `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find_header(&self.headers, name)
    }

    /// The value of the first header named `name`, if it is UTF-8.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Sets header `name` to `value`: replaces the first header of that name
    /// (keeping its position) and removes any further ones, or appends the
    /// header if there is none.
    pub fn set_header(&mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) {
        let name = name.into();
        let value = value.into();
        match self.headers.iter().position(|h| h.name == name) {
            Some(first) => {
                self.headers[first].value = value;
                let mut i = 0;
                self.headers.retain(|h| {
                    let keep = i <= first || h.name != name;
                    i += 1;
                    keep
                });
            }
            None => self.headers.push(Header { name, value }),
        }
    }

    /// Appends a header, even if one of that name exists (Kafka allows
    /// repeated names).
    pub fn add_header(&mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) {
        self.headers.push(Header {
            name: name.into(),
            value: value.into(),
        });
    }

    /// Removes every header named `name`.
    pub fn remove_header(&mut self, name: &str) {
        self.headers.retain(|h| h.name != name);
    }
}

impl Outcome {
    /// Pass on exactly this message.
    #[inline]
    pub fn one(msg: impl Into<OutputMessage>) -> Self {
        Outcome::Emit(vec![msg.into()])
    }

    /// Pass on these messages, in order (none filters the input out).
    #[inline]
    pub fn many(msgs: Vec<OutputMessage>) -> Self {
        Outcome::Emit(msgs)
    }

    /// Filter the input out: emit nothing (the input counts as done).
    #[inline]
    pub fn drop() -> Self {
        Outcome::Emit(Vec::new())
    }

    /// Same as [`Outcome::drop`].
    #[inline]
    pub fn filtered() -> Self {
        Outcome::drop()
    }

    /// Send the input to the flow's dead-letter topic with this reason; it
    /// is not retried.
    #[inline]
    pub fn dead_letter(reason: impl Into<String>) -> Self {
        Outcome::DeadLetter(reason.into())
    }
}

/// The relay's log, tagged by the relay with the plugin's name and version.
/// Lines beyond a rate limit may be dropped by the host.
pub mod log {
    use super::{LogLevel, raw_host};

    /// Writes `message` at `level`.
    #[inline]
    pub fn log(level: LogLevel, message: &str) {
        raw_host::log(level, message);
    }

    /// Writes `message` at trace level.
    pub fn trace(message: &str) {
        log(LogLevel::Trace, message);
    }

    /// Writes `message` at debug level.
    pub fn debug(message: &str) {
        log(LogLevel::Debug, message);
    }

    /// Writes `message` at info level.
    pub fn info(message: &str) {
        log(LogLevel::Info, message);
    }

    /// Writes `message` at warn level.
    pub fn warn(message: &str) {
        log(LogLevel::Warn, message);
    }

    /// Writes `message` at error level.
    pub fn error(message: &str) {
        log(LogLevel::Error, message);
    }
}

/// The plugin's own config entries (set by the flow that uses the plugin, or
/// `--config key=value` in `wasmrelay plugin test`).
pub mod config {
    use super::raw_host;

    /// The value of config entry `key`, if set.
    #[inline]
    pub fn get(key: &str) -> Option<String> {
        raw_host::config_get(key)
    }

    /// The value of config entry `key`, or `default` if it is not set.
    pub fn get_or(key: &str, default: &str) -> String {
        get(key).unwrap_or_else(|| default.to_owned())
    }

    /// All config entries, sorted by key.
    pub fn entries() -> Vec<(String, String)> {
        raw_host::config_entries()
    }
}

/// Wall-clock time in milliseconds since the Unix epoch, from the host.
#[inline]
pub fn now_ms() -> u64 {
    raw_host::now_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, live: bool, connections: u64, quota: u64) -> NodeLoad {
        NodeLoad {
            node_id: id.to_owned(),
            live,
            connections,
            quota,
        }
    }

    fn id(n: Option<&NodeLoad>) -> Option<&str> {
        n.map(|n| n.node_id.as_str())
    }

    #[test]
    fn most_free_quota_picks_most_free_live_node() {
        let nodes = [
            node("a", true, 5, 10),
            node("b", false, 0, 100),
            node("c", true, 1, 10),
            node("d", true, 20, 10),
        ];
        assert_eq!(id(most_free_quota(&nodes)), Some("c"));
    }

    #[test]
    fn most_free_quota_ties_go_to_smallest_id() {
        let nodes = [
            node("n3", true, 0, 4),
            node("n1", true, 2, 6),
            node("n2", true, 1, 5),
        ];
        assert_eq!(id(most_free_quota(&nodes)), Some("n1"));
    }

    #[test]
    fn most_free_quota_none_without_free_live_node() {
        assert_eq!(id(most_free_quota(&[])), None);
        let nodes = [node("a", true, 10, 10), node("b", false, 0, 10)];
        assert_eq!(id(most_free_quota(&nodes)), None);
    }

    #[test]
    fn set_header_replaces_or_appends() {
        let mut out = OutputMessage::new(None, Some(b"v".to_vec()));
        out.add_header("a", "1");
        out.add_header("b", "2");
        out.add_header("a", "3");
        out.set_header("a", "x");
        let names: Vec<_> = out
            .headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.as_slice()))
            .collect();
        assert_eq!(names, [("a", &b"x"[..]), ("b", &b"2"[..])]);
        out.set_header("c", "y");
        assert_eq!(out.header_str("c"), Some("y"));
        out.remove_header("a");
        assert_eq!(out.header("a"), None);
    }

    #[test]
    fn message_helpers() {
        let msg = Message {
            key: Some(b"k".to_vec()),
            value: None,
            headers: vec![Header {
                name: "h".into(),
                value: vec![0xff],
            }],
            topic: "t".into(),
            partition: 0,
            offset: 7,
            timestamp_ms: None,
        };
        assert_eq!(msg.header("h"), Some(&[0xff][..]));
        assert_eq!(msg.header_str("h"), None);
        let out = msg.into_output();
        assert_eq!(out.key.as_deref(), Some(&b"k"[..]));
        assert!(matches!(Outcome::drop(), Outcome::Emit(v) if v.is_empty()));
        assert!(matches!(Outcome::one(out), Outcome::Emit(v) if v.len() == 1));
    }
}
