//! [`Client`]: the handle a business process uses to connect, send
//! upstream and close.

use std::fmt;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::config::ClientConfig;
use crate::connection::StartSendError;
use crate::error::{ClientError, SendError};
use crate::events::Events;
use crate::message::OutgoingMessage;
use crate::supervisor::{State, Supervisor};

/// A connection to a wasmrelay cluster, kept alive in the background.
///
/// Cheap to clone: every clone is a handle on the same connection. The
/// background task runs until [`Client::close`], [`Event::Replaced`]
/// (another connection registered the same process id),
/// [`Event::Refused`], or until every handle and the [`Events`] are
/// dropped.
///
/// [`Event::Replaced`]: crate::Event::Replaced
/// [`Event::Refused`]: crate::Event::Refused
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

/// What the handles share. Dropping the last one tells the background task.
struct Shared {
    config: Arc<ClientConfig>,
    state: watch::Receiver<State>,
    close: CancellationToken,
    handles_gone: CancellationToken,
    /// The background task; [`Client::close`] waits for it.
    supervisor: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.handles_gone.cancel();
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("process_id", &self.shared.config.process_id)
            .field("node_id", &self.node_id())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects and registers the process.
    ///
    /// Tries the configured addresses in order, each within
    /// [`connect_timeout`](ClientConfig::connect_timeout) (TCP connection
    /// and `Hello` / `Welcome` together), following `Redirect`s (a few hops
    /// at most), and returns once a node welcomes the process. Fails with
    /// [`ClientError::Unreachable`] when no address did, and at once with
    /// [`ClientError::Refused`] when a node refuses the process for a
    /// reason retrying cannot fix (unsupported protocol version, bad process
    /// id, a token refused with `UNAUTHORIZED`), and with
    /// [`ClientError::Token`] when the configured token cannot be read. This first round is not retried; call `connect` again to retry.
    ///
    /// From then on a background task keeps the connection: it pings the
    /// node every half keepalive (from the `Welcome`), answers its pings,
    /// and when the connection ends for any reason but
    /// [`Event::Replaced`](crate::Event::Replaced) or [`Client::close`], it
    /// reconnects with exponential backoff
    /// ([`initial_backoff`](ClientConfig::initial_backoff) to
    /// [`max_backoff`](ClientConfig::max_backoff), with jitter) over the
    /// addresses and registers again. A `Rebalance` from the node makes it
    /// reconnect to the given addresses first, after a random pause of up
    /// to [`rebalance_jitter`](ClientConfig::rebalance_jitter).
    ///
    /// The [`Events`] report the deliveries and the connection changes, the
    /// first [`Event::Connected`](crate::Event::Connected) included.
    ///
    /// Must be called within a Tokio runtime.
    pub async fn connect(config: ClientConfig) -> Result<(Client, Events), ClientError> {
        config.validate()?;
        let config = Arc::new(config);
        let span = tracing::info_span!("wasmrelay_client", process_id = %config.process_id);
        let (events_sender, events) = mpsc::unbounded_channel();
        let (state_sender, state) = watch::channel(State::Connecting);
        let close = CancellationToken::new();
        let handles_gone = CancellationToken::new();
        let mut supervisor = Supervisor::new(
            config.clone(),
            events_sender,
            state_sender,
            close.clone(),
            handles_gone.clone(),
        );
        let first = supervisor.register_first().instrument(span.clone()).await?;
        // Awaited by `close`; without it, it ends once every handle is gone.
        #[allow(clippy::disallowed_methods)]
        let supervisor = tokio::spawn(supervisor.run(first).instrument(span));
        let shared = Shared {
            config,
            state,
            close,
            handles_gone,
            supervisor: std::sync::Mutex::new(Some(supervisor)),
        };
        Ok((
            Client {
                shared: Arc::new(shared),
            },
            Events::new(events),
        ))
    }

    /// Sends a message upstream and waits for the node's `SendAck`.
    ///
    /// `Ok` means the node has the message safely in Kafka. While the
    /// client is disconnected, waits for the reconnection first. The whole
    /// call is bounded by [`send_timeout`](ClientConfig::send_timeout).
    ///
    /// Errors: [`SendError::Rejected`] when the node refused it (the error
    /// text); [`SendError::ConnectionLost`] when the connection ended before
    /// the `SendAck` and [`SendError::AckTimeout`] when the `SendAck` did
    /// not come in time: in both cases the message may have reached Kafka
    /// anyway, so a retry is safe but can produce a duplicate;
    /// [`SendError::NotConnected`] when no connection came up in time;
    /// [`SendError::TooLarge`]; [`SendError::Stopped`] once the client has
    /// stopped.
    pub async fn send(&self, message: OutgoingMessage) -> Result<(), SendError> {
        let timeout = self.shared.config.send_timeout;
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.state.clone();
        let mut body = message.into_send(0);
        loop {
            let connection = {
                let ready = state.wait_for(|state| match state {
                    State::Connecting => false,
                    State::Connected(connection) => connection.is_alive(),
                    State::Stopped(_) => true,
                });
                match tokio::time::timeout_at(deadline, ready).await {
                    Err(_) => return Err(SendError::NotConnected(timeout)),
                    Ok(Err(_)) => {
                        return Err(SendError::Stopped(
                            "the client's background task has ended".to_string(),
                        ));
                    }
                    Ok(Ok(state)) => match &*state {
                        State::Connected(connection) => connection.clone(),
                        State::Stopped(reason) => return Err(SendError::Stopped(reason.clone())),
                        State::Connecting => continue,
                    },
                }
            };
            let (seq, acked) = match connection.start_send(body) {
                Ok(started) => started,
                // Nothing was sent: wait for the next connection.
                Err(StartSendError::Gone(returned)) => {
                    body = returned;
                    continue;
                }
                Err(StartSendError::TooLarge { length, max }) => {
                    return Err(SendError::TooLarge { length, max });
                }
            };
            return match tokio::time::timeout_at(deadline, acked).await {
                Err(_) => {
                    connection.forget_send(seq);
                    Err(SendError::AckTimeout(timeout))
                }
                Ok(Err(_)) => Err(SendError::ConnectionLost),
                Ok(Ok(ack)) if ack.ok => Ok(()),
                Ok(Ok(ack)) => Err(SendError::Rejected(ack.error)),
            };
        }
    }

    /// The node currently holding the connection; `None` while
    /// reconnecting or once stopped.
    pub fn node_id(&self) -> Option<String> {
        match &*self.shared.state.borrow() {
            State::Connected(connection) => Some(connection.node_id().to_string()),
            State::Connecting | State::Stopped(_) => None,
        }
    }

    /// The configuration the client was connected with.
    pub fn config(&self) -> &ClientConfig {
        &self.shared.config
    }

    /// Stops the client, for every handle: no more reconnections; writes
    /// the acks already queued (for at most a second) and closes the
    /// socket. Sends still waiting for their `SendAck` fail with
    /// [`SendError::ConnectionLost`]. The [`Events`] stream ends.
    pub async fn close(self) {
        self.shared.close.cancel();
        let mut state = self.shared.state.clone();
        let _ = state
            .wait_for(|state| matches!(state, State::Stopped(_)))
            .await;
        let supervisor = self
            .shared
            .supervisor
            .lock()
            .ok()
            .and_then(|mut task| task.take());
        if let Some(supervisor) = supervisor {
            let _ = supervisor.await;
        }
    }
}
