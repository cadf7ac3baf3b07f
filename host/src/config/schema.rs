//! The relay's config file (TOML), as Rust types: every field documented,
//! unknown keys rejected, defaults as functions. Loading, `${VAR}`
//! interpolation and validation live in the parent module.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::secret::Secret;
use crate::gateway::GatewayOptions;
use crate::kafka::DeliveryOrder;
use crate::plugin::PluginLimits;

/// The whole config file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// This relay node.
    #[serde(default)]
    pub node: NodeConfig,
    /// The admin HTTP listener (health, readiness, metrics, state).
    #[serde(default)]
    pub admin: AdminConfig,
    /// Where plugins come from and the limits they run under.
    pub plugins: PluginsConfig,
    /// The config center Kafka connection info is read from (`kafka.<link>`).
    #[serde(default)]
    pub center: Option<CenterConfig>,
    /// Kafka connections by link id (`[links.main]`). Flows name a link.
    pub links: BTreeMap<String, LinkConfig>,
    /// The message flows (`[[flows]]`).
    pub flows: Vec<FlowConfig>,
    /// Cluster membership, the client listener for business processes, and
    /// the mesh between nodes (`[cluster]`); needed by a flow that delivers
    /// to the cluster.
    #[serde(default)]
    pub cluster: Option<ClusterConfig>,
    /// How long a graceful shutdown may take to finish in-flight work.
    #[serde(default = "default_shutdown_grace", with = "super::duration")]
    pub shutdown_grace: Duration,
}

/// This relay node.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// The node's id: in logs, metrics, and (for clusters) the node table.
    /// Defaults to the host name.
    #[serde(default = "default_node_id")]
    pub id: String,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            id: default_node_id(),
        }
    }
}

/// The admin HTTP listener, apart from the data path.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address to listen on. Localhost by default: expose it deliberately.
    /// Off loopback a `token` is required (or `allow_unauthenticated`).
    #[serde(default = "default_admin_listen")]
    pub listen: SocketAddr,
    /// Bearer token (`Authorization: Bearer <token>`) required by every
    /// endpoint but `/healthz` and `/readyz`, and by every request that is
    /// not a `GET` or `HEAD` (those may change state) whatever the address.
    /// Without it the read-only endpoints answer whoever reaches the
    /// listener, so it is required when `listen` is not a loopback address.
    #[serde(default)]
    pub token: Option<Secret>,
    /// Serve the read-only endpoints without a token on an address that is
    /// not loopback (metrics and state for anyone who can reach it). Off by
    /// default; logs a warning at start when it takes effect.
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// How long a client may take to send a whole request head (request
    /// line and headers) from its first byte; then the connection is closed.
    #[serde(default = "default_admin_header_timeout", with = "super::duration")]
    pub header_timeout: Duration,
    /// How long a connection may stay open with no request in progress and
    /// nothing sent (a keep-alive connection between requests, or one that
    /// never sends anything); then it is closed.
    #[serde(default = "default_admin_idle_timeout", with = "super::duration")]
    pub idle_timeout: Duration,
    /// Admin connections open at once, at most; a connection beyond them is
    /// closed as soon as it is accepted (counted in
    /// `wasmrelay_admin_connections_refused_total`).
    #[serde(default = "default_admin_max_connections")]
    pub max_connections: usize,
    /// Serve the admin API over TLS (HTTPS) with this certificate;
    /// `client_ca` makes clients present a certificate of that CA.
    #[serde(default)]
    pub tls: Option<ListenerTlsConfig>,
}

impl AdminConfig {
    /// Whether `listen` is a loopback address (an IPv4 one written as IPv6,
    /// `::ffff:127.0.0.1`, too). The unspecified address (`0.0.0.0`, `::`)
    /// is not: it listens on every interface.
    pub fn on_loopback(&self) -> bool {
        self.listen.ip().to_canonical().is_loopback()
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: default_admin_listen(),
            token: None,
            allow_unauthenticated: false,
            header_timeout: default_admin_header_timeout(),
            idle_timeout: default_admin_idle_timeout(),
            max_connections: default_admin_max_connections(),
            tls: None,
        }
    }
}

/// Plugins: the watched directory, per-plugin config, limits.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsConfig {
    /// Directory of `*.wasm` components; a plugin's name is its file name
    /// without `.wasm`. Watched for new versions.
    pub dir: PathBuf,
    /// Whether to watch the directory and swap in new versions.
    #[serde(default = "default_true")]
    pub watch: bool,
    /// Longest one plugin call may run.
    #[serde(default = "default_call_deadline", with = "super::duration")]
    pub call_deadline: Duration,
    /// Largest memory of one plugin instance, in MiB.
    #[serde(default = "default_memory_cap_mib")]
    pub memory_cap_mib: u64,
    /// Config values of each plugin by plugin name
    /// (`[plugins.config.json-enrich] field = "x"`).
    #[serde(default)]
    pub config: BTreeMap<String, BTreeMap<String, String>>,
}

/// Where live Kafka connection info comes from (`[center]`): a tagged
/// table, `kind = "dir"` or `kind = "etcd"`, each kind with its own keys.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum CenterConfig {
    /// A directory of files, e.g. a mounted Kubernetes ConfigMap: each file
    /// name is a key, its content the value.
    Dir(DirCenterConfig),
    /// Keys under a prefix in etcd (v3 API).
    Etcd(EtcdCenterConfig),
}

impl CenterConfig {
    /// How long a link waits at start for its key before the relay gives up.
    pub fn wait_for_key(&self) -> Duration {
        match self {
            CenterConfig::Dir(dir) => dir.wait_for_key,
            CenterConfig::Etcd(etcd) => etcd.wait_for_key,
        }
    }

    /// How long a new cluster may take to answer before a switch is refused.
    pub fn probe_timeout(&self) -> Duration {
        match self {
            CenterConfig::Dir(dir) => dir.probe_timeout,
            CenterConfig::Etcd(etcd) => etcd.probe_timeout,
        }
    }

    /// How long the old cluster is drained after a switch.
    pub fn drain_timeout(&self) -> Duration {
        match self {
            CenterConfig::Dir(dir) => dir.drain_timeout,
            CenterConfig::Etcd(etcd) => etcd.drain_timeout,
        }
    }

    /// The directory files named by center values must lie in, if any.
    pub fn files_dir(&self) -> Option<&std::path::Path> {
        match self {
            CenterConfig::Dir(dir) => dir.files_dir.as_deref(),
            CenterConfig::Etcd(etcd) => etcd.files_dir.as_deref(),
        }
    }
}

/// A directory center (`kind = "dir"`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DirCenterConfig {
    /// The directory.
    pub dir: PathBuf,
    /// How long a link waits at start for its key before the relay gives up.
    #[serde(default = "default_wait_for_key", with = "super::duration")]
    pub wait_for_key: Duration,
    /// How long a new cluster may take to answer before a switch is refused.
    #[serde(default = "default_probe_timeout", with = "super::duration")]
    pub probe_timeout: Duration,
    /// How long the old cluster is drained after a switch; what is left
    /// there after that is reported.
    #[serde(default = "default_drain_timeout", with = "super::duration")]
    pub drain_timeout: Duration,
    /// The directory files named by a center value (`ssl.ca.location`,
    /// `ssl.certificate.location`, `ssl.key.location`, `ssl.crl.location`,
    /// `sasl.kerberos.keytab`...) must lie in, e.g. a mounted Secret; a
    /// relative path in a value is taken inside it. Without it a center
    /// value may name no file (TLS material is then given inline as PEM).
    #[serde(default)]
    pub files_dir: Option<PathBuf>,
}

/// An etcd center (`kind = "etcd"`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdCenterConfig {
    /// etcd client URLs, e.g. `["http://10.0.0.5:2379"]`.
    pub endpoints: Vec<String>,
    /// Only etcd keys under this prefix are read, named without it:
    /// `/wasmrelay/kafka.main` is key `kafka.main` with prefix `/wasmrelay/`.
    #[serde(default)]
    pub prefix: String,
    /// etcd user and password, when etcd has authentication enabled
    /// (`[center.auth] user = "relay"`, `password = "${ETCD_PASSWORD}"`).
    /// Only over TLS (`https://` endpoints), unless
    /// `allow_plaintext_password` says otherwise.
    #[serde(default)]
    pub auth: Option<EtcdAuth>,
    /// TLS to etcd, required with `https://` endpoints (`[center.tls]`).
    #[serde(default)]
    pub tls: Option<EtcdTls>,
    /// Sends the etcd password over plaintext `http://` (development only;
    /// logged as a warning at start).
    #[serde(default)]
    pub allow_plaintext_password: bool,
    /// How long a link waits at start for its key before the relay gives up.
    #[serde(default = "default_wait_for_key", with = "super::duration")]
    pub wait_for_key: Duration,
    /// How long a new cluster may take to answer before a switch is refused.
    #[serde(default = "default_probe_timeout", with = "super::duration")]
    pub probe_timeout: Duration,
    /// How long the old cluster is drained after a switch; what is left
    /// there after that is reported.
    #[serde(default = "default_drain_timeout", with = "super::duration")]
    pub drain_timeout: Duration,
    /// The directory files named by a center value (`ssl.ca.location`,
    /// `ssl.certificate.location`, `ssl.key.location`, `ssl.crl.location`,
    /// `sasl.kerberos.keytab`...) must lie in, e.g. a mounted Secret; a
    /// relative path in a value is taken inside it. Without it a center
    /// value may name no file (TLS material is then given inline as PEM).
    #[serde(default)]
    pub files_dir: Option<PathBuf>,
}

/// TLS to etcd: whom to trust, and the relay's own certificate if etcd
/// asks for one.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdTls {
    /// The CA certificate (PEM file) that signed etcd's server certificate.
    pub ca: PathBuf,
    /// A client certificate (PEM file), when etcd requires one
    /// (`--client-cert-auth`); with `key`.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM file).
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// The name etcd's certificate is checked against, when it is not the
    /// endpoints' host.
    #[serde(default)]
    pub domain: Option<String>,
}

/// etcd credentials: a user and its password, always together.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdAuth {
    /// The etcd user.
    pub user: String,
    /// Its password (use `${ETCD_PASSWORD}` rather than writing it here).
    pub password: Secret,
}

/// One Kafka connection. `Debug` hides the values of secret options.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LinkConfig {
    /// `bootstrap.servers`: comma-separated `host:port` list. Not used (and
    /// may be omitted) when `from_center` is set.
    #[serde(default)]
    pub bootstrap_servers: String,
    /// Take the connection info from the config center key `kafka.<link id>`
    /// and follow its changes (requires `[center]`).
    #[serde(default)]
    pub from_center: bool,
    /// Other librdkafka properties passed through as they are
    /// (`"security.protocol" = "sasl_ssl"`, `"sasl.username" = "..."`).
    /// Properties the relay manages itself (group.id, enable.auto.commit,
    /// enable.auto.offset.store, ...) are refused here.
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

impl std::fmt::Debug for LinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let options: BTreeMap<&str, &str> = self
            .options
            .iter()
            .map(|(k, v)| {
                let shown = if crate::kafka::link::is_secret(k) {
                    super::REDACTED
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("LinkConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("from_center", &self.from_center)
            .field("options", &options)
            .finish()
    }
}

/// One message flow: consume, process, deliver, return.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FlowConfig {
    /// The flow's name: in logs, metrics and dead-letter headers.
    pub name: String,
    /// The link (a key of `[links]`) the flow consumes from and produces to.
    pub link: String,
    /// Topic to consume.
    pub input_topic: String,
    /// Consumer group; defaults to `wasmrelay-<flow name>`.
    #[serde(default)]
    pub group: Option<String>,
    /// Service-call chain: processor plugins applied in order to each input.
    #[serde(default)]
    pub service_call: Vec<String>,
    /// Where processed service calls go. Without it the flow is a transform:
    /// the service-call chain's output is produced to `output_topic`.
    #[serde(default)]
    pub deliver: Option<DeliverConfig>,
    /// Data-return chain: processor plugins applied in order to the
    /// application's response (or, in a transform flow, after the
    /// service-call chain).
    #[serde(default)]
    pub data_return: Vec<String>,
    /// Topic data-returns (or transform output) are produced to.
    pub output_topic: String,
    /// Topic for messages that cannot be processed or delivered.
    pub dead_letter_topic: String,
    /// Retry policy for failed deliveries and plugin errors.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Which records of a partition wait for each other: `"key"` (the
    /// default: the same key strictly in order, different keys together),
    /// `"partition"` (one at a time) or `"none"`.
    #[serde(default)]
    pub ordering: DeliveryOrder,
    /// Most records of this flow handled at once (chains and delivery;
    /// waiting for Kafka's acknowledgements is not counted).
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
}

fn default_max_in_flight() -> usize {
    crate::kafka::consumer::DEFAULT_MAX_IN_FLIGHT
}

/// Delivery target of a flow.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum DeliverConfig {
    /// HTTP POST to the application beside the relay.
    App(AppTarget),
    /// The business process the message is addressed to, wherever in the
    /// cluster it is connected (`[flows.deliver.cluster]`). Upstream sends
    /// of processes go through this flow's data-return chain to its output
    /// topic.
    Cluster(ClusterTarget),
}

/// How a cluster flow addresses and delivers messages.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterTarget {
    /// A router plugin that names each message's process; without it, the
    /// `process-id` header, else the message key.
    #[serde(default)]
    pub router: Option<String>,
    /// How long a message whose process is not connected (or whose delivery
    /// failed) is retried before it is dead-lettered.
    #[serde(default = "default_delivery_ttl", with = "super::duration")]
    pub ttl: Duration,
}

/// The relay cluster: where processes and other nodes connect, and how
/// nodes find each other through Kafka.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// The link whose Kafka carries heartbeats, routes and alarms.
    pub link: String,
    /// Where business processes connect.
    pub client_listen: SocketAddr,
    /// The client address other nodes and redirects tell processes
    /// (`host:port`); defaults to `client_listen`.
    #[serde(default)]
    pub client_advertise: Option<String>,
    /// TLS on the client listener: processes connect with TLS and verify
    /// this certificate. With `client_ca`, they must also present a
    /// certificate of that CA (mutual TLS; required by
    /// `client_auth = "mtls"`).
    #[serde(default)]
    pub tls: Option<ListenerTlsConfig>,
    /// Where other nodes connect (the mesh).
    pub mesh_listen: SocketAddr,
    /// Mutual TLS on the mesh: every node presents its certificate, both
    /// when it dials and when it accepts, and verifies the other's against
    /// `ca`. Every node of a cluster needs it once one has it.
    #[serde(default)]
    pub mesh_tls: Option<MeshTlsConfig>,
    /// The mesh address other nodes dial; defaults to `mesh_listen`.
    #[serde(default)]
    pub mesh_advertise: Option<String>,
    /// The admin address shown to other nodes; defaults to `admin.listen`.
    #[serde(default)]
    pub admin_advertise: Option<String>,
    /// The shared secret mesh links authenticate with (at least 16
    /// characters; use `${CLUSTER_SECRET}`).
    pub secret: Secret,
    /// How business processes prove the process id their Hello registers:
    /// `"token"` (the default: a signed token checked against
    /// `client_token_keys`), `"mtls"` (the client certificate's common
    /// name, with `[cluster.tls] client_ca`) or `"none"` (development only: anyone who
    /// reaches the client port may register, and so take over, any process
    /// id; a warning is logged at start).
    #[serde(default)]
    pub client_auth: ClientAuthMode,
    /// The keys client tokens are verified with; token mode needs at least
    /// one. Each is `{ alg = "HS256", path = "..." }` (a shared secret: the
    /// file's bytes, without a trailing newline, at least 32),
    /// `{ alg = "HS256", secret = "${CLIENT_TOKEN_KEY}" }` (the same, inline),
    /// or `{ alg = "EdDSA", path = "..." }` (an Ed25519 public key, PEM).
    /// A token is accepted when any key of its `alg` verifies it, so a new
    /// key is added beside the old one while tokens move over. Key files
    /// are re-read when they change; a file that no longer loads keeps the
    /// keys in use and logs an error.
    #[serde(default)]
    pub client_token_keys: Vec<TokenKeyConfig>,
    /// When set, a client token must name this value in its `aud` claim
    /// (e.g. the cluster's name), so tokens of another cluster signed with
    /// the same key are refused.
    #[serde(default)]
    pub client_token_audience: Option<String>,
    /// Topic of node heartbeats.
    #[serde(default = "default_heartbeat_topic")]
    pub heartbeat_topic: String,
    /// Topic of the route table (process id → node), keyed by process id.
    #[serde(default = "default_routes_topic")]
    pub routes_topic: String,
    /// Topic alarms are also written to (JSON), when set.
    #[serde(default)]
    pub alarm_topic: Option<String>,
    /// How often each node publishes its heartbeat.
    #[serde(default = "default_heartbeat_interval", with = "super::duration")]
    pub heartbeat_interval: Duration,
    /// A node is live while its heartbeats arrive within this time.
    #[serde(default = "default_node_timeout", with = "super::duration")]
    pub node_timeout: Duration,
    /// How often a node writes the routes of its processes again
    /// (anti-entropy: a node that missed a route record learns it within
    /// this period), spread over half of it; they are also written at once
    /// when the node rejoins after others saw it as not live.
    #[serde(default = "default_route_refresh_interval", with = "super::duration")]
    pub route_refresh_interval: Duration,
    /// The alarm fires while fewer nodes than this are live.
    #[serde(default = "default_min_live_nodes")]
    pub min_live_nodes: usize,
    /// Stop consuming the cluster flow's input while fewer than
    /// `min_live_nodes` are live (the alarm fires either way), and consume
    /// again when they are back: for clusters that must not run short of
    /// nodes. Off by default: a short cluster goes on consuming.
    #[serde(default)]
    pub pause_below_min_live: bool,
    /// Connections this node is meant to hold (its quota, published in its
    /// heartbeat for placement).
    #[serde(default = "default_connection_quota")]
    pub connection_quota: u64,
    /// Whether this node moves processes to other nodes on its own when
    /// it holds too many of them (see `rebalance_threshold_percent`).
    /// `POST /rebalance` and `POST /evacuate` work either way.
    #[serde(default = "default_rebalance")]
    pub rebalance: bool,
    /// The imbalance condition: this node is overloaded when its count
    /// exceeds its share (the cluster's connections split in proportion
    /// to the quotas) by more than this percentage of the share...
    #[serde(default = "default_rebalance_threshold_percent")]
    pub rebalance_threshold_percent: u32,
    /// ... and by at least this many connections. A round of moves then
    /// goes on until the count is within half of this many of the share.
    #[serde(default = "default_rebalance_min_excess")]
    pub rebalance_min_excess: u64,
    /// Processes moved per second at most, in a rebalance or an
    /// evacuation (`POST /evacuate?rate=` may set a higher one).
    #[serde(default = "default_rebalance_rate")]
    pub rebalance_rate: u32,
    /// How often the node checks the imbalance condition.
    #[serde(default = "default_rebalance_interval", with = "super::duration")]
    pub rebalance_interval: Duration,
    /// Processes must send something at least this often; a connection
    /// silent for three times this is closed.
    #[serde(default = "default_keepalive", with = "super::duration")]
    pub keepalive: Duration,
    /// How long a new connection may take to say Hello.
    #[serde(default = "default_hello_timeout", with = "super::duration")]
    pub hello_timeout: Duration,
    /// Frames queued for one connection before it is closed as too slow.
    #[serde(default = "default_send_queue")]
    pub send_queue: usize,
    /// Deliveries one process may leave unacknowledged; further deliveries
    /// to it wait (holding back its partition) until it answers.
    #[serde(default = "default_max_unacked")]
    pub max_unacked: usize,
    /// How long deliveries may wait for a process that answers none of its
    /// unacknowledged deliveries before it is disconnected as too slow (its
    /// deliveries are then retried wherever it reconnects).
    #[serde(default = "default_slow_consumer_timeout", with = "super::duration")]
    pub slow_consumer_timeout: Duration,
    /// Largest frame accepted from processes and nodes, in bytes.
    #[serde(default = "default_max_frame_bytes")]
    pub max_frame_bytes: usize,
    /// Client connections served at once at most, counted from accept
    /// (before TLS and Hello); one more is closed at once. Default: the
    /// process's open files limit less 1,024 kept for Kafka, the mesh and
    /// HTTP.
    #[serde(default)]
    pub max_connections: Option<usize>,
}

/// How the client port authenticates a Hello (`cluster.client_auth`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuthMode {
    /// A signed token (JWT) valid for the process id, in `Hello.token`.
    #[default]
    Token,
    /// The client certificate of a mutual TLS connection
    /// (`cluster.tls.client_ca`): its subject common name is the process id
    /// it may register, or a prefix pattern ending in `*`.
    Mtls,
    /// No check at all: for development on a trusted machine only.
    None,
}

/// TLS on a listener: the certificate it presents, and optionally the CA
/// its clients' certificates must be signed by. The files are re-read when
/// they change; connections open at that moment keep going.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTlsConfig {
    /// The certificate chain (PEM), the listener's own certificate first.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA
    /// (PEM): mutual TLS.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

/// Mutual TLS between the nodes of a cluster (`cluster.mesh_tls`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MeshTlsConfig {
    /// This node's certificate chain (PEM): presented to the nodes that
    /// dial it and to the nodes it dials.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA (PEM) every node's certificate must be signed by.
    pub ca: PathBuf,
    /// The name a node's certificate must carry; by default the host part
    /// of the mesh address it advertises (so each node's certificate names
    /// its own address).
    #[serde(default)]
    pub server_name: Option<String>,
}

/// A key client tokens are verified with (`cluster.client_token_keys`):
/// its algorithm and either a file or, for HS256, an inline secret.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenKeyConfig {
    /// The JWT algorithm the key verifies: `"HS256"` or `"EdDSA"`.
    pub alg: TokenAlgorithm,
    /// The key file: the HS256 secret's bytes (a trailing newline is not
    /// part of it), or an Ed25519 public key in PEM (`BEGIN PUBLIC KEY`).
    /// Re-read when it changes.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// An HS256 secret given inline (use `${VAR}`), instead of `path`.
    #[serde(default)]
    pub secret: Option<Secret>,
}

/// The signature algorithms a client token may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub enum TokenAlgorithm {
    /// HMAC-SHA256 with a shared secret.
    #[serde(rename = "HS256", alias = "hs256")]
    Hs256,
    /// Ed25519 signatures: the relay holds only the public key.
    #[serde(rename = "EdDSA", alias = "eddsa")]
    EdDsa,
}

impl std::fmt::Display for TokenAlgorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenAlgorithm::Hs256 => "HS256",
            TokenAlgorithm::EdDsa => "EdDSA",
        })
    }
}

/// The application endpoint of a sidecar flow.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AppTarget {
    /// URL the message value is POSTed to (`http://127.0.0.1:8080/calls`).
    pub url: String,
    /// Time allowed for one request.
    #[serde(default = "default_app_timeout", with = "super::duration")]
    pub timeout: Duration,
    /// Most requests in flight to the application across all partitions.
    #[serde(default = "default_app_concurrency")]
    pub concurrency: usize,
    /// For an `https://` URL: a CA certificate (PEM file) trusted besides
    /// the system's roots, e.g. an internal CA that signed the
    /// application's certificate.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// The application speaks HTTP/2 only: h2c (prior knowledge) over
    /// `http://`, h2 the only protocol offered by ALPN over `https://`.
    /// Off: HTTP/1.1 over `http://`, HTTP/2 over `https://` when the
    /// application offers it.
    #[serde(default)]
    pub http2_only: bool,
}

/// Retry with exponential backoff, bounded by a time budget.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// First wait after a failure.
    #[serde(default = "default_initial_backoff", with = "super::duration")]
    pub initial_backoff: Duration,
    /// Longest wait between two attempts.
    #[serde(default = "default_max_backoff", with = "super::duration")]
    pub max_backoff: Duration,
    /// Total time spent retrying one message before it is dead-lettered.
    #[serde(default = "default_retry_budget", with = "super::duration")]
    pub budget: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            initial_backoff: default_initial_backoff(),
            max_backoff: default_max_backoff(),
            budget: default_retry_budget(),
        }
    }
}

fn default_delivery_ttl() -> Duration {
    Duration::from_secs(60)
}

fn default_heartbeat_topic() -> String {
    "wasmrelay.heartbeats".to_string()
}

fn default_routes_topic() -> String {
    "wasmrelay.routes".to_string()
}

fn default_heartbeat_interval() -> Duration {
    Duration::from_secs(1)
}

fn default_node_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_route_refresh_interval() -> Duration {
    Duration::from_secs(300)
}

fn default_min_live_nodes() -> usize {
    1
}

fn default_connection_quota() -> u64 {
    100_000
}

fn default_rebalance() -> bool {
    true
}

fn default_rebalance_threshold_percent() -> u32 {
    10
}

fn default_rebalance_min_excess() -> u64 {
    10
}

fn default_rebalance_rate() -> u32 {
    50
}

fn default_rebalance_interval() -> Duration {
    Duration::from_secs(5)
}

fn default_keepalive() -> Duration {
    GatewayOptions::default().keepalive
}

fn default_hello_timeout() -> Duration {
    GatewayOptions::default().hello_timeout
}

fn default_send_queue() -> usize {
    GatewayOptions::default().send_queue
}

fn default_max_unacked() -> usize {
    GatewayOptions::default().max_unacked
}

fn default_slow_consumer_timeout() -> Duration {
    GatewayOptions::default().slow_consumer_timeout
}

fn default_max_frame_bytes() -> usize {
    wasmrelay_protocol::DEFAULT_MAX_FRAME_BYTES
}

fn default_wait_for_key() -> Duration {
    Duration::from_secs(30)
}

fn default_probe_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_drain_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_node_id() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "wasmrelay".to_string())
}

fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9464))
}

fn default_admin_header_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_admin_idle_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_admin_max_connections() -> usize {
    256
}

fn default_shutdown_grace() -> Duration {
    Duration::from_secs(30)
}

fn default_true() -> bool {
    true
}

fn default_call_deadline() -> Duration {
    PluginLimits::default().call_deadline
}

fn default_memory_cap_mib() -> u64 {
    PluginLimits::default().memory_cap_bytes / (1024 * 1024)
}

fn default_app_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_app_concurrency() -> usize {
    64
}

fn default_initial_backoff() -> Duration {
    Duration::from_millis(100)
}

fn default_max_backoff() -> Duration {
    Duration::from_secs(5)
}

fn default_retry_budget() -> Duration {
    Duration::from_secs(60)
}
