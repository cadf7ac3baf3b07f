//! The `dir` config-center backend: every regular file of a directory is a
//! key (its name) and its content the value. This is how a Kubernetes
//! ConfigMap is mounted: each key is a symlink `key -> ..data/key`, and an
//! update swaps the `..data` symlink atomically to a new timestamped
//! directory. Editors' write-then-rename and plain deletions work too.
//!
//! The directory is watched with `notify`; a burst of events is debounced
//! into one re-read of the whole directory, so a half-applied update is never
//! published. A directory that cannot be read keeps the last good values and
//! is reported unreachable.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use notify::{RecursiveMode, Watcher as _};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{CenterState, ConfigCenter, Reachability};

/// Quiet time after the last event before the directory is read again.
pub const DEBOUNCE: Duration = Duration::from_millis(50);
/// Read again this often even without events (a safety net for file
/// systems that drop events).
pub const RESCAN_INTERVAL: Duration = Duration::from_secs(10);

/// Reads every key of `dir`: regular files (symlinks followed), hidden
/// entries (`..data`, editors' temporary files) skipped, values trimmed of
/// surrounding whitespace. A file that is not UTF-8 text is a value with
/// its bad bytes replaced by U+FFFD (as etcd values are read), so one bad
/// file is one bad value that its reader refuses, naming its key
/// ([`crate::kafka::LinkInfo::from_center_value`]), never a center that
/// cannot be read at all.
pub fn read_dir_values(dir: &Path) -> std::io::Result<BTreeMap<String, String>> {
    let mut values = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name.starts_with('.') || !path.is_file() {
            continue;
        }
        match std::fs::read(&path) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                values.insert(name.to_string(), text.trim().to_string());
            }
            // Removed between listing and reading: the next event re-reads.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
    }
    Ok(values)
}

/// Reads `dir` once (failing if it cannot be read: a relay must not start
/// without its center) and watches it on `tasks` until `shutdown`.
pub async fn start(
    dir: impl Into<PathBuf>,
    tasks: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<ConfigCenter> {
    let dir = dir.into();
    let values = read_dir_values(&dir)
        .with_context(|| format!("reading config center directory {}", dir.display()))?;
    let (state_tx, state) = watch::channel(CenterState {
        values,
        reachability: Reachability::Reachable,
        generation: 0,
    });
    let (events_tx, events_rx) = mpsc::channel::<()>(1);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if !matches!(&event, Ok(e) if e.kind.is_access()) {
            let _ = events_tx.try_send(());
        }
    })
    .context("creating the config center watcher")?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching config center directory {}", dir.display()))?;
    let description = format!("dir {}", dir.display());
    tasks.spawn(watch_loop(dir, watcher, events_rx, state_tx, shutdown));
    Ok(ConfigCenter::new(state, description))
}

async fn watch_loop(
    dir: PathBuf,
    watcher: notify::RecommendedWatcher,
    mut events: mpsc::Receiver<()>,
    state: watch::Sender<CenterState>,
    shutdown: CancellationToken,
) {
    // The watcher stops when dropped: keep it for the task's lifetime.
    let _watcher = watcher;
    let mut rescan = tokio::time::interval(RESCAN_INTERVAL);
    rescan.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = rescan.tick() => {}
            event = events.recv() => {
                if event.is_none() {
                    return;
                }
                while let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, events.recv()).await {}
            }
        }
        let read = read_dir_values(&dir).map_err(|error| error.to_string());
        let center = format!("dir {}", dir.display());
        state.send_if_modified(|current| current.fold_read(read, &center));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::os::unix::fs::symlink;

    /// Lays out a ConfigMap volume generation: `..<gen>/key` files, then
    /// swaps `..data` to it atomically; key symlinks are made once.
    fn configmap_update(dir: &Path, generation: &str, values: &[(&str, &str)]) {
        let gen_dir = dir.join(format!("..{generation}"));
        std::fs::create_dir(&gen_dir).unwrap();
        for (key, value) in values {
            std::fs::write(gen_dir.join(key), value).unwrap();
        }
        let tmp = dir.join("..data_tmp");
        symlink(format!("..{generation}"), &tmp).unwrap();
        std::fs::rename(&tmp, dir.join("..data")).unwrap();
        for (key, _) in values {
            let link = dir.join(key);
            if std::fs::symlink_metadata(&link).is_err() {
                symlink(format!("..data/{key}"), &link).unwrap();
            }
        }
    }

    async fn next_state(rx: &mut watch::Receiver<CenterState>) -> CenterState {
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .expect("no change within 5 s")
            .unwrap();
        rx.borrow_and_update().clone()
    }

    #[tokio::test]
    async fn reads_files_and_skips_hidden_entries() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("kafka.main"),
            "{\"bootstrap.servers\":\"a:9092\"}\n",
        )
        .unwrap();
        std::fs::write(dir.path().join(".kafka.main.swp"), "junk").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let values = read_dir_values(dir.path()).unwrap();
        assert_eq!(
            values,
            BTreeMap::from([(
                "kafka.main".to_string(),
                "{\"bootstrap.servers\":\"a:9092\"}".to_string()
            )])
        );
    }

    #[tokio::test]
    async fn follows_a_configmap_symlink_swap() {
        let dir = tempfile::tempdir().unwrap();
        configmap_update(
            dir.path(),
            "2026_01",
            &[("kafka.main", "{\"bootstrap.servers\":\"one:9092\"}")],
        );
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        let center = start(dir.path(), &tasks, shutdown.clone()).await.unwrap();
        let mut rx = center.subscribe();
        assert_eq!(
            rx.borrow().kafka_link("main"),
            Some("{\"bootstrap.servers\":\"one:9092\"}")
        );

        configmap_update(
            dir.path(),
            "2026_02",
            &[("kafka.main", "{\"bootstrap.servers\":\"two:9092\"}")],
        );
        let state = next_state(&mut rx).await;
        assert_eq!(
            state.kafka_link("main"),
            Some("{\"bootstrap.servers\":\"two:9092\"}")
        );
        assert_eq!(state.reachability, Reachability::Reachable);
        shutdown.cancel();
        drop(center);
        tasks.close();
        tasks.wait().await;
    }

    #[tokio::test]
    async fn write_then_rename_and_delete_are_seen() {
        let dir = tempfile::tempdir().unwrap();
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        let center = start(dir.path(), &tasks, shutdown.clone()).await.unwrap();
        let mut rx = center.subscribe();
        assert!(rx.borrow().values.is_empty());

        std::fs::write(dir.path().join(".tmp"), "v1").unwrap();
        std::fs::rename(dir.path().join(".tmp"), dir.path().join("kafka.a")).unwrap();
        assert_eq!(next_state(&mut rx).await.kafka_link("a"), Some("v1"));

        std::fs::remove_file(dir.path().join("kafka.a")).unwrap();
        assert_eq!(next_state(&mut rx).await.kafka_link("a"), None);
        shutdown.cancel();
        drop(center);
        tasks.close();
        tasks.wait().await;
    }

    #[tokio::test]
    async fn quick_flips_end_on_the_last_value() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kafka.main"), "1").unwrap();
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        let center = start(dir.path(), &tasks, shutdown.clone()).await.unwrap();
        let mut rx = center.subscribe();
        for value in ["2", "1", "2", "3"] {
            let tmp = dir.path().join(".tmp");
            std::fs::write(&tmp, value).unwrap();
            std::fs::rename(&tmp, dir.path().join("kafka.main")).unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while rx.borrow().kafka_link("main") != Some("3") {
            assert!(
                std::time::Instant::now() < deadline,
                "never settled on the last value"
            );
            let _ = tokio::time::timeout(Duration::from_millis(200), rx.changed()).await;
        }
        shutdown.cancel();
        drop(center);
        tasks.close();
        tasks.wait().await;
    }

    #[test]
    fn a_file_that_is_not_utf8_is_one_bad_value_not_an_unreadable_center() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("kafka.main"),
            b"{\"bootstrap.servers\": \"k:9092\"}",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("kafka.bad"),
            b"{\"bootstrap.servers\": \"\xff\xfe\"}",
        )
        .unwrap();
        let values = read_dir_values(dir.path()).expect("the directory reads");
        assert_eq!(values["kafka.main"], "{\"bootstrap.servers\": \"k:9092\"}");
        let problem = crate::kafka::LinkInfo::from_center_value(
            &values["kafka.bad"],
            &crate::kafka::CenterPolicy::default(),
        )
        .unwrap_err();
        assert!(problem.contains("not UTF-8 text"), "{problem}");
    }

    #[test]
    fn an_unreadable_directory_keeps_the_last_values_and_reports_it() {
        let dir = Path::new("/nonexistent/center");
        let mut state = CenterState {
            values: BTreeMap::from([("kafka.main".to_string(), "x".to_string())]),
            reachability: Reachability::Reachable,
            generation: 3,
        };
        let read = || read_dir_values(dir).map_err(|e| e.to_string());
        assert!(state.fold_read(read(), "dir"));
        assert_eq!(state.kafka_link("main"), Some("x"));
        assert!(matches!(
            state.reachability,
            Reachability::Unreachable { .. }
        ));
        // Still unreadable: nothing new to publish.
        assert!(!state.fold_read(read(), "dir"));
        // Readable again: recovered, new values.
        assert!(state.fold_read(Ok(BTreeMap::new()), "dir"));
        assert_eq!(state.reachability, Reachability::Reachable);
        assert!(state.values.is_empty());
    }
}
