//! glibc's malloc set up for a long-running relay. The one `unsafe` call of
//! wasmrelay lives here, apart from the crates that forbid `unsafe`.
//!
//! glibc gives the threads that allocate arenas of their own, up to eight
//! a core, and each arena keeps what was freed in it. A relay's threads come
//! and go (tokio's blocking pool; librdkafka's broker threads, busy after
//! every reconnect), so memory freed in one arena is not reused from
//! another, and the resident size climbs in steps after each burst: in the
//! soak, cluster nodes grew 6-8% in 25 minutes, in steps after broker cuts;
//! a node cut from its broker every 40 s grew 3.7 MiB over the first three
//! cuts with glibc's default and 0.6 MiB over six with two arenas. Two
//! arenas keep it flat; small allocations stay in each thread's own cache
//! (tcache), so the arenas' locks are rarely contended.
//!
//! `MALLOC_ARENA_MAX` in the environment, read by glibc itself, wins.
//!
//! Even within two arenas, glibc gives memory back to the system only from
//! the top of a heap: what is freed below a chunk still in use stays
//! resident. After a burst (a broker cut and the catch-up that follows it:
//! librdkafka's prefetched fetch buffers, the records in flight) the relay
//! keeps the burst's high-water mark for good: in a 30-minute soak the
//! anonymous memory of a sidecar stepped from 20 to 31 MiB and of a node
//! from 20 to 47 MiB, each after a cut, and stayed there; malloc_info
//! showed 9.7 of a sidecar's 17.5 MB heap free, and `malloc_trim(0)` took
//! its RssAnon from 24.2 to 16.5 MiB. [`release_free_memory`], called now
//! and then ([`RELEASE_INTERVAL`]), gives such free pages back.

/// How often a relay gives free heap memory back ([`release_free_memory`]).
pub const RELEASE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Arenas allowed when `MALLOC_ARENA_MAX` is not set.
pub const DEFAULT_ARENA_MAX: i32 = 2;

/// The limit to set, given `MALLOC_ARENA_MAX`: none when it is set (glibc
/// has read it at start-up), else [`DEFAULT_ARENA_MAX`].
pub fn arena_max_to_set(environment: Option<&std::ffi::OsStr>) -> Option<i32> {
    match environment {
        Some(_) => None,
        None => Some(DEFAULT_ARENA_MAX),
    }
}

/// Limits glibc's arenas (see the crate docs) unless `MALLOC_ARENA_MAX` is
/// set. Call first in `main`, before any thread starts. Returns the limit
/// set, if one was; nothing is set off glibc.
pub fn limit_arenas() -> Option<i32> {
    let max = arena_max_to_set(std::env::var_os("MALLOC_ARENA_MAX").as_deref())?;
    set_arena_max(max).then_some(max)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn set_arena_max(max: i32) -> bool {
    // SAFETY: mallopt only sets a parameter of glibc's allocator, under
    // glibc's own lock; it touches no memory of ours. It returns 1 on
    // success.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, max) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_arena_max(_max: i32) -> bool {
    false
}

/// Gives the whole free pages of every glibc arena back to the system
/// (`malloc_trim(0)`); true when some memory was given back. It takes the
/// arenas' locks while it walks their free chunks (well under a millisecond
/// for a relay's heap): call it from a blocking thread, now and then.
pub fn release_free_memory() -> bool {
    trim()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() -> bool {
    // SAFETY: malloc_trim only hands glibc's own free pages back to the
    // kernel (madvise), under the arenas' locks; memory in use is not
    // touched. It returns 1 when memory was released.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    false
}

/// What glibc's allocator holds, over all its arenas (`mallinfo2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapUsage {
    /// Bytes allocated and not freed, from the arenas and from mmap: what
    /// the program holds, and what a leak raises. Unlike the resident size
    /// it does not count free memory the allocator keeps (fragmentation,
    /// pages not given back yet), except the freed chunks each thread's
    /// cache (tcache) holds for reuse, which glibc counts as in use: up to
    /// 7 chunks of each size up to 1 KiB a thread
    /// (`GLIBC_TUNABLES=glibc.malloc.tcache_count=0` turns the cache off).
    pub in_use_bytes: u64,
    /// Bytes free in the arenas (kept by the allocator for reuse; partly
    /// resident).
    pub free_bytes: u64,
}

/// What glibc's allocator holds now; `None` off glibc. It takes each
/// arena's lock while it counts the free chunks (microseconds for a
/// relay's heap): fine for a metrics scrape, not for a hot path.
pub fn heap_usage() -> Option<HeapUsage> {
    usage()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn usage() -> Option<HeapUsage> {
    // SAFETY: mallinfo2 only reads glibc's allocator statistics under the
    // arenas' locks and returns them by value.
    let info = unsafe { libc::mallinfo2() };
    Some(HeapUsage {
        in_use_bytes: (info.uordblks as u64).saturating_add(info.hblkhd as u64),
        free_bytes: info.fordblks as u64,
    })
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn usage() -> Option<HeapUsage> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests that measure the heap run one at a time (`cargo test` runs
    /// a binary's tests on several threads; nextest, one a process).
    static HEAP: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn the_environment_wins_over_the_default() {
        assert_eq!(arena_max_to_set(None), Some(DEFAULT_ARENA_MAX));
        assert_eq!(arena_max_to_set(Some("8".as_ref())), None);
        assert_eq!(arena_max_to_set(Some("".as_ref())), None);
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn the_heap_in_use_follows_what_is_allocated_and_freed() {
        let _alone = HEAP.lock().unwrap_or_else(|e| e.into_inner());
        let before = heap_usage().unwrap().in_use_bytes;
        // Small blocks (from the arenas) and one large one (mmap).
        let small: Vec<Vec<u8>> = (0..4_096).map(|n| vec![n as u8; 1024]).collect();
        let large = vec![1u8; 8 << 20];
        let during = heap_usage().unwrap().in_use_bytes;
        assert!(
            during >= before + (4 << 20) + (8 << 20),
            "{before} bytes in use before, {during} with 12 MiB more allocated"
        );
        drop((small, large));
        let after = heap_usage().unwrap().in_use_bytes;
        assert!(
            after + (11 << 20) < during,
            "{during} bytes in use with 12 MiB allocated, {after} after freeing them"
        );
    }

    /// What a burst leaves behind: many small blocks freed under one still
    /// in use, which glibc keeps resident until it is told to give them back.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn free_memory_under_a_block_in_use_is_given_back() {
        let _alone = HEAP.lock().unwrap_or_else(|e| e.into_inner());
        fn rss_anon_kib() -> u64 {
            std::fs::read_to_string("/proc/self/status")
                .unwrap_or_default()
                .lines()
                .find_map(|line| line.strip_prefix("RssAnon:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        }
        // Blocks under the mmap threshold (128 KiB): from the heap. 64 MiB.
        let burst: Vec<Vec<u8>> = (0..16_384).map(|n| vec![n as u8; 4096]).collect();
        let kept = vec![1u8; 4096];
        drop(burst);
        let before = rss_anon_kib();
        assert!(release_free_memory(), "nothing was given back");
        let after = rss_anon_kib();
        assert!(
            after + 32 * 1024 < before,
            "RssAnon {before} KiB before, {after} KiB after: the burst's 64 MiB stayed"
        );
        drop(kept);
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_limit() {
        assert!(set_arena_max(DEFAULT_ARENA_MAX));
    }
}
