//! The gateway: the TCP listener business processes connect to, and the
//! table of processes registered on this node.
//!
//! A process connects, says Hello with its process id and a credential for
//! it (checked by [`auth`] before anything else), and is Welcomed; from
//! then on the node delivers messages for that id to it ([`Gateway::deliver`])
//! and takes its upstream sends ([`Upstream`]). An id that registers again
//! replaces the older connection, which is told why: only a Hello that
//! proved the same identity gets that far. Which processes'
//! registration changed is kept in [`RegistrationChanges`] (each process
//! once, with its connection now), which the cluster publishes to the route
//! table.
//!
//! Owns: accepting, client authentication ([`auth`]), the per-connection
//! protocol ([`connection`]), and the per-process session state
//! ([`session`]). Does not own routing between
//! nodes or Kafka.

pub mod auth;
mod connection;
pub mod reply;
pub mod session;
mod upstream_sends;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use prometheus_client::metrics::counter::Counter;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wasmrelay_protocol::{Parcel, WireMessage, v1};

pub use auth::ClientAuth;
pub use reply::{OutcomeSink, Reply, SinkReply};
pub use session::{DeliverError, DeliveryResult, Ending, NoRoom, Session};

/// How the gateway treats connections.
#[derive(Clone, Debug)]
pub struct GatewayOptions {
    /// This node's id (in `Welcome`).
    pub node_id: String,
    /// Clients send something at least this often; a connection silent for
    /// three times this is closed.
    pub keepalive: Duration,
    /// How long a new connection may take to send its Hello.
    pub hello_timeout: Duration,
    /// Frames queued for one connection before it counts as too slow.
    pub send_queue: usize,
    /// Deliveries one connection may leave unanswered; more wait until it
    /// answers. Also the most upstream sends of one connection in flight.
    pub max_unacked: usize,
    /// How long deliveries may wait for a process that answers nothing
    /// before it is cut off as too slow.
    pub slow_consumer_timeout: Duration,
    /// Largest frame accepted or sent.
    pub max_frame_bytes: usize,
    /// TLS on the listener (the handshake must finish within
    /// `hello_timeout`); plain TCP when `None`.
    pub tls: Option<Arc<crate::tls::ServerTls>>,
    /// Processes this node holds at most: a Hello for a process not
    /// connected here is refused (`NODE_FULL`) or placed elsewhere when
    /// this many are connected.
    pub quota: usize,
    /// Connections served at once at most, Hello or not: one more is
    /// closed at once (see [`crate::net::accept_until`]).
    pub max_connections: usize,
}

/// Where a new process should be accepted (see [`PlacementPolicy`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// On this node.
    Here,
    /// On another node: the client is redirected there.
    Elsewhere {
        /// The node.
        node_id: String,
        /// Its client address.
        address: String,
    },
    /// Nowhere now: every node is full; the reason.
    Full(String),
}

/// Picks the node a new process connects to (the cluster's placement).
pub trait PlacementPolicy: Send + Sync + 'static {
    /// Where `process_id` should go, when this node holds
    /// `local_connections` processes.
    fn place(&self, process_id: &str, local_connections: usize) -> BoxFuture<'static, Placement>;
}

impl Default for GatewayOptions {
    fn default() -> Self {
        GatewayOptions {
            node_id: "node".to_string(),
            keepalive: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(10),
            send_queue: 1024,
            max_unacked: 1024,
            slow_consumer_timeout: Duration::from_secs(30),
            max_frame_bytes: wasmrelay_protocol::DEFAULT_MAX_FRAME_BYTES,
            tls: None,
            quota: usize::MAX,
            max_connections: crate::net::default_connection_cap(),
        }
    }
}

/// Where upstream sends of processes go (the cluster flow's data-return
/// chain and output topic).
///
/// The sends of one connection are taken one after the other, in the order
/// the process sent them (the next is not taken before the one before is
/// on its way), and acknowledged in that order: what one process sends
/// with one key reaches Kafka in order, as with Kafka's own idempotent
/// producer, while many are in flight at once.
pub trait Upstream: Send + Sync + 'static {
    /// Takes one `Send` of `process_id`: resolves once the message is on
    /// its way (through the plugins and in the producer's queue), to an
    /// [`Accepted`] that resolves when Kafka has it. Either error's text is
    /// the reason sent back in the `SendAck`.
    fn send(
        &self,
        process_id: &str,
        send: v1::Send,
    ) -> BoxFuture<'static, Result<Accepted, UpstreamError>>;
}

/// An upstream that refuses every `Send`: for a gateway that only holds
/// routes, as in the route table's tests and the route-record fuzz target.
#[derive(Debug)]
pub struct RefusingUpstream;

impl Upstream for RefusingUpstream {
    fn send(&self, _: &str, _: v1::Send) -> BoxFuture<'static, Result<Accepted, UpstreamError>> {
        Box::pin(async { Err(UpstreamError::Refused("no upstream".to_string())) })
    }
}

/// A send on its way: resolves when Kafka has it.
pub type Accepted = BoxFuture<'static, Result<(), UpstreamError>>;

/// An [`Accepted`] for a send that needs no more waiting.
pub fn already_written() -> Accepted {
    Box::pin(std::future::ready(Ok(())))
}

/// Why an upstream send was not taken.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// A data-return plugin failed in a way that may pass later: the
    /// process may send again.
    #[error("data-return plugin {plugin} failed, send again later: {reason}")]
    PluginFailed {
        /// The plugin version, `name@sha256`.
        plugin: String,
        /// What went wrong.
        reason: String,
    },
    /// A data-return plugin refused the message (a dead-letter verdict or
    /// a fault that would repeat).
    #[error("data-return plugin {plugin} refused the message: {reason}")]
    PluginRefused {
        /// The plugin version, `name@sha256`.
        plugin: String,
        /// Why.
        reason: String,
    },
    /// Kafka did not take the record.
    #[error("producing to `{topic}`: {source}")]
    Produce {
        /// The output topic.
        topic: String,
        /// librdkafka's error.
        source: rdkafka::error::KafkaError,
    },
    /// The upstream refused it for its own reason.
    #[error("{0}")]
    Refused(String),
}

/// The processes whose registration here changed and is not published
/// yet, each once with the connection it has here now (`None`: it is no
/// longer connected here). A set, not a log: while the publisher is held
/// up (Kafka out of reach), a process that reconnects a thousand times
/// still waits once, so it is bounded by the processes, not by the churn.
pub type RegistrationChanges = crate::work_set::WorkSet<Option<u64>>;

/// Counters of the gateway, read by metrics and the admin API.
#[derive(Debug, Default)]
pub struct GatewayStats {
    accepted: AtomicU64,
    protocol_errors: AtomicU64,
    replaced: AtomicU64,
    tls_failures: AtomicU64,
    /// Counters (not atomics) so that metrics can register them as they
    /// are: `wasmrelay_cluster_clients_redirected_total` and
    /// `..._refused_full_total`.
    redirected: Counter,
    refused_full: Counter,
}

impl GatewayStats {
    fn protocol_error(&self) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }

    fn tls_failure(&self) {
        self.tls_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Hellos answered with a `Redirect` to another node.
    pub fn redirected(&self) -> u64 {
        self.redirected.get()
    }

    /// The counter behind [`GatewayStats::redirected`], for metrics.
    pub fn redirected_counter(&self) -> Counter {
        self.redirected.clone()
    }

    /// The counter behind [`GatewayStats::refused_full`], for metrics.
    pub fn refused_full_counter(&self) -> Counter {
        self.refused_full.clone()
    }

    /// Hellos refused because this node (and the cluster) was full.
    pub fn refused_full(&self) -> u64 {
        self.refused_full.get()
    }

    /// Connections whose TLS handshake failed or did not finish in time.
    pub fn tls_failures(&self) -> u64 {
        self.tls_failures.load(Ordering::Relaxed)
    }

    /// Connections accepted since start.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Connections closed for bad frames or protocol violations.
    pub fn protocol_errors(&self) -> u64 {
        self.protocol_errors.load(Ordering::Relaxed)
    }

    /// Connections replaced by a newer one with the same process id.
    pub fn replaced(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed)
    }
}

/// The processes connected to this node.
pub struct Gateway {
    options: GatewayOptions,
    client_auth: ClientAuth,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    next_connection: AtomicU64,
    upstream: Arc<dyn Upstream>,
    registrations: Option<Arc<RegistrationChanges>>,
    stats: GatewayStats,
    /// Upstream sends waiting for Kafka's acknowledgement (their answer
    /// goes back to the process); [`Gateway::serve`] waits for them.
    sends: TaskTracker,
    /// Where new processes go; without it, every process is accepted here
    /// while below the quota.
    placement: std::sync::OnceLock<Arc<dyn PlacementPolicy>>,
    /// New processes admitted and not registered yet: they count against
    /// the quota.
    admitting: std::sync::atomic::AtomicUsize,
    /// Set while the node is being evacuated: no new process is accepted
    /// here (the placement policy shares it, so it places them elsewhere).
    evacuating: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("node_id", &self.options.node_id)
            .field("connections", &self.connection_count())
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// A gateway that admits the Hellos `client_auth` accepts, whose
    /// upstream sends go to `upstream` and whose registration changes are
    /// noted in `registrations` (if given).
    pub fn new(
        options: GatewayOptions,
        client_auth: ClientAuth,
        upstream: Arc<dyn Upstream>,
        registrations: Option<Arc<RegistrationChanges>>,
    ) -> Arc<Gateway> {
        Arc::new(Gateway {
            options,
            client_auth,
            sessions: Mutex::new(HashMap::new()),
            next_connection: AtomicU64::new(1),
            upstream,
            registrations,
            stats: GatewayStats::default(),
            sends: TaskTracker::new(),
            placement: std::sync::OnceLock::new(),
            admitting: std::sync::atomic::AtomicUsize::new(0),
            evacuating: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        })
    }

    /// Sets the placement policy new processes are placed by (once, before
    /// [`Gateway::serve`]); later calls are ignored.
    pub fn set_placement(&self, policy: Arc<dyn PlacementPolicy>) {
        let _ = self.placement.set(policy);
    }

    /// Whether the node is being evacuated (accepts no new process).
    pub fn evacuating(&self) -> bool {
        self.evacuating.load(Ordering::SeqCst)
    }

    /// Starts (or ends) refusing new processes: while set, a Hello for a
    /// process not connected here is placed elsewhere or refused.
    pub fn set_evacuating(&self, evacuating: bool) {
        self.evacuating.store(evacuating, Ordering::SeqCst);
    }

    /// The flag behind [`Gateway::evacuating`], for the placement policy.
    pub fn evacuating_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.evacuating.clone()
    }

    /// The sessions connected here now (a snapshot).
    pub fn sessions(&self) -> Vec<Arc<Session>> {
        self.lock_sessions().values().cloned().collect()
    }

    /// Decides where a Hello for `process_id` goes. A process connected
    /// here already is always taken (a reconnect or a takeover); a new one
    /// is placed by the policy when the client may be redirected, and is
    /// accepted here only below the quota and while the node is not being
    /// evacuated. The returned admission holds
    /// its place under the quota until it is dropped (after registering).
    pub(crate) async fn admit(
        &self,
        process_id: &str,
        may_redirect: bool,
    ) -> Result<Admission<'_>, Placement> {
        if self.session(process_id).is_some() {
            return Ok(Admission { gateway: None });
        }
        if may_redirect && let Some(policy) = self.placement.get() {
            // Processes admitted and not yet registered count too: the
            // last one's client may have its Welcome (and be on to the
            // next Hello) before its session is in the map.
            let held = self.connection_count() + self.admitting.load(Ordering::SeqCst);
            match policy.place(process_id, held).await {
                Placement::Here => {}
                elsewhere => return Err(self.count_placement(elsewhere)),
            }
        }
        if self.evacuating() {
            return Err(self.count_placement(Placement::Full(format!(
                "node {} is being evacuated and accepts no new process; connect to another node",
                self.options.node_id
            ))));
        }
        let taken = self.admitting.fetch_add(1, Ordering::SeqCst) + 1;
        if self.connection_count() + taken > self.options.quota {
            self.admitting.fetch_sub(1, Ordering::SeqCst);
            return Err(self.count_placement(Placement::Full(format!(
                "node {} is at its connection quota of {}; connect again later",
                self.options.node_id, self.options.quota
            ))));
        }
        Ok(Admission {
            gateway: Some(self),
        })
    }

    fn count_placement(&self, placement: Placement) -> Placement {
        match &placement {
            Placement::Here => {}
            Placement::Elsewhere { .. } => {
                self.stats.redirected.inc();
            }
            Placement::Full(_) => {
                self.stats.refused_full.inc();
            }
        }
        placement
    }

    /// Accepts connections on `listener` until `shutdown`, following
    /// changes of the client token key files and the TLS certificate
    /// meanwhile; then every
    /// connection is told the node is shutting down, and this returns when
    /// they have all closed.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: CancellationToken) {
        let gateway = self.clone();
        let watching_keys = self.client_auth.clone().watch_keys(shutdown.clone());
        let watching_cert =
            crate::tls::watch_listener(self.options.tls.clone(), "clients", shutdown.clone());
        let accepting = crate::net::accept_until(
            listener,
            shutdown.clone(),
            "clients",
            Some(self.options.max_connections),
            move |stream, peer| {
                gateway.stats.accepted.fetch_add(1, Ordering::Relaxed);
                connection::serve_connection(gateway.clone(), stream, peer, shutdown.clone())
            },
        );
        tokio::join!(accepting, watching_keys, watching_cert);
        self.sends.close();
        self.sends.wait().await;
    }

    /// Where each connection's task of upstream sends runs.
    pub(crate) fn send_tasks(&self) -> &TaskTracker {
        &self.sends
    }

    /// Hands a message to the process `process_id` connected here, in order
    /// with every other delivery to it (waiting while it has `max_unacked`
    /// unanswered); the receiver resolves when the process answers or its
    /// connection ends.
    pub async fn deliver(
        &self,
        process_id: &str,
        delivery_id: String,
        message: v1::Message,
    ) -> Result<oneshot::Receiver<DeliveryResult>, DeliverError> {
        self.deliver_parcel(Arc::new(Parcel {
            process_id: process_id.to_string(),
            delivery_id,
            message: message.into(),
        }))
        .await
    }

    /// [`Gateway::deliver`] of a parcel (its process, delivery id and
    /// message).
    pub async fn deliver_parcel(
        &self,
        parcel: Arc<Parcel>,
    ) -> Result<oneshot::Receiver<DeliveryResult>, DeliverError> {
        self.check_fits(&parcel.delivery_id, &parcel.message)?;
        let session = self
            .session(&parcel.process_id)
            .ok_or_else(|| DeliverError::NotHere(parcel.process_id.clone()))?;
        Ok(session.deliver(parcel).await)
    }

    /// [`Gateway::deliver_parcel`], the outcome owed to `reply` (a refusal
    /// too).
    pub async fn deliver_parcel_reply(&self, parcel: Arc<Parcel>, reply: SinkReply) {
        if let Err(unfit) = self.check_fits(&parcel.delivery_id, &parcel.message) {
            return reply.send(Err(unfit));
        }
        match self.session(&parcel.process_id) {
            Some(session) => session.deliver_reply(parcel, Reply::Sink(reply)).await,
            None => reply.send(Err(DeliverError::NotHere(parcel.process_id.clone()))),
        }
    }

    /// Whether `message` fits in a frame to a process (see
    /// [`DeliverError::TooLarge`]).
    pub fn check_fits(&self, delivery_id: &str, message: &WireMessage) -> Result<(), DeliverError> {
        let bytes = wasmrelay_protocol::deliver_frame_len(delivery_id, message.encoded_len());
        let max = self.options.max_frame_bytes;
        if bytes > max {
            return Err(DeliverError::TooLarge { bytes, max });
        }
        Ok(())
    }

    /// The session of `process_id`, if it is connected here.
    pub fn session(&self, process_id: &str) -> Option<Arc<Session>> {
        self.lock_sessions().get(process_id).cloned()
    }

    /// Processes connected here.
    pub fn connection_count(&self) -> usize {
        self.lock_sessions().len()
    }

    /// Ends the session of `process_id` because it registered elsewhere
    /// (another node holds the newer connection).
    pub fn replace_local(&self, process_id: &str, reason: String) {
        if let Some(session) = self.session(process_id) {
            self.stats.replaced.fetch_add(1, Ordering::Relaxed);
            session.replace(reason);
        }
    }

    /// The gateway's options.
    pub fn options(&self) -> &GatewayOptions {
        &self.options
    }

    /// The gateway's counters.
    pub fn stats(&self) -> &GatewayStats {
        &self.stats
    }

    /// How Hellos are authenticated.
    pub fn client_auth(&self) -> &ClientAuth {
        &self.client_auth
    }

    fn upstream(&self) -> &Arc<dyn Upstream> {
        &self.upstream
    }

    fn next_connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a new session; an older one of the same process is
    /// replaced.
    fn register(&self, session: Arc<Session>) {
        // Noted under the sessions' lock: what is noted last is what holds.
        let older = {
            let mut sessions = self.lock_sessions();
            let older = sessions.insert(session.process_id().to_string(), session.clone());
            self.report(session.process_id(), Some(session.connection_id()));
            older
        };
        if let Some(older) = older {
            self.stats.replaced.fetch_add(1, Ordering::Relaxed);
            older.replace(format!(
                "process `{}` registered again from {} on node {}",
                session.process_id(),
                session.peer(),
                self.options.node_id
            ));
        }
    }

    /// Removes a session that ended, unless a newer one replaced it.
    fn unregister(&self, session: &Session) {
        let mut sessions = self.lock_sessions();
        if sessions
            .get(session.process_id())
            .is_some_and(|current| current.connection_id() == session.connection_id())
        {
            sessions.remove(session.process_id());
            self.report(session.process_id(), None);
        }
    }

    fn report(&self, process_id: &str, connection: Option<u64>) {
        if let Some(registrations) = &self.registrations {
            registrations.add(process_id, connection);
        }
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A new process's place under the quota, from admission until it is
/// registered (or its Hello fails).
pub(crate) struct Admission<'a> {
    gateway: Option<&'a Gateway>,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if let Some(gateway) = self.gateway {
            gateway.admitting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Binds the client listener, with a clear error naming the address.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding the client listener on {addr}: {e}"))
}
