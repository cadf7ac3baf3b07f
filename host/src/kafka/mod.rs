//! The Kafka layer: clients built from a link's connection info, a consumer
//! that hands each partition's messages to an ordered worker and commits
//! only finished work, a producer with back-pressure, and topic creation.
//!
//! - [`link`]: connection info and librdkafka client configs.
//! - [`center_policy`]: what a config-center value may set.
//! - [`record`]: the owned records that cross this layer.
//! - [`offsets`]: which offsets may be committed.
//! - [`consumer`]: the partitioned consumer ([`PartitionedConsumer`]).
//! - [`group_rejoin`]: when a consumer rejoins its group for a lost peer.
//! - [`lane`]: one partition's worker and the flow's [`DeliveryOrder`].
//! - [`producer`]: the producer ([`RelayProducer`]).
//! - [`admin`]: creating the topics the relay owns.
//! - [`probe`]: whether a cluster answers, and librdkafka's reason if not.

pub mod admin;
pub mod center_policy;
pub mod consumer;
pub mod group_rejoin;
pub mod lane;
pub mod link;
pub mod offsets;
pub mod probe;
pub mod producer;
pub mod record;
pub mod tail;

pub use center_policy::CenterPolicy;
pub use consumer::{
    ConsumerOptions, MessageHandler, Outcome as HandleOutcome, PartitionedConsumer,
};
pub use lane::DeliveryOrder;
pub use link::LinkInfo;
pub use producer::RelayProducer;
pub use record::{InputRecord, OutputRecord, RecordView};
