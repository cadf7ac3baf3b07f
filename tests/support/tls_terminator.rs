//! A TLS terminator for tests: accepts TLS on a free port of 127.0.0.1 and
//! passes the plaintext bytes to an upstream address (and back).
//!
//! tansu 0.6.0 cannot serve TLS itself: its `--cert` and `--key` flags are
//! declared in one clap group, which makes them mutually exclusive, so a
//! broker started with both refuses to start and one started with either
//! alone serves plaintext. A secured Kafka in the tests is therefore tansu
//! (with its own SASL, `--authentication`) behind this terminator, which
//! the broker advertises as its address: the client sees `SASL_SSL` from
//! the first byte, as with any TLS-terminating load balancer in front of a
//! broker.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

/// A running terminator; stops (and drops its connections) on drop.
pub struct TlsTerminator {
    addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for TlsTerminator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsTerminator")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl TlsTerminator {
    /// Listens on `listener` (already bound, so the address is known before
    /// the upstream starts) and forwards each TLS connection to `upstream`.
    pub fn start(
        listener: std::net::TcpListener,
        config: Arc<rustls::ServerConfig>,
        upstream: SocketAddr,
    ) -> TlsTerminator {
        let addr = listener.local_addr().expect("the terminator's address");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tls-terminator")
            .enable_all()
            .build()
            .expect("a runtime for the TLS terminator");
        let acceptor = TlsAcceptor::from(config);
        // The runtime owns the accept loop: dropping it ends everything.
        #[allow(clippy::disallowed_methods)]
        runtime.spawn(async move {
            let listener = TcpListener::from_std(listener).expect("a tokio listener");
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                #[allow(clippy::disallowed_methods)]
                tokio::spawn(async move {
                    // A client that fails the handshake (a wrong CA on its
                    // side, plaintext) is simply closed, as a broker would.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(mut plain) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        TlsTerminator {
            addr,
            runtime: Some(runtime),
        }
    }

    /// Where clients connect (TLS).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TlsTerminator {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
