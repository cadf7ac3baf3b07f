//! A real Kafka broker for the integration tests: a `tansu` 0.6.0 process
//! with in-memory storage on a free port of 127.0.0.1, plus helpers on the
//! `rdkafka` crate to create topics, produce, read back and inspect offsets.
//!
//! ```text
//! let kafka = Tansu::start();                       // sync; panics if tansu is missing
//! kafka.create_topic("in", 3).await;                // the helpers are async
//! kafka.produce("in", [TestRecord::keyed("k", "v")]).await;
//! let got = kafka.consume_all("in", 1, Duration::from_secs(10)).await;
//! ```
//!
//! `Tansu::start` is synchronous (it blocks until the broker answers, at most
//! [`START_TIMEOUT`]); every helper is `async` and runs librdkafka's blocking
//! calls on tokio's blocking pool, so a relay running on the test's runtime,
//! even a current-thread one, keeps running while a helper waits. The
//! process is killed when the `Tansu` is dropped; if the test is panicking
//! at that moment, the end of the broker's log is printed to stderr.
//!
//! The command line is
//! `tansu broker --cluster-id ID --listener-url tcp://127.0.0.1:PORT
//! --advertised-listener-url tcp://127.0.0.1:PORT --storage-engine memory://tansu/`,
//! run in a temporary directory (tansu loads a `.env` from its working
//! directory or a parent of it) with `RUST_LOG=warn` (override with `TANSU_LOG`), its output
//! in `tansu.log` there. `TANSU_BIN` may name the binary; otherwise it is
//! looked up in `PATH`, then in `$CARGO_HOME/bin` / `~/.cargo/bin`.
//!
//! # What tansu 0.6.0 (memory storage) does differently from Apache Kafka
//!
//! Found by reading its source (tansu-storage `dynostore.rs`, tansu-broker
//! `coordinator/group/administrator.rs`, `service/fetch.rs`) and measured
//! with rdkafka 0.39 (librdkafka 2.12.1); the relay's design has to live
//! with these:
//!
//! - **No automatic topic creation**: create topics through the Admin API
//!   ([`Tansu::create_topic`]); the relay must create the topics it owns.
//!   CreateTopics on an existing topic answers `TopicAlreadyExists`.
//! - **A fetch from an offset inside a stored record batch skips the rest of
//!   that batch** (storage returns the batches whose *base* offset is at or
//!   after the fetch offset). A group member resuming from a committed offset
//!   in the middle of a producer's batch (restart, rebalance, seek) silently
//!   loses the records up to the end of that batch. Measured: 100 records in
//!   one batch, offset 50 committed, the next member's first record is 100.
//!   So at-least-once across restarts and rebalances holds on tansu only when
//!   commits fall on batch boundaries: [`Tansu::produce`] writes one record
//!   per batch (`batch.num.messages=1`) so that every offset is one; a relay
//!   test whose consumer resumes from the relay's own output needs the relay
//!   producing with `batch.num.messages=1` too.
//! - **ListOffsets "latest" is wrong**: it answers the base offset of the
//!   newest batch plus one (`{0: 1}` after one 364-record batch), so
//!   `fetch_watermarks` and lag computed from it are wrong unless batches
//!   hold one record. `auto.offset.reset=latest` / `Offset::End` still end up
//!   at the end, because of the previous point. The high watermark in Fetch
//!   responses is right; [`Tansu::high_watermarks`] uses that. ListOffsets by
//!   timestamp looks at when batches were stored, not at record timestamps.
//! - **Every Fetch lasts about `fetch.wait.max.ms`, data or not**: after its
//!   first read the handler sleeps the rest of the wait (half of it when at
//!   least 250 ms remain) and does not wake up for new data. Measured
//!   produce-to-consume latency: 462 ms at librdkafka's default of 500, 64 ms
//!   at 100, 7 ms at 20, 5 ms at 5. The helpers use [`FETCH_WAIT_MAX_MS`]; a
//!   relay on tansu needs a small `fetch.wait.max.ms`.
//! - **Consumer groups: classic protocol only** (JoinGroup/SyncGroup/
//!   Heartbeat; no KIP-848 `ConsumerGroupHeartbeat`, so
//!   `group.protocol=consumer` cannot work). A member that already has a
//!   member id and is not the leader waits a fixed 3 s in JoinGroup, so
//!   every rebalance with two or more members costs about 3 s (measured
//!   3.0 s for a second member joining); a member leaving costs about 0.3 s;
//!   a lone member joins in milliseconds. Static members
//!   (`group.instance.id`) wait up to 3 s in every JoinGroup and SyncGroup.
//!   A member that stops heartbeating is evicted after its session timeout
//!   when another member's heartbeat, join or sync notices it.
//! - **APIs**: Produce, Fetch, ListOffsets, Metadata, OffsetCommit/Fetch,
//!   FindCoordinator, the classic group APIs, List/Describe/DeleteGroups,
//!   Create/DeleteTopics, DeleteRecords, DescribeConfigs,
//!   IncrementalAlterConfigs, InitProducerId (the idempotent producer works),
//!   AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, DescribeCluster,
//!   SASL. **Missing**: EndTxn (no transactional producer, no exactly-once
//!   commit), CreatePartitions (rdkafka: `UnsupportedFeature`), the legacy
//!   AlterConfigs, OffsetDelete, ElectLeaders, DescribeLogDirs.
//! - **Memory storage keeps everything, forever**: no retention and no
//!   compaction (`cleanup.policy=compact` is accepted and ignored: a
//!   compacted topic keeps every version of a key; readers must keep the
//!   last one). Everything is lost when the process exits. Each Fetch lists
//!   every stored batch of the partition, so fetches slow down as batches
//!   pile up (20,000 one-partition records still read back in 60 ms).
//! - One broker (node 0) leads every partition; no replication. Fetch
//!   responses are capped at 5 MiB whatever `fetch.max.bytes` says.
//! - Kept as sent (checked): keys, values, null keys and values, header
//!   order, repeated header names, null header values, CreateTime timestamps
//!   (also explicit ones), gzip/snappy/lz4/zstd batches.
//! - **TLS and SASL**: `--cert`/`--key` cannot be used (tansu 0.6.0's CLI
//!   puts them in one clap group, so giving both is refused), so a TLS
//!   broker is tansu behind [`crate::tls_terminator`]. `--authentication`
//!   works with SCRAM (its SASL library is built with SCRAM-SHA-256/512 and
//!   OAUTHBEARER only, no PLAIN), but `tansu user create` cannot log in, so
//!   the first user is created before authentication is turned on, on
//!   storage that survives the restart (SQLite). See [`Tansu::start_secured`].
//!   tansu announces a 60 s SASL session lifetime but refuses the
//!   re-authentication librdkafka then starts on the same connection
//!   ("Unsupported SASL mechanism"): about once a minute each connection of
//!   a SASL client fails and is made again, which the relay must ride out.
//!
//! # Client settings that matter against tansu
//!
//! See [`Tansu::client_config`], [`Tansu::consumer_config`] and
//! [`Tansu::producer_config`]. `fetch.wait.max.ms` dominates test time (see
//! above); `batch.num.messages=1` on producers whose output is resumed
//! mid-way; `session.timeout.ms`/`heartbeat.interval.ms` small so a dead
//! member is noticed quickly; `topic.metadata.refresh.interval.ms` small so
//! a subscription sees topics created after it; `reconnect.backoff.*` small
//! so a client started before the broker connects promptly. Creating a
//! client costs about 0.1 s (connection and metadata), which is why the
//! helpers keep their producers.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read as _;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::join_all;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, Timestamp};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::relay::free_port;

/// The tansu version the tests are written against.
pub const TANSU_VERSION: &str = "0.6.0";

/// How to install tansu, for the panic messages.
pub const INSTALL_HINT: &str = "run scripts/setup.sh, or: \
     cargo install tansu --version 0.6.0 --features dynostore,libsql --locked";

/// How long [`Tansu::start`] waits for the broker to answer a metadata request.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// `fetch.wait.max.ms` of the helpers' consumers (see the module docs: every
/// tansu Fetch lasts about this long).
pub const FETCH_WAIT_MAX_MS: &str = "20";

/// The storage of a broker with SASL users (they must survive a restart;
/// relative to the broker's working directory). Needs tansu built with the
/// `libsql` feature.
const SQLITE_STORAGE: &str = "sqlite://tansu.db";

/// Timeout of a single admin or metadata request made by the helpers.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Records [`Tansu::produce`] sends before it waits for their acknowledgements.
const PRODUCE_CHUNK: usize = 20_000;

/// A record to produce. `partition: None` lets librdkafka's partitioner
/// choose (by key hash; random for null keys).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TestRecord {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub partition: Option<i32>,
}

impl TestRecord {
    /// A record with a key and a value, no headers, partitioned by key.
    pub fn keyed(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> TestRecord {
        TestRecord {
            key: Some(key.into()),
            value: Some(value.into()),
            ..TestRecord::default()
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: impl Into<Vec<u8>>) -> TestRecord {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    /// Sends the record to this partition.
    pub fn in_partition(mut self, partition: i32) -> TestRecord {
        self.partition = Some(partition);
        self
    }

    /// The record for an rdkafka producer, to `topic`.
    pub fn to_future_record<'a>(&'a self, topic: &'a str) -> FutureRecord<'a, [u8], [u8]> {
        let mut future = FutureRecord::<[u8], [u8]>::to(topic);
        if let Some(key) = &self.key {
            future = future.key(key.as_slice());
        }
        if let Some(value) = &self.value {
            future = future.payload(value.as_slice());
        }
        if let Some(partition) = self.partition {
            future = future.partition(partition);
        }
        if !self.headers.is_empty() {
            let headers = self
                .headers
                .iter()
                .fold(OwnedHeaders::new(), |headers, (key, value)| {
                    headers.insert(Header {
                        key: key.as_str(),
                        value: Some(value.as_slice()),
                    })
                });
            future = future.headers(headers);
        }
        future
    }
}

/// A record read back. A header with a null value reads as an empty value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumedRecord {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub partition: i32,
    pub offset: i64,
    pub timestamp: Timestamp,
}

impl ConsumedRecord {
    /// Copies what a test may look at out of an rdkafka message.
    pub fn from_message(message: &impl Message) -> ConsumedRecord {
        ConsumedRecord {
            key: message.key().map(<[u8]>::to_vec),
            value: message.payload().map(<[u8]>::to_vec),
            headers: message
                .headers()
                .map(|headers| {
                    headers
                        .iter()
                        .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                        .collect()
                })
                .unwrap_or_default(),
            partition: message.partition(),
            offset: message.offset(),
            timestamp: message.timestamp(),
        }
    }

    /// The value of the first header called `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
}

/// How a secured broker is reached ([`Tansu::start_secured`]).
#[derive(Clone, Debug, Default)]
pub struct Security {
    /// Serve TLS with this certificate (through a TLS terminator); clients
    /// are given `trust_ca_pem`.
    pub tls: Option<crate::pki::IssuedCert>,
    /// The CA clients trust (PEM), with `tls`.
    pub trust_ca_pem: Option<String>,
    /// Require SASL and create this SCRAM-SHA-256 user (name, password).
    pub scram_user: Option<(String, String)>,
}

impl Security {
    /// The librdkafka properties of a client of such a broker.
    pub fn client_properties(&self) -> Vec<(&'static str, String)> {
        let mut properties = Vec::new();
        let protocol = match (&self.tls, &self.scram_user) {
            (None, None) => return properties,
            (Some(_), None) => "ssl",
            (None, Some(_)) => "sasl_plaintext",
            (Some(_), Some(_)) => "sasl_ssl",
        };
        properties.push(("security.protocol", protocol.to_owned()));
        if let Some(ca) = &self.trust_ca_pem {
            properties.push(("ssl.ca.pem", ca.clone()));
        }
        if let Some((user, password)) = &self.scram_user {
            properties.push(("sasl.mechanism", "SCRAM-SHA-256".to_owned()));
            properties.push(("sasl.username", user.clone()));
            properties.push(("sasl.password", password.clone()));
        }
        properties
    }
}

/// A running tansu broker; killed on drop.
pub struct Tansu {
    child: Option<Child>,
    port: u16,
    /// TLS and SASL, when started secured.
    security: Security,
    /// The TLS terminator clients connect to, when TLS is on.
    terminator: Option<crate::tls_terminator::TlsTerminator>,
    /// The fault proxy clients connect to, when started behind one.
    proxy: Option<crate::fault_proxy::FaultProxy>,
    cluster_id: String,
    log_path: PathBuf,
    /// Made on first use: one record per batch ([`Tansu::produce`]).
    producer: OnceLock<FutureProducer>,
    /// Made on first use: librdkafka's batching ([`Tansu::produce_batched`]).
    batched_producer: OnceLock<FutureProducer>,
    // Holds the working directory and the log for as long as the broker runs.
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for Tansu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tansu")
            .field("bootstrap", &self.bootstrap())
            .field("cluster_id", &self.cluster_id)
            .field("running", &self.child.is_some())
            .field("log", &self.log_path)
            .finish_non_exhaustive()
    }
}

/// Why one attempt to start tansu failed.
enum StartFailure {
    /// Another process took the port between our probe and tansu's bind.
    PortTaken(String),
    Other(String),
}

impl Tansu {
    /// Starts a broker on a free port of 127.0.0.1 with in-memory storage and
    /// waits (at most [`START_TIMEOUT`]) until it answers a metadata request
    /// with its own cluster id. Panics, with install instructions, if tansu
    /// is not installed, and with the broker's log if it exits or does not
    /// answer in time.
    pub fn start() -> Tansu {
        Tansu::start_secured(Security::default())
    }

    /// [`Tansu::start`] with TLS and/or SASL (`security`): with TLS the
    /// broker advertises a TLS terminator's address, with a SCRAM user it
    /// runs with `--authentication` and the user is created before the
    /// readiness probe logs in with it. Every helper of the returned broker
    /// ([`Tansu::client_config`] and the rest) uses these settings.
    pub fn start_secured(security: Security) -> Tansu {
        Tansu::start_with(security, false)
    }

    /// [`Tansu::start`] behind a [`crate::fault_proxy::FaultProxy`], whose
    /// address the broker advertises: every client (the tests' helpers
    /// too) reaches it through the proxy, and [`Tansu::proxy`] breaks the
    /// path.
    pub fn start_behind_proxy() -> Tansu {
        Tansu::start_with(Security::default(), true)
    }

    /// The fault proxy in front of the broker ([`Tansu::start_behind_proxy`]).
    pub fn proxy(&self) -> &crate::fault_proxy::FaultProxy {
        self.proxy
            .as_ref()
            .expect("this broker was not started behind a fault proxy")
    }

    fn start_with(security: Security, proxied: bool) -> Tansu {
        let binary = tansu_binary();
        let mut attempt = 1;
        loop {
            match Tansu::try_start(binary, &security, proxied) {
                Ok(tansu) => return tansu,
                Err(StartFailure::PortTaken(log)) if attempt < 3 => {
                    eprintln!("tansu lost its port to another process, retrying:\n{log}");
                    attempt += 1;
                }
                Err(StartFailure::PortTaken(message) | StartFailure::Other(message)) => {
                    panic!("{message}")
                }
            }
        }
    }

    fn try_start(binary: &Path, security: &Security, proxied: bool) -> Result<Tansu, StartFailure> {
        let dir = tempfile::Builder::new()
            .prefix("wasmrelay-tansu-")
            .tempdir()
            .expect("creating a temporary directory for tansu");
        let log_path = dir.path().join("tansu.log");
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        // With TLS, clients reach the broker through the terminator, whose
        // address the broker advertises in its metadata.
        let terminator = security.tls.as_ref().map(|cert| {
            let listener =
                std::net::TcpListener::bind(("127.0.0.1", 0)).expect("binding the TLS terminator");
            crate::tls_terminator::TlsTerminator::start(
                listener,
                crate::pki::TestPki::server_config(cert),
                SocketAddr::from(([127, 0, 0, 1], port)),
            )
        });
        let proxy = proxied
            .then(|| crate::fault_proxy::FaultProxy::to(SocketAddr::from(([127, 0, 0, 1], port))));
        let advertised = match (&terminator, &proxy) {
            (Some(terminator), _) => format!("tcp://{}", terminator.addr()),
            (None, Some(proxy)) => format!("tcp://{}", proxy.addr()),
            (None, None) => url.clone(),
        };
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let cluster_id = format!("wasmrelay-test-{}-{port}-{nanos}", std::process::id());

        let spawn = |storage: &str, authentication: bool| {
            let log = File::options()
                .create(true)
                .append(true)
                .open(&log_path)
                .expect("opening tansu.log");
            Command::new(binary)
                .arg("broker")
                .args(["--cluster-id", &cluster_id])
                .args(["--listener-url", &url])
                .args(["--advertised-listener-url", &advertised])
                .args(["--storage-engine", storage])
                .args(authentication.then_some("--authentication"))
                .current_dir(dir.path())
                // The flags above win over these, but tansu reads other
                // settings from the environment too: keep the caller's out.
                .env_remove("SCHEMA_REGISTRY")
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
                .env_remove("DATA_LAKE")
                .env(
                    "RUST_LOG",
                    std::env::var("TANSU_LOG").unwrap_or_else(|_| "warn".to_owned()),
                )
                .env("NO_COLOR", "1")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("cloning the log file handle"))
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e} ({INSTALL_HINT})", binary.display()))
        };
        let child = match &security.scram_user {
            None => spawn("memory://tansu/", false),
            Some((user, password)) => {
                // A broker with authentication cannot be told about its
                // first user (`tansu user create` does not log in), and
                // memory storage dies with the process: create the user on
                // SQLite storage without authentication, then restart the
                // broker on the same storage with it.
                let mut open = spawn(SQLITE_STORAGE, false);
                let created = create_scram_user(binary, port, user, password, &mut open);
                let _ = open.kill();
                let _ = open.wait();
                if let Err(problem) = created {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    return Err(if log.to_ascii_lowercase().contains("in use") {
                        StartFailure::PortTaken(format!("{problem}; its log:\n{log}"))
                    } else {
                        StartFailure::Other(format!("{problem}; its log:\n{log}"))
                    });
                }
                spawn(SQLITE_STORAGE, true)
            }
        };

        let mut tansu = Tansu {
            child: Some(child),
            port,
            security: security.clone(),
            terminator,
            proxy,
            cluster_id,
            log_path,
            producer: OnceLock::new(),
            batched_producer: OnceLock::new(),
            _dir: dir,
        };
        match tansu.wait_ready() {
            Ok(()) => Ok(tansu),
            Err(failure) => {
                tansu.kill();
                Err(failure)
            }
        }
    }

    /// Polls until the broker accepts connections and answers a metadata
    /// request with our cluster id (so not some other process on the port).
    fn wait_ready(&mut self) -> Result<(), StartFailure> {
        let deadline = Instant::now() + START_TIMEOUT;
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let mut probe: Option<BaseConsumer> = None;
        let mut last_error = String::from("no answer yet");
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let log = self.log();
                let message = format!(
                    "tansu exited during start-up ({status}) on port {}; its log:\n{log}",
                    self.port
                );
                return Err(if log.to_ascii_lowercase().contains("in use") {
                    StartFailure::PortTaken(message)
                } else {
                    StartFailure::Other(message)
                });
            }
            if Instant::now() > deadline {
                return Err(StartFailure::Other(format!(
                    "tansu did not answer a metadata request on port {} within {START_TIMEOUT:?} \
                     (last: {last_error}); its log:\n{}",
                    self.port,
                    self.log()
                )));
            }
            // Cheap probe first: is anything listening yet?
            if probe.is_none() {
                match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                    Ok(_) => {
                        probe = Some(
                            self.client_config()
                                .set("reconnect.backoff.max.ms", "100")
                                .create()
                                .expect("creating the readiness probe client"),
                        );
                    }
                    Err(e) => {
                        last_error = format!("connect: {e}");
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                }
            }
            let client = probe.as_ref().unwrap().client();
            match client.fetch_metadata(None, Duration::from_secs(1)) {
                Ok(metadata) if !metadata.brokers().is_empty() => {
                    match client.fetch_cluster_id(Duration::from_secs(1)) {
                        Some(id) if id == self.cluster_id => return Ok(()),
                        Some(other) => {
                            return Err(StartFailure::PortTaken(format!(
                                "port {} is answered by another broker (cluster id {other}, \
                                 ours is {}); our tansu's log:\n{}",
                                self.port,
                                self.cluster_id,
                                self.log()
                            )));
                        }
                        None => last_error = "no cluster id in metadata".to_owned(),
                    }
                }
                Ok(_) => last_error = "metadata without brokers".to_owned(),
                Err(e) => last_error = format!("metadata: {e}"),
            }
        }
    }

    /// `127.0.0.1:PORT`, for `bootstrap.servers` (the TLS terminator's
    /// address when TLS is on).
    pub fn bootstrap(&self) -> String {
        if let Some(proxy) = &self.proxy {
            return proxy.addr().to_string();
        }
        match &self.terminator {
            Some(terminator) => terminator.addr().to_string(),
            None => format!("127.0.0.1:{}", self.port),
        }
    }

    /// The security settings the broker was started with.
    pub fn security(&self) -> &Security {
        &self.security
    }

    /// The cluster id the broker was started with (unique per instance).
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// Everything the broker wrote to stdout and stderr so far.
    pub fn log(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(&self.log_path) {
            let mut bytes = Vec::new();
            let _ = file.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        text
    }

    /// Freezes the broker (SIGSTOP): its sockets stay open and nothing
    /// answers, as a broker stuck in a long GC pause or on a dead disk.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Resumes a broker [`Tansu::freeze`] stopped (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the broker is not running").id();
        let status = std::process::Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()
            .expect("running kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }

    /// Kills the broker now (idempotent); its data is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `bootstrap.servers` plus settings that keep clients fast against a
    /// local broker that may start after them.
    pub fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", self.bootstrap())
            .set("broker.address.family", "v4")
            .set("reconnect.backoff.ms", "20")
            .set("reconnect.backoff.max.ms", "500")
            .set("retry.backoff.ms", "50")
            .set("retry.backoff.max.ms", "500")
            .set("topic.metadata.refresh.interval.ms", "1000")
            .set("socket.connection.setup.timeout.ms", "5000");
        for (key, value) in self.security.client_properties() {
            config.set(key, value);
        }
        config
    }

    /// A consumer config for group `group`: reads from the earliest offset
    /// when the group has none, a short `fetch.wait.max.ms` (every tansu Fetch
    /// lasts that long), a short session so dead members go quickly. Auto
    /// commit stays on (librdkafka's default); turn it off for manual commits.
    pub fn consumer_config(&self, group: &str) -> ClientConfig {
        let mut config = self.client_config();
        config
            .set("group.id", group)
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS)
            .set("fetch.error.backoff.ms", "50")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("auto.commit.interval.ms", "200")
            .set("allow.auto.create.topics", "false");
        config
    }

    /// A producer config: `acks=all`, no lingering, deliveries reported
    /// within 30 s at most.
    pub fn producer_config(&self) -> ClientConfig {
        let mut config = self.client_config();
        config
            .set("acks", "all")
            .set("linger.ms", "1")
            .set("message.timeout.ms", "30000");
        config
    }

    /// Creates a topic with `partitions` partitions (replication factor 1)
    /// through the Admin API and waits until metadata shows all of them.
    /// Panics if the topic exists already or cannot be created.
    pub async fn create_topic(&self, name: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> = self
            .client_config()
            .create()
            .expect("creating an admin client");
        let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        let options = AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT));
        let results = admin
            .create_topics([&topic], &options)
            .await
            .unwrap_or_else(|e| panic!("CreateTopics {name}: {e}\n{}", self.log()));
        for result in results {
            if let Err((topic, code)) = result {
                panic!("creating topic {topic}: {code}\n{}", self.log());
            }
        }
        let config = self.client_config();
        let name = name.to_owned();
        blocking(move || {
            let consumer: BaseConsumer = config.create().expect("creating a metadata client");
            let deadline = Instant::now() + REQUEST_TIMEOUT;
            loop {
                match topic_partitions(&consumer, &name) {
                    Ok(found) if found.len() == usize::try_from(partitions).unwrap() => return,
                    Ok(found) if Instant::now() > deadline => {
                        panic!("topic {name}: metadata shows partitions {found:?}")
                    }
                    Err(e) if Instant::now() > deadline => {
                        panic!("topic {name} never showed in metadata: {e}")
                    }
                    _ => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        })
        .await;
    }

    /// Produces `records` to `topic`, all in flight at once, each in a
    /// record batch of its own (`batch.num.messages=1`), and waits for every
    /// delivery report. Returns `(partition, offset)` of each record in input
    /// order. Panics on the first failed delivery.
    ///
    /// One record per batch makes every offset a batch start, the only
    /// offsets tansu resumes from correctly (see the module docs), so a
    /// consumer group can commit after any record and resume there. About
    /// 0.1 s per 1,000 records; [`Tansu::produce_batched`] is faster.
    pub async fn produce(
        &self,
        topic: &str,
        records: impl IntoIterator<Item = TestRecord>,
    ) -> Vec<(i32, i64)> {
        let producer = self.producer.get_or_init(|| {
            self.producer_config()
                .set("batch.num.messages", "1")
                .create()
                .expect("creating a producer")
        });
        self.produce_with(producer, topic, records).await
    }

    /// Like [`Tansu::produce`] but with librdkafka's usual batching: fast,
    /// but on tansu a consumer resuming from an offset inside a batch skips
    /// the rest of that batch.
    pub async fn produce_batched(
        &self,
        topic: &str,
        records: impl IntoIterator<Item = TestRecord>,
    ) -> Vec<(i32, i64)> {
        let producer = self.batched_producer.get_or_init(|| {
            self.producer_config()
                .create()
                .expect("creating a producer")
        });
        self.produce_with(producer, topic, records).await
    }

    async fn produce_with(
        &self,
        producer: &FutureProducer,
        topic: &str,
        records: impl IntoIterator<Item = TestRecord>,
    ) -> Vec<(i32, i64)> {
        let records: Vec<TestRecord> = records.into_iter().collect();
        let mut written = Vec::with_capacity(records.len());
        // In chunks well under librdkafka's queue (100,000 messages): a
        // benchmark's 150,000 records sent at once waited for room in the
        // queue, and the last ones could time out on a slow broker.
        for (chunk_index, chunk) in records.chunks(PRODUCE_CHUNK).enumerate() {
            let sends = chunk.iter().map(|record| {
                producer.send(record.to_future_record(topic), Duration::from_secs(30))
            });
            for (i, delivery) in join_all(sends).await.into_iter().enumerate() {
                match delivery {
                    Ok(delivery) => written.push((delivery.partition, delivery.offset)),
                    Err((e, _)) => panic!(
                        "delivering record {} to {topic}: {e}\n{}",
                        chunk_index * PRODUCE_CHUNK + i,
                        self.log()
                    ),
                }
            }
        }
        written
    }

    /// Reads `topic` from the beginning of every partition (assigned, no
    /// group membership, nothing committed) until `expected` records arrived
    /// or `timeout` passed, and returns what arrived (in order within each
    /// partition). Does not wait for more once `expected` is reached: to
    /// check that nothing more is there, ask for one more with a short
    /// timeout.
    pub async fn consume_all(
        &self,
        topic: &str,
        expected: usize,
        timeout: Duration,
    ) -> Vec<ConsumedRecord> {
        let mut config = self.consumer_config(&unique_group("consume-all"));
        config.set("enable.auto.commit", "false");
        let topic = topic.to_owned();
        blocking(move || {
            let deadline = Instant::now() + timeout;
            let consumer: BaseConsumer = config.create().expect("creating a consumer");
            let partitions = topic_partitions(&consumer, &topic)
                .unwrap_or_else(|e| panic!("metadata of topic {topic}: {e}"));
            let mut assignment = TopicPartitionList::new();
            for partition in partitions {
                assignment
                    .add_partition_offset(&topic, partition, Offset::Beginning)
                    .unwrap();
            }
            consumer.assign(&assignment).unwrap();
            let mut records = Vec::with_capacity(expected);
            while records.len() < expected {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match consumer.poll(left.min(Duration::from_millis(100))) {
                    Some(Ok(message)) => records.push(ConsumedRecord::from_message(&message)),
                    Some(Err(e)) => eprintln!("consume_all {topic}: {e}"),
                    None => {}
                }
            }
            records
        })
        .await
    }

    /// The offsets `group` has committed on `topic`, by partition; a
    /// partition without a committed offset is left out.
    pub async fn committed_offsets(&self, group: &str, topic: &str) -> BTreeMap<i32, i64> {
        let config = self.consumer_config(group);
        let topic = topic.to_owned();
        blocking(move || {
            let consumer: BaseConsumer = config.create().expect("creating a consumer");
            let mut list = TopicPartitionList::new();
            for partition in topic_partitions(&consumer, &topic)
                .unwrap_or_else(|e| panic!("metadata of topic {topic}: {e}"))
            {
                list.add_partition(&topic, partition);
            }
            let committed = consumer
                .committed_offsets(list, REQUEST_TIMEOUT)
                .unwrap_or_else(|e| panic!("committed offsets of {topic}: {e}"));
            committed
                .elements()
                .iter()
                .filter_map(|element| match element.offset() {
                    Offset::Offset(offset) => Some((element.partition(), offset)),
                    _ => None,
                })
                .collect()
        })
        .await
    }

    /// The high watermark (the offset the next record will get) of every
    /// partition of `topic`.
    ///
    /// Not from ListOffsets (`fetch_watermarks`): tansu's memory storage
    /// answers "latest" wrongly (see the module docs). This reads every
    /// partition from the beginning to its end (`enable.partition.eof`) and
    /// takes the position there, which comes from the high watermark in
    /// tansu's Fetch responses; so it costs a read of the whole topic.
    pub async fn high_watermarks(&self, topic: &str) -> BTreeMap<i32, i64> {
        let mut config = self.consumer_config(&unique_group("high-watermarks"));
        config
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true");
        let topic = topic.to_owned();
        blocking(move || {
            let deadline = Instant::now() + REQUEST_TIMEOUT;
            let consumer: BaseConsumer = config.create().expect("creating a consumer");
            let partitions = topic_partitions(&consumer, &topic)
                .unwrap_or_else(|e| panic!("metadata of topic {topic}: {e}"));
            let mut assignment = TopicPartitionList::new();
            for partition in &partitions {
                assignment
                    .add_partition_offset(&topic, *partition, Offset::Beginning)
                    .unwrap();
            }
            consumer.assign(&assignment).unwrap();
            let mut next: BTreeMap<i32, i64> = BTreeMap::new();
            let mut at_end = BTreeMap::new();
            while at_end.len() < partitions.len() {
                assert!(
                    Instant::now() < deadline,
                    "{topic}: only partitions {:?} reached their end within {REQUEST_TIMEOUT:?}",
                    at_end.keys().collect::<Vec<_>>()
                );
                match consumer.poll(Duration::from_millis(100)) {
                    Some(Err(KafkaError::PartitionEOF(partition))) => {
                        // The position at the end is the high watermark; it
                        // is only set once a record was returned.
                        let position = consumer
                            .position()
                            .ok()
                            .and_then(|list| {
                                list.find_partition(&topic, partition)
                                    .map(|element| element.offset())
                            })
                            .and_then(|offset| match offset {
                                Offset::Offset(offset) => Some(offset),
                                _ => None,
                            });
                        let offset = position
                            .or_else(|| next.get(&partition).copied())
                            .unwrap_or(0);
                        at_end.insert(partition, offset);
                    }
                    Some(Err(e)) => eprintln!("high_watermarks {topic}: {e}"),
                    Some(Ok(message)) => {
                        next.insert(message.partition(), message.offset() + 1);
                        // More was produced after this partition's end.
                        at_end.remove(&message.partition());
                    }
                    None => {}
                }
            }
            at_end
        })
        .await
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            let log = self.log();
            let tail = &log[log.floor_char_boundary(log.len().saturating_sub(16 * 1024))..];
            eprintln!(
                "--- tansu log (127.0.0.1:{}), last {} bytes ---\n{tail}\n--- end of tansu log ---",
                self.port,
                tail.len()
            );
        }
        // Producers first: they flush on drop, which is quick while the
        // broker still answers.
        drop(self.producer.take());
        drop(self.batched_producer.take());
        self.kill();
    }
}

/// The partition ids of `topic`, sorted; an error if it has none or metadata
/// reports an error for it.
fn topic_partitions(consumer: &BaseConsumer, topic: &str) -> Result<Vec<i32>, String> {
    let metadata = consumer
        .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
        .map_err(|e| e.to_string())?;
    let found = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(|| "not in metadata".to_owned())?;
    if let Some(error) = found.error() {
        return Err(RDKafkaErrorCode::from(error).to_string());
    }
    let mut partitions: Vec<i32> = found.partitions().iter().map(|p| p.id()).collect();
    if partitions.is_empty() {
        return Err("no partitions".to_owned());
    }
    partitions.sort_unstable();
    Ok(partitions)
}

/// Runs a blocking librdkafka call on tokio's blocking pool, passing panics on.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(value) => value,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// A group id no other consumer uses.
pub fn unique_group(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The tansu binary: `TANSU_BIN`, else `tansu` in `PATH`, else in cargo's
/// bin directory. Panics with install instructions if there is none or it is
/// not version [`TANSU_VERSION`].
pub fn tansu_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let binary = find_tansu().unwrap_or_else(|| {
            panic!(
                "the integration tests need the tansu Kafka broker {TANSU_VERSION}, which is \
                 not installed (looked in TANSU_BIN, PATH and ~/.cargo/bin): {INSTALL_HINT}"
            )
        });
        let output = Command::new(&binary)
            .arg("--version")
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "running {} --version: {e} ({INSTALL_HINT})",
                    binary.display()
                )
            });
        let version = String::from_utf8_lossy(&output.stdout);
        assert!(
            version.split_whitespace().any(|word| word == TANSU_VERSION),
            "{} --version says {:?}; the tests need tansu {TANSU_VERSION}: {INSTALL_HINT}",
            binary.display(),
            version.trim()
        );
        binary
    })
}

fn find_tansu() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("TANSU_BIN") {
        return Some(PathBuf::from(path));
    }
    let in_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("tansu"));
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))
        .map(|dir| dir.join("bin/tansu"));
    in_path.chain(cargo_home).find(|path| path.is_file())
}

/// Runs `tansu user create` against the broker on `port` (started without
/// authentication) until it succeeds, at most [`START_TIMEOUT`].
fn create_scram_user(
    binary: &Path,
    port: u16,
    user: &str,
    password: &str,
    broker: &mut Child,
) -> Result<(), String> {
    let deadline = Instant::now() + START_TIMEOUT;
    let mut last = String::from("not tried");
    while Instant::now() < deadline {
        if let Ok(Some(status)) = broker.try_wait() {
            return Err(format!(
                "tansu (SQLite storage, for creating user `{user}`) exited ({status}); \
                 is it built with the `libsql` feature? ({INSTALL_HINT})"
            ));
        }
        if TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_millis(200),
        )
        .is_err()
        {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let output = Command::new(binary)
            .args([
                "user",
                "create",
                "--broker",
                &format!("tcp://127.0.0.1:{port}"),
            ])
            .args(["--mechanism", "scram256", user, password])
            .env("NO_COLOR", "1")
            .output()
            .map_err(|e| format!("running `tansu user create`: {e}"))?;
        if output.status.success() {
            return Ok(());
        }
        last = String::from_utf8_lossy(&output.stderr).replace(password, "***");
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!(
        "`tansu user create {user}` did not succeed: {last}"
    ))
}
