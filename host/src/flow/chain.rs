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

/// One item's result from [`PluginChain::apply_batch`]: `None` when the
/// batch did not settle it.
pub type BatchResult = Option<Attempt<Vec<OutputRecord>, ChainFailure>>;

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
            let (_, answers) = self.registry.process_batch(version.clone(), batch).await;
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

    /// Runs the message of each item (with the input it came from) through
    /// every plugin, all items together: one `process-batch` call per plugin
    /// for the lot, where [`PluginChain::apply`] makes one per message.
    ///
    /// Each item's result, in the order given: `Some(Success)` its output,
    /// `Some(GiveUp)` a dead-letter verdict or a fault of its own message
    /// (the answer says whose), `None` when it is not settled here: a
    /// retryable error, a plugin not loaded, or a call that failed as a
    /// whole (a trap, the deadline, the memory cap: it cannot say whose
    /// message caused it). Run a `None` item alone, with
    /// [`PluginChain::apply`] and its retries.
    ///
    /// Also each item's message as it was given, handed back by the first
    /// plugin's call (so a caller need not copy it first for a retry or a
    /// dead letter); `None` for an item whose message did not come back (the
    /// executor stopped before answering).
    pub async fn apply_batch(
        &self,
        items: Vec<(&InputRecord, OutputRecord)>,
    ) -> (Vec<BatchResult>, Vec<Option<OutputRecord>>) {
        // Per item: `None` while it goes on through the chain, `Some` once
        // settled (with what `apply_batch` returns for it).
        let mut settled: Vec<Option<BatchResult>> = (0..items.len()).map(|_| None).collect();
        let (inputs, mut current): (Vec<&InputRecord>, Vec<Vec<OutputRecord>>) = items
            .into_iter()
            .map(|(input, message)| (input, vec![message]))
            .unzip();
        // The messages given, once the first plugin's call hands them back.
        let mut given: Option<Vec<Option<OutputRecord>>> = None;
        // False when a plugin of the chain is not loaded: what is not settled
        // then retries on its own.
        let mut every_plugin_ran = true;
        for (name, call_seconds) in self.plugins.iter().zip(&self.call_seconds) {
            let Ok(version) = self.registry.current(name) else {
                every_plugin_ran = false;
                break;
            };
            let mut counts = Vec::with_capacity(current.len());
            let mut batch = Vec::new();
            for ((input, messages), result) in inputs.iter().zip(&mut current).zip(&settled) {
                let count = if result.is_some() { 0 } else { messages.len() };
                counts.push(count);
                batch.extend(messages.drain(..).map(|m| to_plugin_message(input, m)));
            }
            if batch.is_empty() {
                break;
            }
            let started = Instant::now();
            let (messages, answers) = self.registry.process_batch(version.clone(), batch).await;
            call_seconds.observe(started.elapsed().as_secs_f64());
            if given.is_none() {
                // The first call: one message per item, in the items' order.
                let mut messages = messages.into_iter().map(from_plugin_message);
                given = Some(current.iter().map(|_| messages.next()).collect());
            }
            let Ok(answers) = answers else {
                // Failed as a whole: whose message did it is not known.
                for result in settled.iter_mut().filter(|r| r.is_none()) {
                    *result = Some(None);
                }
                break;
            };
            let label = || format!("{}@{}", version.name(), version.sha256());
            let mut answers = answers.into_iter();
            for ((count, messages), result) in
                counts.into_iter().zip(&mut current).zip(&mut settled)
            {
                for answer in answers.by_ref().take(count) {
                    if result.is_some() {
                        continue;
                    }
                    match answer {
                        Ok(Outcome::Emit(outputs)) => {
                            messages.extend(outputs.into_iter().map(from_plugin_output));
                        }
                        Ok(Outcome::DeadLetter(reason)) => {
                            *result =
                                Some(Some(Attempt::GiveUp(ChainFailure::new(&label(), reason))));
                        }
                        Err(error) if error.is_retryable() => *result = Some(None),
                        Err(error) => {
                            *result = Some(Some(Attempt::GiveUp(ChainFailure::new(
                                &label(),
                                error.to_string(),
                            ))));
                        }
                    }
                }
                if result.is_some() {
                    messages.clear();
                }
            }
        }
        // No call made (the first plugin is not loaded): the messages
        // given are still where they were put.
        let given = given.unwrap_or_else(|| current.iter_mut().map(Vec::pop).collect());
        let results = settled
            .into_iter()
            .zip(current)
            .map(|(result, output)| match result {
                Some(result) => result,
                None if every_plugin_ran => Some(Attempt::Success(output)),
                None => None,
            })
            .collect();
        (results, given)
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
        topic: input.topic.to_string(),
        partition: input.partition,
        offset: input.offset,
        timestamp_ms: input.timestamp_ms,
    }
}

/// A message given to a plugin, as it was before the call (its place, which
/// the input keeps, left out).
fn from_plugin_message(message: Message) -> OutputRecord {
    OutputRecord {
        key: message.key,
        value: message.value,
        headers: message
            .headers
            .into_iter()
            .map(|h| (h.name, h.value))
            .collect(),
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
