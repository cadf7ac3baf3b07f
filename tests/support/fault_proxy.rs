//! A TCP proxy for network faults, after Toxiproxy: tests put it between a
//! relay and what it talks to (a broker, an application, a peer, a client)
//! and break the path on purpose while traffic flows.
//!
//! - [`Fault::Pass`]: bytes go through (the default).
//! - [`Fault::Delay`]: every chunk waits this long before it is passed on.
//! - [`Fault::Bandwidth`]: at most this many bytes a second each way.
//! - [`Fault::Blackhole`]: connections stay open, bytes vanish (a peer
//!   frozen, a route gone): only timeouts can tell.
//! - [`FaultProxy::cut`]: every open connection is reset, and new ones are
//!   reset at once, until [`FaultProxy::restore`] (a network partition).
//! - [`FaultProxy::reset`]: the open connections are reset once; new ones
//!   pass (a load balancer restarting).
//!
//! A broker behind the proxy must advertise the proxy's address, or
//! clients reach it directly after their first metadata request: see
//! `Tansu::start_behind_proxy`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What happens to bytes on their way through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Fault {
    /// Passed on as they come.
    #[default]
    Pass,
    /// Passed on after this delay.
    Delay(Duration),
    /// Passed on at most this many bytes a second, each way.
    Bandwidth(u64),
    /// Dropped; the connections stay open.
    Blackhole,
}

#[derive(Debug, Default)]
struct State {
    fault: Fault,
    /// New connections are reset at once.
    cut: bool,
}

/// A running proxy; stops (and drops its connections) on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// Bumped to reset every connection open now.
    resets: watch::Sender<u64>,
    connections: Arc<std::sync::atomic::AtomicUsize>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl FaultProxy {
    /// Listens on `listener` (bound already, so its address can be given
    /// out before the upstream starts) and forwards to `upstream`.
    pub fn start(listener: std::net::TcpListener, upstream: SocketAddr) -> FaultProxy {
        let addr = listener.local_addr().expect("the proxy's address");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .expect("a runtime for the fault proxy");
        let state = Arc::new(Mutex::new(State::default()));
        let (resets, _) = watch::channel(0u64);
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let accept_state = state.clone();
        let accept_resets = resets.clone();
        let accept_connections = connections.clone();
        // The runtime owns the accept loop: dropping it ends everything.
        #[allow(clippy::disallowed_methods)]
        runtime.spawn(async move {
            let listener = TcpListener::from_std(listener).expect("a tokio listener");
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                if accept_state.lock().unwrap().cut {
                    let _ = client.set_zero_linger();
                    drop(client);
                    continue;
                }
                let state = accept_state.clone();
                let mut reset = accept_resets.subscribe();
                let connections = accept_connections.clone();
                #[allow(clippy::disallowed_methods)]
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        let _ = client.set_zero_linger();
                        return;
                    };
                    connections.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    reset.borrow_and_update();
                    let was_reset = tokio::select! {
                        _ = pump(&mut client_read, &mut server_write, &state) => false,
                        _ = pump(&mut server_read, &mut client_write, &state) => false,
                        _ = reset.changed() => true,
                    };
                    // Reset (RST) rather than closed, as a partition or a
                    // crashed middlebox leaves them.
                    if was_reset {
                        let _ = client_write.as_ref().set_zero_linger();
                        let _ = server_write.as_ref().set_zero_linger();
                    }
                    connections.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        });
        FaultProxy {
            addr,
            state,
            resets,
            connections,
            runtime: Some(runtime),
        }
    }

    /// A proxy on a free port of 127.0.0.1 to `upstream`.
    pub fn to(upstream: SocketAddr) -> FaultProxy {
        let listener =
            std::net::TcpListener::bind(("127.0.0.1", 0)).expect("binding the fault proxy");
        FaultProxy::start(listener, upstream)
    }

    /// Where to connect instead of the upstream.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What bytes go through from now on (open connections included).
    pub fn set(&self, fault: Fault) {
        self.state.lock().unwrap().fault = fault;
    }

    /// A partition: every open connection is closed, and new ones are
    /// closed at once, until [`FaultProxy::restore`].
    pub fn cut(&self) {
        self.state.lock().unwrap().cut = true;
        self.reset();
    }

    /// Ends a cut and any fault: bytes pass again.
    pub fn restore(&self) {
        let mut state = self.state.lock().unwrap();
        state.cut = false;
        state.fault = Fault::Pass;
    }

    /// Closes every open connection once; new ones pass.
    pub fn reset(&self) {
        self.resets.send_modify(|resets| *resets += 1);
    }

    /// Connections open through the proxy now.
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Moves bytes from `from` to `to` as the state says, until either side
/// closes.
async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    state: &Mutex<State>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        let fault = state.lock().unwrap().fault;
        match fault {
            Fault::Pass => {}
            Fault::Blackhole => continue,
            Fault::Delay(delay) => tokio::time::sleep(delay).await,
            Fault::Bandwidth(rate) => {
                let rate = rate.max(1);
                tokio::time::sleep(Duration::from_secs_f64(read as f64 / rate as f64)).await;
            }
        }
        // A blackhole that began while this chunk waited swallows it too.
        if state.lock().unwrap().fault == Fault::Blackhole {
            continue;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;

    /// An echo server on a free port.
    fn echo() -> SocketAddr {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                std::thread::spawn(move || {
                    let mut buffer = [0u8; 4096];
                    while let Ok(read) = stream.read(&mut buffer) {
                        if read == 0 || stream.write_all(&buffer[..read]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn connect(proxy: &FaultProxy) -> std::net::TcpStream {
        let stream = std::net::TcpStream::connect(proxy.addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        stream
    }

    /// Writes `bytes` and reads back what comes within the read timeout.
    fn round_trip(stream: &mut std::net::TcpStream, bytes: &[u8]) -> Vec<u8> {
        if stream.write_all(bytes).is_err() {
            return Vec::new();
        }
        let mut back = vec![0u8; bytes.len()];
        let mut got = 0;
        while got < back.len() {
            match stream.read(&mut back[got..]) {
                Ok(0) | Err(_) => break,
                Ok(read) => got += read,
            }
        }
        back.truncate(got);
        back
    }

    #[test]
    fn bytes_pass_vanish_in_a_blackhole_and_pass_again() {
        let proxy = FaultProxy::to(echo());
        let mut stream = connect(&proxy);
        assert_eq!(round_trip(&mut stream, b"hello"), b"hello");
        proxy.set(Fault::Blackhole);
        assert_eq!(round_trip(&mut stream, b"lost"), b"");
        proxy.restore();
        assert_eq!(round_trip(&mut stream, b"again"), b"again");
    }

    #[test]
    fn a_cut_closes_open_connections_and_refuses_new_ones_until_restored() {
        let proxy = FaultProxy::to(echo());
        let mut open = connect(&proxy);
        assert_eq!(round_trip(&mut open, b"hello"), b"hello");
        proxy.cut();
        assert_eq!(round_trip(&mut open, b"cut"), b"");
        let mut new = connect(&proxy);
        assert_eq!(round_trip(&mut new, b"cut"), b"");
        proxy.restore();
        let mut after = connect(&proxy);
        assert_eq!(round_trip(&mut after, b"back"), b"back");
    }

    #[test]
    fn a_delay_holds_each_chunk_back() {
        let proxy = FaultProxy::to(echo());
        let mut stream = connect(&proxy);
        proxy.set(Fault::Delay(Duration::from_millis(300)));
        stream
            .set_read_timeout(Some(Duration::from_millis(2_000)))
            .unwrap();
        let started = std::time::Instant::now();
        assert_eq!(round_trip(&mut stream, b"slow"), b"slow");
        // Both ways: at least two delays.
        assert!(started.elapsed() >= Duration::from_millis(600));
    }
}
