//! Runs the real `wasmrelay` binary as a child process with a config file,
//! waits until its `/readyz` says ready, and stops it with the signal a test
//! asks for.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (bound, then released).
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
    log_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl RelayProcess {
    /// Writes `config` (TOML) to a file and runs `wasmrelay run --config` on
    /// it with `env`; `admin_port` must be the port the config's admin
    /// listener uses. Waits until ready (or panics with the relay's log).
    pub fn start(config: &str, admin_port: u16, env: &[(&str, &str)]) -> RelayProcess {
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("relay.toml");
        std::fs::write(&config_path, config).unwrap();
        let log_path = dir.path().join("relay.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let child = Command::new(crate::wasmrelay_binary())
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .envs(env.iter().copied())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting wasmrelay");
        let mut relay = RelayProcess {
            child: Some(child),
            admin: format!("http://127.0.0.1:{admin_port}"),
            log_path,
            _dir: dir,
        };
        relay.wait_ready(Duration::from_secs(60));
        relay
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

/// A blocking GET: (status, body), or None if nothing answered.
pub fn http_get(url: &str) -> Option<(u16, String)> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{p}")))
        .unwrap_or((rest, "/".into()));
    let mut stream = std::net::TcpStream::connect(host).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
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
