//! The admin listener's accept loop and connections: HTTP/1.1 with hyper,
//! hardened against clients that hold connections without using them.
//!
//! - **Connection cap**: at most `max_connections` at once (a semaphore,
//!   as in mini-redis); a connection beyond them is closed as soon as it is
//!   accepted, and counted, so that a flood cannot queue up behind the cap.
//! - **Header timeout**: from the first byte of a request head, the whole
//!   head must arrive within `header_timeout` (a client trickling bytes
//!   does not extend it).
//! - **Idle timeout**: a connection with no request in progress that sends
//!   nothing for `idle_timeout` is closed: one that never sends a byte, and
//!   a keep-alive connection between requests.
//! - **Shutdown**: the listener closes at once; every connection is told to
//!   finish (hyper's graceful shutdown: an idle one closes now, one with a
//!   request in progress after its response) and is dropped after
//!   [`SHUTDOWN_DRAIN`] whatever it is doing, so a stalled client cannot
//!   hold the node's shutdown past its grace period.
//!
//! hyper's own header timeout is off: it starts when hyper waits for a
//! request head, before any byte, so it would close idle keep-alive
//! connections too and leave no room for a separate idle timeout. The
//! timeouts here are kept by watching the connection's bytes instead
//! ([`Activity`]).
//!
//! Owns: accepting and running connections. What the routes answer is the
//! router's business (the parent module).

use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt as _;

use crate::config::AdminConfig;
use crate::telemetry::metrics::AdminMetrics;

/// How long connections may take to finish after shutdown starts before
/// they are dropped. Admin responses are rendered in memory, so this is
/// ample for a request in progress, and short next to any grace period.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(1);

/// Pause after a failed `accept` (e.g. out of file descriptors) before the
/// next one, so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The limits connections are served under (from `[admin]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// From the first byte of a request head to its end, at most.
    pub header_timeout: Duration,
    /// Silence with no request in progress, at most.
    pub idle_timeout: Duration,
    /// Connections open at once, at most.
    pub max_connections: usize,
}

impl From<&AdminConfig> for ServeOptions {
    fn from(config: &AdminConfig) -> Self {
        ServeOptions {
            header_timeout: config.header_timeout,
            idle_timeout: config.idle_timeout,
            max_connections: config.max_connections,
        }
    }
}

/// Accepts connections on `listener` and serves `app` on them until
/// `shutdown` is cancelled; then closes the listener and returns once every
/// connection has ended (within [`SHUTDOWN_DRAIN`]).
pub async fn run(
    listener: TcpListener,
    app: Router,
    options: ServeOptions,
    tls: Option<Arc<crate::tls::ServerTls>>,
    metrics: AdminMetrics,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(options.max_connections));
    let connections = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "admin listener: accepting a connection failed");
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                }
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.refused.inc();
            tracing::debug!(%peer, max_connections = options.max_connections, "admin connection refused: too many open");
            drop(stream);
            continue;
        };
        connections.spawn(serve_connection(
            stream,
            tls.clone(),
            peer,
            app.clone(),
            options,
            Slot {
                _permit: permit,
                metrics: metrics.clone(),
            },
            shutdown.clone(),
        ));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// A connection's place under the cap: counted open while it lives.
struct Slot {
    _permit: OwnedSemaphorePermit,
    metrics: AdminMetrics,
}

impl Slot {
    fn opened(self) -> Self {
        self.metrics.open.inc();
        self
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.open.dec();
    }
}

/// Why a connection was closed by its watchdog.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expiry {
    /// A request head did not arrive whole within `header_timeout`.
    Header,
    /// Nothing happened for `idle_timeout` with no request in progress.
    Idle,
}

/// What a connection has been doing, shared by its byte stream (which
/// records reads and writes), its service (which records requests) and its
/// watchdog (which closes it when a timeout passes).
#[derive(Debug)]
struct Activity {
    state: Mutex<ActivityState>,
    /// Wakes the watchdog when its deadline changes other than by moving
    /// later: a head starts (idle → header timeout), a request ends.
    deadline_changed: Notify,
}

#[derive(Debug)]
struct ActivityState {
    /// The last byte read or written, or the connection's start.
    last: Instant,
    /// When the first byte of a request head not yet complete arrived.
    head_started: Option<Instant>,
    /// Requests being answered.
    in_flight: usize,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity {
            state: Mutex::new(ActivityState {
                last: Instant::now(),
                head_started: None,
                in_flight: 0,
            }),
            deadline_changed: Notify::new(),
        })
    }

    fn with<T>(&self, f: impl FnOnce(&mut ActivityState) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn read(&self) {
        let head_started = self.with(|s| {
            s.last = Instant::now();
            // Bytes with no request in progress begin the next head.
            let starts = s.in_flight == 0 && s.head_started.is_none();
            if starts {
                s.head_started = Some(s.last);
            }
            starts
        });
        if head_started {
            self.deadline_changed.notify_one();
        }
    }

    fn wrote(&self) {
        self.with(|s| s.last = Instant::now());
    }

    /// hyper parsed a whole head and calls the service.
    fn request_started(self: &Arc<Self>) -> RequestGuard {
        self.with(|s| {
            s.in_flight += 1;
            s.head_started = None;
        });
        RequestGuard(self.clone())
    }

    /// When the watchdog should look again, and what expires then; `None`
    /// while a request is in progress (its end wakes the watchdog).
    fn next_deadline(&self, options: &ServeOptions) -> Option<(Instant, Expiry)> {
        self.with(|s| {
            if s.in_flight > 0 {
                return None;
            }
            Some(match s.head_started {
                Some(started) => (started + options.header_timeout, Expiry::Header),
                None => (s.last + options.idle_timeout, Expiry::Idle),
            })
        })
    }
}

/// Marks a request in progress until dropped (its response is ready).
struct RequestGuard(Arc<Activity>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.with(|s| {
            s.in_flight -= 1;
            s.last = Instant::now();
        });
        self.0.deadline_changed.notify_one();
    }
}

/// A connection that records its reads and writes in [`Activity`].
struct WatchedStream {
    inner: crate::net::Stream,
    activity: Arc<Activity>,
}

impl AsyncRead for WatchedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read();
        }
        polled
    }
}

impl AsyncWrite for WatchedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serves one connection until it ends, a timeout closes it, or shutdown
/// has given it [`SHUTDOWN_DRAIN`] to finish.
async fn serve_connection(
    stream: TcpStream,
    tls: Option<Arc<crate::tls::ServerTls>>,
    peer: SocketAddr,
    app: Router,
    options: ServeOptions,
    slot: Slot,
    shutdown: CancellationToken,
) {
    let slot = slot.opened();
    // The handshake counts against the header timeout: a client that
    // connects and sends nothing is closed as soon.
    let stream = tokio::select! {
        accepted = crate::net::accept_tls(tls.as_deref(), stream, options.header_timeout) => match accepted {
            Ok(stream) => stream,
            Err(reason) => {
                tracing::debug!(%peer, %reason, "admin connection closed");
                return;
            }
        },
        () = shutdown.cancelled() => return,
    };
    let activity = Activity::new();
    let io = TokioIo::new(WatchedStream {
        inner: stream,
        activity: activity.clone(),
    });
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let guard = activity.request_started();
            let app = app.clone();
            async move {
                let response = app.oneshot(request).await;
                drop(guard);
                response
            }
        })
    };
    let mut connection = pin!(
        http1::Builder::new()
            // The timeouts are kept here (see the module doc).
            .header_read_timeout(None)
            .serve_connection(io, service)
    );
    let mut drain_until: Option<Instant> = None;
    loop {
        let deadline = activity.next_deadline(&options);
        let watch_until = deadline.map_or_else(far_future, |(at, _)| at);
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%peer, %error, "admin connection ended with an error");
                }
                break;
            }
            () = activity.deadline_changed.notified() => {}
            () = sleep_until(watch_until) => {
                // Activity since the deadline was taken moves it on.
                if let Some((at, expiry)) = activity.next_deadline(&options)
                    && at <= Instant::now()
                {
                    slot.metrics.timed_out(expiry == Expiry::Header);
                    tracing::debug!(%peer, ?expiry, "admin connection closed: timed out");
                    break;
                }
            }
            () = shutdown.cancelled(), if drain_until.is_none() => {
                connection.as_mut().graceful_shutdown();
                drain_until = Some(Instant::now() + SHUTDOWN_DRAIN);
            }
            () = sleep_until(drain_until.unwrap_or_else(far_future)), if drain_until.is_some() => {
                tracing::debug!(%peer, "admin connection dropped at shutdown");
                break;
            }
        }
    }
    // Dropping the connection closes the socket.
}

/// A deadline that does not come (about a year away).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(365 * 24 * 3600)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> ServeOptions {
        ServeOptions {
            header_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(5),
            max_connections: 1,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_expires_after_the_idle_timeout() {
        let activity = Activity::new();
        let started = Instant::now();
        assert_eq!(
            activity.next_deadline(&options()),
            Some((started + Duration::from_secs(5), Expiry::Idle))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_header_timeout_runs_from_the_first_byte_of_a_head() {
        let activity = Activity::new();
        tokio::time::advance(Duration::from_secs(1)).await;
        activity.read();
        let first_byte = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await;
        // More bytes of the same head do not extend it.
        activity.read();
        assert_eq!(
            activity.next_deadline(&options()),
            Some((first_byte + Duration::from_secs(2), Expiry::Header))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_deadline_while_a_request_is_answered_and_idle_again_after() {
        let activity = Activity::new();
        activity.read();
        let guard = activity.request_started();
        assert_eq!(activity.next_deadline(&options()), None);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(activity.next_deadline(&options()), None);
        drop(guard);
        let ended = Instant::now();
        activity.wrote();
        assert_eq!(
            activity.next_deadline(&options()),
            Some((ended + Duration::from_secs(5), Expiry::Idle))
        );
    }
}
