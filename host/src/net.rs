//! TCP plumbing shared by the node's listeners (business processes, the
//! mesh, admin): accept until shutdown, one task per connection, then wait
//! for every connection task to finish; and the connection type
//! ([`Stream`]) that is plain TCP or TLS, with the server-side handshake
//! ([`accept_tls`]).

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long to wait after a failed accept (out of file descriptors and the
/// like) before trying again, so the loop does not spin.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// Accepts on `listener` until `shutdown`, running `serve(stream, peer)` as
/// a task per connection; `what` names the listener in logs. Closes the
/// listener, then returns when every connection task has ended.
pub async fn accept_until<F, Fut>(
    listener: TcpListener,
    shutdown: CancellationToken,
    what: &str,
    mut serve: F,
) where
    F: FnMut(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let connections = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                connections.spawn(serve(stream, peer));
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
