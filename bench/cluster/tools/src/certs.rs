//! Throw-away certificates for the TLS runs: one CA and, per node, a
//! certificate for 127.0.0.1, ::1 and localhost that is good for server and
//! client authentication (the node presents it on its client listener, and
//! on the mesh both when it accepts and when it dials). ECDSA P-256 keys,
//! as rcgen makes by default (and as the relay's own tests use).

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use serde_json::json;

use crate::emit;

#[derive(Debug, clap::Args)]
pub(crate) struct Certs {
    /// Directory the PEM files are written to (created if missing):
    /// `ca.pem`, and `<name>.pem` / `<name>.key` per name.
    #[arg(long)]
    dir: PathBuf,
    /// Node names, comma separated: one certificate each.
    #[arg(long)]
    names: String,
}

fn name(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

pub(crate) async fn certs(args: Certs) -> Result<(), String> {
    std::fs::create_dir_all(&args.dir)
        .map_err(|e| format!("creating {}: {e}", args.dir.display()))?;
    let ca_key = KeyPair::generate().map_err(|e| format!("CA key: {e}"))?;
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = name("wasmrelay cluster bench CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca_params
        .self_signed(&ca_key)
        .map_err(|e| format!("CA certificate: {e}"))?;
    write(&args.dir.join("ca.pem"), &ca.pem())?;
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let mut written = Vec::new();
    for node in args
        .names
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let mut params = CertificateParams::new(vec!["localhost".to_string()])
            .map_err(|e| format!("certificate parameters: {e}"))?;
        params
            .subject_alt_names
            .push(SanType::IpAddress(Ipv4Addr::LOCALHOST.into()));
        params
            .subject_alt_names
            .push(SanType::IpAddress(Ipv6Addr::LOCALHOST.into()));
        params.distinguished_name = name(node);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(|e| format!("key of {node}: {e}"))?;
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(|e| format!("certificate of {node}: {e}"))?;
        write(&args.dir.join(format!("{node}.pem")), &cert.pem())?;
        write(&args.dir.join(format!("{node}.key")), &key.serialize_pem())?;
        written.push(node.to_string());
    }
    emit(json!({"dir": args.dir, "ca": "ca.pem", "nodes": written}));
    Ok(())
}
