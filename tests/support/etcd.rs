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
}

impl Etcd {
    /// Starts a one-member cluster and waits until it answers a read.
    pub fn start() -> Etcd {
        let dir = tempfile::Builder::new()
            .prefix("wasmrelay-etcd-")
            .tempdir()
            .expect("creating a temporary directory for etcd");
        let mut etcd = Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir,
        };
        etcd.restart();
        etcd
    }

    /// `http://127.0.0.1:PORT`, the client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
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
        etcd_client::Client::connect([self.endpoint()], None)
            .await
            .unwrap_or_else(|e| panic!("connecting to etcd at {}: {e}", self.endpoint()))
    }

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
                && answers_a_read(self.endpoint())
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Whether etcd at `endpoint` answers a read. Runs on a thread of its own,
/// so that it works inside a test's tokio runtime too.
fn answers_a_read(endpoint: String) -> bool {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the etcd readiness probe");
        runtime.block_on(async {
            let options = etcd_client::ConnectOptions::new()
                .with_connect_timeout(Duration::from_secs(1))
                .with_timeout(Duration::from_secs(1));
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
