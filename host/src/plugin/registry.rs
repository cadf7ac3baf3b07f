//! The plugins a relay serves, by name, each with the version currently
//! serving, swapped atomically when a new version has loaded.
//!
//! Owns: the name → slot map, the rule "a new version replaces the old one
//! only after it compiled, linked and instantiated", and the record of the
//! last failed load. Calls in flight hold an `Arc` of the version they
//! started on, so they finish on it; the old version is dropped when the last
//! of them returns. Watching the directory is [`super::watcher`]'s job; it
//! calls [`PluginRegistry::scan`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use sha2::{Digest, Sha256};

use super::bindings::Message;
use super::engine::PluginRuntime;
use super::error::{PluginError, World};
use super::executor::{BatchAnswers, PluginExecutor};
use super::state::PluginConfig;
use super::version::{PluginVersion, VersionStats};

/// The file extension of plugin components.
pub const PLUGIN_EXTENSION: &str = "wasm";

/// The plugins loaded from one directory.
pub struct PluginRegistry {
    runtime: PluginRuntime,
    dir: PathBuf,
    configs: BTreeMap<String, Arc<PluginConfig>>,
    slots: RwLock<HashMap<String, Arc<PluginSlot>>>,
    /// Failed loads of plugins that have no serving version yet, so the
    /// same bad bytes are not recompiled (and re-reported) on every scan.
    failed_new: Mutex<HashMap<String, LoadFailure>>,
    /// Serialises scans: two events in a row must not compile the same file twice.
    scanning: tokio::sync::Mutex<()>,
    /// Runs processor calls, started at the first one; `None` if its
    /// threads could not be started (calls then use the blocking pool).
    executor: OnceLock<Option<PluginExecutor>>,
}

impl std::fmt::Debug for PluginRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginRegistry")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// One plugin name and the version serving it.
pub struct PluginSlot {
    name: String,
    world: World,
    current: ArcSwap<PluginVersion>,
    swaps: AtomicU64,
    file_missing: AtomicBool,
    last_failure: Mutex<Option<LoadFailure>>,
}

impl std::fmt::Debug for PluginSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginSlot")
            .field("name", &self.name)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

/// A load that failed and left the previous version serving.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadFailure {
    /// The sha256 of the bytes that failed to load.
    pub sha256: String,
    /// When it failed.
    pub at: SystemTime,
    /// Why (the whole error, naming the file).
    pub error: String,
}

/// What one plugin looks like from outside (for `/plugins` and logs).
#[derive(Clone, Debug, serde::Serialize)]
pub struct PluginInfo {
    /// The plugin's name.
    pub name: String,
    /// Its world.
    pub world: World,
    /// sha256 of the version serving now.
    pub sha256: String,
    /// The file it was loaded from.
    pub file: PathBuf,
    /// When the serving version was loaded.
    pub loaded_at: SystemTime,
    /// How many times a new version was swapped in.
    pub swaps: u64,
    /// Counters of the serving version.
    pub stats: VersionStats,
    /// The last load that failed, if it came after the serving version.
    pub last_failure: Option<LoadFailure>,
}

/// What a scan of the directory did.
#[derive(Debug, Default)]
pub struct ScanReport {
    /// Plugins loaded for the first time: `name@sha`.
    pub added: Vec<String>,
    /// Plugins whose new version was swapped in: `name@sha`.
    pub swapped: Vec<String>,
    /// Loads that failed (the previous version, if any, still serves).
    pub failed: Vec<PluginError>,
}

impl PluginSlot {
    /// The version serving now. Hold the `Arc` for the duration of one call
    /// (or batch): the call finishes on this version even if a new one is
    /// swapped in meanwhile.
    pub fn current(&self) -> Arc<PluginVersion> {
        self.current.load_full()
    }

    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The world every version of this plugin must implement.
    pub fn world(&self) -> World {
        self.world
    }

    /// How many times a new version was swapped in.
    pub fn swaps(&self) -> u64 {
        self.swaps.load(Ordering::Relaxed)
    }

    /// The last failed load, if any, since the serving version was loaded.
    pub fn last_failure(&self) -> Option<LoadFailure> {
        self.last_failure.lock().ok().and_then(|f| f.clone())
    }
}

impl PluginRegistry {
    /// A registry for the plugins in `dir`; `configs` gives each plugin (by
    /// name) its config values. Nothing is loaded until [`PluginRegistry::scan`].
    pub fn new(
        runtime: PluginRuntime,
        dir: impl Into<PathBuf>,
        configs: BTreeMap<String, PluginConfig>,
    ) -> Self {
        PluginRegistry {
            runtime,
            dir: dir.into(),
            configs: configs
                .into_iter()
                .map(|(name, config)| (name, Arc::new(config)))
                .collect(),
            slots: RwLock::new(HashMap::new()),
            failed_new: Mutex::new(HashMap::new()),
            scanning: tokio::sync::Mutex::new(()),
            executor: OnceLock::new(),
        }
    }

    /// Processes `messages` with `version` on the plugin executor (one
    /// answer per message, in order), merged into one call with other
    /// messages waiting for the same version. The messages are handed back
    /// with the answers (none when the executor stopped before answering,
    /// or the call's blocking task was cancelled at shutdown; a call that
    /// panics is answered with an error, its messages handed back).
    pub async fn process_batch(
        &self,
        version: Arc<PluginVersion>,
        messages: Vec<Message>,
    ) -> (Vec<Message>, BatchAnswers) {
        let executor = self.executor.get_or_init(|| {
            PluginExecutor::start(PluginExecutor::default_threads())
                .inspect_err(|error| {
                    tracing::error!(%error, "starting the plugin executor; plugin calls use the blocking pool");
                })
                .ok()
        });
        match executor {
            Some(executor) => executor.process_batch(version, messages).await,
            None => {
                let label = version.label().clone();
                tokio::task::spawn_blocking(move || {
                    let answers = super::executor::call(&version, &messages);
                    (messages, answers)
                })
                .await
                .unwrap_or_else(|join_error| {
                    (
                        Vec::new(),
                        Err(PluginError::Instantiate {
                            version: label,
                            cause: format!("plugin task failed: {join_error}"),
                        }),
                    )
                })
            }
        }
    }

    /// The directory watched.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The runtime versions are loaded with.
    pub fn runtime(&self) -> &PluginRuntime {
        &self.runtime
    }

    /// The slot of plugin `name`, if it is loaded.
    pub fn get(&self, name: &str) -> Option<Arc<PluginSlot>> {
        self.slots.read().ok()?.get(name).cloned()
    }

    /// The version of plugin `name` serving now.
    pub fn current(&self, name: &str) -> Result<Arc<PluginVersion>, PluginError> {
        self.get(name)
            .map(|slot| slot.current())
            .ok_or_else(|| PluginError::NotLoaded(name.to_string()))
    }

    /// Every loaded plugin, sorted by name.
    pub fn plugins(&self) -> Vec<PluginInfo> {
        let slots: Vec<Arc<PluginSlot>> = match self.slots.read() {
            Ok(slots) => slots.values().cloned().collect(),
            Err(_) => return Vec::new(),
        };
        let mut infos: Vec<PluginInfo> = slots
            .iter()
            .map(|slot| {
                let version = slot.current();
                PluginInfo {
                    name: slot.name.clone(),
                    world: slot.world,
                    sha256: version.sha256().to_string(),
                    file: version.file().to_path_buf(),
                    loaded_at: version.loaded_at(),
                    swaps: slot.swaps(),
                    stats: version.stats(),
                    last_failure: slot.last_failure(),
                }
            })
            .collect();
        infos.sort_by(|a, b| a.name.cmp(&b.name));
        infos
    }

    /// Reads every `*.wasm` in the directory (following symlinks, so a
    /// Kubernetes-style `..data` swap is seen) and loads each file whose
    /// bytes differ from the version serving. A file that fails to load is
    /// reported and leaves its previous version serving; a file that
    /// disappeared leaves its version serving too.
    pub async fn scan(&self) -> ScanReport {
        let _one_scan_at_a_time = self.scanning.lock().await;
        let mut report = ScanReport::default();
        let files = match plugin_files(&self.dir) {
            Ok(files) => files,
            Err(error) => {
                report.failed.push(PluginError::Load {
                    file: self.dir.clone(),
                    cause: format!("listing the plugins directory: {error}"),
                });
                return report;
            }
        };
        self.note_missing_files(&files);
        for (name, path) in files {
            self.scan_file(&name, &path, &mut report).await;
        }
        report
    }

    async fn scan_file(&self, name: &str, path: &Path, report: &mut ScanReport) {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            // Gone between listing and reading: the next event rescans.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return,
            Err(error) => {
                report.failed.push(PluginError::Load {
                    file: path.to_path_buf(),
                    cause: format!("reading the file: {error}"),
                });
                return;
            }
        };
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let slot = self.get(name);
        if let Some(slot) = &slot {
            slot.file_missing.store(false, Ordering::Relaxed);
            if slot.current().sha256() == sha256 {
                return;
            }
            let already_failed = slot
                .last_failure()
                .is_some_and(|failure| failure.sha256 == sha256);
            if already_failed {
                return;
            }
        } else {
            let already_failed = self
                .failed_new
                .lock()
                .ok()
                .and_then(|failed| failed.get(name).map(|f| f.sha256 == sha256))
                .unwrap_or(false);
            if already_failed {
                return;
            }
        }

        let config = self.configs.get(name).cloned().unwrap_or_default();
        let expected = slot.as_ref().map(|slot| slot.world);
        let runtime = self.runtime.clone();
        let (task_name, task_path) = (name.to_string(), path.to_path_buf());
        let loaded = tokio::task::spawn_blocking(move || {
            PluginVersion::load(runtime, &task_name, &task_path, &bytes, config, expected)
        })
        .await
        .unwrap_or_else(|join_error| {
            Err(PluginError::Load {
                file: path.to_path_buf(),
                cause: format!("the compile task failed: {join_error}"),
            })
        });

        match (loaded, slot) {
            (Ok(version), Some(slot)) => {
                let label = version.label().to_string();
                let old = slot.current.swap(Arc::new(version));
                slot.swaps.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut failure) = slot.last_failure.lock() {
                    *failure = None;
                }
                tracing::info!(plugin = %label, replaced = %old.label(), file = %path.display(), "plugin version swapped in");
                report.swapped.push(label);
            }
            (Ok(version), None) => {
                let label = version.label().to_string();
                tracing::info!(plugin = %label, world = %version.world(), file = %path.display(), "plugin loaded");
                let slot = Arc::new(PluginSlot {
                    name: name.to_string(),
                    world: version.world(),
                    current: ArcSwap::from_pointee(version),
                    swaps: AtomicU64::new(0),
                    file_missing: AtomicBool::new(false),
                    last_failure: Mutex::new(None),
                });
                if let Ok(mut slots) = self.slots.write() {
                    slots.insert(name.to_string(), slot);
                }
                if let Ok(mut failed) = self.failed_new.lock() {
                    failed.remove(name);
                }
                report.added.push(label);
            }
            (Err(error), slot) => {
                match &slot {
                    Some(slot) => tracing::error!(
                        error = %error,
                        serving = %slot.current().label(),
                        "new plugin version failed to load; the previous version keeps serving"
                    ),
                    None => tracing::error!(error = %error, "plugin failed to load"),
                }
                let failure = LoadFailure {
                    sha256,
                    at: SystemTime::now(),
                    error: error.to_string(),
                };
                match slot {
                    Some(slot) => {
                        if let Ok(mut last) = slot.last_failure.lock() {
                            *last = Some(failure);
                        }
                    }
                    None => {
                        if let Ok(mut failed) = self.failed_new.lock() {
                            failed.insert(name.to_string(), failure);
                        }
                    }
                }
                report.failed.push(error);
            }
        }
    }

    fn note_missing_files(&self, files: &[(String, PathBuf)]) {
        let Ok(slots) = self.slots.read() else {
            return;
        };
        for (name, slot) in slots.iter() {
            let present = files.iter().any(|(file_name, _)| file_name == name);
            if !present && !slot.file_missing.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    plugin = %slot.current().label(),
                    "plugin file removed; the loaded version keeps serving"
                );
            }
        }
    }
}

/// The `*.wasm` files of a directory as (plugin name, path), sorted by name.
/// Hidden entries (such as Kubernetes' `..data`) are skipped; symlinks are
/// followed when the file is read.
pub fn plugin_files(dir: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(file_name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if file_name.starts_with('.') {
            continue;
        }
        if path.extension().and_then(|e| e.to_str()) != Some(PLUGIN_EXTENSION) {
            continue;
        }
        if !path.is_file() {
            continue;
        }
        if let Some(stem) = path.file_stem().and_then(|s| s.to_str()) {
            files.push((stem.to_string(), path.clone()));
        }
    }
    files.sort();
    Ok(files)
}
