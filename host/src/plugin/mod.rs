//! The WebAssembly plugin runtime: loading plugin components, calling them
//! under a deadline and a memory cap, and swapping versions while traffic
//! flows.
//!
//! - [`engine`]: the wasmtime engine, linker and limits ([`PluginRuntime`]).
//! - [`version`]: one loaded version and its instance pool ([`PluginVersion`]).
//! - [`executor`]: the threads processor calls run on, batching them.
//! - [`registry`]: which version of each plugin serves ([`PluginRegistry`]).
//! - [`watcher`]: hot reload from the plugins directory.
//! - [`state`]: per-instance host state and the `host` interface.
//! - [`bindings`]: the generated WIT bindings.

pub mod bindings;
pub mod engine;
pub mod error;
pub mod executor;
pub mod registry;
mod sleep;
mod state;
pub mod version;
pub mod watcher;

pub use bindings::{Header, Message, NodeLoad, Outcome, OutputMessage};
pub use engine::{PluginLimits, PluginRuntime};
pub use error::{PluginError, VersionLabel, World};
pub use registry::{PluginInfo, PluginRegistry, PluginSlot, ScanReport};
pub use state::PluginConfig;
pub use version::{InstanceProbe, PluginVersion, VersionStats};
pub use watcher::{WatchOptions, spawn_plugin_watcher};
