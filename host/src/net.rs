//! TCP plumbing shared by the node's listeners (business processes, the
//! mesh, admin): accept until shutdown, one task per connection, then wait
//! for every connection task to finish; and the connection type
//! ([`Stream`]) that is plain TCP or TLS, with the server-side handshake
//! ([`accept_tls`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long to wait after a failed accept (out of file descriptors and the
/// like) before trying again, so the loop does not spin.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// How often a listener at its connection cap says so, at most.
const OVER_CAP_LOG_EVERY: Duration = Duration::from_secs(10);

/// Open files a node keeps for everything but client connections (Kafka,
/// the mesh, HTTP, plugins, logs).
const FILES_KEPT_FOR_THE_REST: usize = 1024;

/// The default cap on a listener's connections: what the process's open
/// files limit leaves after [`FILES_KEPT_FOR_THE_REST`] (at least 64), so
/// that clients can never take the files Kafka and HTTP need. Read from
/// `/proc/self/limits`; 10,000 where that cannot be read.
pub fn default_connection_cap() -> usize {
    let soft_limit = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| {
            limits
                .lines()
                .find(|line| line.starts_with("Max open files"))
                .and_then(|line| line.split_whitespace().nth(3))
                .and_then(|soft| soft.parse::<usize>().ok())
        });
    match soft_limit {
        Some(limit) => limit.saturating_sub(FILES_KEPT_FOR_THE_REST).max(64),
        None => 10_000,
    }
}

/// Accepts on `listener` until `shutdown`, running `serve(stream, peer)` as
/// a task per connection; `what` names the listener in logs. With a `cap`,
/// at most that many connections are served at once (counted from accept,
/// before any handshake): one over it is closed at once, and the listener
/// says so in its log (at most every [`OVER_CAP_LOG_EVERY`]). Closes the
/// listener, then returns when every connection task has ended.
pub async fn accept_until<F, Fut>(
    listener: TcpListener,
    shutdown: CancellationToken,
    what: &str,
    cap: Option<usize>,
    mut serve: F,
) where
    F: FnMut(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let connections = TaskTracker::new();
    let slots = cap.map(|cap| (cap, Arc::new(Semaphore::new(cap))));
    let mut refused_since_log = 0u64;
    let mut last_log: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let slot = match &slots {
                    None => None,
                    Some((cap, slots)) => match slots.clone().try_acquire_owned() {
                        Ok(slot) => Some(slot),
                        Err(_) => {
                            drop(stream);
                            refused_since_log += 1;
                            if last_log.is_none_or(|at| at.elapsed() >= OVER_CAP_LOG_EVERY) {
                                tracing::warn!(listener = what, %peer, cap, refused = refused_since_log, "closing new connections: the listener holds its maximum (max_connections)");
                                refused_since_log = 0;
                                last_log = Some(Instant::now());
                            }
                            continue;
                        }
                    },
                };
                connections.spawn(holding_slot(serve(stream, peer), slot));
            }
            Err(error) => {
                tracing::warn!(%error, listener = what, "accepting a connection failed");
                tokio::time::sleep(ACCEPT_RETRY).await;
            }
        }
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// `serving`, which gives `slot` back when it ends. A `map`, not
/// `async move { serving.await; drop(slot) }`: an async block holds the
/// future it awaits twice (as captured and as awaited), which doubled every
/// connection's task.
fn holding_slot<Fut>(
    serving: Fut,
    slot: Option<OwnedSemaphorePermit>,
) -> impl Future<Output = ()> + Send + 'static
where
    Fut: Future<Output = ()> + Send + 'static,
{
    serving.map(move |()| drop(slot))
}

/// An accepted or dialed connection: plain TCP, or TCP under TLS. The
/// listeners' protocols run over it without knowing which.
pub enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (either side of the handshake).
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stream::Plain(_) => f.write_str("Stream::Plain"),
            Stream::Tls(_) => f.write_str("Stream::Tls"),
        }
    }
}

impl Stream {
    /// The certificate chain the peer presented in the TLS handshake, its
    /// own certificate first (empty for plain TCP or no certificate).
    pub fn peer_certificates(&self) -> &[rustls::pki_types::CertificateDer<'static>] {
        match self {
            Stream::Plain(_) => &[],
            Stream::Tls(tls) => tls.get_ref().1.peer_certificates().unwrap_or(&[]),
        }
    }

    /// Whether this connection runs under TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }
}

impl tokio::io::AsyncRead for Stream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for Stream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => std::pin::Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Wraps an accepted connection in TLS when the listener has it: the
/// handshake must finish within `timeout`. The error says what failed
/// (for a debug log line: failed handshakes are the peer's problem).
pub async fn accept_tls(
    tls: Option<&crate::tls::ServerTls>,
    stream: TcpStream,
    timeout: Duration,
) -> Result<Stream, String> {
    let _ = stream.set_nodelay(true);
    let Some(tls) = tls else {
        return Ok(Stream::Plain(stream));
    };
    match tokio::time::timeout(timeout, tls.acceptor().accept(stream)).await {
        Err(_) => Err(format!("no TLS handshake within {timeout:?}")),
        Ok(Err(error)) => Err(format!("TLS handshake failed: {error}")),
        Ok(Ok(stream)) => Ok(Stream::Tls(Box::new(stream.into()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection's task is its serving future and the slot, not the
    /// serving future twice (what an `async move` block around it made).
    #[test]
    fn a_connection_s_task_holds_its_future_once() {
        let serving = async {
            let buffer = [0u8; 1024];
            std::future::ready(()).await;
            std::hint::black_box(buffer);
        };
        let alone = size_of_val(&serving);
        let task = holding_slot(serving, None);
        assert!(
            size_of_val(&task) < alone + 64,
            "a {alone}-byte future became a {}-byte task",
            size_of_val(&task)
        );
    }
}
