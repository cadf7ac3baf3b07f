//! Client tokens for the tests' cluster nodes: an HS256 key made at random
//! once per test process, the `[cluster]` line that makes a node trust it,
//! and tokens for process ids signed with it (what `wasmrelay token issue`
//! makes), so every test cluster runs with client authentication on.

use std::fmt::Write as _;
use std::hash::{BuildHasher as _, Hasher as _};
use std::sync::OnceLock;
use std::time::Duration;

/// The HS256 key of this test process: 64 hex characters, random.
pub fn key() -> &'static str {
    static KEY: OnceLock<String> = OnceLock::new();
    KEY.get_or_init(|| {
        // `RandomState` is seeded from the OS's randomness; four draws make
        // 256 bits, plenty for a key that lives as long as one test.
        let mut key = String::new();
        for n in 0..4u64 {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(n);
            let _ = write!(key, "{:016x}", hasher.finish());
        }
        key
    })
}

/// The `[cluster]` line that makes a node trust [`key`] (inline).
pub fn cluster_keys() -> String {
    format!(
        "client_token_keys = [{{ alg = \"HS256\", secret = \"{}\" }}]",
        key()
    )
}

/// A token for `process` (an id, or a prefix pattern ending in `*`),
/// signed with [`key`], valid for an hour.
pub fn token(process: &str) -> String {
    token_for(key(), process, Duration::from_secs(3600))
}

/// A token for `process` signed with the HS256 `key`, valid for `ttl`.
pub fn token_for(key: &str, process: &str, ttl: Duration) -> String {
    let now = now();
    let mut claims = serde_json::json!({
        "sub": process,
        "iat": now,
        "exp": now + ttl.as_secs(),
    });
    if process.ends_with('*') {
        claims["wasmrelay_process"] = process.into();
    }
    sign(key, &claims)
}

/// `claims`, exactly, signed with the HS256 `key` (for expired or
/// otherwise odd tokens).
pub fn sign(key: &str, claims: &serde_json::Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        claims,
        &jsonwebtoken::EncodingKey::from_secret(key.as_bytes()),
    )
    .unwrap()
}

/// Seconds since the Unix epoch.
pub fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}
