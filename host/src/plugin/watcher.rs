//! Hot reload: watches the plugins directory and rescans it when something
//! changes there.
//!
//! Owns: the `notify` watcher, debouncing (an editor's write-then-rename or a
//! Kubernetes `..data` symlink swap is a burst of events; one scan follows
//! it), and a periodic rescan as a safety net for file systems that drop
//! events. What a scan does with the files is [`super::registry`]'s job.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use notify::{RecursiveMode, Watcher as _};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::registry::PluginRegistry;

/// How the plugins directory is watched.
#[derive(Clone, Debug)]
pub struct WatchOptions {
    /// Quiet time after the last event before the directory is rescanned.
    pub debounce: Duration,
    /// Rescan this often even without events.
    pub rescan_interval: Duration,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            debounce: Duration::from_millis(50),
            rescan_interval: Duration::from_secs(30),
        }
    }
}

/// Starts watching the registry's directory on `tasks`; the task ends when
/// `shutdown` is cancelled. Fails if the directory cannot be watched.
pub fn spawn_plugin_watcher(
    registry: Arc<PluginRegistry>,
    options: WatchOptions,
    tasks: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let (events_tx, mut events_rx) = mpsc::channel::<()>(1);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        match event {
            // A full channel already means "rescan pending": dropping is fine.
            Ok(event) if !event.kind.is_access() => {
                let _ = events_tx.try_send(());
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "plugin directory watch error; rescanning"),
        }
    })
    .context("creating the plugin directory watcher")?;
    watcher
        .watch(registry.dir(), RecursiveMode::NonRecursive)
        .with_context(|| format!("watching plugin directory {}", registry.dir().display()))?;

    tasks.spawn(async move {
        // The watcher stops when dropped: keep it for the task's lifetime.
        let _watcher = watcher;
        let mut rescan = tokio::time::interval(options.rescan_interval);
        rescan.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = rescan.tick() => {}
                event = events_rx.recv() => {
                    if event.is_none() {
                        break;
                    }
                    // Debounce: wait until the burst is over.
                    while let Ok(Some(())) =
                        tokio::time::timeout(options.debounce, events_rx.recv()).await
                    {}
                }
            }
            let report = registry.scan().await;
            if !report.swapped.is_empty() || !report.added.is_empty() {
                tracing::debug!(added = ?report.added, swapped = ?report.swapped, "plugin directory rescanned");
            }
        }
    });
    Ok(())
}
