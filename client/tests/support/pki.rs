//! Certificates for the TLS tests, made with rcgen when the test runs: a
//! certificate authority per test that issues server certificates for the
//! names a test asks for and client certificates for a common name, and the
//! rustls server configurations a [`FakeNode`](super::FakeNode) serves with.

use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A certificate and its key.
#[derive(Debug)]
pub(crate) struct IssuedCert {
    pub(crate) cert_pem: String,
    pub(crate) key_pem: String,
    /// The certificate as it travels in a handshake.
    pub(crate) der: CertificateDer<'static>,
}

impl IssuedCert {
    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).expect("parsing a key rcgen wrote")
    }

    /// Writes the certificate and key as `<stem>.pem` and `<stem>.key` in
    /// `dir`; returns their paths.
    pub(crate) fn write(&self, dir: &tempfile::TempDir, stem: &str) -> (PathBuf, PathBuf) {
        let cert = dir.path().join(format!("{stem}.pem"));
        let key = dir.path().join(format!("{stem}.key"));
        std::fs::write(&cert, &self.cert_pem).expect("writing a certificate");
        std::fs::write(&key, &self.key_pem).expect("writing a key");
        (cert, key)
    }
}

/// A throw-away certificate authority.
pub(crate) struct TestCa {
    key: KeyPair,
    params: CertificateParams,
    /// Its certificate: what a client trusts.
    pub(crate) pem: String,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new authority whose common name is `name`.
    pub(crate) fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().expect("generating the CA key");
        let mut params = CertificateParams::default();
        params.distinguished_name = common_name(name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let pem = params
            .self_signed(&key)
            .expect("self-signing the CA certificate")
            .pem();
        TestCa { key, params, pem }
    }

    /// A server certificate for `names` (IP addresses become IP SANs, the
    /// rest DNS SANs).
    pub(crate) fn server_cert(&self, names: &[&str]) -> IssuedCert {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("server certificate names");
        params.distinguished_name = common_name(names[0]);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params)
    }

    /// A client certificate whose common name is `name`.
    pub(crate) fn client_cert(&self, name: &str) -> IssuedCert {
        let mut params = CertificateParams::default();
        params.distinguished_name = common_name(name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params)
    }

    fn issue(&self, params: CertificateParams) -> IssuedCert {
        let key = KeyPair::generate().expect("generating a key");
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params
            .signed_by(&key, &issuer)
            .expect("signing a certificate");
        IssuedCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }

    /// A server presenting `cert`, without client certificates.
    pub(crate) fn server_config(cert: &IssuedCert) -> Arc<rustls::ServerConfig> {
        Arc::new(
            rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_no_client_auth()
                .with_single_cert(vec![cert.der.clone()], cert.key())
                .expect("a server config"),
        )
    }

    /// A server presenting `cert` that requires a client certificate
    /// issued by this authority.
    pub(crate) fn mtls_server_config(&self, cert: &IssuedCert) -> Arc<rustls::ServerConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(self.pem.as_bytes()) {
            roots
                .add(ca.expect("parsing the CA certificate"))
                .expect("a trust anchor");
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .expect("a client verifier");
        Arc::new(
            rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_client_cert_verifier(verifier)
                .with_single_cert(vec![cert.der.clone()], cert.key())
                .expect("a server config"),
        )
    }
}

fn common_name(name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    dn
}
