//! Delivering a message to its business process wherever it is connected,
//! with retries until a time to live, then a verdict for the dead-letter
//! topic.
//!
//! The first attempt is handed over in the caller's order, waiting while
//! a local process has as many deliveries unanswered as it may: that is the
//! back-pressure on the partition. Waiting for the acknowledgement, and any
//! retry, happen in the returned future; the flow's order holds through
//! retries because each delivery has a place in its line
//! ([`super::delivery_lines`]): after a failure, a line's deliveries go one
//! at a time, in order, until it is settled.
//!
//! A process connected neither here nor, by the route table, to any live
//! node is looked up over the mesh before the attempt fails (the table may
//! have missed its route record): the peers are asked at once, and the
//! first that holds it gets the message (and the table learns the route).
//! That lookup is part of the attempt, so a first attempt that needs one
//! still hands the message over in the caller's order; it takes one mesh
//! round trip when a peer holds the process or every peer says no, and at
//! most the mesh's lookup timeout (1 s) when a peer does not answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt as _;
use futures::future::BoxFuture;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::{Backoff, MessageParts, Parcel, WireMessage, v1};

use super::delivery_lines::{DeliveryLines, Place};
use super::mesh::{ForwardOutcome, Forwarded, LookupFound};
use super::router::ProcessRouter;
use super::routes::RouteTable;
use crate::flow::dead_letter::Stage;
use crate::flow::{Delivery, DeliveryEnd, DeliveryTarget};
use crate::gateway::{DeliverError, DeliveryResult, Gateway, NoRoom};
use crate::kafka::{DeliveryOrder, InputRecord, OutputRecord};

/// Retry pacing of cluster deliveries.
#[derive(Clone, Debug)]
pub struct DeliveryPolicy {
    /// How long a message is retried before it is dead-lettered.
    pub ttl: Duration,
    /// First wait after a failed attempt.
    pub initial_backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
    /// Counts each retry (the flow's `wasmrelay_retries_total`).
    pub retried: prometheus_client::metrics::counter::Counter,
    /// Counts the lines recovering from a failure (see [`DeliveryLines`]).
    pub lines_recovering: prometheus_client::metrics::gauge::Gauge,
    /// The flow's ordering, kept through retries (see [`DeliveryLines`]).
    pub order: DeliveryOrder,
}

/// Hands a message to a process on another node (the mesh).
pub trait Forwarder: Send + Sync + std::fmt::Debug + 'static {
    /// Queues the parcel (a message for its process) on the link to `node`
    /// (in call order) when as many forwards to the process as `node`
    /// holds are not all unanswered, and returns where the process's answer
    /// there arrives; `None` when they are (wait with
    /// [`Forwarder::forward`]); `Err` when there is no usable link to
    /// `node` now.
    fn try_forward(
        &self,
        node: &str,
        parcel: &Arc<Parcel>,
    ) -> Option<Result<Forwarded, ForwardError>>;

    /// [`Forwarder::try_forward`], waiting while the process's forwards
    /// are all unanswered.
    fn forward<'a>(
        &'a self,
        node: &'a str,
        parcel: Arc<Parcel>,
    ) -> BoxFuture<'a, Result<Forwarded, ForwardError>>;

    /// Asks the other nodes whether `process_id` is connected to one of
    /// them; resolves with the first that says so, or `None` (all said no,
    /// or none answered in time).
    fn lookup(&self, process_id: &str) -> BoxFuture<'static, Option<LookupFound>>;
}

/// Why a forward to another node did not end in an acknowledgement.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// It could not be queued: no usable link to the node now.
    #[error("{0}")]
    NotQueued(String),
    /// It is larger than a mesh frame may be: it can never be forwarded.
    #[error("{0}")]
    TooLarge(String),
    /// The process is not connected to that node (any more).
    #[error("not connected to node {node} (any more): {reason}")]
    NotHere {
        /// The node.
        node: String,
        /// The node's reason.
        reason: String,
    },
    /// The process refused it there, or its connection ended first.
    #[error("on node {node}: {reason}")]
    Failed {
        /// The node.
        node: String,
        /// The node's reason.
        reason: String,
    },
    /// The link broke before the answer came: the message may or may not
    /// have reached the process.
    #[error("the mesh link to node {node} broke: {reason}")]
    Lost {
        /// The node.
        node: String,
        /// Why the link broke.
        reason: String,
    },
}

/// Why one attempt to deliver to a process failed (each is retried until
/// the time to live; the last one's text is the dead letter's reason).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AttemptFailure {
    /// The process nacked it.
    #[error("the process refused it: {0}")]
    Refused(String),
    /// The process's connection ended before it acked.
    #[error("the process's connection ended before it acked: {0}")]
    ConnectionEnded(String),
    /// The process is connected nowhere this node knows of.
    #[error("{0} (nor known elsewhere in the cluster)")]
    NotConnected(DeliverError),
    /// The route names another node, and this node has no mesh.
    #[error("process `{process_id}` is on node {node}, and this node has no mesh")]
    NoMesh {
        /// The process.
        process_id: String,
        /// The node the route names.
        node: String,
    },
    /// The forward to the process's node could not be queued.
    #[error("process `{process_id}` is on node {node}: {source}")]
    NotForwarded {
        /// The process.
        process_id: String,
        /// The node the route names.
        node: String,
        /// Why.
        source: ForwardError,
    },
    /// The forward was queued and ended without an acknowledgement.
    #[error(transparent)]
    Forwarded(ForwardError),
}

impl AttemptFailure {
    /// True when no later attempt can do better (the message can never
    /// fit a frame): it is dead-lettered at once.
    fn is_permanent(&self) -> bool {
        matches!(
            self,
            AttemptFailure::NotConnected(DeliverError::TooLarge { .. })
                | AttemptFailure::NotForwarded {
                    source: ForwardError::TooLarge(_),
                    ..
                }
        )
    }
}

/// Delivers messages to processes in the cluster.
#[derive(Debug)]
pub struct ClusterDelivery {
    gateway: Arc<Gateway>,
    routes: Option<Arc<RouteTable>>,
    forwarder: Option<Arc<dyn Forwarder>>,
    policy: DeliveryPolicy,
    lines: Arc<DeliveryLines>,
}

/// The answer to one attempt, from the process's connection here or from
/// the node the message was forwarded to.
#[derive(Debug)]
enum Attempt {
    /// Known already (taken once).
    Ready(Option<Result<(), AttemptFailure>>),
    /// From the process's connection here.
    Here(oneshot::Receiver<DeliveryResult>),
    /// From `node`, where the process is by the route table.
    Forwarded {
        answer: Forwarded,
        /// Shared with the route table.
        node: Arc<str>,
        parcel: Arc<Parcel>,
        routes: Option<Arc<RouteTable>>,
    },
}

impl Attempt {
    fn failed(reason: AttemptFailure) -> Attempt {
        Attempt::Ready(Some(Err(reason)))
    }
}

impl Future for Attempt {
    type Output = Result<(), AttemptFailure>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut *self {
            Attempt::Ready(result) => {
                Poll::Ready(result.take().expect("an attempt's answer is taken once"))
            }
            Attempt::Here(answer) => Poll::Ready(match ready!(Pin::new(answer).poll(cx)) {
                Ok(DeliveryResult::Acked) => Ok(()),
                Ok(DeliveryResult::Nacked(reason)) => Err(AttemptFailure::Refused(reason)),
                Ok(DeliveryResult::Lost(reason)) => Err(AttemptFailure::ConnectionEnded(reason)),
                Err(_) => Err(AttemptFailure::ConnectionEnded(
                    "the session went away".to_string(),
                )),
            }),
            Attempt::Forwarded {
                answer,
                node,
                parcel,
                routes,
            } => {
                let outcome = ready!(Pin::new(answer).poll(cx));
                if let Ok(ForwardOutcome::Delivered) = outcome {
                    return Poll::Ready(Ok(()));
                }
                // Named in the error only.
                let node = node.to_string();
                let error = match outcome {
                    Ok(ForwardOutcome::Delivered) => return Poll::Ready(Ok(())),
                    Ok(ForwardOutcome::NotHere(reason)) => {
                        // A route learned from a lookup that went stale is
                        // not kept (one read from the topic is: its
                        // tombstone will come).
                        if let Some(routes) = routes {
                            routes.forget_learned(&parcel.process_id, &node);
                        }
                        ForwardError::NotHere { node, reason }
                    }
                    Ok(ForwardOutcome::Failed(reason)) => ForwardError::Failed { node, reason },
                    Ok(ForwardOutcome::Lost(reason)) => ForwardError::Lost { node, reason },
                    Err(_) => ForwardError::Lost {
                        node,
                        reason: "the link went away".to_string(),
                    },
                };
                Poll::Ready(Err(AttemptFailure::Forwarded(error)))
            }
        }
    }
}

impl ClusterDelivery {
    /// Delivers to processes connected to `gateway` and, through
    /// `forwarder`, to those `routes` places on other nodes.
    pub fn new(
        gateway: Arc<Gateway>,
        routes: Option<Arc<RouteTable>>,
        forwarder: Option<Arc<dyn Forwarder>>,
        policy: DeliveryPolicy,
    ) -> Arc<ClusterDelivery> {
        Arc::new(ClusterDelivery {
            gateway,
            routes,
            forwarder,
            lines: DeliveryLines::new(policy.order, policy.lines_recovering.clone()),
            policy,
        })
    }

    /// Takes the delivery's place in its line and, when the line is healthy,
    /// makes the first attempt (waiting for the process's capacity); returns
    /// the future of the final outcome, which makes the first attempt at
    /// its turn when the line recovers from a failure. The time to live
    /// counts from here.
    pub async fn start(
        self: &Arc<Self>,
        process_id: String,
        input: &InputRecord,
        message: OutputRecord,
        abort: CancellationToken,
    ) -> BoxFuture<'static, DeliveryEnd> {
        // Given back in a verdict, for the dead letter.
        let tombstone = message.value.is_none();
        // Every attempt shares it: handing it over costs a reference count.
        let parcel = Arc::new(Parcel {
            delivery_id: input.delivery_id(),
            message: WireMessage::encode(MessageParts {
                key: message.key.as_deref(),
                value: message.value.as_deref().unwrap_or_default(),
                headers: &message.headers,
                topic: &input.topic,
                partition: input.partition,
                offset: input.offset,
                timestamp_ms: input.timestamp_ms.unwrap_or(-1),
            }),
            process_id,
        });
        // Encoded: its parts are freed here, on the thread that made them.
        drop(message);
        // A message that can never fit a frame to a process is not tried.
        if let Err(unfit) = self
            .gateway
            .check_fits(&parcel.delivery_id, &parcel.message)
        {
            tracing::warn!(process = %parcel.process_id, delivery_id = %parcel.delivery_id, %unfit, "dead-lettering a message that can never be delivered");
            let end = Ended::GaveUp(unfit.to_string()).verdict(&parcel, tombstone);
            return futures::future::ready(end).boxed();
        }
        let deadline = Instant::now() + self.policy.ttl;
        let place = self.lines.take(&parcel.process_id, input);
        // Handed over here, in the partition's order, when the line is
        // healthy; while it recovers, the delivery waits for its turn in
        // the returned future, so the partition's next records (of this
        // key too) take their places meanwhile.
        let first = if place.goes_at_once() {
            let mut first = self.attempt(&parcel).await;
            // An attempt that failed at once (the process connected
            // nowhere) holds the line before the next record starts.
            if let Some(result) = (&mut first).now_or_never() {
                if result.is_err() {
                    place.failed();
                }
                first = Attempt::Ready(Some(result));
            }
            Some(first)
        } else {
            None
        };
        let this = self.clone();
        // The future of every delivery in flight: kept small (the common
        // case is one attempt, answered), the rare paths boxed.
        async move {
            let ended = async {
                let mut attempt = match first {
                    Some(first) => first,
                    None => match Box::pin(this.first_at_turn(&parcel, &place, deadline, &abort))
                        .await
                    {
                        Ok(first) => first,
                        Err(end) => return end,
                    },
                };
                let result = tokio::select! {
                    _ = abort.cancelled() => return Ended::Aborted,
                    result = &mut attempt => result,
                };
                match result {
                    Ok(()) => Ended::Delivered,
                    Err(reason) if reason.is_permanent() => Ended::GaveUp(reason.to_string()),
                    Err(reason) => {
                        drop(attempt);
                        Box::pin(this.retry(&parcel, &place, deadline, reason, &abort)).await
                    }
                }
            }
            .await;
            ended.verdict(&parcel, tombstone)
        }
        .boxed()
    }

    /// The first attempt of a delivery whose line was recovering when it
    /// started: made at its turn, unless the time to live ran out first.
    async fn first_at_turn(
        &self,
        parcel: &Arc<Parcel>,
        place: &Place,
        deadline: Instant,
        abort: &CancellationToken,
    ) -> Result<Attempt, Ended> {
        tokio::select! {
            _ = abort.cancelled() => return Err(Ended::Aborted),
            _ = place.first_turn() => {}
        }
        if Instant::now() >= deadline {
            return Err(Ended::GaveUp(self.expired_waiting(&parcel.process_id)));
        }
        let first = tokio::select! {
            _ = abort.cancelled() => return Err(Ended::Aborted),
            first = self.attempt(parcel) => first,
        };
        place.handed_over();
        Ok(first)
    }

    /// After a failed attempt: retries, paced, each at its turn in the
    /// line, until one is answered or the time to live is spent.
    async fn retry(
        &self,
        parcel: &Arc<Parcel>,
        place: &Place,
        deadline: Instant,
        mut reason: AttemptFailure,
        abort: &CancellationToken,
    ) -> Ended {
        let mut backoff = Backoff::new(self.policy.initial_backoff, self.policy.max_backoff);
        let mut attempts = 1u32;
        loop {
            // Later deliveries of the line wait until this one settles.
            place.failed();
            // The time to live is spent before giving up: the last pause
            // is cut short so that one more attempt falls on it.
            let now = Instant::now();
            let pause = backoff
                .next_pause()
                .min(deadline.saturating_duration_since(now));
            if now >= deadline {
                return Ended::GaveUp(format!(
                    "{reason} (time to live {:?} spent after {attempts} attempts)",
                    self.policy.ttl
                ));
            }
            tracing::debug!(process = %parcel.process_id, delivery_id = %parcel.delivery_id, %reason, retry_in = ?pause, "delivery failed; retrying");
            let waited = tokio::select! {
                _ = abort.cancelled() => return Ended::Aborted,
                waited = async {
                    tokio::time::sleep(pause).await;
                    // Earlier deliveries of the line go first.
                    place.turn().await
                } => waited,
            };
            if waited && Instant::now() >= deadline {
                // It waited for its turn past the time to live: the
                // messages behind it are not held up by one more try.
                return Ended::GaveUp(format!(
                    "{reason} (time to live {:?} spent after {attempts} attempts, the last \
                     while earlier messages of its line were retried)",
                    self.policy.ttl
                ));
            }
            attempts += 1;
            self.policy.retried.inc();
            let mut attempt = tokio::select! {
                _ = abort.cancelled() => return Ended::Aborted,
                attempt = self.attempt(parcel) => attempt,
            };
            let result = tokio::select! {
                _ = abort.cancelled() => return Ended::Aborted,
                result = &mut attempt => result,
            };
            reason = match result {
                Ok(()) => return Ended::Delivered,
                Err(reason) if reason.is_permanent() => {
                    return Ended::GaveUp(reason.to_string());
                }
                Err(reason) => reason,
            };
        }
    }

    /// The lines that keep its deliveries in order.
    pub fn lines(&self) -> &DeliveryLines {
        &self.lines
    }

    /// Why a message whose time to live ran out while it waited for its
    /// first turn is given up untried.
    fn expired_waiting(&self, process_id: &str) -> String {
        format!(
            "time to live {:?} spent waiting for earlier messages to process `{process_id}` \
             (same partition and key) that failed and were retried; not tried",
            self.policy.ttl
        )
    }

    /// One attempt: hand the message to the process's connection (or the
    /// mesh link to its node); the returned future waits for its answer.
    async fn attempt(&self, parcel: &Arc<Parcel>) -> Attempt {
        // `start` checked the message fits a frame.
        let process_id = parcel.process_id.as_str();
        if let Some(session) = self.gateway.session(process_id) {
            // Waiting for the process's room is boxed: rare, and it would
            // make the future of every delivery larger.
            let answer = match session.try_deliver(parcel.clone()) {
                Ok(answer) => answer,
                Err(no_room) => {
                    let NoRoom { parcel } = *no_room;
                    Box::pin(session.deliver(parcel)).await
                }
            };
            return Attempt::Here(answer);
        }
        let mut elsewhere = self.routes.as_ref().and_then(|r| r.lookup(process_id));
        if elsewhere.is_none()
            && let Some(forwarder) = &self.forwarder
        {
            // The table may have missed the route record: ask the peers
            // (the holder also writes its route again).
            if let Some(found) = forwarder.lookup(process_id).await {
                tracing::debug!(process = %process_id, node = %found.node, generation = found.generation, "no route; a mesh lookup found the process");
                if let Some(routes) = &self.routes {
                    routes.learn(process_id, &found.node, found.generation);
                }
                elsewhere = Some(Arc::from(found.node));
            }
        }
        let (node, forwarder) = match (elsewhere, &self.forwarder) {
            (Some(node), Some(forwarder)) => (node, forwarder),
            (Some(node), None) => {
                return Attempt::failed(AttemptFailure::NoMesh {
                    process_id: process_id.to_string(),
                    node: node.to_string(),
                });
            }
            (None, _) => {
                return Attempt::failed(AttemptFailure::NotConnected(DeliverError::NotHere(
                    process_id.to_string(),
                )));
            }
        };
        // Waiting for room in the process's window is boxed, as above.
        let forwarded = match forwarder.try_forward(&node, parcel) {
            Some(forwarded) => forwarded,
            None => forwarder.forward(&node, parcel.clone()).await,
        };
        match forwarded {
            Ok(answer) => Attempt::Forwarded {
                answer,
                node,
                parcel: parcel.clone(),
                routes: self.routes.clone(),
            },
            Err(source) => Attempt::failed(AttemptFailure::NotForwarded {
                process_id: process_id.to_string(),
                node: node.to_string(),
                source,
            }),
        }
    }
}

/// The wire form of a message (its origin from `input`), decoded. A
/// delivery encodes its message at once instead ([`WireMessage::encode`],
/// the same bytes).
pub fn to_wire(input: &InputRecord, message: OutputRecord) -> v1::Message {
    v1::Message {
        key: message.key.map(Bytes::from),
        value: message.value.map(Bytes::from).unwrap_or_default(),
        headers: message
            .headers
            .into_iter()
            .map(|(name, value)| v1::Header {
                name,
                value: Bytes::from(value),
            })
            .collect(),
        topic: input.topic.to_string(),
        partition: input.partition,
        offset: input.offset,
        timestamp_ms: input.timestamp_ms.unwrap_or(-1),
    }
}

/// How a delivery ended, before the verdict hands the message back.
enum Ended {
    Delivered,
    GaveUp(String),
    Aborted,
}

impl Ended {
    /// The flow's verdict; a message given up goes back with it, as it was
    /// before [`to_wire`] (`tombstone`: it had no value).
    fn verdict(self, parcel: &Parcel, tombstone: bool) -> DeliveryEnd {
        match self {
            Ended::Delivered => DeliveryEnd::Delivered,
            Ended::Aborted => DeliveryEnd::Aborted,
            Ended::GaveUp(reason) => DeliveryEnd::GaveUp {
                reason,
                call: match parcel.message.decoded() {
                    Ok(message) => from_wire(&message, tombstone),
                    // Never expected (the delivery encoded it): the encoding
                    // itself is dead-lettered, rather than nothing.
                    Err(error) => {
                        tracing::error!(process = %parcel.process_id, delivery_id = %parcel.delivery_id, %error, "a delivery's own message does not decode; dead-lettering its encoding");
                        OutputRecord {
                            key: None,
                            value: Some(parcel.message.to_bytes().to_vec()),
                            headers: Vec::new(),
                        }
                    }
                },
            },
        }
    }
}

/// The message [`to_wire`] made `message` from (`tombstone`: it had no
/// value, which the wire cannot tell from an empty one).
fn from_wire(message: &v1::Message, tombstone: bool) -> OutputRecord {
    OutputRecord {
        key: message.key.as_ref().map(|key| key.to_vec()),
        value: (!tombstone).then(|| message.value.to_vec()),
        headers: message
            .headers
            .iter()
            .map(|header| (header.name.clone(), header.value.to_vec()))
            .collect(),
    }
}

/// The relay cluster as a flow's [`DeliveryTarget`]: the router names each
/// message's process, and the message is handed to it wherever it is
/// connected; the outcome (acknowledged, or given up after the time to
/// live) arrives later.
#[derive(Debug)]
pub struct ClusterTarget {
    router: ProcessRouter,
    delivery: Arc<ClusterDelivery>,
}

impl ClusterTarget {
    /// Routes with `router` and delivers with `delivery`.
    pub fn new(router: ProcessRouter, delivery: Arc<ClusterDelivery>) -> Self {
        ClusterTarget { router, delivery }
    }
}

impl DeliveryTarget for ClusterTarget {
    fn deliver<'a>(
        &'a self,
        input: &'a InputRecord,
        call: OutputRecord,
        abort: &'a CancellationToken,
    ) -> BoxFuture<'a, Delivery> {
        async move {
            // A router plugin's call is boxed: it would make the future of
            // every delivery larger, also where no plugin routes.
            let routed = match self.router.route_without_plugin(&call) {
                Some(routed) => routed,
                None => Box::pin(self.router.route(input, &call)).await,
            };
            match routed {
                Ok(process_id) => Delivery::Pending(
                    self.delivery
                        .start(process_id, input, call, abort.clone())
                        .await,
                ),
                Err(failure) => Delivery::Failed {
                    stage: Stage::Route(failure.stage),
                    reason: failure.reason,
                    call,
                },
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> InputRecord {
        InputRecord {
            topic: "calls".into(),
            partition: 1,
            offset: 7,
            key: None,
            value: None,
            headers: vec![],
            timestamp_ms: Some(5),
        }
    }

    #[test]
    fn a_message_given_up_comes_back_as_it_was_handed_over() {
        let cases = [
            OutputRecord {
                key: Some(b"k".to_vec()),
                value: Some(b"v".to_vec()),
                headers: vec![("h".into(), b"1".to_vec()), ("h".into(), Vec::new())],
            },
            // A tombstone stays a tombstone; an empty value stays empty.
            OutputRecord {
                key: Some(b"k".to_vec()),
                value: None,
                headers: vec![],
            },
            OutputRecord {
                key: None,
                value: Some(Vec::new()),
                headers: vec![],
            },
        ];
        for message in cases {
            let tombstone = message.value.is_none();
            let parcel = Parcel {
                process_id: "p".into(),
                delivery_id: "calls/1/7".into(),
                message: to_wire(&input(), message.clone()).into(),
            };
            let end = Ended::GaveUp("gone".into()).verdict(&parcel, tombstone);
            assert_eq!(
                end,
                DeliveryEnd::GaveUp {
                    reason: "gone".into(),
                    call: message,
                }
            );
        }
    }
}
