//! The mesh: authenticated TCP links between the relay nodes of a cluster.
//! A node that holds a message for a process connected to another node
//! forwards it over the mesh and learns the outcome from the other node.
//!
//! Every node dials every other node it is told about ([`Mesh::set_peers`]),
//! so between two nodes there are two links, one each way: a node sends its
//! `Forward`s on its own outgoing link ([`link`]) and the `ForwardAck`s come
//! back on it. The accepting side ([`server`]) hands each `Forward` to the
//! local [`Gateway`] in the order it arrived and answers when the process
//! does.
//!
//! A link starts with `MeshHello` / `MeshWelcome`, in which both sides prove
//! they know the cluster secret and each adds a nonce; every frame after it,
//! both ways, is sealed with a key of that link and direction and numbered
//! (the frames a link's writer finds queued together go under one seal when
//! the peer said in the handshake that it takes that: one MAC for many
//! forwards or answers), so a man in the middle that relays the handshake can neither alter nor
//! answer a forward ([`wasmrelay_protocol::mesh_auth`]). Idle
//! links are pinged; a link silent for three keepalive intervals is broken.
//! A broken link resolves its forwards still waiting for an answer as
//! [`ForwardOutcome::Lost`] and is dialled again, with backoff, for as long
//! as the peer stays in the peer set.
//!
//! A node whose route table has no route for a process asks every linked
//! peer at once whether it holds it ([`Mesh::lookup`]: `MeshLookup` on the
//! outgoing links, `MeshLookupAnswer` back on them); a peer that holds it
//! says so with the generation of its registration and has its route record
//! written again ([`LookupAnswerer`]), so every node that missed the record
//! converges. A node whose reader skipped offsets of the routes topic asks
//! every peer to write again what it wrote there ([`Mesh::ask_to_rewrite`]:
//! `MeshRecordsMissed`, not answered).
//!
//! Owns: the links, their authentication and keepalive, and the forwards and
//! lookups in flight on them. Does not own which nodes exist (membership calls
//! [`Mesh::set_peers`]) nor where processes are (the route table), nor
//! retrying a forward that failed (the caller's delivery policy).

mod link;
mod server;
mod windows;
mod wire;

pub use windows::FORWARDS_WAITING_PER_PROCESS;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt as _, StreamExt as _};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wasmrelay_protocol::{Parcel, v1};

use crate::gateway::Gateway;

use link::PeerSlot;

/// How the mesh treats its links.
#[derive(Clone)]
pub struct MeshOptions {
    /// This node's id: sent in `MeshHello`, and what dialers must name as
    /// `to_node_id`.
    pub node_id: String,
    /// The cluster secret, the HMAC key of the handshake.
    pub secret: Vec<u8>,
    /// Largest frame accepted or sent.
    pub max_frame_bytes: usize,
    /// Frames queued on one link (each way) before [`Mesh::forward`]
    /// refuses with [`MeshError::QueueFull`].
    pub link_queue: usize,
    /// How long dialing a peer may take: TCP connect plus `MeshHello` /
    /// `MeshWelcome`. Also how long an accepted link may take to say
    /// `MeshHello`.
    pub connect_timeout: Duration,
    /// Idle links are pinged this often; a link on which nothing arrives for
    /// three times this is broken (both ends: the nodes of a cluster should
    /// agree on it). At least 10 ms.
    pub keepalive: Duration,
    /// The first and the longest wait before dialing a peer again.
    pub reconnect_backoff: (Duration, Duration),
    /// How long [`Mesh::lookup`] waits for a peer holding the process
    /// before it gives up (when not every peer answered "no" sooner).
    /// Zero turns lookups off: they find nothing and ask no peer (this
    /// node still answers its peers' lookups).
    pub lookup_timeout: Duration,
    /// Mutual TLS on the links, both ways; plain TCP when `None`.
    pub tls: Option<MeshTls>,
}

/// Mutual TLS between nodes: the certificate a node presents when it
/// accepts and when it dials, and how it verifies its peers'.
#[derive(Clone)]
pub struct MeshTls {
    /// The accepting side (requires a peer certificate of the mesh CA).
    pub server: Arc<crate::tls::ServerTls>,
    /// The dialing side (verifies the peer against the mesh CA and
    /// presents the same certificate).
    pub connector: tokio_rustls::TlsConnector,
    /// The name a peer's certificate must carry; by default the host part
    /// of the address dialed.
    pub server_name: Option<String>,
}

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTls")
            .field("server", &self.server)
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl MeshTls {
    /// Loads `cluster.mesh_tls`; the error names the file at fault.
    pub fn load(config: &crate::config::MeshTlsConfig) -> anyhow::Result<MeshTls> {
        use anyhow::Context as _;
        let server = crate::tls::ServerTls::load(&config.into())
            .context("loading the mesh TLS certificate (cluster.mesh_tls)")?;
        let connector = server
            .peer_connector(&config.ca)
            .context("loading the mesh CA (cluster.mesh_tls.ca)")?;
        Ok(MeshTls {
            server: Arc::new(server),
            connector,
            server_name: config.server_name.clone(),
        })
    }

    /// The name a peer dialed at `addr` (`host:port`) must prove.
    fn server_name_for(
        &self,
        addr: &str,
    ) -> Result<rustls::pki_types::ServerName<'static>, String> {
        let host = match &self.server_name {
            Some(name) => name.as_str(),
            None => host_of(addr),
        };
        rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| format!("`{host}` is not a name a certificate can carry: {e}"))
    }
}

/// The host part of `host:port` (brackets of an IPv6 address removed).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

impl std::fmt::Debug for MeshOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshOptions")
            .field("node_id", &self.node_id)
            .field("secret", &"<redacted>")
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("link_queue", &self.link_queue)
            .field("connect_timeout", &self.connect_timeout)
            .field("keepalive", &self.keepalive)
            .field("reconnect_backoff", &self.reconnect_backoff)
            .field("lookup_timeout", &self.lookup_timeout)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for MeshOptions {
    fn default() -> Self {
        MeshOptions {
            node_id: "node".to_string(),
            secret: Vec::new(),
            max_frame_bytes: wasmrelay_protocol::DEFAULT_MAX_FRAME_BYTES,
            link_queue: 4096,
            connect_timeout: Duration::from_secs(3),
            keepalive: Duration::from_secs(2),
            reconnect_backoff: (Duration::from_millis(100), Duration::from_secs(2)),
            lookup_timeout: DEFAULT_LOOKUP_TIMEOUT,
            tls: None,
        }
    }
}

/// Set (to anything) in a node's environment, turns its mesh lookups off
/// ([`MeshOptions::lookup_timeout`] zero): for the tests of what heals a
/// missed route without them (anti-entropy).
pub const NO_LOOKUPS_ENV: &str = "WASMRELAY_TEST_NO_MESH_LOOKUPS";

/// How long a lookup waits for its answers by default.
pub const DEFAULT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);

/// Lookups waiting for their answer on one link at most; a peer asked while
/// this many are waiting counts as having said "no".
pub const MAX_PENDING_LOOKUPS: usize = 1024;

/// A peer that answered a lookup: the process is connected to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupFound {
    /// The peer's node id.
    pub node: String,
    /// The generation of the process's registration there, as its route
    /// record carries it; 0 when the peer has not given it one yet.
    pub generation: u64,
}

/// How this node answers a peer's `MeshLookup` for a process connected
/// here (the route table): the generation of its registration, and having
/// its route record written again so the nodes that missed it learn it.
pub trait LookupAnswerer: Send + Sync + std::fmt::Debug + 'static {
    /// `process_id` is connected here and a peer asked for it: returns the
    /// generation of its registration (0 when it has none yet) and may
    /// write its route again (rate-limited by the implementation).
    fn asked_for(&self, process_id: &str) -> u64;

    /// A peer's reader of the routes topic never got offsets `from..to` of
    /// `partition`: write again what this node wrote there (as it stands
    /// now).
    fn records_missed(&self, partition: i32, from: i64, to: i64);
}

/// How a forward ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForwardOutcome {
    /// The process on the other node acknowledged it.
    Delivered,
    /// The process is not connected to that node (any more); the reason.
    NotHere(String),
    /// The process refused it, or its connection ended before it answered;
    /// the reason.
    Failed(String),
    /// The link broke (or the peer was dropped) before the answer came: the
    /// message may or may not have reached the process.
    Lost(String),
}

/// Why a forward was not even queued.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// The node is not in the peer set.
    #[error("node `{0}` is not a mesh peer of this node")]
    UnknownNode(String),
    /// The node is a peer, but no authenticated link to it is up now.
    #[error("no mesh link to node `{0}` is up")]
    NotLinked(String),
    /// The link's queue is full: the peer does not read fast enough.
    #[error("the mesh link to node `{node_id}` has {capacity} frames queued already")]
    QueueFull {
        /// The peer.
        node_id: String,
        /// The queue's capacity ([`MeshOptions::link_queue`]).
        capacity: usize,
    },
    /// As many forwards to the process as the peer holds are unanswered
    /// on the link already ([`Mesh::try_forward`]; [`Mesh::forward`] waits
    /// for room instead).
    #[error(
        "{window} forwards to process `{process_id}` are unanswered on the mesh link to node `{node_id}` already"
    )]
    WindowFull {
        /// The peer.
        node_id: String,
        /// The process.
        process_id: String,
        /// [`FORWARDS_WAITING_PER_PROCESS`].
        window: usize,
    },
    /// The forward would be larger than the largest frame.
    #[error("a forward of {bytes} bytes is larger than the maximum frame of {max} bytes")]
    TooLarge {
        /// The encoded frame's size.
        bytes: usize,
        /// [`MeshOptions::max_frame_bytes`].
        max: usize,
    },
    /// The mesh was closed (the node is shutting down).
    #[error("the mesh is closed")]
    Closed,
}

/// A forward queued on a link: resolves with its outcome. Its room in the
/// process's window is given back when the outcome arrives, whether or not
/// this is still awaited.
#[derive(Debug)]
pub struct Forwarded {
    answer: oneshot::Receiver<ForwardOutcome>,
}

impl std::future::Future for Forwarded {
    type Output = Result<ForwardOutcome, oneshot::error::RecvError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.answer).poll(cx)
    }
}

/// Counters of the mesh, read by metrics and the admin API.
#[derive(Debug, Default)]
pub struct MeshStats {
    forwards_sent: AtomicU64,
    forwards_delivered: AtomicU64,
    forwards_not_here: AtomicU64,
    forwards_failed: AtomicU64,
    forwards_lost: AtomicU64,
    forwards_received: AtomicU64,
    links_established: AtomicU64,
    links_broken: AtomicU64,
    dial_failures: AtomicU64,
    links_accepted: AtomicU64,
    unauthorized: AtomicU64,
    protocol_errors: AtomicU64,
    lookups_sent: AtomicU64,
    lookups_found: AtomicU64,
    lookups_not_found: AtomicU64,
    lookups_received: AtomicU64,
    rewrites_asked: AtomicU64,
    rewrites_asked_by_peers: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl MeshStats {
    /// Forwards queued on outgoing links.
    pub fn forwards_sent(&self) -> u64 {
        self.forwards_sent.load(Ordering::Relaxed)
    }

    /// Forwards the peer answered as delivered.
    pub fn forwards_delivered(&self) -> u64 {
        self.forwards_delivered.load(Ordering::Relaxed)
    }

    /// Forwards the peer answered with "not here".
    pub fn forwards_not_here(&self) -> u64 {
        self.forwards_not_here.load(Ordering::Relaxed)
    }

    /// Forwards the peer answered as failed (nacked, or the process's
    /// connection ended).
    pub fn forwards_failed(&self) -> u64 {
        self.forwards_failed.load(Ordering::Relaxed)
    }

    /// Forwards whose link broke before the answer.
    pub fn forwards_lost(&self) -> u64 {
        self.forwards_lost.load(Ordering::Relaxed)
    }

    /// Forwards received from peers and handed to the gateway (or answered
    /// "not here").
    pub fn forwards_received(&self) -> u64 {
        self.forwards_received.load(Ordering::Relaxed)
    }

    /// Outgoing links authenticated.
    pub fn links_established(&self) -> u64 {
        self.links_established.load(Ordering::Relaxed)
    }

    /// Authenticated outgoing links that broke or were closed.
    pub fn links_broken(&self) -> u64 {
        self.links_broken.load(Ordering::Relaxed)
    }

    /// Attempts to dial a peer that did not end in an authenticated link.
    pub fn dial_failures(&self) -> u64 {
        self.dial_failures.load(Ordering::Relaxed)
    }

    /// Incoming links authenticated.
    pub fn links_accepted(&self) -> u64 {
        self.links_accepted.load(Ordering::Relaxed)
    }

    /// Incoming links refused because their `MeshHello` did not
    /// authenticate (wrong secret, wrong node, clock skew, replay), outgoing
    /// ones whose `MeshWelcome` did not, and links (either way) closed for a
    /// frame after the handshake that did not authenticate (unsealed, a bad
    /// MAC, out of sequence).
    pub fn unauthorized(&self) -> u64 {
        self.unauthorized.load(Ordering::Relaxed)
    }

    /// Links closed for bad frames or protocol violations, either way.
    pub fn protocol_errors(&self) -> u64 {
        self.protocol_errors.load(Ordering::Relaxed)
    }

    /// `MeshLookup`s sent to peers (one per peer asked).
    pub fn lookups_sent(&self) -> u64 {
        self.lookups_sent.load(Ordering::Relaxed)
    }

    /// Lookups ([`Mesh::lookup`]) a peer answered with "connected here".
    pub fn lookups_found(&self) -> u64 {
        self.lookups_found.load(Ordering::Relaxed)
    }

    /// Lookups that found the process nowhere: every peer said no, none was
    /// linked, or the time ran out first.
    pub fn lookups_not_found(&self) -> u64 {
        self.lookups_not_found.load(Ordering::Relaxed)
    }

    /// `MeshLookup`s received from peers and answered.
    pub fn lookups_received(&self) -> u64 {
        self.lookups_received.load(Ordering::Relaxed)
    }

    /// `MeshRecordsMissed` sent to peers (one per peer asked).
    pub fn rewrites_asked(&self) -> u64 {
        self.rewrites_asked.load(Ordering::Relaxed)
    }

    /// `MeshRecordsMissed` received from peers.
    pub fn rewrites_asked_by_peers(&self) -> u64 {
        self.rewrites_asked_by_peers.load(Ordering::Relaxed)
    }
}

/// State shared by the mesh handle and the tasks of its outgoing links.
struct Shared {
    options: MeshOptions,
    stats: MeshStats,
    /// Outgoing links, by peer node id.
    peers: Mutex<HashMap<String, Arc<PeerSlot>>>,
    /// The peers with an authenticated outgoing link now.
    linked: watch::Sender<BTreeSet<String>>,
    /// Cancelled by [`Mesh::close`]; every peer's token is a child.
    closed: CancellationToken,
    /// The tasks of the outgoing links.
    tasks: TaskTracker,
}

impl Shared {
    fn lock_peers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<PeerSlot>>> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Recomputes the set of linked peers and tells the watchers if it
    /// changed.
    fn publish_linked(&self) {
        let now: BTreeSet<String> = self
            .lock_peers()
            .values()
            .filter(|slot| slot.link().is_some())
            .map(|slot| slot.node_id().to_string())
            .collect();
        self.linked.send_if_modified(|linked| {
            if *linked == now {
                false
            } else {
                *linked = now;
                true
            }
        });
    }
}

/// This node's end of the mesh: its outgoing links to every peer, and the
/// listener for the peers' links.
pub struct Mesh {
    shared: Arc<Shared>,
    gateway: Arc<Gateway>,
    replays: server::ReplayGuard,
    /// Where the generation of a process held here comes from, for the
    /// peers' lookups; without it they are answered from the gateway alone
    /// (generation 0).
    answerer: std::sync::OnceLock<Arc<dyn LookupAnswerer>>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("node_id", &self.shared.options.node_id)
            .field("linked", &self.linked())
            .finish_non_exhaustive()
    }
}

impl Mesh {
    /// A mesh with no peers yet, handing forwards it receives to `gateway`.
    pub fn new(options: MeshOptions, gateway: Arc<Gateway>) -> Arc<Mesh> {
        let (linked, _) = watch::channel(BTreeSet::new());
        Arc::new(Mesh {
            shared: Arc::new(Shared {
                options,
                stats: MeshStats::default(),
                peers: Mutex::new(HashMap::new()),
                linked,
                closed: CancellationToken::new(),
                tasks: TaskTracker::new(),
            }),
            gateway,
            replays: server::ReplayGuard::default(),
            answerer: std::sync::OnceLock::new(),
        })
    }

    /// Answers the peers' lookups for processes connected here with
    /// `answerer` (the route table): the generation of their registration,
    /// and their route written again. Set once; later calls are ignored.
    pub fn answer_lookups_with(&self, answerer: Arc<dyn LookupAnswerer>) {
        let _ = self.answerer.set(answerer);
    }

    /// Accepts the peers' links on `listener` until `shutdown`.
    ///
    /// A dialer must authenticate first: its `MeshHello` must carry a valid
    /// MAC of the cluster secret, name this node as `to_node_id`, have a
    /// clock within a minute of ours and a nonce not seen before; it is
    /// answered with `MeshWelcome`, after which every frame either way is
    /// sealed with the link's session keys. Then each `Forward` is handed to the
    /// gateway in the order it arrived, and answered with a `ForwardAck`
    /// when the process answers (in any order): `DELIVERED` when it acked,
    /// `FAILED` when it nacked or its connection ended, `NOT_HERE` at once
    /// when it is not connected here. Bad frames and failed authentication
    /// get an `Error` frame and the link is closed; other links are not
    /// affected.
    ///
    /// On `shutdown`, stops accepting, tells every incoming link the node is
    /// shutting down, closes the outgoing links ([`Mesh::close`]) and
    /// returns when the incoming links have closed.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: CancellationToken) {
        server::serve(self, listener, shutdown).await;
    }

    /// Sets the live peers (node id → mesh address) as membership sees
    /// them; this node's own id is ignored. New peers are dialled; a peer
    /// whose address changed is dialled at the new one; links to peers no
    /// longer in the set are closed and their forwards waiting for an answer
    /// resolve as [`ForwardOutcome::Lost`]. A link that breaks is dialled
    /// again, with backoff, while its peer stays in the set. Idempotent:
    /// call it whenever the membership view changes. Does nothing once the
    /// mesh is closed. Must be called within a Tokio runtime.
    pub fn set_peers(&self, peers: BTreeMap<String, String>) {
        if self.shared.closed.is_cancelled() {
            return;
        }
        let mut dropped = Vec::new();
        {
            let mut slots = self.shared.lock_peers();
            slots.retain(|node_id, slot| {
                let keep = peers.get(node_id).is_some_and(|addr| addr == slot.addr());
                if !keep {
                    dropped.push(slot.clone());
                }
                keep
            });
            for (node_id, addr) in peers {
                if node_id == self.shared.options.node_id || slots.contains_key(&node_id) {
                    continue;
                }
                tracing::info!(peer = %node_id, %addr, "mesh: dialing a new peer");
                let slot = Arc::new(PeerSlot::new(
                    node_id.clone(),
                    addr,
                    self.shared.closed.child_token(),
                ));
                self.shared
                    .tasks
                    .spawn(link::supervise(self.shared.clone(), slot.clone()));
                slots.insert(node_id, slot);
            }
        }
        for slot in dropped {
            tracing::info!(peer = %slot.node_id(), addr = %slot.addr(), "mesh: dropping a peer");
            slot.stop(
                &format!("node `{}` left the peer set (or moved)", slot.node_id()),
                &self.shared.stats,
            );
        }
        self.shared.publish_linked();
    }

    /// Queues a `Forward` of `parcel` (a message for its process) on the
    /// link to `node_id`, in order with the other forwards queued on it, and returns
    /// where its outcome arrives. Waits while as many forwards to the
    /// process as the peer holds ([`FORWARDS_WAITING_PER_PROCESS`]) are
    /// unanswered on the link, so the peer never has to refuse one for
    /// that. Refused when that node is not a peer, no authenticated link to
    /// it is up (or it closes while waiting), its queue is full, or the
    /// frame would be too large; the caller then retries or routes
    /// elsewhere.
    pub async fn forward(
        &self,
        node_id: &str,
        parcel: Arc<Parcel>,
    ) -> Result<Forwarded, MeshError> {
        let link = self.link(node_id)?;
        let room = match link.try_room(&parcel.process_id) {
            Ok(room) => room,
            Err(_) => link.room(&parcel.process_id).await?,
        };
        link.forward(&self.shared.stats, room, parcel)
    }

    /// [`Mesh::forward`] without waiting: refused ([`MeshError::WindowFull`])
    /// when the process's window is full, the parcel left with the caller.
    pub fn try_forward_parcel(
        &self,
        node_id: &str,
        parcel: &Arc<Parcel>,
    ) -> Result<Forwarded, MeshError> {
        let link = self.link(node_id)?;
        let room = link.try_room(&parcel.process_id)?;
        link.forward(&self.shared.stats, room, parcel.clone())
    }

    /// [`Mesh::forward`] of `message` for `process_id`, without waiting: refused
    /// ([`MeshError::WindowFull`]) when the process's window is full.
    pub fn try_forward(
        &self,
        node_id: &str,
        process_id: &str,
        delivery_id: String,
        message: v1::Message,
    ) -> Result<Forwarded, MeshError> {
        let link = self.link(node_id)?;
        let room = link.try_room(process_id)?;
        let parcel = Arc::new(Parcel {
            process_id: process_id.to_string(),
            delivery_id,
            message: message.into(),
        });
        link.forward(&self.shared.stats, room, parcel)
    }

    /// The link to `node_id`, if one is up.
    fn link(&self, node_id: &str) -> Result<Arc<link::Link>, MeshError> {
        if self.shared.closed.is_cancelled() {
            return Err(MeshError::Closed);
        }
        let slot = self
            .shared
            .lock_peers()
            .get(node_id)
            .cloned()
            .ok_or_else(|| MeshError::UnknownNode(node_id.to_string()))?;
        slot.link()
            .ok_or_else(|| MeshError::NotLinked(node_id.to_string()))
    }

    /// Asks every peer linked now, at once, whether `process_id` is
    /// connected to it. Resolves with the first peer that says so, or
    /// `None` once every peer said no (or its link broke first), at once
    /// when no peer is linked, and after [`MeshOptions::lookup_timeout`] at
    /// the latest. A peer with [`MAX_PENDING_LOOKUPS`] lookups waiting on
    /// its link is not asked. Dropping the future forgets its lookups.
    pub fn lookup(&self, process_id: &str) -> BoxFuture<'static, Option<LookupFound>> {
        let off = self.shared.options.lookup_timeout.is_zero();
        let links: Vec<_> = if off || self.shared.closed.is_cancelled() {
            Vec::new()
        } else {
            self.shared
                .lock_peers()
                .values()
                .filter_map(|slot| slot.link())
                .collect()
        };
        let mut answers: FuturesUnordered<_> = links
            .into_iter()
            .filter_map(|link| link.lookup(&self.shared.stats, process_id))
            .map(link::AskedLookup::answer)
            .collect();
        let shared = self.shared.clone();
        async move {
            let first_found = async {
                while let Some((node, answer)) = answers.next().await {
                    if let Some(generation) = answer {
                        return Some(LookupFound { node, generation });
                    }
                }
                None
            };
            let found = tokio::time::timeout(shared.options.lookup_timeout, first_found)
                .await
                .unwrap_or(None);
            bump(if found.is_some() {
                &shared.stats.lookups_found
            } else {
                &shared.stats.lookups_not_found
            });
            found
        }
        .boxed()
    }

    /// Asks every linked peer to write again the route records it wrote at
    /// offsets `from..to` of `partition` (this node's reader never got
    /// them); returns how many peers were asked. A peer whose link is
    /// down or full is not: anti-entropy is left for it.
    pub fn ask_to_rewrite(&self, partition: i32, from: i64, to: i64) -> usize {
        let links: Vec<_> = self
            .shared
            .lock_peers()
            .values()
            .filter_map(|slot| slot.link())
            .collect();
        let asked = links
            .iter()
            .filter(|link| link.records_missed(partition, from, to))
            .count();
        self.shared
            .stats
            .rewrites_asked
            .fetch_add(asked as u64, Ordering::Relaxed);
        asked
    }

    /// A peer's reader missed offsets `from..to` of `partition` of the
    /// routes topic: the route table writes again what this node wrote
    /// there.
    fn rewrite_for_peer(&self, partition: i32, from: i64, to: i64) {
        bump(&self.shared.stats.rewrites_asked_by_peers);
        if let Some(answerer) = self.answerer.get() {
            answerer.records_missed(partition, from, to);
        }
    }

    /// Lookups waiting for their answer on the link to `node_id` now;
    /// `None` when no link to it is up.
    pub fn pending_lookups(&self, node_id: &str) -> Option<usize> {
        let link = self.shared.lock_peers().get(node_id)?.link()?;
        Some(link.pending_lookups())
    }

    /// The answer to a peer's lookup for `process_id`: its generation when
    /// it is connected here (the route table asked to write its route
    /// again), `None` when it is not.
    fn answer_lookup(&self, process_id: &str) -> Option<u64> {
        bump(&self.shared.stats.lookups_received);
        self.gateway.session(process_id)?;
        Some(
            self.answerer
                .get()
                .map_or(0, |answerer| answerer.asked_for(process_id)),
        )
    }

    /// The peers with an authenticated outgoing link now, sorted.
    pub fn linked(&self) -> Vec<String> {
        self.shared.linked.borrow().iter().cloned().collect()
    }

    /// Follows the set of peers with an authenticated outgoing link.
    pub fn watch_linked(&self) -> watch::Receiver<BTreeSet<String>> {
        self.shared.linked.subscribe()
    }

    /// Waits until every one of `nodes` has an authenticated outgoing link
    /// (wrap it in a timeout).
    pub async fn wait_linked(&self, nodes: &[&str]) {
        let mut linked = self.shared.linked.subscribe();
        // The sender lives as long as `self`, so this only ends when done.
        let _ = linked
            .wait_for(|linked| nodes.iter().all(|node| linked.contains(*node)))
            .await;
    }

    /// Closes every outgoing link (their forwards waiting for an answer
    /// resolve as [`ForwardOutcome::Lost`]) and refuses new forwards and
    /// peers from now on. Idempotent. Incoming links close when
    /// [`Mesh::serve`]'s shutdown is cancelled (which calls this too).
    pub fn close(&self) {
        self.shared.closed.cancel();
        let slots: Vec<_> = self.shared.lock_peers().drain().map(|(_, s)| s).collect();
        for slot in slots {
            slot.stop("the mesh is shutting down", &self.shared.stats);
        }
        self.shared.tasks.close();
        self.shared.publish_linked();
    }

    /// Waits until the tasks of the outgoing links have ended (after
    /// [`Mesh::close`]).
    pub async fn closed(&self) {
        self.shared.tasks.wait().await;
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.shared.options.node_id
    }

    /// The mesh's options.
    pub fn options(&self) -> &MeshOptions {
        &self.shared.options
    }

    /// The mesh's counters.
    pub fn stats(&self) -> &MeshStats {
        &self.shared.stats
    }

    fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.close();
    }
}

/// Milliseconds since the Unix epoch, by this node's clock.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The keepalive interval, at least [`MIN_KEEPALIVE`].
fn keepalive(options: &MeshOptions) -> Duration {
    options.keepalive.max(MIN_KEEPALIVE)
}

/// The shortest keepalive interval used, whatever the options say.
const MIN_KEEPALIVE: Duration = Duration::from_millis(10);
