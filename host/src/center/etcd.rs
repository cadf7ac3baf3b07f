//! The `etcd` config-center backend: every key under a prefix is a key of the
//! center (the prefix stripped), its value the value.
//!
//! One task runs sessions against etcd, one after the other. A session reads
//! every key under the prefix, publishes them, then watches the prefix from
//! the revision after that read, so no change made between the read and the
//! watch is missed. When the watch breaks (etcd stopped, network gone, the
//! keepalive timed out) the state is marked unreachable, keeping the last
//! good values, and a new session starts after a backoff that doubles up to
//! [`MAX_BACKOFF`]. When the watch start revision has been compacted away the
//! session simply reads again: the read is the truth, the watch only news.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetOptions, Identity, TlsOptions, WatchOptions,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{CenterState, ConfigCenter, Reachability};
use crate::config::Secret;
use wasmrelay_protocol::Backoff;

/// The first wait before connecting again after a failure.
pub const INITIAL_BACKOFF: Duration = Duration::from_millis(100);
/// The longest wait between attempts to reach etcd.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long connecting and each request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 keepalive on the watch connection: a peer that stops answering is
/// noticed within about twice this.
pub const KEEPALIVE: Duration = Duration::from_secs(3);

/// Where etcd is and which keys are the center's.
#[derive(Clone, Debug)]
pub struct EtcdCenterOptions {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Only keys starting with this belong to the center; it is stripped
    /// from their names (`/wasmrelay/kafka.main` → `kafka.main`).
    pub prefix: String,
    /// etcd user and password, when etcd has authentication enabled.
    pub user: Option<(String, Secret)>,
    /// TLS to etcd (`https://` endpoints).
    pub tls: Option<EtcdTlsFiles>,
}

/// The TLS material of an etcd center, read at start.
#[derive(Clone)]
pub struct EtcdTlsFiles {
    ca_pem: Vec<u8>,
    identity: Option<(Vec<u8>, Secret)>,
    domain: Option<String>,
}

impl std::fmt::Debug for EtcdTlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTlsFiles")
            .field("client_certificate", &self.identity.is_some())
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

impl EtcdTlsFiles {
    /// Reads the files named by `[center.tls]`; the error names the file.
    pub fn read(tls: &crate::config::EtcdTls) -> anyhow::Result<EtcdTlsFiles> {
        let read = |key: &str, path: &std::path::Path| {
            std::fs::read(path)
                .with_context(|| format!("center.tls.{key}: reading {}", path.display()))
        };
        let identity = match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => Some((
                read("cert", cert)?,
                Secret::new(String::from_utf8(read("key", key)?).with_context(|| {
                    format!("center.tls.key: {} is not PEM text", key.display())
                })?),
            )),
            _ => None,
        };
        Ok(EtcdTlsFiles {
            ca_pem: read("ca", &tls.ca)?,
            identity,
            domain: tls.domain.clone(),
        })
    }

    fn options(&self) -> TlsOptions {
        let mut options = TlsOptions::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.identity {
            options = options.identity(Identity::from_pem(cert, key.expose()));
        }
        if let Some(domain) = &self.domain {
            options = options.domain_name(domain.clone());
        }
        options
    }
}

impl EtcdCenterOptions {
    fn describe(&self) -> String {
        format!("etcd {} prefix {:?}", self.endpoints.join(","), self.prefix)
    }
}

/// Starts following etcd until `shutdown`. Never fails on etcd being down:
/// the state starts unreachable and becomes reachable at the first good
/// read (a link waiting for its key says why it is still waiting).
pub fn start(
    options: EtcdCenterOptions,
    tasks: &TaskTracker,
    shutdown: CancellationToken,
) -> ConfigCenter {
    let description = options.describe();
    let (state_tx, state) = watch::channel(CenterState {
        values: BTreeMap::new(),
        reachability: Reachability::Unreachable {
            since: std::time::SystemTime::now(),
            error: "not read yet".to_string(),
        },
        generation: 0,
    });
    tasks.spawn(follow(options, state_tx, shutdown));
    ConfigCenter::new(state, description)
}

/// A session that ended without an error: the watch start revision was
/// compacted, so the prefix is read again at once.
#[derive(Debug)]
struct Compacted;

async fn follow(
    options: EtcdCenterOptions,
    state: watch::Sender<CenterState>,
    shutdown: CancellationToken,
) {
    let center = options.describe();
    let mut backoff = Backoff::new(INITIAL_BACKOFF, MAX_BACKOFF);
    loop {
        let end = tokio::select! {
            _ = shutdown.cancelled() => return,
            end = session(&options, &state, &center, &mut backoff) => end,
        };
        match end {
            Ok(Compacted) => {
                tracing::info!(%center, "watch revision compacted; reading the prefix again");
                continue;
            }
            Err(error) => {
                let error = format!("{error:#}");
                tracing::debug!(%center, %error, "etcd session ended");
                state.send_if_modified(|current| current.fold_read(Err(error), &center));
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff.next_pause()) => {}
        }
    }
}

/// Connects, reads, publishes, then watches and publishes each change until
/// something breaks. Resets `backoff` once a read succeeded.
async fn session(
    options: &EtcdCenterOptions,
    state: &watch::Sender<CenterState>,
    center: &str,
    backoff: &mut Backoff,
) -> anyhow::Result<Compacted> {
    let mut connect = ConnectOptions::new()
        .with_connect_timeout(REQUEST_TIMEOUT)
        .with_timeout(REQUEST_TIMEOUT)
        .with_keep_alive(KEEPALIVE, KEEPALIVE)
        .with_keep_alive_while_idle(true);
    if let Some((user, password)) = &options.user {
        connect = connect.with_user(user.clone(), password.expose().to_string());
    }
    if let Some(tls) = &options.tls {
        connect = connect.with_tls(tls.options());
    }
    let mut client = Client::connect(&options.endpoints, Some(connect))
        .await
        .context("connecting")?;
    let read = client
        .get(
            options.prefix.as_str(),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .context("reading the prefix")?;
    let revision = read
        .header()
        .map(|h| h.revision())
        .context("etcd answered a read without a revision")?;
    let mut values = BTreeMap::new();
    for kv in read.kvs() {
        if let Some(key) = strip_prefix(kv.key(), &options.prefix) {
            values.insert(key, value_text(kv.value()));
        }
    }
    state.send_if_modified(|current| current.fold_read(Ok(values.clone()), center));
    backoff.reset();

    let watch_options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1)
        .with_progress_notify();
    let mut stream = client
        .watch(options.prefix.as_str(), Some(watch_options))
        .await
        .context("starting the watch")?;
    loop {
        let Some(response) = stream.message().await.context("watching the prefix")? else {
            anyhow::bail!("the watch stream ended");
        };
        if response.compact_revision() > 0 {
            return Ok(Compacted);
        }
        if response.canceled() {
            anyhow::bail!("etcd cancelled the watch: {}", response.cancel_reason());
        }
        let mut changed = false;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            let Some(key) = strip_prefix(kv.key(), &options.prefix) else {
                continue;
            };
            changed = true;
            match event.event_type() {
                EventType::Put => {
                    values.insert(key, value_text(kv.value()));
                }
                EventType::Delete => {
                    values.remove(&key);
                }
            }
        }
        if changed {
            state.send_if_modified(|current| current.fold_read(Ok(values.clone()), center));
        }
    }
}

/// The center's name for an etcd key, or `None` when the key is not under
/// the prefix or is not UTF-8.
fn strip_prefix(key: &[u8], prefix: &str) -> Option<String> {
    let rest = key.strip_prefix(prefix.as_bytes())?;
    std::str::from_utf8(rest).ok().map(str::to_string)
}

/// A value as text, trimmed like a file's content. Bytes that are not UTF-8
/// are replaced, so the link manager reports a clear "not JSON" error.
fn value_text(value: &[u8]) -> String {
    String::from_utf8_lossy(value).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_named_without_the_prefix() {
        assert_eq!(
            strip_prefix(b"/wasmrelay/kafka.main", "/wasmrelay/"),
            Some("kafka.main".to_string())
        );
        assert_eq!(
            strip_prefix(b"kafka.main", ""),
            Some("kafka.main".to_string())
        );
        assert_eq!(strip_prefix(b"/other/kafka.main", "/wasmrelay/"), None);
        assert_eq!(strip_prefix(b"/wasmrelay/\xff", "/wasmrelay/"), None);
    }

    #[test]
    fn values_are_trimmed_text() {
        assert_eq!(value_text(b" {\"a\":1}\n"), "{\"a\":1}");
        assert_eq!(value_text(b"\xff"), "\u{fffd}");
    }
}
