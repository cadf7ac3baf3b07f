//! Incoming links: accepting the peers' connections, authenticating each
//! dialer's `MeshHello` and answering with a `MeshWelcome` (from then on
//! every frame is sealed), then handing its `Forward`s to the gateway in the
//! order they arrive for each process (a lane per process with forwards
//! waiting, so one slow process holds back only its own) and answering each
//! with a `ForwardAck` when the process answers (in whatever order that
//! happens), and answering each
//! `MeshLookup` at once with a `MeshLookupAnswer` (is the process connected
//! here?), and having the route table write again what a peer's
//! `MeshRecordsMissed` says it never read.
//!
//! Anything a peer sends that is not a valid frame, not allowed at that
//! point, or does not authenticate gets an `Error` frame and the link is
//! closed; the node and its other links are not affected.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::mesh_auth::{
    MAX_CLOCK_SKEW_MS, MeshCodec, SessionKeys, verify_hello, welcome_mac,
};
use wasmrelay_protocol::v1::{self, ErrorCode, ForwardResult};
use wasmrelay_protocol::{
    EncodedMessage, Frame, Kind, Outgoing, PROTOCOL_VERSION, Parcel, WireMessage,
};

use super::link::{NONCE_BYTES, code_name};
use super::wire::{self, Conn};
use super::{Mesh, bump, keepalive, now_ms};
use crate::gateway::{DeliverError, DeliveryResult, OutcomeSink, SinkReply};

/// Remembers the nonces of accepted `MeshHello`s for as long as the hello
/// could still pass the clock check, so a recorded hello cannot be replayed
/// to open a link.
#[derive(Debug, Default)]
pub(super) struct ReplayGuard {
    seen: Mutex<HashMap<Bytes, i64>>,
}

impl ReplayGuard {
    /// Records `nonce`; false when it was seen within the window.
    fn first_use(&self, nonce: &Bytes, now_ms: i64) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        // A hello passes the clock check for up to a skew after its time,
        // which is up to a skew after the first use.
        seen.retain(|_, first| now_ms - *first <= 2 * MAX_CLOCK_SKEW_MS);
        seen.insert(nonce.clone(), now_ms).is_none()
    }
}

/// Why an incoming link was refused, and what to tell the dialer (nothing
/// when the connection is gone already).
struct Refusal {
    code: Option<ErrorCode>,
    reason: String,
}

impl Refusal {
    fn new(code: ErrorCode, reason: impl Into<String>) -> Refusal {
        Refusal {
            code: Some(code),
            reason: reason.into(),
        }
    }
}

/// Accepts links until `shutdown`, then closes them all (and the outgoing
/// ones) and waits for the incoming ones to end.
pub(super) async fn serve(mesh: Arc<Mesh>, listener: TcpListener, shutdown: CancellationToken) {
    let closing = mesh.clone();
    let links_shutdown = shutdown.clone();
    let on_shutdown = async move {
        links_shutdown.cancelled().await;
        // Outgoing links close with the node, not only incoming ones.
        closing.close();
    };
    let watching_cert = crate::tls::watch_listener(
        mesh.options().tls.as_ref().map(|tls| tls.server.clone()),
        "mesh",
        shutdown.clone(),
    );
    let accepting =
        crate::net::accept_until(listener, shutdown.clone(), "mesh", None, |stream, peer| {
            serve_link(mesh.clone(), stream, peer, shutdown.clone())
        });
    tokio::join!(accepting, on_shutdown, watching_cert);
}

/// Serves one accepted connection until it ends.
async fn serve_link(
    mesh: Arc<Mesh>,
    stream: TcpStream,
    peer: SocketAddr,
    shutdown: CancellationToken,
) {
    let options = mesh.options().clone();
    let stats = mesh.stats();
    let tls = options.tls.as_ref().map(|tls| &*tls.server);
    let stream = match crate::net::accept_tls(tls, stream, options.connect_timeout).await {
        Ok(stream) => stream,
        Err(reason) => {
            bump(&stats.unauthorized);
            tracing::warn!(%peer, %reason, "refusing a mesh link: TLS");
            return;
        }
    };
    let mut conn = Framed::new(stream, MeshCodec::new(options.max_frame_bytes));
    let hello = tokio::select! {
        _ = shutdown.cancelled() => Err(Refusal::new(ErrorCode::ShuttingDown, "the node is shutting down")),
        hello = handshake(&mesh, &mut conn) => hello,
    };
    let hello = match hello {
        Ok(hello) => hello,
        Err(refusal) => {
            match refusal.code {
                Some(ErrorCode::Unauthorized) => bump(&stats.unauthorized),
                Some(ErrorCode::ShuttingDown) | None => {}
                Some(_) => bump(&stats.protocol_errors),
            }
            if refusal.code.is_some() {
                tracing::warn!(%peer, code = ?refusal.code, reason = %refusal.reason, "refusing a mesh link");
            } else {
                tracing::debug!(%peer, reason = %refusal.reason, "a mesh connection ended before its handshake");
            }
            let last_word = refusal.code.map(|code| Frame::error(code, refusal.reason));
            wire::refuse(&mut conn, last_word).await;
            return;
        }
    };
    let nonce: [u8; NONCE_BYTES] = rand::random();
    let welcome = v1::MeshWelcome {
        node_id: options.node_id.clone(),
        mac: welcome_mac(
            &options.secret,
            &options.node_id,
            &hello.node_id,
            &hello.nonce,
            &nonce,
        )
        .into(),
        nonce: Bytes::copy_from_slice(&nonce),
        takes_sealed_batches: true,
    };
    if conn
        .send(Frame::of(Kind::MeshWelcome(welcome)))
        .await
        .is_err()
    {
        return;
    }
    // Every frame from now on is sealed, both ways.
    let keys = SessionKeys::derive(
        &options.secret,
        &hello.node_id,
        &options.node_id,
        &hello.nonce,
        &nonce,
    );
    conn.codec_mut().seal_with(keys.for_acceptor());
    conn.codec_mut().send_batches(hello.takes_sealed_batches);
    bump(&stats.links_accepted);
    let from = hello.node_id;
    tracing::info!(peer = %from, %peer, "mesh link accepted");

    let (sink, mut frames) = conn.split();
    let (queue, queue_rx) = mpsc::channel(options.link_queue.max(1));
    let closed = CancellationToken::new();
    // Kept: the writer is awaited when the link ends.
    #[allow(clippy::disallowed_methods)]
    let writer = tokio::spawn(wire::write_frames(sink, queue_rx, closed.clone()));
    // Forwards go to the gateway in arrival order per process, each
    // process's on a task of its own (its lane), which may wait for the
    // process's capacity without stopping this loop (pings, other answers);
    // each answer goes to the writer as the process gives it (through this
    // loop only when the writer's queue is full).
    let (overflow_tx, mut overflow) = mpsc::unbounded_channel::<Outgoing>();
    let answers = Arc::new(LinkAnswers {
        queue: queue.clone(),
        overflow: overflow_tx,
    });
    let mut lanes = ForwardLanes::new(mesh.clone(), answers);
    // The timer is moved only when it fires, to the last frame's time plus
    // the timeout: not on every frame (a reset takes the timer's lock).
    let idle_timeout = keepalive(&options) * 3;
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    let mut last_received = Instant::now();
    let (reason, last_word) = loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => break (
                "the node is shutting down".to_string(),
                Some(Frame::error(ErrorCode::ShuttingDown, "the node is shutting down")),
            ),
            _ = closed.cancelled() => break ("writing to the peer failed".to_string(), None),
            Some(ack) = overflow.recv() => {
                if !enqueue(&queue, &closed, ack).await {
                    break ("writing to the peer failed".to_string(), None);
                }
                continue;
            }
            _ = &mut idle => {
                let silent = last_received.elapsed();
                if silent >= idle_timeout {
                    let reason = format!("nothing received for {silent:?}");
                    break (reason.clone(), Some(Frame::error(ErrorCode::IdleTimeout, reason)));
                }
                idle.as_mut().reset(last_received + idle_timeout);
                continue;
            }
            next = frames.next() => next,
        };
        last_received = Instant::now();
        let frame = match next {
            None => break ("the peer closed the link".to_string(), None),
            Some(Err(error)) => {
                let reason = error.to_string();
                if error.is_unauthorized() {
                    bump(&stats.unauthorized);
                    tracing::warn!(peer = %from, %peer, %error, "a mesh peer's frame did not authenticate; closing the link");
                } else if error.code().is_some() {
                    bump(&stats.protocol_errors);
                }
                let last_word = error.code().map(|code| Frame::error(code, reason.clone()));
                break (reason, last_word);
            }
            Some(Ok(frame)) => frame,
        };
        let reply = match frame.kind {
            Some(Kind::Forward(forward)) => {
                bump(&stats.forwards_received);
                // Checked here, then passed on to the process as it came.
                let checked = match forward.message {
                    None => Err(("has no message".to_string(), ErrorCode::ProtocolViolation)),
                    Some(message) => EncodedMessage::check(message)
                        .map_err(|error| (format!("carries {error}"), ErrorCode::BadFrame)),
                };
                let message = match checked {
                    Ok(message) => message,
                    Err((error, code)) => {
                        bump(&stats.protocol_errors);
                        let reason = format!("Forward {} {error}", forward.seq);
                        break (reason.clone(), Some(Frame::error(code, reason)));
                    }
                };
                let parcel = Parcel {
                    process_id: forward.process_id,
                    delivery_id: forward.delivery_id,
                    message: WireMessage::Encoded(message),
                };
                // A refusal (the process's lane is full) is answered at once.
                lanes.take(forward.seq, parcel)
            }
            Some(Kind::MeshLookup(lookup)) => {
                let generation = mesh.answer_lookup(&lookup.process_id);
                Some(Frame::of(Kind::MeshLookupAnswer(v1::MeshLookupAnswer {
                    lookup_id: lookup.lookup_id,
                    process_id: lookup.process_id,
                    connected: generation.is_some(),
                    generation: generation.unwrap_or_default(),
                })))
            }
            Some(Kind::MeshRecordsMissed(missed)) => {
                mesh.rewrite_for_peer(missed.partition, missed.from_offset, missed.to_offset);
                None
            }
            Some(Kind::Ping(ping)) => Some(Frame::of(Kind::Pong(v1::Pong { nonce: ping.nonce }))),
            Some(Kind::Pong(_)) => None,
            Some(Kind::Error(error)) => {
                break (
                    format!(
                        "the peer closed the link: {}: {}",
                        code_name(error.code),
                        error.message
                    ),
                    None,
                );
            }
            Some(other) => {
                bump(&stats.protocol_errors);
                let reason = format!(
                    "a node may not send {} frames on a mesh link it dialed",
                    other.name()
                );
                break (
                    reason.clone(),
                    Some(Frame::error(ErrorCode::ProtocolViolation, reason)),
                );
            }
            None => {
                bump(&stats.protocol_errors);
                let reason = "a frame without a kind".to_string();
                break (
                    reason.clone(),
                    Some(Frame::error(ErrorCode::BadFrame, reason)),
                );
            }
        };
        if let Some(reply) = reply
            && !enqueue(&queue, &closed, Outgoing::Frame(reply)).await
        {
            break ("writing to the peer failed".to_string(), None);
        }
    };
    if last_word.is_some() {
        tracing::info!(peer = %from, %peer, %reason, "closing a mesh link");
    } else {
        tracing::debug!(peer = %from, %peer, %reason, "mesh link closed");
    }
    closed.cancel();
    // A lane still waiting for its process's room stops there (the sender
    // redelivers).
    drop(lanes);
    match writer.await {
        Ok((sink, error)) => {
            if let Some(error) = error {
                tracing::debug!(peer = %from, %peer, %error, "writing to a mesh peer failed");
            }
            wire::farewell(sink, last_word).await;
        }
        Err(error) => tracing::warn!(peer = %from, %peer, %error, "a mesh link writer failed"),
    }
    // Forwards still with the gateway are not answered: the dialer resolves
    // them as lost and delivers them again.
}

/// Waits for a dialer's `MeshHello` and checks it.
async fn handshake(mesh: &Mesh, conn: &mut Conn) -> Result<v1::MeshHello, Refusal> {
    let options = mesh.options();
    let frame = match tokio::time::timeout(options.connect_timeout, conn.next()).await {
        Err(_) => {
            return Err(Refusal::new(
                ErrorCode::IdleTimeout,
                format!("no MeshHello within {:?}", options.connect_timeout),
            ));
        }
        Ok(None) => {
            return Err(Refusal {
                code: None,
                reason: "the connection closed before its MeshHello".to_string(),
            });
        }
        Ok(Some(Err(error))) => {
            return Err(Refusal {
                code: error.code(),
                reason: error.to_string(),
            });
        }
        Ok(Some(Ok(frame))) => frame,
    };
    let hello = match frame.kind {
        Some(Kind::MeshHello(hello)) => hello,
        _ => {
            return Err(Refusal::new(
                ErrorCode::ProtocolViolation,
                format!(
                    "the first frame on a mesh link must be a MeshHello, not {}",
                    frame.kind_name()
                ),
            ));
        }
    };
    if hello.protocol_version != PROTOCOL_VERSION {
        return Err(Refusal::new(
            ErrorCode::UnsupportedVersion,
            format!(
                "this node speaks protocol version {PROTOCOL_VERSION}; node `{}` sent version {}",
                hello.node_id, hello.protocol_version
            ),
        ));
    }
    if hello.to_node_id != options.node_id {
        return Err(Refusal::new(
            ErrorCode::Unauthorized,
            format!(
                "node `{}` dialed node `{}`, but this is node `{}`",
                hello.node_id, hello.to_node_id, options.node_id
            ),
        ));
    }
    if hello.nonce.len() != NONCE_BYTES {
        return Err(Refusal::new(
            ErrorCode::Unauthorized,
            format!(
                "the nonce of node `{}` is {} bytes long, not {NONCE_BYTES}",
                hello.node_id,
                hello.nonce.len()
            ),
        ));
    }
    let now = now_ms();
    verify_hello(&options.secret, &hello, now)
        .map_err(|reason| Refusal::new(ErrorCode::Unauthorized, reason))?;
    if !mesh.replays.first_use(&hello.nonce, now) {
        return Err(Refusal::new(
            ErrorCode::Unauthorized,
            format!(
                "the MeshHello of node `{}` was used before (a replay?)",
                hello.node_id
            ),
        ));
    }
    Ok(hello)
}

/// Forwards waiting in one process's lane at most; one more is answered
/// `Failed` at once (the sender retries it), so a process that does not
/// keep up never holds the link's other forwards nor its reading. A sender
/// of this version keeps no more than this unanswered per process
/// ([`super::windows`]), so only an older or misbehaving one is refused.
const LANE_LIMIT: usize = super::FORWARDS_WAITING_PER_PROCESS;

/// The lanes of one link: the forwards waiting per process, in arrival
/// order. A lane's task hands them to the gateway one after the other and
/// ends, under the lock, once its lane is empty.
/// (The process ids are the authenticated peer's: a fast hash will do.)
type Lanes = Arc<
    Mutex<HashMap<String, std::collections::VecDeque<(u64, Parcel)>, foldhash::fast::RandomState>>,
>;

/// Where the outcomes of a link's forwards go: each as its `ForwardAck`,
/// into the link writer's queue, or (when that is full) to the link's loop,
/// which waits for room.
#[derive(Debug)]
struct LinkAnswers {
    queue: mpsc::Sender<Outgoing>,
    overflow: mpsc::UnboundedSender<Outgoing>,
}

impl OutcomeSink for LinkAnswers {
    fn outcome(&self, seq: u64, outcome: Result<DeliveryResult, DeliverError>) {
        let ack = Outgoing::Frame(forward_ack(seq, outcome));
        if let Err(mpsc::error::TrySendError::Full(ack)) = self.queue.try_send(ack) {
            // Gone only with the link: its dialer resolves the forwards
            // it waits for as lost.
            let _ = self.overflow.send(ack);
        }
    }
}

/// Hands a link's forwards to the gateway, in arrival order per process
/// and concurrently across processes; their outcomes go to the link's
/// [`LinkAnswers`]. Dropping it stops the lanes.
struct ForwardLanes {
    mesh: Arc<Mesh>,
    lanes: Lanes,
    tasks: tokio::task::JoinSet<()>,
    answers: Arc<LinkAnswers>,
}

impl ForwardLanes {
    fn new(mesh: Arc<Mesh>, answers: Arc<LinkAnswers>) -> Self {
        ForwardLanes {
            mesh,
            lanes: Arc::default(),
            tasks: tokio::task::JoinSet::new(),
            answers,
        }
    }

    /// Queues forward `seq` of `parcel` in its process's lane (starting the
    /// lane's task if it has none); the `ForwardAck` refusing it when the
    /// lane is full.
    fn take(&mut self, seq: u64, parcel: Parcel) -> Option<Frame> {
        while self.tasks.try_join_next().is_some() {}
        let start_lane = {
            let mut lanes = lock(&self.lanes);
            match lanes.get_mut(&parcel.process_id) {
                Some(lane) if lane.len() >= LANE_LIMIT => {
                    return Some(Frame::of(Kind::ForwardAck(v1::ForwardAck {
                        seq,
                        result: ForwardResult::Failed as i32,
                        reason: format!(
                            "process `{}` has {LANE_LIMIT} forwards waiting here already",
                            parcel.process_id
                        ),
                    })));
                }
                Some(lane) => {
                    lane.push_back((seq, parcel));
                    None
                }
                None => {
                    let process_id = parcel.process_id.clone();
                    lanes.insert(
                        process_id.clone(),
                        std::collections::VecDeque::from([(seq, parcel)]),
                    );
                    Some(process_id)
                }
            }
        };
        if let Some(process_id) = start_lane {
            self.tasks.spawn(run_lane(
                self.mesh.clone(),
                self.lanes.clone(),
                process_id,
                self.answers.clone(),
            ));
        }
        None
    }
}

/// Hands the forwards of `process_id`'s lane to the gateway in order until
/// the lane is empty, then removes it.
async fn run_lane(mesh: Arc<Mesh>, lanes: Lanes, process_id: String, answers: Arc<LinkAnswers>) {
    loop {
        let (seq, parcel) = {
            let mut lanes = lock(&lanes);
            let next = lanes.get_mut(&process_id).and_then(|lane| lane.pop_front());
            match next {
                Some(forward) => forward,
                None => {
                    lanes.remove(&process_id);
                    return;
                }
            }
        };
        // Waits while the process has no room; its outcome goes to
        // `answers` as forward `seq`'s `ForwardAck`.
        let reply = SinkReply::new(answers.clone(), seq);
        mesh.gateway()
            .deliver_parcel_reply(Arc::new(parcel), reply)
            .await;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `ForwardAck` for the outcome of forward `seq`: the process's answer,
/// or why the gateway did not take it.
fn forward_ack(seq: u64, outcome: Result<DeliveryResult, DeliverError>) -> Frame {
    let (result, reason) = match outcome {
        Ok(DeliveryResult::Acked) => (ForwardResult::Delivered, String::new()),
        Ok(DeliveryResult::Nacked(reason)) => (
            ForwardResult::Failed,
            format!("the process nacked it: {reason}"),
        ),
        Ok(DeliveryResult::Lost(reason)) => (
            ForwardResult::Failed,
            format!("the process's connection ended before it answered: {reason}"),
        ),
        Err(error @ DeliverError::NotHere(_)) => (ForwardResult::NotHere, error.to_string()),
        // The sender checks with its own limit first; a node with a smaller
        // one refuses here.
        Err(error @ DeliverError::TooLarge { .. }) => (ForwardResult::Failed, error.to_string()),
    };
    Frame::of(Kind::ForwardAck(v1::ForwardAck {
        seq,
        result: result as i32,
        reason,
    }))
}

/// Queues a frame to the peer; false when the link is closing.
async fn enqueue(
    queue: &mpsc::Sender<Outgoing>,
    closed: &CancellationToken,
    frame: Outgoing,
) -> bool {
    tokio::select! {
        _ = closed.cancelled() => false,
        sent = queue.send(frame) => sent.is_ok(),
    }
}
