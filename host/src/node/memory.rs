//! Giving free heap memory back to the system now and then
//! ([`wasmrelay_malloc::release_free_memory`] every
//! [`wasmrelay_malloc::RELEASE_INTERVAL`]): glibc keeps what a burst freed
//! below memory still in use, so without it a relay's resident size keeps
//! the high-water mark of its worst burst (a broker cut and the catch-up
//! after it). See `wasmrelay_malloc` for the soak that found it.

use tokio_util::sync::CancellationToken;

/// Until `stop`: every [`wasmrelay_malloc::RELEASE_INTERVAL`], gives the
/// free pages of glibc's arenas back, on a blocking thread.
pub(super) async fn release_free_memory_now_and_then(stop: CancellationToken) {
    let mut interval = tokio::time::interval(wasmrelay_malloc::RELEASE_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once; the heap is small then.
    interval.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = interval.tick() => {}
        }
        // Awaited here: nothing is left running when the task ends.
        let released = tokio::task::spawn_blocking(wasmrelay_malloc::release_free_memory).await;
        tracing::trace!(
            released = released.unwrap_or(false),
            "free heap memory given back"
        );
    }
}
