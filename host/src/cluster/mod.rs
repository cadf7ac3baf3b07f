//! The relay cluster: routing each message of a cluster flow to the
//! business process it is addressed to, and taking the processes' upstream
//! sends to Kafka.
//!
//! Owns: naming the process of a message ([`router`]), delivering to it
//! with retries until a time to live ([`delivery`]), and upstream sends
//! ([`upstream`]). The TCP side of processes is the [`crate::gateway`].

pub mod delivery;
pub mod mesh;
pub mod router;
pub mod upstream;

pub use delivery::{ClusterDelivery, DeliveryEnd, DeliveryPolicy};
pub use router::{PROCESS_ID_HEADER, ProcessRouter, RouteFailure};
pub use upstream::FlowUpstream;
