//! Per-process windows of one outgoing link: how many forwards to one
//! process may be unanswered on the link at once.
//!
//! The accepting node keeps, per process, at most
//! [`FORWARDS_WAITING_PER_PROCESS`] forwards waiting for the process's room
//! and refuses the next one (the sender retries it: work done twice). A
//! sender that keeps at most that many unanswered per process never makes
//! the peer refuse one: a forward waits here for room instead, which holds
//! back the partition it came from, as a local process's `max_unacked`
//! does. A window's room is a permit held by the forward until its answer
//! arrives (or the link closes); windows with nothing in flight are dropped
//! on the link's keepalive tick.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Forwards to one process that a node holds waiting for the process's
/// room at most (one more is refused), and so the window of unanswered
/// forwards per process a sender keeps on its link.
pub const FORWARDS_WAITING_PER_PROCESS: usize = 1024;

/// The windows of one link, by process id.
#[derive(Debug)]
pub(super) struct ProcessWindows {
    size: usize,
    windows: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// Room for one forward in its process's window, given back when dropped.
#[derive(Debug)]
pub(super) struct Room {
    _permit: OwnedSemaphorePermit,
}

impl ProcessWindows {
    /// Windows of `size` forwards each.
    pub(super) fn new(size: usize) -> ProcessWindows {
        ProcessWindows {
            size: size.max(1),
            windows: Mutex::default(),
        }
    }

    /// The window's size.
    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// Room in `process_id`'s window now, if it has any.
    pub(super) fn try_room(&self, process_id: &str) -> Option<Room> {
        self.window(process_id)
            .try_acquire_owned()
            .ok()
            .map(|permit| Room { _permit: permit })
    }

    /// Room in `process_id`'s window, waiting until an unanswered forward
    /// to it is answered when it is full.
    pub(super) async fn room(&self, process_id: &str) -> Room {
        let window = self.window(process_id);
        let permit = match window.clone().try_acquire_owned() {
            Ok(permit) => permit,
            // Never closed.
            Err(_) => window
                .acquire_owned()
                .await
                .expect("a process window is never closed"),
        };
        Room { _permit: permit }
    }

    /// Drops the windows with no forward in flight and no one waiting.
    pub(super) fn drop_idle(&self) {
        self.lock()
            .retain(|_, window| Arc::strong_count(window) > 1);
    }

    /// Processes with a window now (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }

    fn window(&self, process_id: &str) -> Arc<Semaphore> {
        let mut windows = self.lock();
        if let Some(window) = windows.get(process_id) {
            return window.clone();
        }
        let window = Arc::new(Semaphore::new(self.size));
        windows.insert(process_id.to_string(), window.clone());
        window
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Semaphore>>> {
        self.windows.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;

    #[tokio::test]
    async fn a_full_window_waits_until_a_forward_is_answered() {
        let windows = ProcessWindows::new(2);
        let first = windows.try_room("p").unwrap();
        let _second = windows.room("p").await;
        assert!(windows.try_room("p").is_none(), "a third fit a window of 2");
        // Another process has its own window.
        let _other = windows.try_room("q").unwrap();
        let mut third = Box::pin(windows.room("p"));
        assert!((&mut third).now_or_never().is_none());
        drop(first);
        assert!(third.now_or_never().is_some(), "room was given back");
    }

    #[tokio::test]
    async fn windows_with_nothing_in_flight_are_dropped() {
        let windows = ProcessWindows::new(2);
        let held = windows.try_room("p").unwrap();
        drop(windows.try_room("q").unwrap());
        windows.drop_idle();
        assert_eq!(windows.len(), 1, "only p's window is in use");
        drop(held);
        windows.drop_idle();
        assert_eq!(windows.len(), 0);
    }
}
