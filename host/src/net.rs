//! TCP plumbing shared by the node's listeners (business processes, the
//! mesh): accept until shutdown, one task per connection, then wait for
//! every connection task to finish.

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
