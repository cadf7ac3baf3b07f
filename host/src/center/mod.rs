//! The config center: where the relay reads Kafka connection info
//! (`kafka.<link-id>` → a JSON object of librdkafka properties) and watches
//! it change.
//!
//! Owns: the backends ([`dir`], [`etcd`]) and what they publish, a
//! [`CenterState`] on a `tokio::sync::watch` channel: the latest values and
//! whether the center is reachable. A watch channel keeps only the newest
//! state, so flips in quick succession end on the last value. Every backend
//! runs as one task behind a [`ConfigCenter`]. What a new value means for a
//! Kafka link is the link manager's business, not this module's.

pub mod dir;
pub mod etcd;

use std::collections::BTreeMap;
use std::time::SystemTime;

use tokio::sync::watch;

/// The key prefix of Kafka connection info: `kafka.<link-id>`.
pub const KAFKA_KEY_PREFIX: &str = "kafka.";

/// Whether the center answered the last time it was asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reachability {
    /// The values are current.
    Reachable,
    /// The center could not be read; the values are the last good ones.
    Unreachable {
        /// Since when.
        since: SystemTime,
        /// Why (the last error).
        error: String,
    },
}

/// What the center holds, as last read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CenterState {
    /// Every key and its value (text).
    pub values: BTreeMap<String, String>,
    /// Whether `values` is current.
    pub reachability: Reachability,
    /// Counts reads that changed something (for logs and `/links`).
    pub generation: u64,
}

impl CenterState {
    /// The value of `kafka.<link_id>`, if the center has one.
    pub fn kafka_link(&self, link_id: &str) -> Option<&str> {
        self.values
            .get(&format!("{KAFKA_KEY_PREFIX}{link_id}"))
            .map(String::as_str)
    }

    /// Folds one complete read of the center (`Ok`: every key and value;
    /// `Err`: why it could not be read) into the state; true when something
    /// changed that watchers must see. A failed read keeps the last good
    /// values and marks them unreachable; `center` names the center in logs.
    pub fn fold_read(
        &mut self,
        read: Result<BTreeMap<String, String>, String>,
        center: &str,
    ) -> bool {
        match read {
            Ok(values) => {
                let recovered = self.reachability != Reachability::Reachable;
                if recovered {
                    tracing::info!(%center, "config center readable again");
                }
                if values == self.values && !recovered {
                    return false;
                }
                self.values = values;
                self.reachability = Reachability::Reachable;
                self.generation += 1;
                true
            }
            Err(error) => {
                if let Reachability::Unreachable { error: last, .. } = &mut self.reachability {
                    // Still down: keep `since`, note the latest cause quietly.
                    *last = error;
                    return false;
                }
                tracing::warn!(%center, %error, "config center unreachable; keeping the last good values");
                self.reachability = Reachability::Unreachable {
                    since: SystemTime::now(),
                    error,
                };
                self.generation += 1;
                true
            }
        }
    }
}

/// A running config center of any backend: the state it publishes. Its
/// task (reading and watching the backend) runs on the task tracker it was
/// started on, until the token it was given is cancelled.
#[derive(Debug)]
pub struct ConfigCenter {
    state: watch::Receiver<CenterState>,
    description: String,
}

impl ConfigCenter {
    pub(crate) fn new(state: watch::Receiver<CenterState>, description: String) -> ConfigCenter {
        ConfigCenter { state, description }
    }

    /// The latest state; `changed()` on it waits for the next one.
    pub fn subscribe(&self) -> watch::Receiver<CenterState> {
        self.state.clone()
    }

    /// Where the center is (`dir /etc/center`, `etcd http://...`), for logs
    /// and error messages.
    pub fn description(&self) -> &str {
        &self.description
    }
}
