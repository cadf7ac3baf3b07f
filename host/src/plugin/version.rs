//! One loaded version of a plugin: compiled, linked (`InstancePre` prepared
//! once), checked to instantiate, and a small pool of live instances reused
//! across calls.
//!
//! Owns: turning bytes into a callable version (with a clear error naming
//! what is wrong with a bad file), calling it under the deadline and memory
//! cap, and turning a trap into a typed [`PluginError`]. A trapped instance is
//! dropped, never reused. Choosing which version serves is the registry's job.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest, Sha256};
use wasmtime::Store;
use wasmtime::component::Component;

use super::bindings::processor::{Processor, ProcessorPre};
use super::bindings::router::{Router, RouterPre};
use super::bindings::{Message, NodeLoad, Outcome};
use super::engine::{EPOCH_TICK, PluginRuntime, TickerHold};
use super::error::{PluginError, VersionLabel, World};
use super::state::{HostState, InstanceIdentity, PluginConfig};

/// Loading files: here rather than in [`super::engine`], so that the engine
/// stays a leaf that knows nothing of versions.
impl PluginRuntime {
    /// Compiles, links and instantiates a plugin file. This blocks for as
    /// long as compilation takes (up to seconds): call it off the async
    /// workers, or use [`PluginRuntime::load_file_async`].
    ///
    /// `expected` is the world the caller needs; `None` accepts either and
    /// tells which one the component implements.
    pub fn load_file(
        &self,
        name: &str,
        path: &Path,
        config: Arc<PluginConfig>,
        expected: Option<World>,
    ) -> Result<PluginVersion, PluginError> {
        let bytes = std::fs::read(path).map_err(|e| PluginError::Load {
            file: path.to_path_buf(),
            cause: format!("reading the file: {e}"),
        })?;
        PluginVersion::load(self.clone(), name, path, &bytes, config, expected)
    }

    /// [`PluginRuntime::load_file`] on tokio's blocking pool.
    pub async fn load_file_async(
        &self,
        name: &str,
        path: &Path,
        config: Arc<PluginConfig>,
        expected: Option<World>,
    ) -> Result<PluginVersion, PluginError> {
        let runtime = self.clone();
        let name = name.to_string();
        let path_buf = path.to_path_buf();
        tokio::task::spawn_blocking(move || runtime.load_file(&name, &path_buf, config, expected))
            .await
            .map_err(|e| PluginError::Load {
                file: path.to_path_buf(),
                cause: format!("the compile task failed: {e}"),
            })?
    }
}

/// A plugin version ready to be called from any thread.
pub struct PluginVersion {
    identity: Arc<InstanceIdentity>,
    world: World,
    file: PathBuf,
    size_bytes: usize,
    loaded_at: SystemTime,
    compile_time: Duration,
    runtime: PluginRuntime,
    pre: WorldPre,
    deadline_ticks: u64,
    idle: Mutex<Vec<LiveInstance>>,
    calls: AtomicU64,
    errors: AtomicU64,
    instances_created: AtomicU64,
    /// Keeps the epoch ticker ticking while the version lives: its calls
    /// have deadlines.
    _ticking: TickerHold,
}

impl std::fmt::Debug for PluginVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginVersion")
            .field("label", &self.identity.label)
            .field("world", &self.world)
            .field("file", &self.file)
            .finish()
    }
}

enum WorldPre {
    Processor(ProcessorPre<HostState>),
    Router(RouterPre<HostState>),
}

enum WorldExports {
    Processor(Processor),
    Router(Router),
}

struct LiveInstance {
    store: Store<HostState>,
    exports: WorldExports,
}

/// What creating one instance of a version cost (`wasmrelay plugin bench`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InstanceProbe {
    /// How long instantiating took (from the prepared `InstancePre`).
    pub instantiate: Duration,
    /// Linear memory the new instance has, in bytes, over all its memories.
    pub memory_bytes: u64,
}

/// Counters of one version, for `/plugins` and metrics.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct VersionStats {
    /// Calls made (a batch counts once).
    pub calls: u64,
    /// Calls that ended in an error (trap, timeout, memory cap).
    pub errors: u64,
    /// Instances created (the first at load time included).
    pub instances_created: u64,
}

/// The WebAssembly magic number and the layer/version word of a component.
const WASM_MAGIC: &[u8; 4] = b"\0asm";
const CORE_MODULE_VERSION: [u8; 4] = [1, 0, 0, 0];

impl PluginVersion {
    /// Compiles, links and instantiates `bytes` (see [`PluginRuntime::load_file`]).
    pub(crate) fn load(
        runtime: PluginRuntime,
        name: &str,
        file: &Path,
        bytes: &[u8],
        config: Arc<PluginConfig>,
        expected: Option<World>,
    ) -> Result<PluginVersion, PluginError> {
        let load_error = |cause: String| PluginError::Load {
            file: file.to_path_buf(),
            cause,
        };
        check_component_header(bytes).map_err(load_error)?;
        let sha256 = hex::encode(Sha256::digest(bytes));

        let compiling = Instant::now();
        let component = Component::from_binary(&runtime.inner.engine, bytes)
            .map_err(|e| load_error(format!("compiling: {e:#}")))?;
        let compile_time = compiling.elapsed();
        let pre = runtime
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(|e| {
                load_error(format!(
                    "linking: {e:#} (a plugin may import only `wasmrelay:plugin/host` and WASI)"
                ))
            })?;
        let world_pre = match (ProcessorPre::new(pre.clone()), RouterPre::new(pre)) {
            (Ok(processor), _) if expected != Some(World::Router) => WorldPre::Processor(processor),
            (_, Ok(router)) if expected != Some(World::Processor) => WorldPre::Router(router),
            (Ok(_), _) => {
                return Err(load_error(
                    "it implements the processor world, but a router plugin was expected".into(),
                ));
            }
            (_, Ok(_)) => {
                return Err(load_error(
                    "it implements the router world, but a processor plugin was expected".into(),
                ));
            }
            (Err(processor), Err(router)) => {
                let wanted = match expected {
                    Some(World::Processor) => format!("processor world: {processor:#}"),
                    Some(World::Router) => format!("router world: {router:#}"),
                    None => format!("processor world: {processor:#}; router world: {router:#}"),
                };
                return Err(load_error(format!(
                    "it does not export what the plugin contract requires ({wanted})"
                )));
            }
        };
        let world = match world_pre {
            WorldPre::Processor(_) => World::Processor,
            WorldPre::Router(_) => World::Router,
        };

        let ticking = runtime.inner.ticker.hold();
        let deadline = runtime.inner.limits.call_deadline;
        // Round up to whole ticks, plus one: the first tick can come at any
        // moment after the deadline is set.
        let deadline_ticks = deadline.as_nanos().div_ceil(EPOCH_TICK.as_nanos()) as u64 + 1;
        let version = PluginVersion {
            identity: Arc::new(InstanceIdentity {
                log_limit: Arc::default(),
                label: VersionLabel {
                    name: name.to_string(),
                    sha256,
                },
                config,
            }),
            world,
            file: file.to_path_buf(),
            size_bytes: bytes.len(),
            loaded_at: SystemTime::now(),
            compile_time,
            runtime,
            pre: world_pre,
            deadline_ticks,
            idle: Mutex::new(Vec::new()),
            calls: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            instances_created: AtomicU64::new(0),
            _ticking: ticking,
        };
        // Instantiate once now, so that a version that cannot even start
        // (a trapping start function, an exhausted pool) never gets swapped in.
        let instance = version.instantiate().map_err(|e| match e {
            PluginError::Instantiate { cause, .. } => load_error(format!("instantiating: {cause}")),
            other => load_error(format!("instantiating: {other}")),
        })?;
        version.check_in(instance);
        Ok(version)
    }

    /// `name@sha256` of this version.
    pub fn label(&self) -> &VersionLabel {
        &self.identity.label
    }

    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.identity.label.name
    }

    /// Full hex sha256 of the component bytes: the version's identity.
    pub fn sha256(&self) -> &str {
        &self.identity.label.sha256
    }

    /// The world the component implements.
    pub fn world(&self) -> World {
        self.world
    }

    /// The file it was loaded from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Size of the component in bytes.
    pub fn size_bytes(&self) -> usize {
        self.size_bytes
    }

    /// When it was loaded.
    pub fn loaded_at(&self) -> SystemTime {
        self.loaded_at
    }

    /// How long compiling the component took when it was loaded.
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }

    /// Creates one fresh instance, measures it and drops it.
    pub fn probe_instance(&self) -> Result<InstanceProbe, PluginError> {
        let started = Instant::now();
        let instance = self.instantiate()?;
        let instantiate = started.elapsed();
        Ok(InstanceProbe {
            instantiate,
            memory_bytes: instance.store.data().memory.total as u64,
        })
    }

    /// The plugin's config values.
    pub fn config(&self) -> &PluginConfig {
        &self.identity.config
    }

    /// Calls, errors and instances so far.
    pub fn stats(&self) -> VersionStats {
        VersionStats {
            calls: self.calls.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            instances_created: self.instances_created.load(Ordering::Relaxed),
        }
    }

    /// Processes one message (processor world).
    ///
    /// `Ok` is the plugin's verdict; the plugin's own `err(reason)` comes back
    /// as [`PluginError::Failed`], a trap, timeout or memory cap as the
    /// matching error. Blocks for up to the call deadline.
    pub fn process(&self, msg: &Message) -> Result<Outcome, PluginError> {
        let answer = self.call(World::Processor, |store, exports| match exports {
            WorldExports::Processor(p) => p.call_process(store, msg),
            WorldExports::Router(_) => unreachable_world(),
        })?;
        answer.map_err(|reason| self.failed(reason))
    }

    /// Processes a batch in one call (processor world): one answer per
    /// message, in order. A trap fails the whole batch.
    pub fn process_batch(
        &self,
        batch: &[Message],
    ) -> Result<Vec<Result<Outcome, PluginError>>, PluginError> {
        let answers = self.call(World::Processor, |store, exports| match exports {
            WorldExports::Processor(p) => p.call_process_batch(store, batch),
            WorldExports::Router(_) => unreachable_world(),
        })?;
        if answers.len() != batch.len() {
            return Err(PluginError::Contract {
                version: self.label().clone(),
                detail: format!(
                    "process-batch returned {} answers for {} messages",
                    answers.len(),
                    batch.len()
                ),
            });
        }
        Ok(answers
            .into_iter()
            .map(|answer| answer.map_err(|reason| self.failed(reason)))
            .collect())
    }

    /// Which process a message is for (router world).
    pub fn route(&self, msg: &Message) -> Result<Option<String>, PluginError> {
        let answer = self.call(World::Router, |store, exports| match exports {
            WorldExports::Router(r) => r.call_route(store, msg),
            WorldExports::Processor(_) => unreachable_world(),
        })?;
        answer.map_err(|reason| self.failed(reason))
    }

    /// Which node should accept a new connection (router world).
    pub fn place(
        &self,
        process_id: &str,
        nodes: &[NodeLoad],
    ) -> Result<Option<String>, PluginError> {
        let answer = self.call(World::Router, |store, exports| match exports {
            WorldExports::Router(r) => r.call_place(store, process_id, nodes),
            WorldExports::Processor(_) => unreachable_world(),
        })?;
        answer.map_err(|reason| self.failed(reason))
    }

    fn failed(&self, reason: String) -> PluginError {
        PluginError::Failed {
            version: self.label().clone(),
            reason,
        }
    }

    /// Runs `f` on an instance under the deadline; a failed call discards the
    /// instance, a successful one returns it to the pool.
    fn call<R>(
        &self,
        wanted: World,
        f: impl FnOnce(&mut Store<HostState>, &WorldExports) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        if self.world != wanted {
            return Err(PluginError::WrongWorld {
                version: self.label().clone(),
                actual: self.world,
                wanted,
            });
        }
        let mut instance = self.check_out()?;
        instance.store.set_epoch_deadline(self.deadline_ticks);
        self.calls.fetch_add(1, Ordering::Relaxed);
        match f(&mut instance.store, &instance.exports) {
            Ok(value) => {
                self.check_in(instance);
                Ok(value)
            }
            Err(error) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                Err(self.classify(error, &instance.store))
            }
        }
    }

    fn classify(&self, error: wasmtime::Error, store: &Store<HostState>) -> PluginError {
        let version = self.label().clone();
        let limits = &self.runtime.inner.limits;
        if store.data().memory.hit {
            return PluginError::MemoryLimit {
                version,
                limit_bytes: limits.memory_cap_bytes,
            };
        }
        let trap = error.downcast_ref::<wasmtime::Trap>().copied();
        if trap == Some(wasmtime::Trap::Interrupt) {
            return PluginError::Timeout {
                version,
                deadline: limits.call_deadline,
            };
        }
        let mut cause = match trap {
            Some(trap) => trap.to_string(),
            None => super::error::chain_to_string(&error),
        };
        let stderr = store.data().stderr.tail();
        if !stderr.is_empty() {
            cause.push_str("; plugin stderr: ");
            cause.push_str(&stderr);
        }
        PluginError::Trap { version, cause }
    }

    fn check_out(&self) -> Result<LiveInstance, PluginError> {
        let reused = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        match reused {
            Some(instance) => Ok(instance),
            None => self.instantiate(),
        }
    }

    fn check_in(&self, instance: LiveInstance) {
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < self.runtime.inner.limits.max_idle_instances
        {
            idle.push(instance);
        }
    }

    fn instantiate(&self) -> Result<LiveInstance, PluginError> {
        let limits = &self.runtime.inner.limits;
        let state = HostState::new(self.identity.clone(), limits.memory_cap_bytes);
        let mut store = Store::new(&self.runtime.inner.engine, state);
        store.limiter(|state| &mut state.memory);
        store.set_epoch_deadline(self.deadline_ticks);
        let exports = match &self.pre {
            WorldPre::Processor(pre) => pre.instantiate(&mut store).map(WorldExports::Processor),
            WorldPre::Router(pre) => pre.instantiate(&mut store).map(WorldExports::Router),
        }
        .map_err(|e| PluginError::Instantiate {
            version: self.label().clone(),
            cause: super::error::chain_to_string(&e),
        })?;
        self.instances_created.fetch_add(1, Ordering::Relaxed);
        Ok(LiveInstance { store, exports })
    }
}

fn unreachable_world<R>() -> wasmtime::Result<R> {
    // `call` checks the world before it gets here.
    Err(wasmtime::Error::msg(
        "internal error: plugin world mismatch",
    ))
}

/// Tells apart "not wasm at all" and "a core module, not a component" before
/// wasmtime's less specific parse error.
fn check_component_header(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < 8 || &bytes[..4] != WASM_MAGIC {
        return Err(
            "not a WebAssembly file (it does not start with the `\\0asm` magic bytes)".into(),
        );
    }
    if bytes[4..8] == CORE_MODULE_VERSION {
        return Err(
            "this is a core WebAssembly module, not a component: build the plugin for \
             `--target wasm32-wasip2` (or wrap it with `wasm-tools component new`)"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_check_names_the_problem() {
        let not_wasm = check_component_header(b"hello world").unwrap_err();
        assert!(not_wasm.contains("not a WebAssembly file"), "{not_wasm}");
        let core = check_component_header(b"\0asm\x01\0\0\0").unwrap_err();
        assert!(core.contains("core WebAssembly module"), "{core}");
        assert!(check_component_header(b"\0asm\x0d\0\x01\0").is_ok());
    }
}
