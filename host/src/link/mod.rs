//! A Kafka link: the connection a set of flows uses right now, and the
//! record of its switches.
//!
//! Owns: the current [`LinkGeneration`] (connection info and producer),
//! swapped atomically so that data-returns always go to the current cluster,
//! the switch history and the status shown at `/links`. Following the config
//! center and draining the old cluster is [`switch`]'s job; running a flow's
//! consumer on a given cluster is [`runner`]'s.

pub mod runner;
pub mod switch;

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use serde::Serialize;

use crate::kafka::{LinkInfo, RelayProducer};

/// One connection of a link: where to, and the producer for it.
#[derive(Debug)]
pub struct LinkGeneration {
    /// Connection info.
    pub info: LinkInfo,
    /// Producer on that cluster.
    pub producer: RelayProducer,
    /// When this connection became current.
    pub since: SystemTime,
    /// Where the info came from: `config` or `center`.
    pub source: &'static str,
}

/// One switch from a cluster to another.
#[derive(Clone, Debug, Serialize)]
pub struct SwitchRecord {
    /// When the switch started, ms since the Unix epoch.
    pub at_ms: u64,
    /// The old connection (secrets redacted).
    pub from: LinkInfo,
    /// The new connection (secrets redacted).
    pub to: LinkInfo,
    /// From the start of the switch until the old cluster was drained and closed.
    pub duration_ms: u64,
    /// Records consumed from the old cluster after the switch.
    pub drained: u64,
    /// Records left on the old cluster (below its high watermarks at the
    /// switch) when draining stopped; `None` when they could not be counted
    /// (the old cluster did not answer).
    pub left_behind: Option<u64>,
    /// True when draining stopped at its timeout.
    pub drain_timed_out: bool,
}

/// What `/links` says about a link besides its connection.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LinkStatus {
    /// The last problem with a new value (bad value, cluster not answering,
    /// key deleted), kept until the next successful switch.
    pub last_error: Option<String>,
    /// Whether the config center could be read the last time.
    pub center_reachable: Option<bool>,
    /// A switch is in progress (the old cluster is being drained).
    pub switching: bool,
}

/// A Kafka link shared by the flows that use it.
#[derive(Debug)]
pub struct KafkaLink {
    id: String,
    current: ArcSwap<LinkGeneration>,
    history: Mutex<Vec<SwitchRecord>>,
    status: Mutex<LinkStatus>,
    /// Switches so far: watched by whoever reads on the current cluster.
    switches: tokio::sync::watch::Sender<u64>,
}

/// How many switches `/links` keeps.
const HISTORY_LIMIT: usize = 50;

impl KafkaLink {
    /// A link connected to `info`.
    pub fn new(id: &str, info: LinkInfo, source: &'static str) -> anyhow::Result<Arc<KafkaLink>> {
        let producer = RelayProducer::new(&info)?;
        Ok(Arc::new(KafkaLink {
            id: id.to_string(),
            current: ArcSwap::from_pointee(LinkGeneration {
                info,
                producer,
                since: SystemTime::now(),
                source,
            }),
            history: Mutex::new(Vec::new()),
            status: Mutex::new(LinkStatus::default()),
            switches: tokio::sync::watch::channel(0).0,
        }))
    }

    /// The link's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The current connection.
    pub fn current(&self) -> Arc<LinkGeneration> {
        self.current.load_full()
    }

    /// The producer of the current connection (data-returns always go here).
    pub fn producer(&self) -> RelayProducer {
        self.current.load().producer.clone()
    }

    /// Makes `generation` current and returns the previous one.
    pub fn swap(&self, generation: LinkGeneration) -> Arc<LinkGeneration> {
        let old = self.current.swap(Arc::new(generation));
        self.switches.send_modify(|switches| *switches += 1);
        old
    }

    /// Changes at every switch (after the new connection is current).
    pub fn switches(&self) -> tokio::sync::watch::Receiver<u64> {
        self.switches.subscribe()
    }

    /// Adds a finished switch to the history.
    pub fn record_switch(&self, record: SwitchRecord) {
        if let Ok(mut history) = self.history.lock() {
            history.push(record);
            let excess = history.len().saturating_sub(HISTORY_LIMIT);
            history.drain(..excess);
        }
    }

    /// Updates the status.
    pub fn update_status(&self, update: impl FnOnce(&mut LinkStatus)) {
        if let Ok(mut status) = self.status.lock() {
            update(&mut status);
        }
    }

    /// The link as `/links` shows it.
    pub fn snapshot(&self) -> serde_json::Value {
        let current = self.current();
        let since_ms = current
            .since
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        serde_json::json!({
            "id": self.id,
            "current": current.info.redacted(),
            "source": current.source,
            "since_ms": since_ms,
            "status": self.status.lock().map(|s| s.clone()).unwrap_or_default(),
            "switches": self.history.lock().map(|h| h.clone()).unwrap_or_default(),
        })
    }
}
