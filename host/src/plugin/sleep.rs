//! How long a guest may sleep: at most about the call deadline per sleep.
//!
//! The epoch deadline interrupts WebAssembly code, not a host call: a
//! guest blocked in `wasi:io/poll` on a clock (`std::thread::sleep`, a
//! `poll` with a timeout) would hold its executor thread for as long as it
//! asked, past any deadline, and enough of them would stall every plugin of
//! the node. So the guest's `wasi:clocks/monotonic-clock` subscriptions are
//! shadowed with ones that wait at most [`PluginLimits::call_deadline`]
//! (and three epoch ticks) each: a sleeping guest wakes just after the
//! deadline, its next instructions hit it, and the call ends as a timeout
//! like any other.
//!
//! [`PluginLimits::call_deadline`]: super::PluginLimits::call_deadline

use std::time::Duration;

use wasmtime::StoreContextMut;
use wasmtime::component::{Linker, Resource};
use wasmtime_wasi::p2::{DynPollable, Pollable, subscribe};

use super::state::HostState;

/// The monotonic clock interface of the WASI version linked (see
/// `wasmtime_wasi::p2::add_to_linker_sync`); components importing any
/// 0.2.x version are given it.
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.12";

/// A sleep of the guest: ready at its end.
struct CappedSleep(tokio::time::Instant);

#[wasmtime_wasi::async_trait]
impl Pollable for CappedSleep {
    async fn ready(&mut self) {
        tokio::time::sleep_until(self.0).await;
    }
}

/// Replaces the monotonic clock's `subscribe-duration` and
/// `subscribe-instant` in `linker` with ones that wait at most `longest`.
pub(crate) fn cap_guest_sleeps(
    linker: &mut Linker<HostState>,
    longest: Duration,
) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let mut clock = linker.instance(MONOTONIC_CLOCK)?;
    clock.func_wrap(
        "subscribe-duration",
        move |mut store: StoreContextMut<'_, HostState>, (nanos,): (u64,)| {
            let wait = Duration::from_nanos(nanos).min(longest);
            Ok((sleep(&mut store.data_mut().table, wait)?,))
        },
    )?;
    clock.func_wrap(
        "subscribe-instant",
        move |mut store: StoreContextMut<'_, HostState>, (when,): (u64,)| {
            let state = store.data_mut();
            let wait =
                Duration::from_nanos(when.saturating_sub(state.clock.now_nanos())).min(longest);
            Ok((sleep(&mut state.table, wait)?,))
        },
    )?;
    linker.allow_shadowing(false);
    Ok(())
}

fn sleep(
    table: &mut wasmtime::component::ResourceTable,
    wait: Duration,
) -> wasmtime::Result<Resource<DynPollable>> {
    let until = tokio::time::Instant::now() + wait;
    let sleep = table.push(CappedSleep(until))?;
    subscribe(table, sleep)
}
