//! Where a flow's service calls go: the seam between a flow and what it
//! delivers to.
//!
//! The flow owns the [`DeliveryTarget`] trait; the application beside the
//! relay ([`super::app::AppTarget`]) and the relay cluster (its
//! `ClusterTarget`) implement it. A flow without a target
//! is a transform. This module imports nothing from the targets, so the
//! dependency points one way: targets know flows, flows do not know targets.

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use super::dead_letter::Stage;
use crate::kafka::{InputRecord, OutputRecord};

/// Something a flow hands its processed service calls to.
///
/// `deliver` runs in the partition's order (the flow awaits it before the
/// next record of the partition): a target that answers at once returns
/// [`Delivery::Answered`]; one whose outcome arrives later (a business
/// process acknowledging over TCP) hands the message over in order and
/// returns [`Delivery::Pending`], which the flow awaits off the ordered
/// path before the input counts as finished. Such a target retries off the
/// ordered path too, so it must keep the flow's order through its retries
/// itself (the cluster's does with `cluster::delivery_lines`).
pub trait DeliveryTarget: Send + Sync + std::fmt::Debug {
    /// Delivers `call`, which the service-call chain made from `input`.
    /// Retries are the target's business; `abort` (shutdown, revoked
    /// partition) ends them.
    fn deliver<'a>(
        &'a self,
        input: &'a InputRecord,
        call: OutputRecord,
        abort: &'a CancellationToken,
    ) -> BoxFuture<'a, Delivery>;
}

/// What became of one delivery, as far as the ordered part can tell.
pub enum Delivery {
    /// Delivered; these records came back and go through the data-return
    /// chain to the output topic (possibly none).
    Answered(Vec<OutputRecord>),
    /// Handed over; the outcome arrives later.
    Pending(BoxFuture<'static, DeliveryEnd>),
    /// Cannot be delivered: the call is dead-lettered with this stage and
    /// reason.
    Failed {
        /// Where it failed.
        stage: Stage,
        /// Why.
        reason: String,
        /// The call as the target was given it, for the dead letter (the
        /// flow keeps no copy).
        call: OutputRecord,
    },
    /// The work was aborted: the input is consumed again later.
    Aborted,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Delivery::Answered(records) => f.debug_tuple("Answered").field(records).finish(),
            Delivery::Pending(_) => f.write_str("Pending"),
            Delivery::Failed {
                stage,
                reason,
                call,
            } => f
                .debug_struct("Failed")
                .field("stage", stage)
                .field("reason", reason)
                .field("call", call)
                .finish(),
            Delivery::Aborted => f.write_str("Aborted"),
        }
    }
}

/// How a pending delivery ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeliveryEnd {
    /// The receiver acknowledged it.
    Delivered,
    /// Every attempt failed until the time to live ran out (or it can never
    /// be delivered).
    GaveUp {
        /// Why: the last attempt's reason.
        reason: String,
        /// The call as the target was given it, for the dead letter (the
        /// flow keeps no copy).
        call: OutputRecord,
    },
    /// The work was aborted (shutdown, partition revoked): it will be
    /// consumed again.
    Aborted,
}
