//! TLS for the relay's own listeners (rustls with the ring provider): a
//! certificate chain and private key from PEM files, reloaded when the files
//! change without dropping a connection (handshakes after the reload present
//! the new certificate, connections made before keep their session), and
//! optionally client certificates verified against a CA file (mutual TLS).
//!
//! A reload that fails (a half-written file, a key that does not match the
//! certificate) keeps the certificate in use and is reported; the next
//! change of the files is tried again.
//!
//! The mesh is mutual TLS both ways: a node's [`ServerTls`] also gives the
//! connector it dials its peers with ([`ServerTls::peer_connector`]),
//! presenting the same reloadable certificate as a client certificate.
//! [`common_name`] reads the identity a client certificate carries.
//! [`web_client_config`] is the client side towards web servers (the
//! sidecar's `https://` application): the system's CAs plus a flow's own.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, bail};
use arc_swap::ArcSwap;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, SignatureScheme};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;

/// The files of a TLS listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain (PEM), the listener's own certificate first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA (PEM).
    pub client_ca: Option<PathBuf>,
}

impl From<&crate::config::ListenerTlsConfig> for TlsFiles {
    fn from(config: &crate::config::ListenerTlsConfig) -> Self {
        TlsFiles {
            cert: config.cert.clone(),
            key: config.key.clone(),
            client_ca: config.client_ca.clone(),
        }
    }
}

impl From<&crate::config::MeshTlsConfig> for TlsFiles {
    fn from(config: &crate::config::MeshTlsConfig) -> Self {
        TlsFiles {
            cert: config.cert.clone(),
            key: config.key.clone(),
            client_ca: Some(config.ca.clone()),
        }
    }
}

/// When a file was last changed, and its size: a change of either is a
/// change of the file.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let metadata = std::fs::metadata(path).ok()?;
    Some((metadata.modified().ok()?, metadata.len()))
}

/// Presents whatever certificate was loaded last.
#[derive(Debug)]
struct ReloadableCert {
    current: ArcSwap<CertifiedKey>,
}

impl ResolvesServerCert for ReloadableCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// A TLS listener's server side: the acceptor to wrap accepted connections
/// with, and the certificate it presents, reloadable.
pub struct ServerTls {
    files: TlsFiles,
    acceptor: TlsAcceptor,
    cert: Arc<ReloadableCert>,
    stamps: Mutex<(Stamp, Stamp)>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// The same certificate, presented as a client certificate when dialing.
impl ResolvesClientCert for ReloadableCert {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Reads the CA certificates of `path` (PEM); the error names the file.
pub fn load_roots(path: &Path) -> anyhow::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading the CA {}", path.display()))?
    {
        roots
            .add(cert.with_context(|| format!("parsing the CA {}", path.display()))?)
            .with_context(|| format!("the CA {}", path.display()))?;
    }
    if roots.is_empty() {
        bail!("the CA file {} holds no PEM certificate", path.display());
    }
    Ok(roots)
}

/// A client configuration for web servers (the sidecar's `https://`
/// application): the system's CA certificates, and those of `extra_ca_pem`
/// (PEM) when given. An `extra_ca_pem` that holds no certificate, or one
/// that cannot be parsed, is an error; system certificates that cannot be
/// read are skipped, as long as some CA is left to verify with.
pub fn web_client_config(extra_ca_pem: Option<&[u8]>) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _unparsable) = roots.add_parsable_certificates(native.certs);
    if let Some(pem) = extra_ca_pem {
        let mut extra = 0;
        for cert in CertificateDer::pem_slice_iter(pem) {
            roots
                .add(cert.context("parsing the application CA")?)
                .context("the application CA")?;
            extra += 1;
        }
        if extra == 0 {
            bail!("the application CA holds no PEM certificate");
        }
    } else if added == 0 {
        tracing::warn!(
            errors = ?native.errors,
            "no system CA certificate could be loaded: https applications will not verify without a flow `ca`"
        );
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The subject common name of a DER certificate, if it has one (UTF-8).
pub fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let name = parsed.subject().iter_common_name().next()?;
    name.as_str().ok().map(str::to_string)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a certificate chain and its key and checks that they belong
/// together. The error names the file.
fn load_certified_key(files: &TlsFiles) -> anyhow::Result<CertifiedKey> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .with_context(|| format!("reading the certificate {}", files.cert.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing the certificate {}", files.cert.display()))?;
    if chain.is_empty() {
        bail!("{} holds no PEM certificate", files.cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .with_context(|| format!("reading the private key {}", files.key.display()))?;
    let certified = CertifiedKey::from_der(chain, key, &provider()).with_context(|| {
        format!(
            "the private key {} does not belong to the certificate {}",
            files.key.display(),
            files.cert.display()
        )
    })?;
    Ok(certified)
}

impl ServerTls {
    /// Loads the files; fails with a message naming the file at fault.
    pub fn load(files: &TlsFiles) -> anyhow::Result<ServerTls> {
        let cert = Arc::new(ReloadableCert {
            current: ArcSwap::from_pointee(load_certified_key(files)?),
        });
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?;
        let builder = match &files.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let roots = load_roots(ca).context("the client CA")?;
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()
                        .with_context(|| format!("the client CA {}", ca.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder.with_cert_resolver(cert.clone());
        Ok(ServerTls {
            stamps: Mutex::new((stamp(&files.cert), stamp(&files.key))),
            files: files.clone(),
            acceptor: TlsAcceptor::from(Arc::new(config)),
            cert,
        })
    }

    /// Wraps accepted connections.
    pub fn acceptor(&self) -> TlsAcceptor {
        self.acceptor.clone()
    }

    /// A connector for dialing the other nodes of a mutual TLS mesh: it
    /// verifies them against `ca` and presents this listener's certificate
    /// (reloaded with it) as its client certificate.
    pub fn peer_connector(&self, ca: &Path) -> anyhow::Result<TlsConnector> {
        let roots = load_roots(ca)?;
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_root_certificates(roots)
            .with_client_cert_resolver(self.cert.clone());
        Ok(TlsConnector::from(Arc::new(config)))
    }

    /// Loads the certificate again if its files changed since the last
    /// (attempted) load. `Ok(true)` when a new certificate is in use; an
    /// error keeps the old one.
    pub fn reload_if_changed(&self) -> anyhow::Result<bool> {
        let now = (stamp(&self.files.cert), stamp(&self.files.key));
        {
            let mut stamps = self.stamps.lock().unwrap_or_else(|e| e.into_inner());
            if *stamps == now {
                return Ok(false);
            }
            *stamps = now;
        }
        let certified = load_certified_key(&self.files)?;
        self.cert.current.store(Arc::new(certified));
        Ok(true)
    }

    /// Checks the files every `every` until `stop`, logging reloads and
    /// failed reloads (`what` names the listener).
    pub async fn watch(
        self: Arc<Self>,
        what: &'static str,
        every: Duration,
        stop: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            match self.reload_if_changed() {
                Ok(true) => tracing::info!(
                    listener = what,
                    cert = %self.files.cert.display(),
                    "TLS certificate reloaded"
                ),
                Ok(false) => {}
                Err(error) => tracing::error!(
                    listener = what,
                    error = %format!("{error:#}"),
                    "TLS certificate not reloaded; keeping the one in use"
                ),
            }
        }
    }
}

/// How often a listener's certificate files are checked for changes.
pub const RELOAD_POLL: Duration = Duration::from_secs(1);

/// Loads the TLS of listener `what` (an error names it and the file), if
/// it has any.
pub fn load_listener(
    what: &str,
    files: Option<TlsFiles>,
) -> anyhow::Result<Option<Arc<ServerTls>>> {
    files
        .map(|files| {
            ServerTls::load(&files)
                .map(Arc::new)
                .with_context(|| format!("loading the TLS certificate of the {what} listener"))
        })
        .transpose()
}

/// Follows changes of `tls`'s files (if any) until `stop`.
pub async fn watch_listener(
    tls: Option<Arc<ServerTls>>,
    what: &'static str,
    stop: CancellationToken,
) {
    if let Some(tls) = tls {
        tls.watch(what, RELOAD_POLL, stop).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};
    use wasmrelay_test_support::pki::TestPki;

    /// An echo server behind `tls`; returns its address.
    #[allow(clippy::disallowed_methods)] // test server: ends with the test's runtime
    async fn echo_server(tls: Arc<ServerTls>) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let acceptor = tls.acceptor();
                tokio::spawn(async move {
                    let Ok(mut stream) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = [0u8; 64];
                    while let Ok(n) = stream.read(&mut buf).await {
                        if n == 0 || stream.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    /// The serial-free fingerprint of the certificate the server presented.
    fn presented(stream: &tokio_rustls::client::TlsStream<TcpStream>) -> Vec<u8> {
        stream.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    }

    async fn echo(stream: &mut tokio_rustls::client::TlsStream<TcpStream>, text: &[u8]) {
        stream.write_all(text).await.unwrap();
        let mut back = vec![0u8; text.len()];
        stream.read_exact(&mut back).await.unwrap();
        assert_eq!(back, text);
    }

    #[tokio::test]
    async fn a_changed_certificate_is_used_by_new_handshakes_and_old_connections_live_on() {
        let pki = TestPki::new("reload");
        let first = pki.server_cert("server");
        let files = TlsFiles {
            cert: first.cert_path.clone(),
            key: first.key_path.clone(),
            client_ca: None,
        };
        let tls = Arc::new(ServerTls::load(&files).unwrap());
        let addr = echo_server(tls.clone()).await;
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        // A fresh client per handshake: a resumed session would show the
        // certificate of the session it resumes.
        let mut old = pki
            .connector(None)
            .connect(name.clone(), TcpStream::connect(addr).await.unwrap())
            .await
            .unwrap();
        echo(&mut old, b"before").await;
        assert_eq!(presented(&old), first.chain()[0].to_vec());
        assert!(!tls.reload_if_changed().unwrap(), "nothing changed yet");

        // A bad key: the reload fails, the old certificate stays.
        std::fs::write(&files.key, "not a key").unwrap();
        let error = tls.reload_if_changed().unwrap_err();
        assert!(format!("{error:#}").contains("private key"), "{error:#}");
        let mut during = pki
            .connector(None)
            .connect(name.clone(), TcpStream::connect(addr).await.unwrap())
            .await
            .unwrap();
        assert_eq!(presented(&during), first.chain()[0].to_vec());
        echo(&mut during, b"during").await;

        // A new certificate in the same files: new handshakes present it.
        let second = pki.server_cert("server");
        assert_eq!(second.cert_path, files.cert);
        assert!(tls.reload_if_changed().unwrap());
        let mut new = pki
            .connector(None)
            .connect(name, TcpStream::connect(addr).await.unwrap())
            .await
            .unwrap();
        assert_eq!(presented(&new), second.chain()[0].to_vec());
        echo(&mut new, b"after").await;
        echo(&mut old, b"still here").await;
    }

    #[tokio::test]
    async fn with_a_client_ca_only_clients_with_its_certificates_get_in() {
        let pki = TestPki::new("mtls");
        let server = pki.server_cert("server");
        let tls = Arc::new(
            ServerTls::load(&TlsFiles {
                cert: server.cert_path.clone(),
                key: server.key_path.clone(),
                client_ca: Some(pki.ca_path()),
            })
            .unwrap(),
        );
        let addr = echo_server(tls).await;
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();

        let good = pki.client_cert("p-1", "client");
        let mut stream = pki
            .connector(Some(&good))
            .connect(name.clone(), TcpStream::connect(addr).await.unwrap())
            .await
            .unwrap();
        echo(&mut stream, b"hello").await;

        // No certificate, or one of another CA: the server ends the
        // handshake (TLS 1.3 reports it at the first read).
        let other = TestPki::new("other").client_cert("p-1", "client");
        for identity in [None, Some(&other)] {
            let refused = async {
                let mut stream = pki
                    .connector(identity)
                    .connect(name.clone(), TcpStream::connect(addr).await?)
                    .await?;
                stream.write_all(b"x").await?;
                let mut buf = [0u8; 1];
                stream.read_exact(&mut buf).await?;
                Ok::<_, std::io::Error>(())
            };
            assert!(
                refused.await.is_err(),
                "a client without a good certificate got in"
            );
        }
    }

    #[test]
    fn a_key_of_another_certificate_is_named() {
        let pki = TestPki::new("mismatch");
        let a = pki.server_cert("a");
        let b = pki.server_cert("b");
        let error = ServerTls::load(&TlsFiles {
            cert: a.cert_path.clone(),
            key: b.key_path.clone(),
            client_ca: None,
        })
        .unwrap_err();
        let text = format!("{error:#}");
        assert!(
            text.contains("does not belong") && text.contains("b.key"),
            "{text}"
        );
    }
}
