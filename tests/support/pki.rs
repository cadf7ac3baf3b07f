//! Certificates for tests: a throw-away certificate authority per test that
//! issues server certificates for `127.0.0.1`/`localhost` and client
//! certificates for a given name, written as PEM files into a temporary
//! directory (librdkafka, etcd and the relay read files; rustls takes the
//! parsed forms).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A certificate and its private key, as PEM text and as files.
#[derive(Clone, Debug)]
pub struct IssuedCert {
    pub cert_pem: String,
    pub key_pem: String,
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
}

impl IssuedCert {
    /// The certificate chain, parsed for rustls.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .expect("parsing a certificate this module wrote")
    }

    /// The private key, parsed for rustls.
    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .expect("parsing a key this module wrote")
    }
}

/// A certificate authority of one test, with the files it wrote.
pub struct TestPki {
    name: String,
    ca_key: KeyPair,
    ca_params: CertificateParams,
    ca_pem: String,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for TestPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestPki")
            .field("name", &self.name)
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

impl TestPki {
    /// A new authority named `name` (its certificate's common name).
    pub fn new(name: &str) -> TestPki {
        let ca_key = KeyPair::generate().expect("generating the CA key");
        let mut ca_params = CertificateParams::default();
        ca_params.distinguished_name = distinguished_name(&format!("{name} test CA"));
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params
            .self_signed(&ca_key)
            .expect("self-signing the CA certificate");
        let dir = tempfile::Builder::new()
            .prefix("wasmrelay-pki-")
            .tempdir()
            .expect("creating a directory for certificates");
        let ca_pem = ca_cert.pem();
        std::fs::write(dir.path().join("ca.pem"), &ca_pem).expect("writing ca.pem");
        TestPki {
            name: name.to_owned(),
            ca_key,
            ca_params,
            ca_pem,
            dir,
        }
    }

    /// The authority's certificate (PEM): what a client trusts.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The path of [`TestPki::ca_pem`].
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A root store that trusts this authority only.
    pub fn root_store(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots
                .add(cert.expect("parsing the CA certificate"))
                .expect("adding the CA to a root store");
        }
        roots
    }

    /// A server certificate for `127.0.0.1`, `::1` and `localhost`, written
    /// as `<file_stem>.pem` and `<file_stem>.key`.
    pub fn server_cert(&self, file_stem: &str) -> IssuedCert {
        self.issue(
            localhost_params(vec![ExtendedKeyUsagePurpose::ServerAuth]),
            file_stem,
        )
    }

    /// A relay node's certificate for the mesh, presented both when it
    /// accepts and when it dials: for `127.0.0.1`, `::1` and `localhost`,
    /// good for server and client authentication.
    pub fn node_cert(&self, file_stem: &str) -> IssuedCert {
        self.issue(
            localhost_params(vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ]),
            file_stem,
        )
    }

    /// A TLS client that trusts this CA and presents `identity`, if given.
    pub fn connector(&self, identity: Option<&IssuedCert>) -> tokio_rustls::TlsConnector {
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(self.root_store());
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some(cert) => builder
                .with_client_auth_cert(cert.chain(), cert.key())
                .expect("a client certificate this module issued"),
        };
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }

    /// A client certificate whose common name (and DNS name) is `name`,
    /// written as `<file_stem>.pem` and `<file_stem>.key`.
    pub fn client_cert(&self, name: &str, file_stem: &str) -> IssuedCert {
        let mut params =
            CertificateParams::new(vec![name.to_owned()]).expect("client certificate parameters");
        params.distinguished_name = distinguished_name(name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params, file_stem)
    }

    fn issue(&self, params: CertificateParams, file_stem: &str) -> IssuedCert {
        let key = KeyPair::generate().expect("generating a key");
        let issuer = Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params
            .signed_by(&key, &issuer)
            .expect("signing a certificate");
        let issued = IssuedCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_path: self.dir.path().join(format!("{file_stem}.pem")),
            key_path: self.dir.path().join(format!("{file_stem}.key")),
        };
        std::fs::write(&issued.cert_path, &issued.cert_pem).expect("writing a certificate");
        std::fs::write(&issued.key_path, &issued.key_pem).expect("writing a key");
        issued
    }

    /// A rustls server config presenting `cert` (no client certificates).
    pub fn server_config(cert: &IssuedCert) -> Arc<rustls::ServerConfig> {
        Arc::new(
            rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(cert.chain(), cert.key())
            .expect("a server config from a certificate this module issued"),
        )
    }
}

fn distinguished_name(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name
}

/// Parameters of a certificate for `127.0.0.1`, `::1` and `localhost` with
/// the extended key usages `usages`.
fn localhost_params(usages: Vec<ExtendedKeyUsagePurpose>) -> CertificateParams {
    let mut params =
        CertificateParams::new(vec!["localhost".to_owned()]).expect("certificate parameters");
    params
        .subject_alt_names
        .push(SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
    params
        .subject_alt_names
        .push(SanType::IpAddress(std::net::Ipv6Addr::LOCALHOST.into()));
    params.distinguished_name = distinguished_name("localhost");
    params.extended_key_usages = usages;
    params
}
