//! The host state of one plugin instance (the `T` of `Store<T>`) and the
//! implementation of the `host` interface plugins import: log, their own
//! config values, time.
//!
//! It also owns the sandbox: the WASI context grants nothing (no preopened
//! directories, no environment, no sockets), guest stdout and stderr go to
//! the relay's log, and the memory cap is enforced by [`MemoryCap`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{Host, LogLevel};
use super::error::VersionLabel;

/// A plugin's own config values (`key=value` entries set by the flow that uses it).
pub type PluginConfig = BTreeMap<String, String>;

/// What every instance of one plugin version shares: who it is and its config.
#[derive(Debug)]
pub(crate) struct InstanceIdentity {
    pub(crate) label: VersionLabel,
    pub(crate) config: Arc<PluginConfig>,
}

/// The data of one instance's `Store`.
pub(crate) struct HostState {
    identity: Arc<InstanceIdentity>,
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) memory: MemoryCap,
    pub(crate) stderr: GuestOutput,
}

impl HostState {
    pub(crate) fn new(identity: Arc<InstanceIdentity>, memory_cap: u64) -> Self {
        let stdout = GuestOutput::new(identity.label.clone(), "stdout");
        let stderr = GuestOutput::new(identity.label.clone(), "stderr");
        // The builder grants nothing by default; say so explicitly for the
        // parts that matter, so a wasmtime default changing cannot widen it.
        let wasi = WasiCtx::builder()
            .stdout(stdout)
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        HostState {
            identity,
            wasi,
            table: ResourceTable::new(),
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
    stream: &'static str,
    pending_line: Vec<u8>,
    tail: Vec<u8>,
}

impl GuestOutput {
    fn new(label: VersionLabel, stream: &'static str) -> Self {
        GuestOutput {
            inner: Arc::new(Mutex::new(OutputBuffer {
                label,
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
            let text = String::from_utf8_lossy(&line[..line.len() - 1]);
            tracing::debug!(plugin = %buffer.label, stream = buffer.stream, "{text}");
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
