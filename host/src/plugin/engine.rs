//! The one wasmtime engine of a relay process and the linker every plugin is
//! linked with.
//!
//! Owns: engine configuration (component model, epoch interruption, pooling
//! allocator with an on-demand fallback), the epoch ticker thread that makes
//! call deadlines work (it ticks only while a plugin version is loaded: an
//! idle relay without plugins does not wake every tick), the limits every
//! instance runs under, and the linker
//! (the `host` interface plus WASI p2 with a context that grants nothing).
//! A leaf of the plugin module: it knows nothing of versions. Loading a
//! plugin version is in [`super::version`] (which adds
//! `PluginRuntime::load_file`); swapping versions is in [`super::registry`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::bindings;
use super::state::HostState;

/// How often the epoch ticker advances the engine's epoch. Deadlines are
/// rounded up to whole ticks, so this is also the precision of a deadline.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);

/// The limits every plugin instance runs under.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PluginLimits {
    /// Longest a single call (one message, or one batch) may run before it is
    /// interrupted and reported as a timeout.
    #[serde(with = "humantime_millis")]
    pub call_deadline: Duration,
    /// Largest linear memory one instance may grow to, in bytes.
    pub memory_cap_bytes: u64,
    /// Most instances alive at once across all plugins (bounds the pooling
    /// allocator's reservation).
    pub max_instances: u32,
    /// Most idle instances kept per plugin version for reuse.
    pub max_idle_instances: usize,
}

impl Default for PluginLimits {
    fn default() -> Self {
        PluginLimits {
            call_deadline: Duration::from_millis(100),
            memory_cap_bytes: 64 * 1024 * 1024,
            max_instances: 256,
            max_idle_instances: 16,
        }
    }
}

/// Serialises a `Duration` as whole milliseconds (`call_deadline = 100`).
mod humantime_millis {
    use std::time::Duration;

    pub(super) fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        let millis = <u64 as serde::Deserialize>::deserialize(d)?;
        Ok(Duration::from_millis(millis))
    }
}

/// The plugin runtime: one engine, one linker, the limits. Cheap to clone.
#[derive(Clone)]
pub struct PluginRuntime {
    pub(crate) inner: Arc<RuntimeInner>,
}

pub(crate) struct RuntimeInner {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<HostState>,
    pub(crate) limits: PluginLimits,
    pub(crate) pooling: bool,
    pub(crate) ticker: Arc<EpochTicker>,
}

/// Whether the epoch ticker must tick: it does while anything holds it (a
/// loaded plugin version, whose calls have deadlines), and sleeps
/// otherwise.
#[derive(Debug, Default)]
pub(crate) struct EpochTicker {
    holds: AtomicUsize,
    thread: OnceLock<Thread>,
    /// Ticks so far.
    ticks: AtomicU64,
}

impl EpochTicker {
    /// Keeps the ticker ticking until the returned hold is dropped. Taken
    /// before a version's first instance runs, so every call has ticks.
    pub(crate) fn hold(self: &Arc<Self>) -> TickerHold {
        if self.holds.fetch_add(1, Ordering::SeqCst) == 0
            && let Some(thread) = self.thread.get()
        {
            thread.unpark();
        }
        TickerHold {
            ticker: self.clone(),
        }
    }

    /// How many times the epoch has advanced.
    #[cfg(test)]
    pub(crate) fn ticks(&self) -> u64 {
        self.ticks.load(Ordering::Relaxed)
    }

    /// Whether anything holds the ticker now.
    pub(crate) fn held(&self) -> bool {
        self.holds.load(Ordering::SeqCst) > 0
    }
}

/// Keeps the epoch ticker ticking while alive (see [`EpochTicker::hold`]).
#[derive(Debug)]
pub(crate) struct TickerHold {
    ticker: Arc<EpochTicker>,
}

impl Drop for TickerHold {
    fn drop(&mut self) {
        self.ticker.holds.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for PluginRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginRuntime")
            .field("limits", &self.inner.limits)
            .field("pooling", &self.inner.pooling)
            .finish()
    }
}

impl PluginRuntime {
    /// Builds the engine (pooling allocator when the machine allows it, else
    /// on-demand allocation), starts the epoch ticker and fills the linker.
    pub fn new(limits: PluginLimits) -> anyhow::Result<Self> {
        let (engine, pooling) = match Engine::new(&engine_config(&limits, true)) {
            Ok(engine) => (engine, true),
            Err(error) => {
                tracing::warn!(
                    error = %format!("{error:#}"),
                    "pooling allocator unavailable (not enough virtual address space?); using on-demand allocation"
                );
                let engine = Engine::new(&engine_config(&limits, false))
                    .map_err(|e| anyhow::anyhow!("creating the wasmtime engine: {e:#}"))?;
                (engine, false)
            }
        };
        let ticker = Arc::new(EpochTicker::default());
        spawn_epoch_ticker(&engine, &ticker);
        // A sleep ends a little after the deadline, so that the guest's
        // next instructions find it passed: the call ends as a timeout.
        let linker = build_linker(&engine, limits.call_deadline + 3 * EPOCH_TICK)
            .map_err(|e| anyhow::anyhow!("filling the plugin linker: {e:#}"))?;
        Ok(PluginRuntime {
            inner: Arc::new(RuntimeInner {
                engine,
                linker,
                limits,
                pooling,
                ticker,
            }),
        })
    }

    /// The limits every instance runs under.
    pub fn limits(&self) -> &PluginLimits {
        &self.inner.limits
    }

    /// Whether the pooling allocator is in use (false: on-demand fallback).
    pub fn uses_pooling_allocator(&self) -> bool {
        self.inner.pooling
    }
}

fn engine_config(limits: &PluginLimits, pooling: bool) -> Config {
    let mut config = Config::new();
    config.wasm_component_model(true);
    config.epoch_interruption(true);
    if pooling {
        let instances = limits.max_instances.max(1);
        let mut pool = PoolingAllocationConfig::default();
        // A Rust wasip2 component has a handful of core instances (the
        // program plus adapter shims) and usually one memory; leave room for
        // composed components.
        pool.total_component_instances(instances)
            .total_core_instances(instances.saturating_mul(8))
            .total_memories(instances.saturating_mul(2))
            .total_tables(instances.saturating_mul(4))
            .total_stacks(instances)
            .max_core_instances_per_component(64)
            .max_memories_per_component(16)
            .max_tables_per_component(32)
            .max_memories_per_module(2)
            .max_tables_per_module(4)
            .max_memory_size(usize::try_from(limits.memory_cap_bytes).unwrap_or(usize::MAX))
            .max_component_instance_size(1 << 20)
            .max_core_instance_size(1 << 20)
            .max_unused_warm_slots(instances / 4);
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    }
    config
}

/// Advances the epoch every [`EPOCH_TICK`] while `ticker` is held, and
/// sleeps while it is not, until the engine is dropped.
fn spawn_epoch_ticker(engine: &Engine, ticker: &Arc<EpochTicker>) {
    let weak = engine.weak();
    let gate = ticker.clone();
    let spawned = std::thread::Builder::new()
        .name("wasm-epoch-ticker".into())
        .spawn(move || {
            loop {
                if gate.held() {
                    std::thread::sleep(EPOCH_TICK);
                } else {
                    // Woken by the first hold; the timeout is for noticing
                    // that the engine was dropped meanwhile.
                    std::thread::park_timeout(Duration::from_secs(1));
                    if weak.upgrade().is_none() {
                        break;
                    }
                    continue;
                }
                match weak.upgrade() {
                    Some(engine) => {
                        engine.increment_epoch();
                        gate.ticks.fetch_add(1, Ordering::Relaxed);
                    }
                    None => break,
                }
            }
        });
    match spawned {
        Ok(handle) => {
            let _ = ticker.thread.set(handle.thread().clone());
        }
        // Without the ticker deadlines never fire; that must not go unnoticed.
        Err(error) => {
            tracing::error!(%error, "could not start the epoch ticker; plugin deadlines will not be enforced");
        }
    }
}

/// The linker: the `host` interface, and WASI p2 (synchronous bindings) whose
/// context grants nothing and whose sleeps last at most `longest_sleep`
/// ([`super::sleep`]). Anything else a component imports fails to link,
/// which is how a disallowed import is refused before a version is swapped in.
fn build_linker(engine: &Engine, longest_sleep: Duration) -> wasmtime::Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    super::sleep::cap_guest_sleeps(&mut linker, longest_sleep)?;
    bindings::processor::wasmrelay::plugin::host::add_to_linker::<HostState, HasSelf<HostState>>(
        &mut linker,
        |state| state,
    )?;
    Ok(linker)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sleeps until `ticker` has ticked `at_least` times more than
    /// `since`, or 5 s pass; the ticks then.
    fn ticks_after(ticker: &EpochTicker, since: u64, at_least: u64) -> u64 {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while ticker.ticks() < since + at_least && std::time::Instant::now() < deadline {
            std::thread::sleep(EPOCH_TICK);
        }
        ticker.ticks()
    }

    /// The ticker sleeps while no version holds it (an idle relay without
    /// plugins does not wake 200 times a second), ticks once one does, and
    /// stops again when the last hold goes.
    #[test]
    fn the_epoch_ticker_ticks_only_while_held() {
        let runtime = PluginRuntime::new(PluginLimits::default()).expect("a runtime");
        let ticker = runtime.inner.ticker.clone();
        std::thread::sleep(20 * EPOCH_TICK);
        assert_eq!(ticker.ticks(), 0, "ticked with nothing loaded");

        let hold = ticker.hold();
        let second = ticker.hold();
        let ticked = ticks_after(&ticker, 0, 5);
        assert!(ticked >= 5, "held, it ticked {ticked} times in 5 s");
        drop(hold);
        let ticked = ticks_after(&ticker, ticked, 3);
        assert!(ticked >= 8, "still held once, it stopped at {ticked}");

        drop(second);
        // At most the tick under way when the last hold went.
        std::thread::sleep(2 * EPOCH_TICK);
        let stopped = ticker.ticks();
        std::thread::sleep(20 * EPOCH_TICK);
        assert!(
            ticker.ticks() <= stopped + 1,
            "ticked on without a hold: {stopped} then {}",
            ticker.ticks()
        );

        // The runtime (and its engine) dropped, the sleeping ticker's thread
        // ends within its park timeout, and lets go of its ticker.
        drop(runtime);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&ticker) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(EPOCH_TICK);
        }
        assert_eq!(
            Arc::strong_count(&ticker),
            1,
            "the ticker's thread outlived its engine"
        );
    }
}
