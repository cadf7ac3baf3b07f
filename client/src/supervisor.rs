//! The background task of a client: serves the current connection (reads
//! frames, answers pings, sends keepalive pings) and, when it ends,
//! reconnects with backoff and registers again, until the client is closed,
//! replaced or permanently refused.

use std::future::pending;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wasmrelay_protocol::v1::{self, ErrorCode};
use wasmrelay_protocol::{Frame, Kind};

use crate::config::ClientConfig;
use crate::connection::{Connection, error_kind, write_frames};
use crate::delivery::Delivery;
use crate::dial::{self, Candidate, DialError, Registered, Transport};
use crate::events::Event;
use crate::stream::Stream;
use tokio::io::ReadHalf;
use wasmrelay_protocol::Backoff;
use wasmrelay_protocol::io::FrameReader;

/// How long a closing connection may take to write what is queued.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The connection state, as the client handles see it.
#[derive(Debug)]
pub(crate) enum State {
    /// Between connections.
    Connecting,
    /// Registered on this connection.
    Connected(Arc<Connection>),
    /// Stopped for good, for this reason.
    Stopped(String),
}

/// The background task's state.
#[derive(Debug)]
pub(crate) struct Supervisor {
    config: Arc<ClientConfig>,
    events: mpsc::UnboundedSender<Box<Event>>,
    state: watch::Sender<State>,
    /// Cancelled by `Client::close`.
    close: CancellationToken,
    /// Cancelled when the last `Client` handle is dropped.
    handles_gone: CancellationToken,
    /// Where the next round over the configured addresses starts.
    next_origin: usize,
    /// Addresses to try first in the next round (from `Rebalance`).
    preferred: Vec<String>,
    /// Writers of ended connections, flushing what was queued for at most
    /// `CLOSE_GRACE` while the next connection comes up.
    closing: TaskTracker,
}

/// How a connection ended.
#[derive(Debug)]
enum End {
    /// The client was closed (or abandoned).
    Stop,
    /// `Replaced{reason}`.
    Replaced(String),
    /// `Rebalance{addresses, reason}`.
    Rebalance(Vec<String>, String),
    /// Anything else: reconnect after a pause.
    Lost(String),
}

impl Supervisor {
    pub(crate) fn new(
        config: Arc<ClientConfig>,
        events: mpsc::UnboundedSender<Box<Event>>,
        state: watch::Sender<State>,
        close: CancellationToken,
        handles_gone: CancellationToken,
    ) -> Supervisor {
        Supervisor {
            config,
            events,
            state,
            close,
            handles_gone,
            next_origin: 0,
            preferred: Vec::new(),
            closing: TaskTracker::new(),
        }
    }

    /// One round over the addresses, for `Client::connect`.
    pub(crate) async fn register_first(&mut self) -> Result<Registered, DialError> {
        let candidates = self.candidates();
        dial::register(&self.config, candidates).await
    }

    /// Runs until the client stops, starting with `first`.
    pub(crate) async fn run(self, first: Registered) {
        let closing = self.closing.clone();
        self.supervise(first).await;
        closing.close();
        closing.wait().await;
    }

    async fn supervise(mut self, first: Registered) {
        let mut backoff = Backoff::new(self.config.initial_backoff, self.config.max_backoff);
        let mut next = Some(first);
        let mut pause = false;
        loop {
            let registered = match next.take() {
                Some(registered) => registered,
                // Boxed: dialing (TCP, TLS, Hello) is a large future, and
                // a task is as large as its largest state; only while
                // dialing does this cost anything.
                None => match Box::pin(self.reconnect(&mut backoff, pause)).await {
                    Ok(registered) => registered,
                    Err(reason) => return self.finish(reason),
                },
            };
            let started = Instant::now();
            let end = self.serve(registered).await;
            // A connection that outlived the longest pause was healthy: the
            // next failure starts the backoff over.
            if started.elapsed() >= self.config.max_backoff {
                backoff.reset();
            }
            match end {
                End::Stop => return self.finish("the client was closed".to_string()),
                End::Replaced(reason) => {
                    tracing::warn!(%reason, "replaced by another connection with the same process id; stopping");
                    self.emit(Event::Replaced {
                        reason: reason.clone(),
                    });
                    return self.finish(format!("replaced by another connection: {reason}"));
                }
                End::Rebalance(addresses, reason) => {
                    // A random pause first: the node moves many processes
                    // at once, and they should not all dial together.
                    let delay = wasmrelay_protocol::jitter(self.config.rebalance_jitter);
                    tracing::info!(?addresses, %reason, ?delay, "rebalanced; reconnecting there after a random pause");
                    self.emit(Event::Disconnected {
                        reason: format!("rebalance to {addresses:?}: {reason}"),
                    });
                    self.preferred = addresses;
                    pause = false;
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = self.stop_requested() => return self.finish("the client was closed".to_string()),
                    }
                }
                End::Lost(reason) => {
                    tracing::warn!(%reason, "connection lost; reconnecting");
                    self.emit(Event::Disconnected { reason });
                    pause = true;
                }
            }
        }
    }

    fn finish(self, reason: String) {
        tracing::debug!(%reason, "client stopped");
        self.state.send_replace(State::Stopped(reason));
    }

    fn emit(&self, event: Event) {
        // Nobody reads the events any more: a delivery dropped here is
        // redelivered by the node.
        let _ = self.events.send(Box::new(event));
    }

    /// Completes when the client is closed, or when every handle and the
    /// events are dropped (nobody can use the connection any more).
    async fn stop_requested(&self) {
        tokio::select! {
            () = self.close.cancelled() => {}
            () = async {
                self.handles_gone.cancelled().await;
                self.events.closed().await;
            } => {}
        }
    }

    /// The addresses of the next round: the preferred ones, then the
    /// configured ones from the rotation point.
    fn candidates(&mut self) -> Vec<Candidate> {
        let configured = &self.config.addresses;
        let mut candidates: Vec<Candidate> = self
            .preferred
            .drain(..)
            .map(|address| Candidate {
                address,
                origin: None,
            })
            .collect();
        for i in 0..configured.len() {
            let index = (self.next_origin + i) % configured.len();
            let address = &configured[index];
            if !candidates.iter().any(|c| &c.address == address) {
                candidates.push(Candidate {
                    address: address.clone(),
                    origin: Some(index),
                });
            }
        }
        candidates
    }

    /// Rounds over the addresses, with a growing pause between them (and
    /// before the first if `pause`), until one welcomes the process. Err
    /// with the reason to stop: closed, or permanently refused.
    async fn reconnect(
        &mut self,
        backoff: &mut Backoff,
        mut pause: bool,
    ) -> Result<Registered, String> {
        loop {
            if pause {
                let delay = backoff.next_pause();
                tracing::debug!(?delay, "waiting before reconnecting");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = self.stop_requested() => return Err("the client was closed".to_string()),
                }
            }
            pause = true;
            let candidates = self.candidates();
            let result = tokio::select! {
                result = dial::register(&self.config, candidates) => result,
                () = self.stop_requested() => return Err("the client was closed".to_string()),
            };
            match result {
                Ok(registered) => return Ok(registered),
                Err(DialError::Refused {
                    address,
                    code,
                    message,
                }) => {
                    let reason = format!(
                        "{address} refused the process ({}): {message}",
                        code.as_str_name()
                    );
                    tracing::error!(%reason, "permanently refused; stopping");
                    self.emit(Event::Refused {
                        reason: reason.clone(),
                    });
                    return Err(reason);
                }
                Err(DialError::Unreachable(failures)) => {
                    tracing::warn!(?failures, "no relay node accepted the connection; retrying");
                }
                // The token file may be being replaced: try again later.
                Err(DialError::Token(reason)) => {
                    tracing::warn!(%reason, "no token to send; retrying");
                }
            }
        }
    }

    /// Serves one registered connection until it ends.
    async fn serve(&mut self, registered: Registered) -> End {
        let Registered {
            transport,
            welcome,
            address,
            origin,
        } = registered;
        if let Some(origin) = origin {
            self.next_origin = origin + 1;
        }
        let node_max = usize::try_from(welcome.max_frame_bytes).unwrap_or(usize::MAX);
        let max_send_bytes = match node_max {
            0 => self.config.max_frame_bytes,
            node_max => node_max.min(self.config.max_frame_bytes),
        };
        let Transport {
            frames: mut stream,
            sink,
        } = transport;
        let (connection, queue) = Connection::new(welcome.node_id.clone(), address, max_send_bytes);
        let mut writer = Some(self.closing.spawn(write_frames(
            sink,
            queue,
            connection.alive_token(),
        )));
        tracing::info!(
            node_id = %connection.node_id(),
            address = %connection.address(),
            keepalive_ms = welcome.keepalive_ms,
            "registered"
        );
        self.state
            .send_replace(State::Connected(connection.clone()));
        self.emit(Event::Connected {
            node_id: welcome.node_id.clone(),
        });
        let keepalive = Duration::from_millis(welcome.keepalive_ms.into());
        let end = self
            .read(&connection, &mut stream, &mut writer, keepalive)
            .await;
        self.state.send_replace(State::Connecting);
        connection.end();
        drop(stream);
        if let Some(mut writer) = writer {
            let closing = self.closing.spawn(async move {
                if tokio::time::timeout(CLOSE_GRACE, &mut writer)
                    .await
                    .is_err()
                {
                    writer.abort();
                }
            });
            if matches!(end, End::Stop) {
                let _ = closing.await;
            }
        }
        end
    }

    /// Reads frames until the connection ends; sends a `Ping` every half
    /// keepalive and gives up on a node silent for three keepalives (no
    /// pings and no idle limit when the keepalive is zero).
    async fn read(
        &self,
        connection: &Arc<Connection>,
        stream: &mut FrameReader<ReadHalf<Stream>>,
        writer: &mut Option<JoinHandle<Result<(), String>>>,
        keepalive: Duration,
    ) -> End {
        let mut pings = (!keepalive.is_zero()).then(|| {
            let period = keepalive / 2;
            let mut interval = tokio::time::interval_at(Instant::now() + period, period);
            interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
            interval
        });
        let idle_limit = keepalive * 3;
        let mut last_heard = Instant::now();
        let mut nonce = 0u64;
        loop {
            let idle_deadline = last_heard + idle_limit;
            tokio::select! {
                () = self.stop_requested() => return End::Stop,
                result = wait_writer(writer) => {
                    *writer = None;
                    return End::Lost(match result {
                        Ok(Ok(())) => "the connection writer stopped".to_string(),
                        Ok(Err(reason)) => reason,
                        Err(error) => format!("the connection writer failed: {error}"),
                    });
                }
                () = tick(&mut pings) => {
                    nonce += 1;
                    connection.queue(Kind::Ping(v1::Ping { nonce }));
                }
                () = tokio::time::sleep_until(idle_deadline), if pings.is_some() => {
                    let reason = format!("nothing heard from the node for {idle_limit:?}");
                    connection.queue(error_kind(ErrorCode::IdleTimeout, reason.clone()));
                    return End::Lost(reason);
                }
                frame = stream.next() => {
                    last_heard = Instant::now();
                    match frame {
                        None => return End::Lost("the node closed the connection".to_string()),
                        Some(Err(error)) => {
                            if let Some(code) = error.code() {
                                connection.queue(error_kind(code, error.to_string()));
                            }
                            return End::Lost(format!("bad data from the node: {error}"));
                        }
                        Some(Ok(frame)) => {
                            if let Some(end) = self.handle(connection, frame) {
                                return end;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Handles one frame from the node; `Some` when the connection ends.
    fn handle(&self, connection: &Arc<Connection>, frame: Frame) -> Option<End> {
        let name = frame.kind_name();
        match frame.kind {
            Some(Kind::Deliver(deliver)) => {
                self.emit(Event::Delivery(Delivery::new(connection.clone(), deliver)));
                None
            }
            Some(Kind::SendAck(ack)) => {
                let seq = ack.seq;
                if !connection.complete_send(ack) {
                    tracing::debug!(seq, "SendAck for a send nobody waits for");
                }
                None
            }
            Some(Kind::Ping(ping)) => {
                connection.queue(Kind::Pong(v1::Pong { nonce: ping.nonce }));
                None
            }
            Some(Kind::Pong(_)) => None,
            Some(Kind::Replaced(replaced)) => Some(End::Replaced(replaced.reason)),
            Some(Kind::Rebalance(rebalance)) => {
                Some(End::Rebalance(rebalance.addresses, rebalance.reason))
            }
            Some(Kind::Error(error)) => {
                let code = ErrorCode::try_from(error.code).unwrap_or(ErrorCode::Unspecified);
                Some(End::Lost(format!(
                    "the node sent {}: {}",
                    code.as_str_name(),
                    error.message
                )))
            }
            _ => {
                let reason = format!("the node sent an unexpected {name} frame");
                connection.queue(error_kind(
                    ErrorCode::ProtocolViolation,
                    format!("unexpected {name} frame from a node"),
                ));
                Some(End::Lost(reason))
            }
        }
    }
}

/// The writer's result, or never once it has been taken.
async fn wait_writer(
    writer: &mut Option<JoinHandle<Result<(), String>>>,
) -> Result<Result<(), String>, tokio::task::JoinError> {
    match writer {
        Some(writer) => writer.await,
        None => pending().await,
    }
}

/// The next keepalive tick, or never without keepalive.
async fn tick(pings: &mut Option<tokio::time::Interval>) {
    match pings {
        Some(interval) => {
            interval.tick().await;
        }
        None => pending().await,
    }
}
