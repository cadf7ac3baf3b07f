//! [`ClientTls`]: TLS towards the relay nodes. It owns what the client
//! trusts (CA certificates from PEM, optionally the system roots), the
//! optional client certificate for mutual TLS, and which name the node's
//! certificate must carry (by default the host part of the address being
//! dialed, so redirect targets are checked under their own names).
//!
//! It does not dial: [`dial`](crate::dial) connects over TCP, then wraps the
//! socket with [`ClientTls::connect`] inside the connect timeout. Everything
//! is read and checked when the [`ClientTls`] is built, so a bad file fails
//! there, naming the file, and never in a reconnection loop.

use std::fmt;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// How a client speaks TLS to the relay nodes: the certificates it trusts,
/// an optional client certificate, an optional server name.
///
/// Cheap to clone (the parsed certificates are shared). `Debug` shows where
/// the trust and the client certificate came from, never the key.
///
/// ```no_run
/// use wasmrelay_client::{ClientConfig, ClientTls};
///
/// # fn build() -> Result<ClientConfig, wasmrelay_client::TlsError> {
/// let tls = ClientTls::with_ca_file("/etc/wasmrelay/ca.pem")?
///     .with_client_cert_files("/etc/wasmrelay/billing.pem", "/etc/wasmrelay/billing.key")?;
/// Ok(ClientConfig::new(["relay-1:7400"], "billing-worker-1").with_tls(tls))
/// # }
/// ```
#[derive(Clone)]
pub struct ClientTls {
    roots: Arc<RootCertStore>,
    /// Where the trusted certificates came from, for `Debug`.
    trusted: Vec<String>,
    identity: Option<Identity>,
    server_name: Option<ServerName<'static>>,
    /// Built from the fields above whenever one changes, so dialing only
    /// clones an `Arc`.
    connector: TlsConnector,
}

/// The client certificate and where it came from.
#[derive(Clone)]
struct Identity {
    key: Arc<CertifiedKey>,
    origin: String,
}

/// Why a [`ClientTls`] could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {what} {}: {source}", .path.display())]
    Read {
        /// What the file was for, e.g. `"the CA file"`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        source: io::Error,
    },
    /// A CA or client certificate source holds no PEM certificate, or a key
    /// source no PEM private key.
    #[error("{origin} holds no PEM {expected}")]
    Missing {
        /// The source, e.g. `"the CA file /etc/wasmrelay/ca.pem"`.
        origin: String,
        /// What it should hold, e.g. `"certificate"`.
        expected: &'static str,
    },
    /// A source holds something rustls refuses: broken PEM, a certificate
    /// that cannot be a trust anchor, a key of an unsupported type or one
    /// that does not belong to the certificate.
    #[error("{origin}: {reason}")]
    Invalid {
        /// The source.
        origin: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The system's root certificates could not be loaded.
    #[error("loading the system root certificates: {0}")]
    SystemRoots(String),
    /// The name given to [`ClientTls::with_server_name`] is neither a DNS
    /// name nor an IP address.
    #[error("{0:?} is not a valid TLS server name (a DNS name or an IP address)")]
    ServerName(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// Every PEM certificate in `pem`; none is an error naming `origin`.
fn certificates(pem: &[u8], origin: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Invalid {
            origin: origin.to_string(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Missing {
            origin: origin.to_string(),
            expected: "certificate",
        });
    }
    Ok(certs)
}

impl ClientTls {
    /// Trusts the CA certificates in `pem` (one or more PEM blocks) and
    /// nothing else.
    pub fn with_ca_pem(pem: impl AsRef<[u8]>) -> Result<ClientTls, TlsError> {
        ClientTls::empty()?.add_ca_pem(pem)
    }

    /// Trusts the CA certificates in the PEM file `path` and nothing else.
    /// The error names the file when it cannot be read or holds no
    /// certificate.
    pub fn with_ca_file(path: impl AsRef<Path>) -> Result<ClientTls, TlsError> {
        ClientTls::empty()?.add_ca_file(path)
    }

    /// Trusts the operating system's root certificates (as
    /// `rustls-native-certs` finds them; `SSL_CERT_FILE` and `SSL_CERT_DIR`
    /// are honoured) and nothing else.
    pub fn with_system_roots() -> Result<ClientTls, TlsError> {
        ClientTls::empty()?.add_system_roots()
    }

    /// Also trusts the CA certificates in `pem`.
    pub fn add_ca_pem(self, pem: impl AsRef<[u8]>) -> Result<ClientTls, TlsError> {
        self.add_cas(pem.as_ref(), "the CA PEM".to_string())
    }

    /// Also trusts the CA certificates in the PEM file `path`.
    pub fn add_ca_file(self, path: impl AsRef<Path>) -> Result<ClientTls, TlsError> {
        let path = path.as_ref();
        let pem = read("the CA file", path)?;
        self.add_cas(&pem, format!("the CA file {}", path.display()))
    }

    /// Also trusts the operating system's root certificates.
    pub fn add_system_roots(mut self) -> Result<ClientTls, TlsError> {
        let found = rustls_native_certs::load_native_certs();
        // Some unreadable or odd entries are normal in a system store; only
        // a store that yields nothing usable is an error.
        let mut roots = RootCertStore::clone(&self.roots);
        let (added, _ignored) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            let errors: Vec<String> = found.errors.iter().map(|e| e.to_string()).collect();
            return Err(TlsError::SystemRoots(if errors.is_empty() {
                "no root certificate was found".to_string()
            } else {
                format!("no usable root certificate: {}", errors.join("; "))
            }));
        }
        self.roots = Arc::new(roots);
        self.trusted.push(format!("system roots ({added})"));
        self.rebuild()
    }

    /// Presents the certificate chain in `cert_chain_pem` (its own
    /// certificate first) with the private key in `key_pem` (PKCS#8, PKCS#1
    /// or SEC1) to nodes that ask for one (mutual TLS).
    pub fn with_client_cert_pem(
        self,
        cert_chain_pem: impl AsRef<[u8]>,
        key_pem: impl AsRef<[u8]>,
    ) -> Result<ClientTls, TlsError> {
        self.with_identity(
            cert_chain_pem.as_ref(),
            "the client certificate PEM".to_string(),
            key_pem.as_ref(),
            "the client key PEM".to_string(),
        )
    }

    /// Presents the certificate chain in the PEM file `cert` with the
    /// private key in the PEM file `key` (mutual TLS). Errors name the file.
    pub fn with_client_cert_files(
        self,
        cert: impl AsRef<Path>,
        key: impl AsRef<Path>,
    ) -> Result<ClientTls, TlsError> {
        let (cert, key) = (cert.as_ref(), key.as_ref());
        let cert_pem = read("the client certificate", cert)?;
        let key_pem = read("the client key", key)?;
        self.with_identity(
            &cert_pem,
            format!("the client certificate {}", cert.display()),
            &key_pem,
            format!("the client key {}", key.display()),
        )
    }

    /// Verifies every node's certificate for `name` (a DNS name or an IP
    /// address) instead of the host part of the address being dialed: for
    /// nodes reached by an address their certificate does not name.
    pub fn with_server_name(mut self, name: impl Into<String>) -> Result<ClientTls, TlsError> {
        let name = name.into();
        let parsed = parse_server_name(&name).ok_or(TlsError::ServerName(name))?;
        self.server_name = Some(parsed);
        Ok(self)
    }

    /// Runs the TLS handshake on `tcp`, connected to `address`, verifying
    /// the node's certificate for the configured server name or the host
    /// of `address`. The error says what failed (e.g. `invalid peer
    /// certificate: UnknownIssuer`).
    pub(crate) async fn connect(
        &self,
        address: &str,
        tcp: TcpStream,
    ) -> Result<TlsStream<TcpStream>, String> {
        let name = match &self.server_name {
            Some(name) => name.clone(),
            None => server_name_of(address).ok_or_else(|| {
                format!(
                    "cannot verify TLS: the host of {address:?} is not a DNS name or an IP \
                     address (set a server name)"
                )
            })?,
        };
        self.connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake with {address} failed: {e}"))
    }

    /// A configuration that trusts nothing yet (not public: it could not
    /// connect anywhere).
    fn empty() -> Result<ClientTls, TlsError> {
        let roots = Arc::new(RootCertStore::empty());
        Ok(ClientTls {
            connector: connector(&roots, None)?,
            roots,
            trusted: Vec::new(),
            identity: None,
            server_name: None,
        })
    }

    fn add_cas(mut self, pem: &[u8], origin: String) -> Result<ClientTls, TlsError> {
        let mut roots = RootCertStore::clone(&self.roots);
        let certs = certificates(pem, &origin)?;
        let count = certs.len();
        for cert in certs {
            roots.add(cert).map_err(|e| TlsError::Invalid {
                origin: origin.clone(),
                reason: e.to_string(),
            })?;
        }
        self.roots = Arc::new(roots);
        self.trusted.push(format!("{origin} ({count})"));
        self.rebuild()
    }

    fn with_identity(
        mut self,
        cert_pem: &[u8],
        cert_origin: String,
        key_pem: &[u8],
        key_origin: String,
    ) -> Result<ClientTls, TlsError> {
        let chain = certificates(cert_pem, &cert_origin)?;
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| match e {
            rustls::pki_types::pem::Error::NoItemsFound => TlsError::Missing {
                origin: key_origin.clone(),
                expected: "private key",
            },
            other => TlsError::Invalid {
                origin: key_origin.clone(),
                reason: other.to_string(),
            },
        })?;
        // Checks that the key is usable and belongs to the certificate.
        let key =
            CertifiedKey::from_der(chain, key, &provider()).map_err(|e| TlsError::Invalid {
                origin: format!("{key_origin} with {cert_origin}"),
                reason: e.to_string(),
            })?;
        self.identity = Some(Identity {
            key: Arc::new(key),
            origin: cert_origin,
        });
        self.rebuild()
    }

    /// Takes the changed roots or identity into the connector.
    fn rebuild(mut self) -> Result<ClientTls, TlsError> {
        self.connector = connector(&self.roots, self.identity.as_ref())?;
        Ok(self)
    }
}

/// The rustls configuration for `roots` and `identity`: the ring provider
/// (not the process default, which another crate may have set or left
/// ambiguous), safe default protocol versions.
fn connector(
    roots: &Arc<RootCertStore>,
    identity: Option<&Identity>,
) -> Result<TlsConnector, TlsError> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Invalid {
            origin: "the TLS protocol versions".to_string(),
            reason: e.to_string(),
        })?
        .with_root_certificates(roots.clone());
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some(identity) => builder
            .with_client_cert_resolver(Arc::new(SingleCertAndKey::from(identity.key.clone()))),
    };
    Ok(TlsConnector::from(Arc::new(config)))
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("trusted", &self.trusted)
            .field(
                "client_cert",
                &self.identity.as_ref().map(|identity| &identity.origin),
            )
            .field("server_name", &self.server_name)
            .finish()
    }
}

/// `name` as a rustls server name: an IP address (also in brackets) or a
/// DNS name.
fn parse_server_name(name: &str) -> Option<ServerName<'static>> {
    let unbracketed = name
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .unwrap_or(name);
    // IP addresses first: a dotted quad must be checked as an address, not
    // as a DNS name.
    if let Ok(ip) = unbracketed.parse::<IpAddr>() {
        return Some(ServerName::IpAddress(ip.into()));
    }
    ServerName::try_from(name.to_string()).ok()
}

/// The server name to verify for `address`: its host part (`host:port`,
/// `[v6]:port`, or a bare host or address).
pub(crate) fn server_name_of(address: &str) -> Option<ServerName<'static>> {
    let address = address.trim();
    // A bare IPv6 address has colons but no port.
    if let Ok(ip) = address.parse::<IpAddr>() {
        return Some(ServerName::IpAddress(ip.into()));
    }
    let host = if let Some(rest) = address.strip_prefix('[') {
        &rest[..rest.find(']')?]
    } else {
        match address.rsplit_once(':') {
            Some((host, _port)) => host,
            None => address,
        }
    };
    if host.is_empty() {
        return None;
    }
    parse_server_name(host)
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn dns(name: &str) -> Option<ServerName<'static>> {
        Some(ServerName::try_from(name.to_string()).unwrap())
    }

    fn ip(address: IpAddr) -> Option<ServerName<'static>> {
        Some(ServerName::IpAddress(address.into()))
    }

    #[test]
    fn the_server_name_is_the_host_part_of_the_address() {
        assert_eq!(
            server_name_of("relay-1.example.com:7400"),
            dns("relay-1.example.com")
        );
        assert_eq!(server_name_of("relay-1:7400"), dns("relay-1"));
        assert_eq!(server_name_of("relay-1"), dns("relay-1"));
        assert_eq!(
            server_name_of("127.0.0.1:7400"),
            ip(Ipv4Addr::LOCALHOST.into())
        );
        assert_eq!(server_name_of("[::1]:7400"), ip(Ipv6Addr::LOCALHOST.into()));
        assert_eq!(
            server_name_of("[fe80::1]:7400"),
            ip("fe80::1".parse().unwrap())
        );
        assert_eq!(server_name_of("::1"), ip(Ipv6Addr::LOCALHOST.into()));
        assert_eq!(
            server_name_of(" 10.0.0.2:7400 "),
            ip("10.0.0.2".parse().unwrap())
        );
        assert_eq!(server_name_of(":7400"), None);
        assert_eq!(server_name_of("[::1:7400"), None);
        assert_eq!(server_name_of("bad_host!:7400"), None);
    }

    #[test]
    fn an_explicit_server_name_may_be_a_dns_name_or_an_address() {
        let tls = ClientTls::empty().unwrap();
        assert_eq!(
            tls.clone()
                .with_server_name("relay.internal")
                .unwrap()
                .server_name,
            dns("relay.internal")
        );
        assert_eq!(
            tls.clone().with_server_name("[::1]").unwrap().server_name,
            ip(Ipv6Addr::LOCALHOST.into())
        );
        let error = tls.with_server_name("not a name").unwrap_err();
        assert!(matches!(error, TlsError::ServerName(_)), "{error:?}");
    }

    #[test]
    fn a_ca_file_without_a_certificate_is_an_error_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("wasmrelay-client-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("not-a-ca.pem");
        std::fs::write(&path, "this is no certificate\n").unwrap();
        let error = ClientTls::with_ca_file(&path).unwrap_err();
        assert!(matches!(error, TlsError::Missing { .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            format!("the CA file {} holds no PEM certificate", path.display())
        );

        let missing = dir.join("missing.pem");
        let error = ClientTls::with_ca_file(&missing).unwrap_err();
        assert!(matches!(error, TlsError::Read { .. }), "{error:?}");
        assert!(
            error
                .to_string()
                .starts_with(&format!("reading the CA file {}: ", missing.display())),
            "{error}"
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let error = ClientTls::with_ca_pem("").unwrap_err();
        assert_eq!(error.to_string(), "the CA PEM holds no PEM certificate");
    }

    #[test]
    fn a_client_key_that_is_missing_or_does_not_match_is_refused() {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["ca".to_string()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&ca_key).unwrap();
        let tls = ClientTls::with_ca_pem(ca.pem()).unwrap();

        let client_key = rcgen::KeyPair::generate().unwrap();
        let client = rcgen::CertificateParams::new(vec!["proc-1".to_string()])
            .unwrap()
            .self_signed(&client_key)
            .unwrap();
        let with_cert = tls
            .clone()
            .with_client_cert_pem(client.pem(), client_key.serialize_pem())
            .unwrap();
        let debug = format!("{with_cert:?}");
        assert!(debug.contains("the client certificate PEM"), "{debug}");
        assert!(!debug.contains("PRIVATE KEY"), "{debug}");

        let error = tls
            .clone()
            .with_client_cert_pem(client.pem(), ca.pem())
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "the client key PEM holds no PEM private key"
        );
        let error = tls
            .with_client_cert_pem(client.pem(), ca_key.serialize_pem())
            .unwrap_err();
        assert!(matches!(error, TlsError::Invalid { .. }), "{error:?}");
    }
}
