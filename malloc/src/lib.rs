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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_wins_over_the_default() {
        assert_eq!(arena_max_to_set(None), Some(DEFAULT_ARENA_MAX));
        assert_eq!(arena_max_to_set(Some("8".as_ref())), None);
        assert_eq!(arena_max_to_set(Some("".as_ref())), None);
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_limit() {
        assert!(set_arena_max(DEFAULT_ARENA_MAX));
    }
}
