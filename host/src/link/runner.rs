//! Runs one flow's consumer on whichever cluster its link points at, and
//! replaces it when the link switches (the old consumer is handed back to be
//! drained).

use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::kafka::consumer::ConsumerReport;
use crate::kafka::{ConsumerOptions, LinkInfo, MessageHandler, PartitionedConsumer};

/// A consumer and the token that stops it.
#[derive(Debug)]
pub struct RunningConsumer {
    /// The consumer.
    pub consumer: PartitionedConsumer,
    /// Cancelling it stops this consumer only (drain, commit, close).
    pub stop: CancellationToken,
}

impl RunningConsumer {
    /// Stops the consumer and waits until it has drained and committed.
    pub async fn stop_and_join(self) -> ConsumerReport {
        self.stop.cancel();
        self.consumer.join().await
    }
}

/// One flow's consumer, restartable on another cluster.
pub struct FlowRunner {
    /// The flow's name.
    pub name: String,
    group: String,
    topic: String,
    handler: Arc<dyn MessageHandler>,
    options: ConsumerOptions,
    shutdown: CancellationToken,
    current: Mutex<Option<RunningConsumer>>,
}

impl std::fmt::Debug for FlowRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowRunner")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl FlowRunner {
    /// A runner for flow `name` consuming `topic` in `group`; its consumers
    /// stop when `shutdown` is cancelled.
    pub fn new(
        name: &str,
        group: &str,
        topic: &str,
        handler: Arc<dyn MessageHandler>,
        options: ConsumerOptions,
        shutdown: CancellationToken,
    ) -> Arc<FlowRunner> {
        Arc::new(FlowRunner {
            name: name.to_string(),
            group: group.to_string(),
            topic: topic.to_string(),
            handler,
            options,
            shutdown,
            current: Mutex::new(None),
        })
    }

    /// The input topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// Starts consuming on `info` and returns the consumer it replaces, if
    /// any (still running: the caller drains and stops it).
    pub fn start_on(&self, info: &LinkInfo) -> anyhow::Result<Option<RunningConsumer>> {
        let stop = self.shutdown.child_token();
        let consumer = PartitionedConsumer::start(
            info,
            &self.group,
            &self.topic,
            self.handler.clone(),
            self.options.clone(),
            stop.clone(),
        )?;
        let new = RunningConsumer { consumer, stop };
        let mut current = self
            .current
            .lock()
            .map_err(|_| anyhow::anyhow!("flow `{}`: runner state poisoned", self.name))?;
        Ok(current.replace(new))
    }

    /// Makes `consumer` current again (a switch rolled back) and returns
    /// the one it replaces, for the caller to stop.
    pub fn put_back(&self, consumer: RunningConsumer) -> Option<RunningConsumer> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(consumer)
    }

    /// Takes the current consumer (at shutdown).
    pub fn take(&self) -> Option<RunningConsumer> {
        self.current.lock().ok().and_then(|mut c| c.take())
    }
}
