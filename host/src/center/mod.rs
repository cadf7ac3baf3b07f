//! The config center: where the relay reads Kafka connection info
//! (`kafka.<link-id>` → a JSON object of librdkafka properties) and watches
//! it change.
//!
//! Owns: the backends ([`dir`] today; etcd next) and what they publish, a
//! [`CenterState`] on a `tokio::sync::watch` channel: the latest values and
//! whether the center is reachable. A watch channel keeps only the newest
//! state, so flips in quick succession end on the last value. What a new
//! value means for a Kafka link is the link manager's business, not this
//! module's.

pub mod dir;

use std::collections::BTreeMap;
use std::time::SystemTime;

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
}
