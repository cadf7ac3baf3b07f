//! Mesh authentication: a node dialing another proves it knows the cluster
//! secret with an HMAC-SHA256 over both node ids, a fresh nonce and its
//! clock; the acceptor proves it too by answering with an HMAC over the
//! nonce. The exact texts are in `proto/wasmrelay.proto` (`MeshHello`,
//! `MeshWelcome`) so that other implementations can interoperate.

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

/// How far apart the two nodes' clocks may be, in milliseconds.
pub const MAX_CLOCK_SKEW_MS: i64 = 60_000;

type HmacSha256 = Hmac<Sha256>;

fn mac_of(secret: &[u8], text: &str) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(text.as_bytes());
    mac
}

fn hello_text(node_id: &str, to_node_id: &str, nonce: &[u8], time_ms: i64) -> String {
    format!(
        "wasmrelay-mesh-hello\n{node_id}\n{to_node_id}\n{}\n{time_ms}",
        hex::encode(nonce)
    )
}

fn welcome_text(node_id: &str, nonce: &[u8]) -> String {
    format!("wasmrelay-mesh-welcome\n{node_id}\n{}", hex::encode(nonce))
}

/// The `mac` of a `MeshHello`.
pub fn hello_mac(
    secret: &[u8],
    node_id: &str,
    to_node_id: &str,
    nonce: &[u8],
    time_ms: i64,
) -> Vec<u8> {
    mac_of(secret, &hello_text(node_id, to_node_id, nonce, time_ms))
        .finalize()
        .into_bytes()
        .to_vec()
}

/// Checks a `MeshHello`'s `mac` (in constant time) and clock.
pub fn verify_hello(
    secret: &[u8],
    hello: &crate::v1::MeshHello,
    now_ms: i64,
) -> Result<(), String> {
    if (hello.time_ms - now_ms).abs() > MAX_CLOCK_SKEW_MS {
        return Err(format!(
            "the clocks of {} and this node are {} ms apart (at most {MAX_CLOCK_SKEW_MS} allowed)",
            hello.node_id,
            (hello.time_ms - now_ms).abs()
        ));
    }
    mac_of(
        secret,
        &hello_text(
            &hello.node_id,
            &hello.to_node_id,
            &hello.nonce,
            hello.time_ms,
        ),
    )
    .verify_slice(&hello.mac)
    .map_err(|_| format!("node {} does not know the cluster secret", hello.node_id))
}

/// The `mac` of a `MeshWelcome`.
pub fn welcome_mac(secret: &[u8], node_id: &str, nonce: &[u8]) -> Vec<u8> {
    mac_of(secret, &welcome_text(node_id, nonce))
        .finalize()
        .into_bytes()
        .to_vec()
}

/// Checks a `MeshWelcome`'s `mac` against the nonce the dialer sent.
pub fn verify_welcome(
    secret: &[u8],
    welcome: &crate::v1::MeshWelcome,
    nonce: &[u8],
) -> Result<(), String> {
    mac_of(secret, &welcome_text(&welcome.node_id, nonce))
        .verify_slice(&welcome.mac)
        .map_err(|_| format!("node {} does not know the cluster secret", welcome.node_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{MeshHello, MeshWelcome};

    fn hello(secret: &[u8], time_ms: i64) -> MeshHello {
        let nonce = vec![7; 16];
        MeshHello {
            protocol_version: 1,
            node_id: "a".to_string(),
            to_node_id: "b".to_string(),
            mac: hello_mac(secret, "a", "b", &nonce, time_ms).into(),
            nonce: nonce.into(),
            time_ms,
        }
    }

    #[test]
    fn the_right_secret_passes_and_a_wrong_one_does_not() {
        assert!(verify_hello(b"s3cret", &hello(b"s3cret", 1000), 1000).is_ok());
        let error = verify_hello(b"s3cret", &hello(b"other", 1000), 1000).unwrap_err();
        assert!(
            error.contains("does not know the cluster secret"),
            "{error}"
        );
        let mut tampered = hello(b"s3cret", 1000);
        tampered.to_node_id = "c".to_string();
        assert!(verify_hello(b"s3cret", &tampered, 1000).is_err());
    }

    #[test]
    fn an_old_hello_is_refused() {
        let error = verify_hello(b"s", &hello(b"s", 0), MAX_CLOCK_SKEW_MS + 1).unwrap_err();
        assert!(error.contains("clocks"), "{error}");
    }

    #[test]
    fn the_welcome_proves_the_acceptor_knows_the_secret() {
        let nonce = [1u8; 16];
        let welcome = MeshWelcome {
            node_id: "b".to_string(),
            mac: welcome_mac(b"s", "b", &nonce).into(),
        };
        assert!(verify_welcome(b"s", &welcome, &nonce).is_ok());
        assert!(verify_welcome(b"x", &welcome, &nonce).is_err());
        assert!(verify_welcome(b"s", &welcome, &[2u8; 16]).is_err());
    }
}
