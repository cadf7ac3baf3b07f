//! A chain of processor plugins applied in order (the service-call chain or
//! the data-return chain of a flow).
//!
//! Plugins are looked up by name at every call, so a hot-reloaded version
//! serves the next message; calls run on the plugin executor
//! ([`crate::plugin::executor`]), which merges the messages of records in
//! flight together into one call per plugin version.

use std::sync::Arc;
use std::time::Instant;

use prometheus_client::metrics::histogram::Histogram;

use super::retry::Attempt;
use crate::kafka::{InputRecord, OutputRecord};
use crate::plugin::{Header, Message, Outcome, PluginError, PluginRegistry};
use crate::telemetry::metrics::RelayMetrics;

/// Why a chain did not produce its output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainFailure {
    /// The plugin version that failed, `name@sha256`.
    pub plugin: String,
    /// What happened.
    pub reason: String,
}

/// Processor plugins applied in order.
#[derive(Clone)]
pub struct PluginChain {
    plugins: Vec<String>,
    /// The call-duration histogram of each plugin, in the same order.
    call_seconds: Vec<Histogram>,
    registry: Arc<PluginRegistry>,
}

impl std::fmt::Debug for PluginChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginChain")
            .field("plugins", &self.plugins)
            .finish()
    }
}

impl PluginChain {
    /// A chain of the named plugins (in order) from `registry`.
    pub fn new(
        plugins: Vec<String>,
        registry: Arc<PluginRegistry>,
        metrics: Arc<RelayMetrics>,
    ) -> Self {
        let call_seconds = plugins
            .iter()
            .map(|plugin| metrics.plugin_call_histogram(plugin))
            .collect();
        PluginChain {
            plugins,
            call_seconds,
            registry,
        }
    }

    /// True when the chain has no plugin (messages pass unchanged).
    pub fn is_empty(&self) -> bool {
        self.plugins.is_empty()
    }

    /// Runs `message` (derived from `input`) through every plugin.
    ///
    /// `Success` is the chain's output (possibly empty: filtered out).
    /// `GiveUp` is a dead-letter verdict or a plugin fault (trap, timeout,
    /// memory cap: retrying would fail the same way); `Retry` is a plugin's
    /// own `err` or a plugin not loaded. The failure names the plugin.
    pub async fn apply(
        &self,
        input: &InputRecord,
        message: OutputRecord,
    ) -> Attempt<Vec<OutputRecord>, ChainFailure> {
        let mut current = vec![message];
        for (name, call_seconds) in self.plugins.iter().zip(&self.call_seconds) {
            let version = match self.registry.current(name) {
                Ok(version) => version,
                Err(error) => return Attempt::Retry(ChainFailure::new(name, error.to_string())),
            };
            // The full sha256: a dead letter must say exactly which version
            // failed (made only then: this runs for every record).
            let label = || format!("{}@{}", version.name(), version.sha256());
            let batch: Vec<Message> = current
                .drain(..)
                .map(|m| to_plugin_message(input, m))
                .collect();
            let started = Instant::now();
            let answers = self.registry.process_batch(version.clone(), batch).await;
            call_seconds.observe(started.elapsed().as_secs_f64());
            let answers = match answers {
                Ok(answers) => answers,
                Err(error) => return classify(&label(), error),
            };
            for answer in answers {
                match answer {
                    Ok(Outcome::Emit(outputs)) => {
                        current.extend(outputs.into_iter().map(from_plugin_output))
                    }
                    Ok(Outcome::DeadLetter(reason)) => {
                        return Attempt::GiveUp(ChainFailure::new(&label(), reason));
                    }
                    Err(error) => return classify(&label(), error),
                }
            }
            if current.is_empty() {
                break;
            }
        }
        Attempt::Success(current)
    }
}

impl ChainFailure {
    fn new(plugin: &str, reason: impl Into<String>) -> Self {
        ChainFailure {
            plugin: plugin.to_string(),
            reason: reason.into(),
        }
    }
}

/// Retries what the error says may pass on a later call
/// ([`PluginError::is_retryable`]); gives up on the rest.
fn classify<T>(label: &str, error: PluginError) -> Attempt<T, ChainFailure> {
    let retryable = error.is_retryable();
    let failure = ChainFailure::new(label, error.to_string());
    if retryable {
        Attempt::Retry(failure)
    } else {
        Attempt::GiveUp(failure)
    }
}

pub(crate) fn to_plugin_message(input: &InputRecord, message: OutputRecord) -> Message {
    Message {
        key: message.key,
        value: message.value,
        headers: message
            .headers
            .into_iter()
            .map(|(name, value)| Header { name, value })
            .collect(),
        topic: input.topic.clone(),
        partition: input.partition,
        offset: input.offset,
        timestamp_ms: input.timestamp_ms,
    }
}

fn from_plugin_output(output: crate::plugin::OutputMessage) -> OutputRecord {
    OutputRecord {
        key: output.key,
        value: output.value,
        headers: output
            .headers
            .into_iter()
            .map(|h| (h.name, h.value))
            .collect(),
    }
}
