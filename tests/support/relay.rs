//! Runs the real `wasmrelay` binary as a child process with a config file,
//! waits until its `/readyz` says ready, and stops it with the signal a test
//! asks for.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (bound, then released): for the servers the
/// tests start that are not wasmrelay (whose listeners take port 0), or for
/// an address nothing answers on.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running relay process.
#[derive(Debug)]
pub struct RelayProcess {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT` of its admin API.
    pub admin: String,
    client: Option<String>,
    mesh: Option<String>,
    log_path: PathBuf,
    /// The admin token [`RelayProcess::cluster_json`] sends, if any.
    admin_token: Option<String>,
    _dir: tempfile::TempDir,
}

impl RelayProcess {
    /// Writes `config` (TOML) to a file and runs `wasmrelay run --config` on
    /// it with `env` (which may set `RUST_LOG`; the default is this
    /// process's `RUST_LOG`, else `info`). Its listeners should be given as
    /// `127.0.0.1:0`: the addresses they got are read from the relay's
    /// `listening` log lines, so the filter must let `wasmrelay::node` info
    /// through. Waits until ready (or panics with the relay's log).
    pub fn start(config: &str, env: &[(&str, &str)]) -> RelayProcess {
        Self::start_within(config, env, Duration::from_secs(60))
    }

    /// [`RelayProcess::start`], waiting up to `timeout` for it to be ready
    /// (a relay compiles its plugins before it is ready: a large component,
    /// such as a JavaScript or Python one, takes most of a minute to compile
    /// in a debug build).
    pub fn start_within(config: &str, env: &[(&str, &str)], timeout: Duration) -> RelayProcess {
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("relay.toml");
        std::fs::write(&config_path, config).unwrap();
        let log_path = dir.path().join("relay.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let child = Command::new(crate::wasmrelay_binary())
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting wasmrelay");
        let mut relay = RelayProcess {
            child: Some(child),
            admin: String::new(),
            client: None,
            mesh: None,
            log_path,
            admin_token: None,
            _dir: dir,
        };
        let started = Instant::now();
        let admin = relay.wait_listening(timeout);
        relay.admin = format!("http://{admin}");
        relay.wait_ready(timeout.saturating_sub(started.elapsed()));
        // Every `listening` line comes before the node starts anything, so
        // all are in the log once it is ready (the admin line may have been
        // read before the others were written).
        let log = relay.log();
        relay.client = listening_addr(&log, "client");
        relay.mesh = listening_addr(&log, "mesh");
        relay
    }

    /// `host:port` the cluster client listener got, on a cluster node.
    pub fn client_addr(&self) -> Option<String> {
        self.client.clone()
    }

    /// `host:port` the cluster mesh listener got, on a cluster node.
    pub fn mesh_addr(&self) -> Option<String> {
        self.mesh.clone()
    }

    /// Waits for the admin listener's `listening` line (logged after every
    /// listener is bound) and returns its address.
    fn wait_listening(&mut self, timeout: Duration) -> String {
        let started = Instant::now();
        loop {
            // Read the log before asking whether the process exited, so a
            // line written just before the exit is not missed.
            let log = self.log();
            if let Some(addr) = listening_addr(&log, "admin") {
                return addr;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "wasmrelay exited with {status} before it logged its admin address:\n{}",
                    self.log()
                );
            }
            if started.elapsed() > timeout {
                panic!(
                    "wasmrelay logged no `listening listener=\"admin\"` line within {timeout:?} \
                     (RUST_LOG must let wasmrelay::node info through):\n{log}"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_ready(&mut self, timeout: Duration) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "wasmrelay exited with {status} before it was ready:\n{}",
                    self.log()
                );
            }
            if http_get(&format!("{}/readyz", self.admin)).is_some_and(|(status, _)| status == 200)
            {
                return;
            }
            if started.elapsed() > timeout {
                panic!(
                    "wasmrelay was not ready within {timeout:?}:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Everything the relay logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM failed");
    }

    /// Kills with SIGKILL and reaps the process.
    pub fn sigkill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for the process to exit (up to `timeout`) and returns its status.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return status;
            }
            if started.elapsed() > timeout {
                panic!("wasmrelay did not exit within {timeout:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `/metrics` as text.
    pub fn metrics(&self) -> String {
        http_get(&format!("{}/metrics", self.admin))
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// The value of one counter line of `/metrics` (0 if absent).
    pub fn metric(&self, name_and_labels: &str) -> u64 {
        self.metrics()
            .lines()
            .find_map(|line| {
                line.strip_prefix(name_and_labels)?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .map(|v| v as u64)
            .unwrap_or(0)
    }
}

/// What the nodes of a cluster test read from each other's admin API.
impl RelayProcess {
    /// Sends `token` (the config's `[admin] token`) with the admin requests
    /// of [`RelayProcess::cluster_json`].
    pub fn with_admin_token(mut self, token: &str) -> RelayProcess {
        self.admin_token = Some(token.to_string());
        self
    }

    /// This node's `/cluster` (Null when it does not parse).
    pub fn cluster_json(&self) -> serde_json::Value {
        let url = format!("{}/cluster", self.admin);
        let (_, body) =
            http_get_with_token(&url, self.admin_token.as_deref()).expect("no /cluster");
        serde_json::from_str(&body).unwrap_or(serde_json::Value::Null)
    }

    /// Waits (up to `timeout`) until every one of `nodes` sees `live` nodes
    /// live.
    pub async fn wait_all_live(nodes: &[RelayProcess], live: usize, timeout: Duration) {
        nodes[0]
            .wait_for("every node live everywhere", timeout, || {
                nodes.iter().all(|node| node.cluster_json()["live"] == live)
            })
            .await;
    }

    /// The processes each of `nodes` holds, by node id, as its `/cluster`
    /// says.
    pub fn connections_by_node(nodes: &[RelayProcess]) -> HashMap<String, u64> {
        nodes
            .iter()
            .map(|node| {
                let view = node.cluster_json();
                (
                    view["node"].as_str().unwrap_or_default().to_string(),
                    view["connections"].as_u64().unwrap_or_default(),
                )
            })
            .collect()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.sigkill();
    }
}

impl RelayProcess {
    /// Waits until `done()` holds, checking every 50 ms; after `timeout`
    /// the test fails with `what` and the relay's log.
    pub async fn wait_for(&self, what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
        let started = Instant::now();
        while !done() {
            assert!(
                started.elapsed() < timeout,
                "timed out after {timeout:?} waiting for {what}; relay log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `count()` has not changed for `quiet`, checking every
    /// 20 ms: for a check that nothing more arrives (no duplicate), in place
    /// of a fixed sleep. A late delivery restarts the quiet period, so the
    /// check that follows sees it; the wait ends as soon as the count has
    /// been still for `quiet`. After `timeout` with the count still
    /// changing, the test fails with `what` and the relay's log.
    pub async fn wait_quiet(
        &self,
        what: &str,
        quiet: Duration,
        timeout: Duration,
        mut count: impl FnMut() -> usize,
    ) {
        let started = Instant::now();
        let mut last = count();
        let mut still_since = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let now = count();
            if now != last {
                last = now;
                still_since = Instant::now();
            } else if still_since.elapsed() >= quiet {
                return;
            }
            assert!(
                started.elapsed() < timeout,
                "{what}: the count was still changing after {timeout:?} (now {now}); relay log:\n{}",
                self.log()
            );
        }
    }
}

/// The address of `listener` in the relay's text log line
/// `... listening listener="admin" addr=127.0.0.1:41234`, if logged.
pub fn listening_addr(log: &str, listener: &str) -> Option<String> {
    let name = format!("listener=\"{listener}\"");
    log.lines()
        .filter(|line| line.contains(" listening ") && line.contains(&name))
        .find_map(|line| {
            let addr = line.split_once(" addr=")?.1.split_whitespace().next()?;
            Some(addr.to_string())
        })
}

/// A blocking GET: (status, body), or None if nothing answered.
pub fn http_get(url: &str) -> Option<(u16, String)> {
    http_get_with_token(url, None)
}

/// A blocking GET with `Authorization: Bearer <token>` when given:
/// (status, body), or None if nothing answered.
pub fn http_get_with_token(url: &str, token: Option<&str>) -> Option<(u16, String)> {
    http_request("GET", url, token)
}

/// A blocking POST without a body, with `Authorization: Bearer <token>`
/// when given: (status, body), or None if nothing answered.
pub fn http_post_with_token(url: &str, token: Option<&str>) -> Option<(u16, String)> {
    http_request("POST", url, token)
}

fn http_request(method: &str, url: &str, token: Option<&str>) -> Option<(u16, String)> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{p}")))
        .unwrap_or((rest, "/".into()));
    let mut stream = std::net::TcpStream::connect(host).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let authorization = token
        .map(|token| format!("Authorization: Bearer {token}\r\n"))
        .unwrap_or_default();
    let length = if method == "GET" {
        ""
    } else {
        "Content-Length: 0\r\n"
    };
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{authorization}{length}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    std::io::Read::read_to_string(&mut stream, &mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}
