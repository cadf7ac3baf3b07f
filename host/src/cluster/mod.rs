//! The relay cluster: routing each message of a cluster flow to the
//! business process it is addressed to, and taking the processes' upstream
//! sends to Kafka.
//!
//! Owns: naming the process of a message ([`router`]), delivering to it
//! with retries until a time to live ([`delivery`]), upstream sends
//! ([`upstream`]), heartbeats and liveness ([`membership`]), the shared
//! route table ([`routes`], stored compact and sharded by `route_map`),
//! the links between nodes (`mesh`), and where processes connect
//! ([`placement`], [`rebalance`]). The TCP side of processes is the
//! [`crate::gateway`].

pub mod delivery;
pub mod delivery_lines;
pub mod membership;
pub mod mesh;
pub mod placement;
pub mod rebalance;
mod route_map;
pub mod router;
pub mod routes;
pub mod runtime;
pub mod upstream;

pub use delivery::{ClusterDelivery, ClusterTarget, DeliveryPolicy};
pub use router::{PROCESS_ID_HEADER, ProcessRouter, RouteFailure};
pub use runtime::{Advertised, ClusterFlow, ClusterListeners, ClusterRuntime};
pub use upstream::FlowUpstream;

/// Milliseconds since the Unix epoch, for the records nodes exchange.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
