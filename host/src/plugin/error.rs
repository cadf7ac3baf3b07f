//! The plugin runtime's error type: what can go wrong loading or calling a
//! plugin, with enough context (plugin name, version, file, cause) that an
//! operator reading one log line knows what failed and why.
//!
//! Callers branch on the kind: a flow dead-letters a message after
//! [`PluginError::Timeout`] or [`PluginError::MemoryLimit`] and keeps going,
//! while a [`PluginError::Load`] leaves the previous version serving.

use std::path::PathBuf;
use std::time::Duration;

/// Which contract a plugin implements (the WIT world it targets).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum World {
    /// A processing step: `process` / `process-batch`.
    Processor,
    /// A routing policy: `route` / `place`.
    Router,
}

impl World {
    /// The world's name as written in `wit/plugin.wit`.
    pub fn as_str(self) -> &'static str {
        match self {
            World::Processor => "processor",
            World::Router => "router",
        }
    }
}

impl std::fmt::Display for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for World {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "processor" => Ok(World::Processor),
            "router" => Ok(World::Router),
            other => Err(format!(
                "unknown plugin world `{other}` (expected `processor` or `router`)"
            )),
        }
    }
}

/// Identifies one loaded version of a plugin in errors and logs:
/// `name@sha256-prefix`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionLabel {
    /// The plugin's name (its file name without `.wasm`).
    pub name: String,
    /// The full hex sha256 of the component bytes.
    pub sha256: String,
}

impl VersionLabel {
    /// The first 12 hex digits of the sha256: enough to tell versions apart in logs.
    pub fn short_sha(&self) -> &str {
        &self.sha256[..self.sha256.len().min(12)]
    }
}

impl std::fmt::Display for VersionLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.short_sha())
    }
}

/// Everything that can go wrong loading or calling a plugin.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The file could not be read, is not a component, failed to compile, or
    /// does not link against what the relay offers (missing export, wrong
    /// world, a disallowed import).
    #[error("loading plugin {file}: {cause}")]
    Load {
        /// The file that was being loaded.
        file: PathBuf,
        /// What was wrong, including wasmtime's own explanation.
        cause: String,
    },
    /// The call ran past its deadline and was interrupted.
    #[error("plugin {version} ran past its deadline of {deadline:?} and was stopped")]
    Timeout {
        /// The version that was called.
        version: VersionLabel,
        /// The configured deadline.
        deadline: Duration,
    },
    /// The plugin tried to grow its memory past the cap.
    #[error(
        "plugin {version} tried to grow its memory past the cap of {limit_bytes} bytes and was stopped"
    )]
    MemoryLimit {
        /// The version that was called.
        version: VersionLabel,
        /// The configured cap in bytes.
        limit_bytes: u64,
    },
    /// The plugin trapped (a panic in Rust plugins, an out-of-bounds access, ...).
    #[error("plugin {version} trapped: {cause}")]
    Trap {
        /// The version that was called.
        version: VersionLabel,
        /// The trap and, when the plugin wrote to stderr (a Rust panic
        /// message does), the last of what it wrote.
        cause: String,
    },
    /// The plugin returned `err(reason)`: it ran fine but says processing failed.
    #[error("plugin {version} failed: {reason}")]
    Failed {
        /// The version that was called.
        version: VersionLabel,
        /// The plugin's own reason.
        reason: String,
    },
    /// The plugin broke the contract in a way the types cannot express (e.g.
    /// a batch answer with the wrong number of entries).
    #[error("plugin {version} broke the plugin contract: {detail}")]
    Contract {
        /// The version that was called.
        version: VersionLabel,
        /// What it did wrong.
        detail: String,
    },
    /// The plugin was called through the wrong world (a router asked to process).
    #[error("plugin {version} is a {actual} plugin; it cannot be used as a {wanted}")]
    WrongWorld {
        /// The version that was called.
        version: VersionLabel,
        /// The world the plugin implements.
        actual: World,
        /// The world the caller needed.
        wanted: World,
    },
    /// No plugin of that name is loaded.
    #[error("no plugin named `{0}` is loaded")]
    NotLoaded(String),
    /// Instantiating a fresh instance failed (e.g. the instance pool is exhausted).
    #[error("plugin {version}: could not create an instance: {cause}")]
    Instantiate {
        /// The version being instantiated.
        version: VersionLabel,
        /// wasmtime's explanation.
        cause: String,
    },
}

impl PluginError {
    /// The version involved, when the error is about a loaded version.
    pub fn version(&self) -> Option<&VersionLabel> {
        match self {
            PluginError::Timeout { version, .. }
            | PluginError::MemoryLimit { version, .. }
            | PluginError::Trap { version, .. }
            | PluginError::Failed { version, .. }
            | PluginError::Contract { version, .. }
            | PluginError::WrongWorld { version, .. }
            | PluginError::Instantiate { version, .. } => Some(version),
            PluginError::Load { .. } | PluginError::NotLoaded(_) => None,
        }
    }

    /// Whether calling again may succeed: a plugin's own `err`, a plugin
    /// not loaded yet, or an instance that could not be created (the pool
    /// was full) are worth a retry; a trap, a timeout, the memory cap, a
    /// broken contract or the wrong world would fail the same way again.
    pub fn is_retryable(&self) -> bool {
        match self {
            PluginError::Failed { .. }
            | PluginError::NotLoaded(_)
            | PluginError::Instantiate { .. } => true,
            PluginError::Load { .. }
            | PluginError::Timeout { .. }
            | PluginError::MemoryLimit { .. }
            | PluginError::Trap { .. }
            | PluginError::Contract { .. }
            | PluginError::WrongWorld { .. } => false,
        }
    }

    /// A short machine-readable kind, used in metrics labels and dead-letter headers.
    pub fn kind(&self) -> &'static str {
        match self {
            PluginError::Load { .. } => "load",
            PluginError::Timeout { .. } => "timeout",
            PluginError::MemoryLimit { .. } => "memory-limit",
            PluginError::Trap { .. } => "trap",
            PluginError::Failed { .. } => "failed",
            PluginError::Contract { .. } => "contract",
            PluginError::WrongWorld { .. } => "wrong-world",
            PluginError::NotLoaded(_) => "not-loaded",
            PluginError::Instantiate { .. } => "instantiate",
        }
    }
}

/// Renders a wasmtime error with its whole chain of causes on one line.
pub(crate) fn chain_to_string(error: &wasmtime::Error) -> String {
    format!("{error:#}")
}
