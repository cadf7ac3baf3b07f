//! The upstream sends of one connection, kept in order: one task per
//! connection that sends (started at its first `Send`) takes each send
//! through the [`Upstream`] in the order the client sent them, and answers
//! each with its `SendAck` in that order too, while every send taken is in
//! flight at once (Kafka acknowledges them meanwhile). A task per send, as
//! before, let two sends with the same key overtake each other on their
//! way to the output topic, and their acknowledgements come back shuffled.

use std::sync::Arc;

use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use wasmrelay_protocol::v1;
use wasmrelay_protocol::{Frame, Kind};

use super::session::Session;
use super::{Gateway, Upstream, UpstreamError};

/// A send waiting to be taken, holding its place among the connection's
/// `max_unacked` until it is acknowledged.
type Queued = (v1::Send, OwnedSemaphorePermit);

/// A send taken, until Kafka has it: its `seq`, the outcome, its place.
type InFlight = BoxFuture<'static, (u64, Result<(), UpstreamError>, OwnedSemaphorePermit)>;

/// The sends of one connection.
pub(super) struct OrderedSends {
    queue: mpsc::UnboundedSender<Queued>,
}

impl OrderedSends {
    /// Starts the connection's task of sends (on the gateway's tracker, so
    /// a shutdown waits for the sends taken); it ends once this is dropped
    /// and every send taken is answered.
    pub(super) fn start(gateway: &Gateway, session: &Arc<Session>) -> OrderedSends {
        let (queue, taken) = mpsc::unbounded_channel();
        gateway
            .send_tasks()
            .spawn(run(gateway.upstream().clone(), session.clone(), taken));
        OrderedSends { queue }
    }

    /// Queues `send` after every send before it (the permit bounds how
    /// many are queued).
    pub(super) fn push(&self, send: v1::Send, permit: OwnedSemaphorePermit) {
        // The task ends only after this is dropped.
        let _ = self.queue.send((send, permit));
    }
}

async fn run(
    upstream: Arc<dyn Upstream>,
    session: Arc<Session>,
    mut queue: mpsc::UnboundedReceiver<Queued>,
) {
    let mut in_flight: FuturesOrdered<InFlight> = FuturesOrdered::new();
    let mut open = true;
    loop {
        tokio::select! {
            biased;
            Some((seq, result, permit)) = in_flight.next(), if !in_flight.is_empty() => {
                drop(permit);
                let (ok, error) = match result {
                    Ok(()) => (true, String::new()),
                    Err(error) => (false, error.to_string()),
                };
                session.send_frame(Frame::of(Kind::SendAck(v1::SendAck { seq, ok, error })));
            }
            queued = queue.recv(), if open => match queued {
                None => open = false,
                Some((send, permit)) => {
                    let seq = send.seq;
                    // The next send waits until this one is on its way.
                    let taken = upstream.send(session.process_id(), send).await;
                    in_flight.push_back(Box::pin(async move {
                        let result = match taken {
                            Ok(accepted) => accepted.await,
                            Err(error) => Err(error),
                        };
                        (seq, result, permit)
                    }));
                }
            },
            else => return,
        }
    }
}
