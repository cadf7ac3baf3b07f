//! A real etcd server for the integration tests: Debian's `etcd-server`
//! (3.4) on free ports of 127.0.0.1 with its data in a temporary directory,
//! which it keeps across [`Etcd::stop`] and [`Etcd::restart`].
//!
//! ```text
//! let mut etcd = Etcd::start();                  // sync; panics if etcd is missing
//! etcd.put("/wasmrelay/kafka.main", "{..}").await;
//! etcd.stop();                                   // the relay sees it unreachable
//! etcd.restart();                                // same ports, same data
//! ```
//!
//! `ETCD_BIN` may name the binary; otherwise `etcd` is looked up in `PATH`.
//! The server's output goes to `etcd.log` in its directory, printed to
//! stderr when a test panics while the server is still owned.

use std::fs::File;
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::pki::{IssuedCert, TestPki};
use crate::relay::free_port;

const INSTALL_HINT: &str = "install it with `sudo apt-get install etcd-server` (or run scripts/setup.sh), \
     or set ETCD_BIN to an etcd 3.4+ binary";
/// How long etcd may take to answer after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// One etcd server.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    secured: Option<Secured>,
}

/// TLS (with client certificates) and user authentication.
#[derive(Debug)]
struct Secured {
    server: IssuedCert,
    client: IssuedCert,
    ca_pem: String,
    ca_path: PathBuf,
    root_password: String,
    /// Set once authentication is on: clients log in as root from then on.
    auth_enabled: bool,
}

/// What a client of a secured etcd is given ([`Etcd::client_tls`]).
#[derive(Clone, Debug)]
pub struct EtcdClientTls {
    /// The CA that signed etcd's certificate.
    pub ca_path: PathBuf,
    /// A client certificate etcd accepts, and its key.
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
}

impl Etcd {
    /// Starts a one-member cluster and waits until it answers a read.
    pub fn start() -> Etcd {
        let mut etcd = Etcd::unstarted(None);
        etcd.restart();
        etcd
    }

    /// An etcd on new free ports and a new data directory, not running.
    fn unstarted(secured: Option<Secured>) -> Etcd {
        Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::Builder::new()
                .prefix("wasmrelay-etcd-")
                .tempdir()
                .expect("creating a temporary directory for etcd"),
            secured,
        }
    }

    /// Starts a one-member cluster serving TLS only (a server certificate of
    /// `pki`), requiring client certificates of `pki`, with authentication
    /// enabled and user `root` having `root_password`.
    pub async fn start_secured(pki: &TestPki, root_password: &str) -> Etcd {
        let mut etcd = Etcd::unstarted(Some(Secured {
            server: pki.server_cert("etcd-server"),
            client: pki.client_cert("etcd-client", "etcd-client"),
            ca_pem: pki.ca_pem().to_owned(),
            ca_path: pki.ca_path(),
            root_password: root_password.to_owned(),
            auth_enabled: false,
        }));
        etcd.restart();
        let mut client = etcd.client().await;
        client
            .user_add("root", root_password, None)
            .await
            .expect("etcd: adding user root");
        client
            .user_grant_role("root", "root")
            .await
            .expect("etcd: granting root the root role");
        client
            .auth_enable()
            .await
            .expect("etcd: enabling authentication");
        if let Some(secured) = etcd.secured.as_mut() {
            secured.auth_enabled = true;
        }
        etcd
    }

    /// `http://127.0.0.1:PORT` (`https://` when secured), the client URL.
    pub fn endpoint(&self) -> String {
        let scheme = if self.secured.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The files a client of a secured etcd needs.
    pub fn client_tls(&self) -> Option<EtcdClientTls> {
        self.secured.as_ref().map(|s| EtcdClientTls {
            ca_path: s.ca_path.clone(),
            cert_path: s.client.cert_path.clone(),
            key_path: s.client.key_path.clone(),
        })
    }

    /// Starts the server again on the same ports with the same data (after
    /// [`Etcd::stop`]), and waits until it answers.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "etcd is already running");
        let binary = std::env::var_os("ETCD_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("etcd"));
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("opening etcd.log");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(&binary)
            .args(["--name", "test"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &self.endpoint()])
            .args(["--advertise-client-urls", &self.endpoint()])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .args(["--log-level", "warn"])
            .args(self.secured.iter().flat_map(|s| {
                [
                    "--cert-file".to_owned(),
                    s.server.cert_path.display().to_string(),
                    "--key-file".to_owned(),
                    s.server.key_path.display().to_string(),
                    "--client-cert-auth".to_owned(),
                    "--trusted-ca-file".to_owned(),
                    s.ca_path.display().to_string(),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("cloning the log file handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "the tests need an etcd server; starting {}: {e}: {INSTALL_HINT}",
                    binary.display()
                )
            });
        self.child = Some(child);
        self.wait_ready();
    }

    /// Kills the server (SIGKILL, like a crash); its data stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Everything the server wrote so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Writes `key = value`.
    pub async fn put(&self, key: &str, value: &str) {
        self.client()
            .await
            .put(key, value, None)
            .await
            .unwrap_or_else(|e| panic!("etcd put {key}: {e}"));
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &str) {
        self.client()
            .await
            .delete(key, None)
            .await
            .unwrap_or_else(|e| panic!("etcd delete {key}: {e}"));
    }

    async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], Some(self.connect_options()))
            .await
            .unwrap_or_else(|e| panic!("connecting to etcd at {}: {e}", self.endpoint()))
    }

    /// Timeouts; when secured, TLS with the client certificate, and root's
    /// login once authentication is on.
    fn connect_options(&self) -> etcd_client::ConnectOptions {
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(5));
        match &self.secured {
            None => options,
            Some(secured) if secured.auth_enabled => options
                .with_user("root", secured.root_password.clone())
                .with_tls(secured.tls_options()),
            Some(secured) => options.with_tls(secured.tls_options()),
        }
    }
}

impl Secured {
    fn tls_options(&self) -> etcd_client::TlsOptions {
        etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(&self.ca_pem))
            .identity(etcd_client::Identity::from_pem(
                &self.client.cert_pem,
                &self.client.key_pem,
            ))
    }
}

impl Etcd {
    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        let addr = SocketAddr::from(([127, 0, 0, 1], self.client_port));
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "etcd exited during start-up ({status}) on port {}; its log:\n{}",
                    self.client_port,
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not answer on port {} within {START_TIMEOUT:?}; its log:\n{}",
                self.client_port,
                self.log()
            );
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                && answers_a_read(self.endpoint(), self.connect_options())
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Whether etcd at `endpoint` answers a read. Runs on a thread of its own,
/// so that it works inside a test's tokio runtime too.
fn answers_a_read(endpoint: String, options: etcd_client::ConnectOptions) -> bool {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the etcd readiness probe");
        runtime.block_on(async {
            match etcd_client::Client::connect([endpoint], Some(options)).await {
                Ok(mut client) => client.get("probe", None).await.is_ok(),
                Err(_) => false,
            }
        })
    })
    .join()
    .unwrap_or(false)
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            eprintln!("--- etcd log ---\n{}", self.log());
        }
        self.stop();
    }
}
