//! One registered business process as the rest of the node sees it: a
//! bounded queue of frames to its connection, and the deliveries it has not
//! acknowledged yet, each owing its outcome to a oneshot or a sink
//! ([`Reply`]).
//!
//! A process has at most `max_unacked` deliveries unanswered: the next one
//! waits (back-pressure toward whoever delivers, in order) until the process
//! answers an earlier one. A process that answers nothing for
//! `slow_consumer_timeout` while deliveries wait, or whose queue of frames
//! fills up because it does not read, is cut off as too slow.
//!
//! Ending a session (connection closed, replaced, too slow, node shutting
//! down) resolves every pending delivery as [`DeliveryResult::Lost`], so the
//! caller retries it through the cluster: nothing waits forever and nothing
//! is dropped silently.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Semaphore, TryAcquireError, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::v1::ErrorCode;
use wasmrelay_protocol::{Frame, Parcel, ParcelFrame};

use super::reply::Reply;
use crate::pending::{Answer as _, NotRegistered, PendingAnswers};

/// How a delivery to a process ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeliveryResult {
    /// The process acknowledged it.
    Acked,
    /// The process refused it, with its reason.
    Nacked(String),
    /// The connection ended before an answer; deliver it again (wherever
    /// the process is now).
    Lost(String),
}

/// Why a delivery could not even be handed to the session.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeliverError {
    /// No process with this id is connected to this node.
    #[error("process `{0}` is not connected to this node")]
    NotHere(String),
    /// The message would not fit in a frame to a process: it can never be
    /// delivered (and is refused before any connection sees it).
    #[error(
        "the message is {bytes} bytes as a delivery frame, more than the {max} bytes a frame to a process may have (max_frame_bytes): it can never be delivered"
    )]
    TooLarge {
        /// Its `Deliver` frame's length.
        bytes: usize,
        /// The gateway's `max_frame_bytes`.
        max: usize,
    },
}

/// Why the node ends a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The same process id registered again (here or on another node); the
    /// client is sent `Replaced`.
    Replaced(String),
    /// The client is sent `Error{code, reason}`.
    Error(ErrorCode, String),
    /// The node moves the process to another node (rebalancing or
    /// evacuation): the client is sent `Rebalance{addresses, reason}` and
    /// reconnects there.
    Rebalanced {
        /// Where the process should reconnect (the target node's client
        /// address; empty: anywhere it knows).
        addresses: Vec<String>,
        /// Why.
        reason: String,
    },
    /// The client closed the connection or it broke: nobody to tell.
    ClientGone(String),
}

impl Ending {
    /// Why, in words.
    pub fn reason(&self) -> &str {
        match self {
            Ending::Replaced(reason)
            | Ending::Error(_, reason)
            | Ending::Rebalanced { reason, .. }
            | Ending::ClientGone(reason) => reason,
        }
    }
}

/// A receiver that already holds `Lost(reason)`.
fn lost(reason: String) -> oneshot::Receiver<DeliveryResult> {
    let (tx, rx) = oneshot::channel();
    let _ = tx.send(DeliveryResult::Lost(reason));
    rx
}

/// What a session's queue holds for its connection's writer.
#[derive(Debug)]
pub(crate) enum Outbound {
    /// A frame other than a delivery, boxed: the queue's first block holds
    /// 32 of these from the start, on every idle connection.
    Frame(Box<Frame>),
    /// A `Deliver`, encoded from the message every attempt shares.
    Deliver(ParcelFrame),
}

// Every idle connection's queue holds a block of 32 from the start.
const _: () = assert!(std::mem::size_of::<Outbound>() <= 24);

/// A registered process's connection, shared by the connection task and
/// the senders of deliveries.
#[derive(Debug)]
pub struct Session {
    process_id: String,
    connection_id: u64,
    peer: String,
    /// Frames to the client (small: the queue's first block holds 32 of
    /// them from the start, 6 KiB of every idle connection were frames in
    /// it unboxed).
    outbound: mpsc::Sender<Outbound>,
    pending: PendingAnswers<DeliveryResult, (), Reply>,
    next_seq: AtomicU64,
    max_unacked: usize,
    /// One permit per delivery that may be unanswered.
    capacity: Semaphore,
    slow_consumer_timeout: Duration,
    closed: CancellationToken,
    ending: Mutex<Option<Ending>>,
}

/// A delivery the process had no room for ([`Session::try_deliver`]),
/// handed back.
#[derive(Debug)]
pub struct NoRoom {
    /// The delivery.
    pub parcel: Arc<Parcel>,
}

impl Session {
    pub(crate) fn new(
        process_id: String,
        connection_id: u64,
        peer: String,
        outbound: mpsc::Sender<Outbound>,
        max_unacked: usize,
        slow_consumer_timeout: Duration,
    ) -> Session {
        Session {
            process_id,
            connection_id,
            peer,
            outbound,
            pending: PendingAnswers::default(),
            next_seq: AtomicU64::new(1),
            max_unacked,
            capacity: Semaphore::new(max_unacked),
            slow_consumer_timeout,
            closed: CancellationToken::new(),
            ending: Mutex::new(None),
        }
    }

    /// The registered process id.
    pub fn process_id(&self) -> &str {
        &self.process_id
    }

    /// Unique per connection on this node.
    pub fn connection_id(&self) -> u64 {
        self.connection_id
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Deliveries sent and not yet answered.
    pub fn unacked(&self) -> usize {
        self.pending.len()
    }

    /// Waits for room for one more delivery (taking it) while the process
    /// has `max_unacked` unanswered: after `slow_consumer_timeout` the
    /// session ends with `SLOW_CONSUMER`, and the delivery is lost.
    async fn wait_for_room(&self) -> Result<(), DeliveryResult> {
        match tokio::time::timeout(self.slow_consumer_timeout, self.capacity.acquire()).await {
            Ok(Ok(permit)) => {
                permit.forget();
                Ok(())
            }
            Ok(Err(_)) => Err(DeliveryResult::Lost(self.reason_closed())),
            Err(_) => {
                self.close(
                    ErrorCode::SlowConsumer,
                    format!(
                        "{} deliveries unacknowledged for {:?}",
                        self.max_unacked, self.slow_consumer_timeout
                    ),
                );
                Err(DeliveryResult::Lost("the process is too slow".to_string()))
            }
        }
    }

    /// Queues a delivery, in order with every other frame to this process,
    /// and returns where its outcome will arrive. Waits while the process
    /// has `max_unacked` deliveries unanswered; after
    /// `slow_consumer_timeout` of that, or when the queue of frames is full,
    /// the session ends with `SLOW_CONSUMER` and every pending delivery,
    /// this one included, resolves as lost.
    pub async fn deliver(&self, parcel: Arc<Parcel>) -> oneshot::Receiver<DeliveryResult> {
        let (waiter, answer) = oneshot::channel();
        self.deliver_reply(parcel, Reply::Waiter(waiter)).await;
        answer
    }

    /// [`Session::deliver`], the outcome owed to `reply`.
    pub async fn deliver_reply(&self, parcel: Arc<Parcel>, reply: Reply) {
        match self.capacity.try_acquire() {
            Ok(permit) => {
                permit.forget();
                self.queue(parcel, reply);
            }
            Err(TryAcquireError::Closed) => {
                reply.answer(DeliveryResult::Lost(self.reason_closed()));
            }
            // Boxed: the wait (a timer) is the rare case, and the future of
            // every delivery would otherwise carry it.
            Err(TryAcquireError::NoPermits) => match Box::pin(self.wait_for_room()).await {
                Ok(()) => self.queue(parcel, reply),
                Err(lost) => reply.answer(lost),
            },
        }
    }

    /// [`Session::deliver`] when the process has room now; otherwise the
    /// delivery is handed back, to be waited for with `deliver`. A caller
    /// that tries first keeps the wait out of its own future.
    pub fn try_deliver(
        &self,
        parcel: Arc<Parcel>,
    ) -> Result<oneshot::Receiver<DeliveryResult>, Box<NoRoom>> {
        match self.capacity.try_acquire() {
            Ok(permit) => {
                permit.forget();
                let (waiter, answer) = oneshot::channel();
                self.queue(parcel, Reply::Waiter(waiter));
                Ok(answer)
            }
            Err(TryAcquireError::Closed) => Ok(lost(self.reason_closed())),
            Err(TryAcquireError::NoPermits) => Err(Box::new(NoRoom { parcel })),
        }
    }

    /// Queues a delivery for which room was taken, its outcome owed to
    /// `reply`.
    fn queue(&self, parcel: Arc<Parcel>, reply: Reply) {
        let registered = self.pending.register_answer(reply, (), |_| {
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let frame = ParcelFrame::deliver(seq, parcel);
            match self.outbound.try_send(Outbound::Deliver(frame)) {
                Ok(()) => Ok(seq),
                Err(mpsc::error::TrySendError::Full(_)) => Err(true),
                Err(mpsc::error::TrySendError::Closed(_)) => Err(false),
            }
        });
        match registered {
            Ok(()) => {}
            Err((reply, NotRegistered::Refused(true))) => {
                self.capacity.add_permits(1);
                self.close(
                    ErrorCode::SlowConsumer,
                    "the send queue is full: deliveries are not read fast enough".to_string(),
                );
                reply.answer(DeliveryResult::Lost("the process is too slow".to_string()));
            }
            Err((reply, NotRegistered::Closed | NotRegistered::Refused(false))) => {
                self.capacity.add_permits(1);
                reply.answer(DeliveryResult::Lost(self.reason_closed()));
            }
        }
    }

    /// Resolves delivery `seq` (from the process's Ack or Nack). False when
    /// no such delivery is pending (a protocol violation by the client).
    pub(crate) fn answer(&self, seq: u64, result: DeliveryResult) -> bool {
        let answered = self.pending.resolve(seq, result);
        if answered {
            self.capacity.add_permits(1);
        }
        answered
    }

    /// Queues a frame that is not a delivery (SendAck, Pong); false when the
    /// queue is full or closed (the session is then ended as too slow).
    pub(crate) fn send_frame(&self, frame: Frame) -> bool {
        match self.outbound.try_send(Outbound::Frame(Box::new(frame))) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.close(
                    ErrorCode::SlowConsumer,
                    "the send queue is full: frames are not read fast enough".to_string(),
                );
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Ends the session with `Error{code, reason}` to the client.
    pub fn close(&self, code: ErrorCode, reason: String) {
        self.end(Ending::Error(code, reason));
    }

    /// Ends the session because the same process id registered again.
    pub fn replace(&self, reason: String) {
        self.end(Ending::Replaced(reason));
    }

    /// Ends the session by moving the process to `addresses`: the client is
    /// told to reconnect there. Its unanswered deliveries resolve as lost
    /// when the connection ends, so they are delivered again wherever it
    /// reconnects.
    pub fn rebalance(&self, addresses: Vec<String>, reason: String) {
        self.end(Ending::Rebalanced { addresses, reason });
    }

    /// Whether the session was ended (or is ending).
    pub fn is_ending(&self) -> bool {
        self.lock_ending().is_some()
    }

    /// Ends the session: the connection task tells the client why and
    /// closes. Idempotent; the first reason wins.
    pub fn end(&self, ending: Ending) {
        {
            let mut slot = self.lock_ending();
            if slot.is_some() {
                return;
            }
            *slot = Some(ending);
        }
        self.closed.cancel();
    }

    /// Cancelled when the session must end.
    pub(crate) fn closed(&self) -> &CancellationToken {
        &self.closed
    }

    /// Why the node ended the session, if it did.
    pub(crate) fn ending(&self) -> Option<Ending> {
        self.lock_ending().clone()
    }

    /// Resolves every pending delivery as lost; later deliveries resolve
    /// as lost at once. Called by the connection task when it ends.
    pub(crate) fn fail_pending(&self, reason: &str) {
        // Deliveries waiting for capacity give up too.
        self.capacity.close();
        self.pending
            .close(|| DeliveryResult::Lost(reason.to_string()));
    }

    fn reason_closed(&self) -> String {
        self.lock_ending().as_ref().map_or_else(
            || "the connection ended".to_string(),
            |e| e.reason().to_string(),
        )
    }

    fn lock_ending(&self) -> std::sync::MutexGuard<'_, Option<Ending>> {
        self.ending.lock().unwrap_or_else(|e| e.into_inner())
    }
}
