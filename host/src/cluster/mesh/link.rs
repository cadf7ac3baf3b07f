//! Outgoing links: for each peer, a task that dials it, authenticates with
//! `MeshHello` / `MeshWelcome` (after which every frame is sealed), then
//! sends the forwards queued on the link and resolves each when its
//! `ForwardAck` comes back (and the lookups, each when its
//! `MeshLookupAnswer` comes back); and dials again, with backoff, when the link
//! breaks, until the peer is dropped.
//!
//! A link is broken when the socket fails, the peer sends something that is
//! not allowed, or nothing arrives for three keepalive intervals (the link
//! pings the peer when it has been quiet for one). Breaking resolves the
//! forwards still waiting for an answer as [`ForwardOutcome::Lost`], and
//! the lookups still waiting as "not there".

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use prost::Message as _;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::mesh_auth::{
    MeshCodec, MeshWireError, SessionKeys, hello_mac, sealed_len, verify_welcome,
};
use wasmrelay_protocol::v1::{self, ErrorCode, ForwardResult};
use wasmrelay_protocol::{Backoff, Frame, Kind, Outgoing, PROTOCOL_VERSION, Parcel, ParcelFrame};

use super::windows::{FORWARDS_WAITING_PER_PROCESS, ProcessWindows, Room};
use super::wire::{self, Conn};
use super::{
    ForwardOutcome, Forwarded, MAX_PENDING_LOOKUPS, MeshError, MeshOptions, MeshStats, Shared,
    bump, keepalive, now_ms,
};
use crate::pending::{NotRegistered, PendingAnswers};

/// Bytes of the random nonce of a `MeshHello`.
pub(super) const NONCE_BYTES: usize = 16;

/// A peer in the peer set: where to dial it, and its link when one is up.
#[derive(Debug)]
pub(super) struct PeerSlot {
    node_id: String,
    addr: String,
    /// Cancelled when the peer is dropped or the mesh closes.
    stop: CancellationToken,
    link: Mutex<Option<Arc<Link>>>,
}

impl PeerSlot {
    pub(super) fn new(node_id: String, addr: String, stop: CancellationToken) -> PeerSlot {
        PeerSlot {
            node_id,
            addr,
            stop,
            link: Mutex::new(None),
        }
    }

    pub(super) fn node_id(&self) -> &str {
        &self.node_id
    }

    pub(super) fn addr(&self) -> &str {
        &self.addr
    }

    /// The authenticated link to the peer, if one is up.
    pub(super) fn link(&self) -> Option<Arc<Link>> {
        self.lock_link().clone()
    }

    /// Stops dialing the peer and closes its link; the forwards waiting on
    /// it resolve as lost with `reason`.
    pub(super) fn stop(&self, reason: &str, stats: &MeshStats) {
        self.stop.cancel();
        if let Some(link) = self.lock_link().take() {
            link.close(reason, stats);
        }
    }

    fn set_link(&self, link: Arc<Link>) {
        *self.lock_link() = Some(link);
    }

    /// Forgets `link`, unless another one replaced it already.
    fn clear_link(&self, link: &Arc<Link>) {
        let mut slot = self.lock_link();
        if slot
            .as_ref()
            .is_some_and(|current| Arc::ptr_eq(current, link))
        {
            *slot = None;
        }
    }

    fn lock_link(&self) -> std::sync::MutexGuard<'_, Option<Arc<Link>>> {
        self.link.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An authenticated outgoing link, shared by its task and the senders of
/// forwards.
#[derive(Debug)]
pub(super) struct Link {
    node_id: String,
    queue: mpsc::Sender<Outgoing>,
    capacity: usize,
    max_frame_bytes: usize,
    /// Forwards waiting for their `ForwardAck`, by seq; closed with the link.
    /// Each holds its room in its process's window.
    pending: PendingAnswers<ForwardOutcome, Room>,
    /// Unanswered forwards per process, at most as many as the peer holds.
    windows: ProcessWindows,
    next_seq: AtomicU64,
    /// Lookups waiting for their `MeshLookupAnswer`, by lookup id: the
    /// generation when the peer holds the process, `None` when it does not
    /// (or the link closed). At most [`MAX_PENDING_LOOKUPS`]; a lookup
    /// given up on is forgotten.
    lookups: PendingAnswers<Option<u64>>,
    next_lookup: AtomicU64,
    /// Whether a forward was queued since the last keepalive tick.
    sent_since_tick: AtomicBool,
    /// Cancelled when the link is closed (or its writer failed).
    closed: CancellationToken,
}

impl Link {
    fn new(node_id: &str, queue: mpsc::Sender<Outgoing>, options: &MeshOptions) -> Link {
        Link {
            node_id: node_id.to_string(),
            queue,
            capacity: options.link_queue,
            max_frame_bytes: options.max_frame_bytes,
            pending: PendingAnswers::default(),
            windows: ProcessWindows::new(FORWARDS_WAITING_PER_PROCESS),
            next_seq: AtomicU64::new(1),
            lookups: PendingAnswers::default(),
            next_lookup: AtomicU64::new(1),
            sent_since_tick: AtomicBool::new(false),
            closed: CancellationToken::new(),
        }
    }

    /// Room for a forward to `process_id` now; refused when its window is
    /// full.
    pub(super) fn try_room(&self, process_id: &str) -> Result<Room, MeshError> {
        self.windows
            .try_room(process_id)
            .ok_or_else(|| MeshError::WindowFull {
                node_id: self.node_id.clone(),
                process_id: process_id.to_string(),
                window: self.windows.size(),
            })
    }

    /// Room for a forward to `process_id`, waiting while its window is
    /// full; refused when the link closes first.
    pub(super) async fn room(&self, process_id: &str) -> Result<Room, MeshError> {
        tokio::select! {
            room = self.windows.room(process_id) => Ok(room),
            _ = self.closed.cancelled() => Err(MeshError::NotLinked(self.node_id.clone())),
        }
    }

    /// Queues a `Forward` in the `room` of its process's window, in order
    /// with the others, and returns where its outcome arrives. The room is
    /// given back when the outcome arrives (or the link closes).
    pub(super) fn forward(
        &self,
        stats: &MeshStats,
        room: Room,
        parcel: Arc<Parcel>,
    ) -> Result<Forwarded, MeshError> {
        // Queued under the table's lock, so an ack cannot be looked up
        // before its forward is pending, and closing cannot miss it.
        let registered = self.pending.register_holding(room, |_| {
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let frame = ParcelFrame::forward(seq, parcel);
            // The frame goes out sealed: the sealed size is what is limited.
            let bytes = sealed_len(frame.encoded_len());
            if bytes > self.max_frame_bytes {
                return Err(MeshError::TooLarge {
                    bytes,
                    max: self.max_frame_bytes,
                });
            }
            match self.queue.try_send(Outgoing::Parcel(frame)) {
                Ok(()) => Ok(seq),
                Err(mpsc::error::TrySendError::Full(_)) => Err(MeshError::QueueFull {
                    node_id: self.node_id.clone(),
                    capacity: self.capacity,
                }),
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    Err(MeshError::NotLinked(self.node_id.clone()))
                }
            }
        });
        match registered {
            Ok(answer) => {
                self.sent_since_tick.store(true, Ordering::Relaxed);
                bump(&stats.forwards_sent);
                Ok(Forwarded { answer })
            }
            Err(NotRegistered::Closed) => Err(MeshError::NotLinked(self.node_id.clone())),
            Err(NotRegistered::Refused(error)) => Err(error),
        }
    }

    /// Queues a `MeshLookup` for `process_id` and returns where its answer
    /// arrives; `None` when it cannot be asked now (closed, queue full, too
    /// many lookups waiting, frame too large): the peer counts as "no".
    pub(super) fn lookup(
        self: &Arc<Self>,
        stats: &MeshStats,
        process_id: &str,
    ) -> Option<AskedLookup> {
        let mut lookup_id = 0;
        let answer = self
            .lookups
            .register(|waiting| {
                if waiting >= MAX_PENDING_LOOKUPS {
                    return Err(());
                }
                lookup_id = self.next_lookup.fetch_add(1, Ordering::Relaxed);
                let frame = Frame::of(Kind::MeshLookup(v1::MeshLookup {
                    lookup_id,
                    process_id: process_id.to_string(),
                }));
                if sealed_len(frame.encoded_len()) > self.max_frame_bytes {
                    return Err(());
                }
                self.queue.try_send(frame.into()).map_err(|_| ())?;
                Ok(lookup_id)
            })
            .ok()?;
        self.sent_since_tick.store(true, Ordering::Relaxed);
        bump(&stats.lookups_sent);
        Some(AskedLookup {
            link: self.clone(),
            lookup_id,
            answer,
        })
    }

    /// Queues a `MeshRecordsMissed` for offsets `from..to` of `partition`;
    /// false when it cannot be sent now (closed, queue full).
    pub(super) fn records_missed(&self, partition: i32, from: i64, to: i64) -> bool {
        let frame = Frame::of(Kind::MeshRecordsMissed(v1::MeshRecordsMissed {
            partition,
            from_offset: from,
            to_offset: to,
        }));
        let queued = self.queue.try_send(frame.into()).is_ok();
        if queued {
            self.sent_since_tick.store(true, Ordering::Relaxed);
        }
        queued
    }

    /// Lookups waiting for their answer.
    pub(super) fn pending_lookups(&self) -> usize {
        self.lookups.len()
    }

    /// Resolves forward `seq`; false when it is not pending.
    fn resolve(&self, seq: u64, outcome: ForwardOutcome) -> bool {
        self.pending.resolve(seq, outcome)
    }

    /// Closes the link: later forwards are refused, pending ones resolve as
    /// lost with `reason`. Idempotent.
    fn close(&self, reason: &str, stats: &MeshStats) {
        self.lookups.close(|| None);
        let lost = self.pending.close(|| {
            ForwardOutcome::Lost(format!(
                "the mesh link to node `{}` broke before the answer: {reason}",
                self.node_id
            ))
        });
        self.closed.cancel();
        stats
            .forwards_lost
            .fetch_add(lost as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A lookup asked on a link; forgotten there when dropped unanswered.
#[derive(Debug)]
pub(super) struct AskedLookup {
    link: Arc<Link>,
    lookup_id: u64,
    answer: oneshot::Receiver<Option<u64>>,
}

impl AskedLookup {
    /// The peer's node id and its answer: the generation when it holds
    /// the process, `None` when it does not or the link closed first.
    pub(super) async fn answer(mut self) -> (String, Option<u64>) {
        let answer = (&mut self.answer).await.ok().flatten();
        (self.link.node_id.clone(), answer)
    }
}

impl Drop for AskedLookup {
    fn drop(&mut self) {
        // A no-op when answered; otherwise the asker gave up.
        self.link.lookups.forget(self.lookup_id);
    }
}

/// Why dialing a peer did not give an authenticated link.
#[derive(Debug, thiserror::Error)]
enum DialError {
    #[error("no authenticated link within {0:?}")]
    Timeout(Duration),
    #[error("connecting failed: {0}")]
    Connect(std::io::Error),
    #[error("TLS handshake failed: {0}")]
    Tls(String),
    #[error(transparent)]
    Codec(#[from] MeshWireError),
    #[error("the peer closed the connection before its MeshWelcome")]
    Closed,
    #[error("the peer refused the link: {code}: {message}")]
    Refused { code: String, message: String },
    #[error("the peer did not authenticate: {0}")]
    Unauthorized(String),
    #[error("the peer broke the protocol: {0}")]
    Protocol(String),
}

/// Why an established link ends, and what to tell the peer (an `Error`
/// frame with this code and the reason, if any).
struct Closing {
    reason: String,
    code: Option<ErrorCode>,
}

impl Closing {
    fn quietly(reason: impl Into<String>) -> Closing {
        Closing {
            reason: reason.into(),
            code: None,
        }
    }

    fn telling(code: ErrorCode, reason: impl Into<String>) -> Closing {
        Closing {
            reason: reason.into(),
            code: Some(code),
        }
    }
}

/// Dials `slot`'s peer and keeps a link to it up until the peer is dropped.
pub(super) async fn supervise(shared: Arc<Shared>, slot: Arc<PeerSlot>) {
    let options = &shared.options;
    let (initial_backoff, max_backoff) = options.reconnect_backoff;
    let mut backoff = Backoff::new(initial_backoff, max_backoff);
    let mut failures = 0u32;
    loop {
        let dialed = tokio::select! {
            _ = slot.stop.cancelled() => break,
            dialed = dial(options, &slot) => dialed,
        };
        let retry_in = match dialed {
            Ok(conn) => {
                failures = 0;
                backoff.reset();
                bump(&shared.stats.links_established);
                tracing::info!(peer = %slot.node_id, addr = %slot.addr, "mesh link up");
                let reason = run(&shared, &slot, conn).await;
                bump(&shared.stats.links_broken);
                if slot.stop.is_cancelled() {
                    tracing::info!(peer = %slot.node_id, %reason, "mesh link closed");
                    break;
                }
                tracing::warn!(peer = %slot.node_id, addr = %slot.addr, %reason, "mesh link broken; dialing again");
                backoff.next_pause()
            }
            Err(error) => {
                failures += 1;
                let retry_in = backoff.next_pause();
                bump(&shared.stats.dial_failures);
                match &error {
                    DialError::Unauthorized(_) => bump(&shared.stats.unauthorized),
                    DialError::Protocol(_) | DialError::Codec(_) => {
                        bump(&shared.stats.protocol_errors);
                    }
                    _ => {}
                }
                // Loud on the first failure and now and then after.
                if failures == 1 || failures.is_multiple_of(30) {
                    tracing::warn!(peer = %slot.node_id, addr = %slot.addr, %error, failures, ?retry_in, "dialing a mesh peer failed");
                } else {
                    tracing::debug!(peer = %slot.node_id, addr = %slot.addr, %error, failures, ?retry_in, "dialing a mesh peer failed");
                }
                retry_in
            }
        };
        tokio::select! {
            _ = slot.stop.cancelled() => break,
            _ = tokio::time::sleep(retry_in) => {}
        }
    }
}

/// Connects to the peer and authenticates, within the connect timeout.
async fn dial(options: &MeshOptions, slot: &PeerSlot) -> Result<Conn, DialError> {
    tokio::time::timeout(options.connect_timeout, handshake(options, slot))
        .await
        .unwrap_or(Err(DialError::Timeout(options.connect_timeout)))
}

async fn handshake(options: &MeshOptions, slot: &PeerSlot) -> Result<Conn, DialError> {
    let stream = TcpStream::connect(&slot.addr)
        .await
        .map_err(DialError::Connect)?;
    let _ = stream.set_nodelay(true);
    let stream = match &options.tls {
        None => crate::net::Stream::Plain(stream),
        Some(tls) => {
            let name = tls.server_name_for(&slot.addr).map_err(DialError::Tls)?;
            let stream = tls
                .connector
                .connect(name, stream)
                .await
                .map_err(|e| DialError::Tls(e.to_string()))?;
            crate::net::Stream::Tls(Box::new(stream.into()))
        }
    };
    let mut conn = Framed::new(stream, MeshCodec::new(options.max_frame_bytes));
    let nonce: [u8; NONCE_BYTES] = rand::random();
    let time_ms = now_ms();
    let hello = v1::MeshHello {
        protocol_version: PROTOCOL_VERSION,
        node_id: options.node_id.clone(),
        to_node_id: slot.node_id.clone(),
        nonce: Bytes::copy_from_slice(&nonce),
        time_ms,
        mac: hello_mac(
            &options.secret,
            &options.node_id,
            &slot.node_id,
            &nonce,
            time_ms,
        )
        .into(),
        takes_sealed_batches: true,
    };
    conn.send(Frame::of(Kind::MeshHello(hello))).await?;
    let frame = conn.next().await.ok_or(DialError::Closed)??;
    match frame.kind {
        Some(Kind::MeshWelcome(welcome)) => {
            let checked = if welcome.node_id != slot.node_id {
                Err(format!(
                    "node `{}` answered at {}, where node `{}` was expected",
                    welcome.node_id, slot.addr, slot.node_id
                ))
            } else if welcome.nonce.len() != NONCE_BYTES {
                Err(format!(
                    "the nonce of node `{}` is {} bytes long, not {NONCE_BYTES}",
                    welcome.node_id,
                    welcome.nonce.len()
                ))
            } else {
                verify_welcome(&options.secret, &welcome, &options.node_id, &nonce)
            };
            match checked {
                Ok(()) => {
                    // Every frame from now on is sealed, both ways.
                    let keys = SessionKeys::derive(
                        &options.secret,
                        &options.node_id,
                        &slot.node_id,
                        &nonce,
                        &welcome.nonce,
                    );
                    conn.codec_mut().seal_with(keys.for_dialer());
                    conn.codec_mut().send_batches(welcome.takes_sealed_batches);
                    Ok(conn)
                }
                Err(reason) => {
                    let last_word = Frame::error(ErrorCode::Unauthorized, reason.clone());
                    wire::refuse(&mut conn, Some(last_word)).await;
                    Err(DialError::Unauthorized(reason))
                }
            }
        }
        Some(Kind::Error(error)) => Err(DialError::Refused {
            code: code_name(error.code),
            message: error.message,
        }),
        _ => {
            let reason = format!("expected a MeshWelcome, got a {} frame", frame.kind_name());
            let last_word = Frame::error(ErrorCode::ProtocolViolation, reason.clone());
            wire::refuse(&mut conn, Some(last_word)).await;
            Err(DialError::Protocol(reason))
        }
    }
}

/// Runs an authenticated link until it breaks or the peer is dropped;
/// returns why it ended.
async fn run(shared: &Shared, slot: &PeerSlot, conn: Conn) -> String {
    let options = &shared.options;
    let (queue, queue_rx) = mpsc::channel(options.link_queue.max(1));
    let link = Arc::new(Link::new(&slot.node_id, queue, options));
    let (sink, mut frames) = conn.split();
    // Awaited when the link ends.
    #[allow(clippy::disallowed_methods)]
    let writer = tokio::spawn(wire::write_frames(sink, queue_rx, link.closed.clone()));
    slot.set_link(link.clone());
    shared.publish_linked();

    let keepalive = keepalive(options);
    let mut tick = tokio::time::interval_at(Instant::now() + keepalive, keepalive);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last_received = Instant::now();
    let mut received_since_tick = false;
    let mut ping_nonce = 0u64;
    let closing = loop {
        tokio::select! {
            _ = slot.stop.cancelled() => break Closing::quietly("the peer was dropped"),
            _ = link.closed.cancelled() => break Closing::quietly("the link was closed"),
            _ = tick.tick() => {
                let silent = last_received.elapsed();
                if silent >= keepalive * 3 {
                    break Closing::telling(
                        ErrorCode::IdleTimeout,
                        format!("nothing received for {silent:?}; pings unanswered"),
                    );
                }
                let sent = link.sent_since_tick.swap(false, Ordering::Relaxed);
                if !received_since_tick || !sent {
                    ping_nonce += 1;
                    // A full queue means the link is busy: no ping needed.
                    let _ = link.queue.try_send(Frame::of(Kind::Ping(v1::Ping { nonce: ping_nonce })).into());
                }
                received_since_tick = false;
                link.windows.drop_idle();
            }
            next = frames.next() => match next {
                None => break Closing::quietly("the peer closed the link"),
                Some(Err(error)) => {
                    if let Some(code) = error.code() {
                        if error.is_unauthorized() {
                            bump(&shared.stats.unauthorized);
                            tracing::warn!(peer = %slot.node_id, addr = %slot.addr, %error, "a mesh peer's frame did not authenticate; closing the link");
                        } else {
                            bump(&shared.stats.protocol_errors);
                        }
                        break Closing::telling(code, error.to_string());
                    }
                    break Closing::quietly(error.to_string());
                }
                Some(Ok(frame)) => {
                    last_received = Instant::now();
                    received_since_tick = true;
                    if let Err(closing) = handle_frame(&shared.stats, &link, frame) {
                        break closing;
                    }
                }
            },
        }
    };

    slot.clear_link(&link);
    shared.publish_linked();
    // Stop the writer before failing the pending forwards, so its error (if
    // it is why the link ended) is the reason given.
    link.closed.cancel();
    let last_word = closing
        .code
        .map(|code| Frame::error(code, closing.reason.clone()));
    let (reason, sink) = match writer.await {
        Ok((sink, Some(error))) => (format!("writing to the peer failed: {error}"), Some(sink)),
        Ok((sink, None)) => (closing.reason, Some(sink)),
        Err(error) => (format!("the link's writer failed: {error}"), None),
    };
    link.close(&reason, &shared.stats);
    if let Some(sink) = sink {
        wire::farewell(sink, last_word).await;
    }
    reason
}

/// Acts on one frame from the peer; `Err` ends the link.
fn handle_frame(stats: &MeshStats, link: &Link, frame: Frame) -> Result<(), Closing> {
    match frame.kind {
        Some(Kind::ForwardAck(ack)) => {
            let (outcome, counter) = match ForwardResult::try_from(ack.result) {
                Ok(ForwardResult::Delivered) => {
                    (ForwardOutcome::Delivered, &stats.forwards_delivered)
                }
                Ok(ForwardResult::NotHere) => (
                    ForwardOutcome::NotHere(ack.reason),
                    &stats.forwards_not_here,
                ),
                Ok(ForwardResult::Failed) => {
                    (ForwardOutcome::Failed(ack.reason), &stats.forwards_failed)
                }
                Ok(ForwardResult::Unspecified) | Err(_) => {
                    bump(&stats.protocol_errors);
                    return Err(Closing::telling(
                        ErrorCode::ProtocolViolation,
                        format!(
                            "ForwardAck for forward {} with no known result ({})",
                            ack.seq, ack.result
                        ),
                    ));
                }
            };
            if link.resolve(ack.seq, outcome) {
                bump(counter);
                Ok(())
            } else {
                bump(&stats.protocol_errors);
                Err(Closing::telling(
                    ErrorCode::ProtocolViolation,
                    format!(
                        "ForwardAck for forward {}, which is not awaiting an answer",
                        ack.seq
                    ),
                ))
            }
        }
        Some(Kind::MeshLookupAnswer(answer)) => {
            // An answer nobody waits for any more (the asker gave up) is
            // dropped: lookups time out, unlike forwards.
            if !link.lookups.resolve(
                answer.lookup_id,
                answer.connected.then_some(answer.generation),
            ) {
                tracing::debug!(peer = %link.node_id, lookup = answer.lookup_id, process = %answer.process_id, "a lookup answer came after its lookup was given up");
            }
            Ok(())
        }
        Some(Kind::Ping(ping)) => {
            let _ = link
                .queue
                .try_send(Frame::of(Kind::Pong(v1::Pong { nonce: ping.nonce })).into());
            Ok(())
        }
        Some(Kind::Pong(_)) => Ok(()),
        Some(Kind::Error(error)) => Err(Closing::quietly(format!(
            "the peer closed the link: {}: {}",
            code_name(error.code),
            error.message
        ))),
        Some(other) => {
            bump(&stats.protocol_errors);
            Err(Closing::telling(
                ErrorCode::ProtocolViolation,
                format!(
                    "a node may not send {} frames on a mesh link it accepted",
                    other.name()
                ),
            ))
        }
        None => {
            bump(&stats.protocol_errors);
            Err(Closing::telling(
                ErrorCode::BadFrame,
                "a frame without a kind",
            ))
        }
    }
}

/// The name of an error code, or its number when unknown.
pub(super) fn code_name(code: i32) -> String {
    ErrorCode::try_from(code).map_or_else(
        |_| format!("error code {code}"),
        |code| code.as_str_name().to_string(),
    )
}
