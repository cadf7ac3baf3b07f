//! The host state of one plugin instance (the `T` of `Store<T>`) and the
//! implementation of the `host` interface plugins import: log, their own
//! config values, time.
//!
//! It also owns the sandbox: the WASI context grants nothing (no preopened
//! directories, no environment, no sockets), guest stdout and stderr go to
//! the relay's log, and the memory cap is enforced by [`MemoryCap`]. What a
//! plugin logs (its `log` calls and its output lines) is rate-limited per
//! plugin version ([`LogLimiter`]) and each line cut to [`LOG_LINE_BYTES`]:
//! a plugin logging in a loop cannot flood the relay's log or slow it down.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{Host, LogLevel};
use super::error::VersionLabel;

/// A plugin's own config values (`key=value` entries set by the flow that uses it).
pub type PluginConfig = BTreeMap<String, String>;

/// What every instance of one plugin version shares: who it is, its config
/// and its log's rate limit.
#[derive(Debug)]
pub(crate) struct InstanceIdentity {
    pub(crate) label: VersionLabel,
    pub(crate) config: Arc<PluginConfig>,
    pub(crate) log_limit: Arc<LogLimiter>,
}

/// Log lines a plugin version may write a second, on average.
pub(crate) const LOG_LINES_PER_SECOND: u32 = 100;
/// Log lines a plugin version may write at once after a quiet time.
pub(crate) const LOG_BURST: u32 = 200;
/// The longest log line of a plugin kept, in bytes (the rest is cut).
pub(crate) const LOG_LINE_BYTES: usize = 4096;

/// A token bucket over the log lines of one plugin version: what it drops
/// it counts, and the next line let through says how many went.
#[derive(Debug)]
pub(crate) struct LogLimiter {
    bucket: Mutex<LogBucket>,
}

#[derive(Debug)]
struct LogBucket {
    tokens: f64,
    at: Instant,
    dropped: u64,
}

impl Default for LogLimiter {
    fn default() -> Self {
        LogLimiter {
            bucket: Mutex::new(LogBucket {
                tokens: f64::from(LOG_BURST),
                at: Instant::now(),
                dropped: 0,
            }),
        }
    }
}

impl LogLimiter {
    /// Whether a line may be written at `now`: `Some(n)` with the lines
    /// dropped since the last one written, `None` when this one is dropped.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let mut bucket = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let refill = now.saturating_duration_since(bucket.at).as_secs_f64()
            * f64::from(LOG_LINES_PER_SECOND);
        bucket.tokens = (bucket.tokens + refill).min(f64::from(LOG_BURST));
        bucket.at = now;
        if bucket.tokens < 1.0 {
            bucket.dropped += 1;
            return None;
        }
        bucket.tokens -= 1.0;
        Some(std::mem::take(&mut bucket.dropped))
    }
}

/// `line` cut to [`LOG_LINE_BYTES`], saying so.
fn cut(line: &str) -> std::borrow::Cow<'_, str> {
    crate::text::cut_to(line, LOG_LINE_BYTES)
}

/// Says that a plugin's log lines were dropped, when some were.
fn report_dropped(plugin: &VersionLabel, dropped: u64) {
    if dropped > 0 {
        tracing::warn!(%plugin, dropped, "dropped log lines of a plugin over its rate limit ({LOG_LINES_PER_SECOND} a second, bursts of {LOG_BURST})");
    }
}

/// The data of one instance's `Store`.
pub(crate) struct HostState {
    identity: Arc<InstanceIdentity>,
    wasi: WasiCtx,
    pub(crate) table: ResourceTable,
    /// The zero of the guest's monotonic clock (see [`GuestClock`]).
    pub(crate) clock: GuestClock,
    pub(crate) memory: MemoryCap,
    pub(crate) stderr: GuestOutput,
}

impl HostState {
    pub(crate) fn new(identity: Arc<InstanceIdentity>, memory_cap: u64) -> Self {
        let stdout = GuestOutput::new(&identity, "stdout");
        let stderr = GuestOutput::new(&identity, "stderr");
        let clock = GuestClock::default();
        // The builder grants nothing by default; say so explicitly for the
        // parts that matter, so a wasmtime default changing cannot widen it.
        let wasi = WasiCtx::builder()
            .stdout(stdout)
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .monotonic_clock(clock)
            .build();
        HostState {
            identity,
            wasi,
            table: ResourceTable::new(),
            clock,
            memory: MemoryCap::new(memory_cap),
            stderr,
        }
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl Host for HostState {
    fn log(&mut self, level: LogLevel, message: String) {
        let plugin = &self.identity.label;
        let Some(dropped) = self.identity.log_limit.admit(Instant::now()) else {
            return;
        };
        report_dropped(plugin, dropped);
        let message = cut(&message);
        match level {
            LogLevel::Trace => tracing::trace!(%plugin, "{message}"),
            LogLevel::Debug => tracing::debug!(%plugin, "{message}"),
            LogLevel::Info => tracing::info!(%plugin, "{message}"),
            LogLevel::Warn => tracing::warn!(%plugin, "{message}"),
            LogLevel::Error => tracing::error!(%plugin, "{message}"),
        }
    }

    fn config_get(&mut self, key: String) -> Option<String> {
        self.identity.config.get(&key).cloned()
    }

    fn config_entries(&mut self) -> Vec<(String, String)> {
        self.identity
            .config
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn now_ms(&mut self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}

/// The guest's monotonic clock: nanoseconds since the instance was made.
/// The host's own copy reads the same time as the guest's, so that a
/// guest's `subscribe-instant` can be turned into a duration (see
/// [`super::sleep`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct GuestClock {
    zero: Instant,
}

impl Default for GuestClock {
    fn default() -> Self {
        GuestClock {
            zero: Instant::now(),
        }
    }
}

impl GuestClock {
    /// Nanoseconds since the clock's zero.
    pub(crate) fn now_nanos(&self) -> u64 {
        u64::try_from(self.zero.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

impl wasmtime_wasi::HostMonotonicClock for GuestClock {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        self.now_nanos()
    }
}

/// Caps one instance's linear memory and remembers whether the cap was hit,
/// so that the trap it causes is reported as a memory-limit error, not as a
/// generic trap.
#[derive(Debug)]
pub(crate) struct MemoryCap {
    limit: usize,
    pub(crate) hit: bool,
    /// Linear memory the instance has, in bytes, summed over its memories
    /// (the initial size counts as growth from zero).
    pub(crate) total: usize,
}

impl MemoryCap {
    fn new(limit: u64) -> Self {
        MemoryCap {
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
            hit: false,
            total: 0,
        }
    }
}

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.limit {
            self.hit = true;
            // Trap right here rather than returning -1 to the guest: most
            // guests abort on allocation failure anyway, and a trap at the
            // grow keeps the cause obvious.
            wasmtime::bail!(
                "memory cap: growing linear memory to {desired} bytes exceeds the cap of {} bytes",
                self.limit
            );
        }
        self.total = self.total.saturating_add(desired.saturating_sub(current));
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(maximum.is_none_or(|max| desired <= max))
    }
}

/// How much of a guest's recent stderr is kept to explain a trap.
const STDERR_TAIL_BYTES: usize = 2048;

/// A guest's stdout or stderr: complete lines go to the relay's log (debug
/// level, tagged with the plugin), and the last bytes are kept so that a trap
/// can be explained with the panic message the guest printed just before.
#[derive(Clone)]
pub(crate) struct GuestOutput {
    inner: Arc<Mutex<OutputBuffer>>,
}

struct OutputBuffer {
    label: VersionLabel,
    log_limit: Arc<LogLimiter>,
    stream: &'static str,
    pending_line: Vec<u8>,
    tail: Vec<u8>,
}

impl GuestOutput {
    fn new(identity: &InstanceIdentity, stream: &'static str) -> Self {
        GuestOutput {
            inner: Arc::new(Mutex::new(OutputBuffer {
                label: identity.label.clone(),
                log_limit: identity.log_limit.clone(),
                stream,
                pending_line: Vec::new(),
                tail: Vec::new(),
            })),
        }
    }

    /// The last bytes written (lossy UTF-8, trimmed).
    pub(crate) fn tail(&self) -> String {
        self.inner
            .lock()
            .map(|b| String::from_utf8_lossy(&b.tail).trim().to_string())
            .unwrap_or_default()
    }

    fn write(&self, bytes: &[u8]) {
        let Ok(mut buffer) = self.inner.lock() else {
            return;
        };
        buffer.tail.extend_from_slice(bytes);
        if buffer.tail.len() > STDERR_TAIL_BYTES {
            let excess = buffer.tail.len() - STDERR_TAIL_BYTES;
            buffer.tail.drain(..excess);
        }
        buffer.pending_line.extend_from_slice(bytes);
        while let Some(newline) = buffer.pending_line.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.pending_line.drain(..=newline).collect();
            let Some(dropped) = buffer.log_limit.admit(Instant::now()) else {
                continue;
            };
            report_dropped(&buffer.label, dropped);
            let text = String::from_utf8_lossy(&line[..line.len() - 1]);
            tracing::debug!(plugin = %buffer.label, stream = buffer.stream, "{}", cut(&text));
        }
        if buffer.pending_line.len() > STDERR_TAIL_BYTES {
            // A guest writing without newlines must not grow this without bound.
            buffer.pending_line.clear();
        }
    }
}

impl IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestOutput {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        // Only the synchronous p2 bindings are linked; this path is unused.
        Box::new(tokio::io::sink())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for GuestOutput {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        GuestOutput::write(self, &bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(64 * 1024)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for GuestOutput {
    async fn ready(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_passes_then_lines_are_dropped_counted_and_reported_with_the_next_one() {
        let limit = LogLimiter::default();
        let t0 = Instant::now();
        for _ in 0..LOG_BURST {
            assert_eq!(limit.admit(t0), Some(0));
        }
        for _ in 0..1000 {
            assert_eq!(limit.admit(t0), None);
        }
        // A tenth of a second later: ten lines' worth, the first saying
        // how many went before it.
        let later = t0 + Duration::from_millis(100);
        assert_eq!(limit.admit(later), Some(1000));
        let admitted = (0..100).filter(|_| limit.admit(later).is_some()).count();
        assert_eq!(admitted, 9);
    }

    #[test]
    fn a_long_line_is_cut_at_a_character_boundary_saying_how_much_went() {
        let line = "é".repeat(LOG_LINE_BYTES);
        let cut = cut(&line);
        assert!(cut.len() < LOG_LINE_BYTES + 40, "{}", cut.len());
        assert!(cut.ends_with(&format!("… ({LOG_LINE_BYTES} bytes cut)")));
        assert_eq!(super::cut("short"), "short");
    }
}
