//! Client authentication: whether a Hello may register the process id it
//! names. In token mode (`cluster.client_auth = "token"`, the default) the
//! Hello carries a JWT signed by a key the cluster trusts; it must be
//! unexpired and name that process id (`sub`, or the `wasmrelay_process`
//! pattern). In `"mtls"` mode the connection's client certificate (verified
//! by the TLS listener against `cluster.tls.client_ca`) decides: its subject
//! common name is the process id it may register, or a prefix pattern
//! ending in `*`. In `"none"` mode, for development, nothing is checked.
//!
//! The check runs before the gateway creates a session or touches an
//! existing one, so a connection can only take a process over by proving
//! the same identity the first one proved: a valid token for that id.
//! Every refusal is one [`Refusal`], logged (never with the token) and
//! counted in `wasmrelay_client_auth_refused_total{reason}` together.
//!
//! Keys come from files (or, for HS256, inline secrets) and are re-read
//! every [`KEY_POLL`]: a changed file replaces the whole key set if every
//! key still loads; otherwise the keys in use stay and the error is logged
//! once per bad content. Owns: the key set, token verification, and the
//! issuing of tokens for `wasmrelay token issue`. Does not own the
//! connection (see `connection`) or the TLS handshake (`crate::tls`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::config::{ClientAuthMode, ClusterConfig, TokenAlgorithm, TokenKeyConfig};
use crate::telemetry::metrics::ClientAuthMetrics;

/// The shortest HS256 secret accepted, in bytes (the hash's own length).
pub const MIN_HS256_KEY_BYTES: usize = 32;
/// How often key files are checked for changes.
pub const KEY_POLL: Duration = Duration::from_secs(1);
/// Clock skew allowed on `exp` and `nbf`, in seconds.
const LEEWAY_SECS: u64 = 5;
/// Longest token looked at; a JWT with a few claims is a few hundred bytes.
const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// The claim that names a process id or prefix pattern in place of `sub`.
pub const PROCESS_CLAIM: &str = "wasmrelay_process";

/// Why a Hello's credential was refused. The `Display` text goes to the
/// client and the log; it never holds the token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The Hello carried no token.
    #[error("a token is required: this node authenticates clients (Hello.token is empty)")]
    Missing,
    /// Not a JWT, or a JWT without the claims needed.
    #[error("the token is malformed: {0}")]
    Malformed(String),
    /// No trusted key of the token's algorithm verifies it.
    #[error("the token's signature is not valid for any {alg} key this node trusts")]
    UnknownKey {
        /// The token's `alg`.
        alg: String,
    },
    /// `exp` has passed.
    #[error("the token has expired")]
    Expired,
    /// `nbf` is still to come.
    #[error("the token is not valid yet (nbf)")]
    NotYetValid,
    /// `aud` does not name this cluster's audience.
    #[error("the token's audience (aud) does not include `{expected}`")]
    WrongAudience {
        /// `cluster.client_token_audience`.
        expected: String,
    },
    /// `client_auth = "mtls"` and the connection presented no client
    /// certificate with a common name.
    #[error(
        "a client certificate is required: this node takes the process id from its common name"
    )]
    NoCertificate,
    /// The client certificate is valid but for another process id.
    #[error(
        "the client certificate is for process `{granted}` (its common name), not `{requested}`"
    )]
    WrongCertificate {
        /// The certificate's common name.
        granted: String,
        /// The Hello's process id.
        requested: String,
    },
    /// The token is valid but for another process id.
    #[error("the token is for process `{granted}`, not `{requested}`")]
    WrongProcess {
        /// What the token grants (`sub` or the pattern).
        granted: String,
        /// The Hello's process id.
        requested: String,
    },
}

impl Refusal {
    /// The `reason` label of the refused-Hello counter: a fixed set.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed(_) => "malformed",
            Refusal::UnknownKey { .. } => "unknown_key",
            Refusal::Expired => "expired",
            Refusal::NotYetValid => "not_yet_valid",
            Refusal::WrongAudience { .. } => "wrong_audience",
            Refusal::WrongProcess { .. } | Refusal::WrongCertificate { .. } => "wrong_process",
            Refusal::NoCertificate => "no_certificate",
        }
    }
}

/// The claims the relay reads from a client token.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct TokenClaims {
    /// The process id, or (with [`PROCESS_CLAIM`]) a name for logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub: Option<String>,
    /// An exact process id or a prefix pattern ending in `*`; when
    /// present it decides, not `sub`.
    #[serde(
        rename = "wasmrelay_process",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub process: Option<String>,
    /// Expiry, seconds since the Unix epoch.
    pub exp: u64,
    /// Not before, seconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    /// Issued at, seconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iat: Option<u64>,
    /// The audience.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aud: Option<String>,
}

impl TokenClaims {
    /// What the token grants: the pattern claim, else `sub`.
    fn granted(&self) -> Option<&str> {
        self.process.as_deref().or(self.sub.as_deref())
    }
}

/// Whether `granted` (an exact id, or a prefix ending in `*`) allows
/// `process_id`.
pub fn grants(granted: &str, process_id: &str) -> bool {
    match granted.strip_suffix('*') {
        Some(prefix) => process_id.starts_with(prefix),
        None => granted == process_id,
    }
}

/// Who a Hello proved to be, for the log line of its registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Identity {
    /// `client_auth = "none"`: nothing was proved.
    Unauthenticated,
    /// A token that grants the process id (`sub` or pattern).
    Token {
        /// What the token grants.
        granted: String,
    },
    /// A client certificate whose common name grants the process id.
    Certificate {
        /// The common name.
        granted: String,
    },
}

/// One trusted key, loaded.
struct LoadedKey {
    alg: Algorithm,
    key: DecodingKey,
}

/// Where a key comes from, and what its file held when last read.
#[derive(Debug)]
struct KeySource {
    /// `cluster.client_token_keys[i]`, for messages.
    name: String,
    config: TokenKeyConfig,
}

/// The token verifier: the key sources and the keys loaded from them.
struct TokenVerifier {
    sources: Vec<KeySource>,
    keys: ArcSwap<Vec<LoadedKey>>,
    /// The file contents behind `keys`, or a rejected newer content (so a
    /// bad file is reported once, not every poll).
    seen: Mutex<Vec<Option<Vec<u8>>>>,
    audience: Option<String>,
}

enum Mode {
    None,
    Token(TokenVerifier),
    Certificate,
}

/// How the gateway authenticates Hellos; cheap to clone.
#[derive(Clone)]
pub struct ClientAuth {
    mode: Arc<Mode>,
    metrics: ClientAuthMetrics,
}

impl std::fmt::Debug for ClientAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.mode {
            Mode::None => f.write_str("ClientAuth::None"),
            Mode::Certificate => f.write_str("ClientAuth::Certificate"),
            Mode::Token(verifier) => f
                .debug_struct("ClientAuth::Token")
                .field("keys", &verifier.keys.load().len())
                .field("audience", &verifier.audience)
                .finish(),
        }
    }
}

impl ClientAuth {
    /// No authentication: any Hello registers (development only).
    pub fn none() -> ClientAuth {
        ClientAuth {
            mode: Arc::new(Mode::None),
            metrics: ClientAuthMetrics::default(),
        }
    }

    /// Client certificate authentication: the TLS listener verifies the
    /// certificate, this checks that its common name grants the process id.
    pub fn certificate() -> ClientAuth {
        ClientAuth {
            mode: Arc::new(Mode::Certificate),
            metrics: ClientAuthMetrics::default(),
        }
    }

    /// Token authentication with `keys`, loaded now (an error names the
    /// key and its file); tokens must carry `audience` when given.
    pub fn token(keys: &[TokenKeyConfig], audience: Option<String>) -> anyhow::Result<ClientAuth> {
        anyhow::ensure!(
            !keys.is_empty(),
            "token authentication needs at least one key (`cluster.client_token_keys`)"
        );
        let sources: Vec<KeySource> = keys
            .iter()
            .enumerate()
            .map(|(i, config)| KeySource {
                name: format!("cluster.client_token_keys[{i}]"),
                config: config.clone(),
            })
            .collect();
        let contents = sources
            .iter()
            .map(KeySource::read)
            .collect::<anyhow::Result<Vec<_>>>()?;
        let loaded = load_all(&sources, &contents)?;
        Ok(ClientAuth {
            mode: Arc::new(Mode::Token(TokenVerifier {
                sources,
                keys: ArcSwap::from_pointee(loaded),
                seen: Mutex::new(contents),
                audience,
            })),
            metrics: ClientAuthMetrics::default(),
        })
    }

    /// The authentication `cluster` configures, counting refusals in
    /// `metrics`. In `"none"` mode this logs the warning operators must see.
    pub fn from_config(
        cluster: &ClusterConfig,
        metrics: ClientAuthMetrics,
    ) -> anyhow::Result<ClientAuth> {
        let auth = match cluster.client_auth {
            ClientAuthMode::None => {
                tracing::warn!(
                    "cluster.client_auth = \"none\": clients are not authenticated; anyone who \
                     can reach the client port can register, and take over, any process id \
                     (development only)"
                );
                ClientAuth::none()
            }
            ClientAuthMode::Token => ClientAuth::token(
                &cluster.client_token_keys,
                cluster.client_token_audience.clone(),
            )
            .context("loading the client token keys")?,
            ClientAuthMode::Mtls => ClientAuth::certificate(),
        };
        Ok(auth.with_metrics(metrics))
    }

    /// The same authentication, counting refusals in `metrics`.
    pub fn with_metrics(mut self, metrics: ClientAuthMetrics) -> ClientAuth {
        self.metrics = metrics;
        self
    }

    /// True when Hellos are checked.
    pub fn is_enforced(&self) -> bool {
        !matches!(&*self.mode, Mode::None)
    }

    /// Checks that `token` lets its holder register `process_id`. Counts
    /// a refusal; the caller logs it.
    pub fn check(&self, process_id: &str, token: &str) -> Result<Identity, Refusal> {
        self.check_hello(process_id, token, None)
    }

    /// Checks a Hello for `process_id` with `token`, on a connection whose
    /// verified client certificate (if any) has the common name
    /// `certificate_name`. Counts a refusal; the caller logs it.
    pub fn check_hello(
        &self,
        process_id: &str,
        token: &str,
        certificate_name: Option<&str>,
    ) -> Result<Identity, Refusal> {
        let result = match &*self.mode {
            Mode::None => Ok(Identity::Unauthenticated),
            Mode::Token(verifier) => verifier.check(process_id, token),
            Mode::Certificate => match certificate_name {
                None => Err(Refusal::NoCertificate),
                Some(name) if grants(name, process_id) => Ok(Identity::Certificate {
                    granted: name.to_string(),
                }),
                Some(name) => Err(Refusal::WrongCertificate {
                    granted: name.to_string(),
                    requested: process_id.to_string(),
                }),
            },
        };
        if let Err(refusal) = &result {
            self.metrics.refused(refusal.reason());
        }
        result
    }

    /// Re-reads the key files every [`KEY_POLL`] until `shutdown`; returns
    /// at once in `"none"` mode.
    pub async fn watch_keys(self, shutdown: CancellationToken) {
        let Mode::Token(verifier) = &*self.mode else {
            return;
        };
        if verifier.sources.iter().all(|s| s.config.path.is_none()) {
            return;
        }
        let mut poll = tokio::time::interval(KEY_POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = poll.tick() => {}
            }
            // File reads block: off the async workers, awaited at once.
            let auth = self.clone();
            let reload = tokio::task::spawn_blocking(move || {
                if let Mode::Token(verifier) = &*auth.mode {
                    verifier.reload();
                }
            });
            if let Err(error) = reload.await {
                tracing::error!(%error, "reloading the client token keys failed");
            }
        }
    }
}

impl KeySource {
    /// The key's bytes: its file's content, or the inline secret.
    fn read(&self) -> anyhow::Result<Option<Vec<u8>>> {
        match (&self.config.path, &self.config.secret) {
            (Some(path), _) => std::fs::read(path)
                .map(Some)
                .with_context(|| format!("{}: reading {}", self.name, path.display())),
            (None, Some(_)) => Ok(None),
            (None, None) => anyhow::bail!("{}: needs `path` or `secret`", self.name),
        }
    }

    /// Loads the key from `content` (its file's bytes) or the inline secret.
    fn load(&self, content: Option<&[u8]>) -> anyhow::Result<LoadedKey> {
        let inline = self.config.secret.as_ref().map(|s| s.expose().as_bytes());
        let bytes = content.or(inline).unwrap_or_default();
        let origin = match &self.config.path {
            Some(path) => path.display().to_string(),
            None => "the inline secret".to_string(),
        };
        match self.config.alg {
            TokenAlgorithm::Hs256 => {
                let secret = trim_line_end(bytes);
                anyhow::ensure!(
                    secret.len() >= MIN_HS256_KEY_BYTES,
                    "{}: the HS256 key in {origin} is {} bytes; at least {MIN_HS256_KEY_BYTES} \
                     are needed (e.g. `openssl rand -hex 32`)",
                    self.name,
                    secret.len()
                );
                Ok(LoadedKey {
                    alg: Algorithm::HS256,
                    key: DecodingKey::from_secret(secret),
                })
            }
            TokenAlgorithm::EdDsa => {
                let key = DecodingKey::from_ed_pem(bytes).map_err(|e| {
                    anyhow::anyhow!(
                        "{}: {origin} is not an Ed25519 public key in PEM \
                         (`-----BEGIN PUBLIC KEY-----`): {e}",
                        self.name
                    )
                })?;
                Ok(LoadedKey {
                    alg: Algorithm::EdDSA,
                    key,
                })
            }
        }
    }
}

/// Loads every key; the first failure fails all.
fn load_all(sources: &[KeySource], contents: &[Option<Vec<u8>>]) -> anyhow::Result<Vec<LoadedKey>> {
    sources
        .iter()
        .zip(contents)
        .map(|(source, content)| source.load(content.as_deref()))
        .collect()
}

/// `bytes` without a trailing `\n` or `\r\n` (an editor's or `echo`'s).
fn trim_line_end(bytes: &[u8]) -> &[u8] {
    let bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    bytes.strip_suffix(b"\r").unwrap_or(bytes)
}

impl TokenVerifier {
    fn check(&self, process_id: &str, token: &str) -> Result<Identity, Refusal> {
        if token.is_empty() {
            return Err(Refusal::Missing);
        }
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Refusal::Malformed(format!(
                "{} bytes long; at most {MAX_TOKEN_BYTES} are accepted",
                token.len()
            )));
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| {
            Refusal::Malformed(
                "not a JWT (three base64url parts: header.claims.signature)".to_string(),
            )
        })?;
        let keys = self.keys.load();
        let mut verified = None;
        for key in keys.iter().filter(|k| k.alg == header.alg) {
            match jsonwebtoken::decode::<TokenClaims>(token, &key.key, &self.validation(key.alg)) {
                Ok(data) => {
                    verified = Some(data.claims);
                    break;
                }
                // Another key of the same algorithm may verify it.
                Err(e) if matches!(e.kind(), ErrorKind::InvalidSignature) => {}
                Err(e) => return Err(self.refusal(e.kind())),
            }
        }
        let claims = verified.ok_or_else(|| Refusal::UnknownKey {
            alg: format!("{:?}", header.alg),
        })?;
        let Some(granted) = claims.granted() else {
            return Err(Refusal::Malformed(format!(
                "it names no process: set `sub` (a process id) or `{PROCESS_CLAIM}`"
            )));
        };
        if grants(granted, process_id) {
            Ok(Identity::Token {
                granted: granted.to_string(),
            })
        } else {
            Err(Refusal::WrongProcess {
                granted: granted.to_string(),
                requested: process_id.to_string(),
            })
        }
    }

    fn validation(&self, alg: Algorithm) -> Validation {
        let mut validation = Validation::new(alg);
        validation.leeway = LEEWAY_SECS;
        validation.validate_nbf = true;
        match &self.audience {
            Some(audience) => {
                validation.set_audience(&[audience]);
                validation.set_required_spec_claims(&["exp", "aud"]);
            }
            // Without a configured audience, a token's `aud` is not read.
            None => validation.validate_aud = false,
        }
        validation
    }

    fn refusal(&self, kind: &ErrorKind) -> Refusal {
        match kind {
            ErrorKind::ExpiredSignature => Refusal::Expired,
            ErrorKind::ImmatureSignature => Refusal::NotYetValid,
            ErrorKind::InvalidAudience => Refusal::WrongAudience {
                expected: self.audience.clone().unwrap_or_default(),
            },
            ErrorKind::MissingRequiredClaim(claim) if claim == "aud" => Refusal::WrongAudience {
                expected: self.audience.clone().unwrap_or_default(),
            },
            ErrorKind::MissingRequiredClaim(claim) => {
                Refusal::Malformed(format!("the `{claim}` claim is required"))
            }
            ErrorKind::InvalidClaimFormat(claim) => {
                Refusal::Malformed(format!("the `{claim}` claim is not valid"))
            }
            ErrorKind::Json(_) => {
                Refusal::Malformed("its claims are not what this node reads (`exp` must be a number of seconds; `sub` and `wasmrelay_process` strings)".to_string())
            }
            other => Refusal::Malformed(format!("{other:?}")),
        }
    }

    /// Re-reads the key files; when one changed and every key loads, the
    /// new set replaces the old. A failure keeps the old set and is logged
    /// once per content.
    fn reload(&self) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let mut contents = Vec::with_capacity(self.sources.len());
        for source in &self.sources {
            match source.read() {
                Ok(content) => contents.push(content),
                Err(error) => {
                    // A file being replaced may be missing for a moment;
                    // report it once, then keep polling.
                    let marker = Some(Vec::new());
                    let index = contents.len();
                    if seen[index] != marker {
                        tracing::error!(error = %format!("{error:#}"), "cannot read a client token key; the keys in use stay");
                        seen[index] = marker;
                    }
                    return;
                }
            }
        }
        if contents == *seen {
            return;
        }
        match load_all(&self.sources, &contents) {
            Ok(keys) => {
                self.keys.store(Arc::new(keys));
                tracing::info!(keys = self.sources.len(), "client token keys reloaded");
            }
            Err(error) => {
                tracing::error!(error = %format!("{error:#}"), "a changed client token key does not load; the keys in use stay");
            }
        }
        *seen = contents;
    }
}

/// What `wasmrelay token issue` signs.
#[derive(Clone, Debug)]
pub struct TokenRequest {
    /// The signing algorithm.
    pub alg: TokenAlgorithm,
    /// HS256: the secret file's content; EdDSA: an Ed25519 private key in
    /// PEM (PKCS#8, `BEGIN PRIVATE KEY`).
    pub key: Vec<u8>,
    /// A process id, or a prefix pattern ending in `*`.
    pub process: String,
    /// How long the token is valid from now.
    pub ttl: Duration,
    /// `aud`, when the cluster checks one.
    pub audience: Option<String>,
}

/// Signs a token for `request` (for operators and tests; the relay itself
/// only verifies). An exact id goes in `sub`; a pattern in
/// `wasmrelay_process`, with `sub` naming it too.
pub fn issue_token(request: &TokenRequest) -> anyhow::Result<String> {
    let now = jsonwebtoken::get_current_timestamp();
    let pattern = request.process.ends_with('*');
    let claims = TokenClaims {
        sub: Some(request.process.clone()),
        process: pattern.then(|| request.process.clone()),
        exp: now + request.ttl.as_secs(),
        nbf: None,
        iat: Some(now),
        aud: request.audience.clone(),
    };
    let (alg, key) = match request.alg {
        TokenAlgorithm::Hs256 => {
            let secret = trim_line_end(&request.key);
            anyhow::ensure!(
                secret.len() >= MIN_HS256_KEY_BYTES,
                "the HS256 key is {} bytes; at least {MIN_HS256_KEY_BYTES} are needed",
                secret.len()
            );
            (Algorithm::HS256, EncodingKey::from_secret(secret))
        }
        TokenAlgorithm::EdDsa => (
            Algorithm::EdDSA,
            EncodingKey::from_ed_pem(&request.key).map_err(|e| {
                anyhow::anyhow!(
                    "the key is not an Ed25519 private key in PEM (`-----BEGIN PRIVATE KEY-----`): {e}"
                )
            })?,
        ),
    };
    jsonwebtoken::encode(&Header::new(alg), &claims, &key).context("signing the token")
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::config::Secret;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";
    /// An Ed25519 key pair made with `openssl genpkey -algorithm ed25519`.
    const ED_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIDUfgM0BeZJtLan+YBlu2Anu03B5t4FD2sBzd3PzJN+F\n-----END PRIVATE KEY-----\n";
    const ED_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEAt0IFoUbGn1sr5ijyFx5B8XavIKmFUZs0TRyKJIV0co8=\n-----END PUBLIC KEY-----\n";

    fn hs256_auth(audience: Option<&str>) -> ClientAuth {
        let key = TokenKeyConfig {
            alg: TokenAlgorithm::Hs256,
            path: None,
            secret: Some(Secret::new(SECRET)),
        };
        ClientAuth::token(&[key], audience.map(str::to_string)).unwrap()
    }

    fn sign(claims: &serde_json::Value, secret: &str) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    }

    fn now() -> u64 {
        jsonwebtoken::get_current_timestamp()
    }

    #[test]
    fn a_token_for_the_process_id_is_accepted_and_others_are_refused() {
        let auth = hs256_auth(None);
        let token = sign(
            &serde_json::json!({"sub": "p-1", "exp": now() + 60}),
            SECRET,
        );
        assert_eq!(
            auth.check("p-1", &token),
            Ok(Identity::Token {
                granted: "p-1".to_string()
            })
        );
        assert_eq!(
            auth.check("p-2", &token).unwrap_err().reason(),
            "wrong_process"
        );
        assert_eq!(auth.check("p-1", "").unwrap_err(), Refusal::Missing);
        assert_eq!(
            auth.check("p-1", "not a jwt").unwrap_err().reason(),
            "malformed"
        );
        let expired = sign(
            &serde_json::json!({"sub": "p-1", "exp": now() - 60}),
            SECRET,
        );
        assert_eq!(auth.check("p-1", &expired).unwrap_err(), Refusal::Expired);
        let early = sign(
            &serde_json::json!({"sub": "p-1", "exp": now() + 600, "nbf": now() + 300}),
            SECRET,
        );
        assert_eq!(auth.check("p-1", &early).unwrap_err(), Refusal::NotYetValid);
        let no_exp = sign(&serde_json::json!({"sub": "p-1"}), SECRET);
        assert_eq!(
            auth.check("p-1", &no_exp).unwrap_err().reason(),
            "malformed"
        );
        let other_key = sign(
            &serde_json::json!({"sub": "p-1", "exp": now() + 60}),
            "another-secret-another-secret-another",
        );
        assert_eq!(
            auth.check("p-1", &other_key).unwrap_err().reason(),
            "unknown_key"
        );
        let nobody = sign(&serde_json::json!({"exp": now() + 60}), SECRET);
        assert!(
            auth.check("p-1", &nobody)
                .unwrap_err()
                .to_string()
                .contains("names no process")
        );
    }

    #[test]
    fn a_pattern_claim_grants_a_prefix_and_decides_over_sub() {
        let auth = hs256_auth(None);
        let token = sign(
            &serde_json::json!({"sub": "billing", "wasmrelay_process": "billing-*", "exp": now() + 60}),
            SECRET,
        );
        assert!(auth.check("billing-7", &token).is_ok());
        assert!(auth.check("billing-", &token).is_ok());
        assert_eq!(
            auth.check("billing", &token).unwrap_err().reason(),
            "wrong_process"
        );
        assert!(grants("*", "anything"));
        assert!(grants("p-1", "p-1"));
        assert!(!grants("p-1", "p-10"));
        assert!(!grants("p-1*x", "p-1*"));
    }

    #[test]
    fn an_audience_when_configured_is_required() {
        let auth = hs256_auth(Some("prod"));
        let right = sign(
            &serde_json::json!({"sub": "p-1", "exp": now() + 60, "aud": "prod"}),
            SECRET,
        );
        assert!(auth.check("p-1", &right).is_ok());
        let wrong = sign(
            &serde_json::json!({"sub": "p-1", "exp": now() + 60, "aud": "staging"}),
            SECRET,
        );
        assert_eq!(
            auth.check("p-1", &wrong).unwrap_err().reason(),
            "wrong_audience"
        );
        let none = sign(
            &serde_json::json!({"sub": "p-1", "exp": now() + 60}),
            SECRET,
        );
        assert_eq!(
            auth.check("p-1", &none).unwrap_err().reason(),
            "wrong_audience"
        );
    }

    #[test]
    fn eddsa_tokens_verify_with_the_public_key_and_hs256_cannot_pose_as_them() {
        let dir = tempfile::tempdir().unwrap();
        let public = dir.path().join("issuer.pub.pem");
        std::fs::write(&public, ED_PUBLIC).unwrap();
        let auth = ClientAuth::token(
            &[TokenKeyConfig {
                alg: TokenAlgorithm::EdDsa,
                path: Some(public.clone()),
                secret: None,
            }],
            None,
        )
        .unwrap();
        let token = issue_token(&TokenRequest {
            alg: TokenAlgorithm::EdDsa,
            key: ED_PRIVATE.as_bytes().to_vec(),
            process: "p-1".to_string(),
            ttl: Duration::from_secs(60),
            audience: None,
        })
        .unwrap();
        assert!(auth.check("p-1", &token).is_ok());
        // The classic confusion: an HS256 token "signed" with the public key.
        let confused = sign(
            &serde_json::json!({"sub": "p-1", "exp": now() + 60}),
            ED_PUBLIC,
        );
        assert_eq!(
            auth.check("p-1", &confused).unwrap_err().reason(),
            "unknown_key"
        );
    }

    #[test]
    fn bad_key_files_fail_the_start_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short.key");
        std::fs::write(&short, "tooshort\n").unwrap();
        let key = |alg, path: PathBuf| TokenKeyConfig {
            alg,
            path: Some(path),
            secret: None,
        };
        let error = ClientAuth::token(&[key(TokenAlgorithm::Hs256, short.clone())], None)
            .unwrap_err()
            .to_string();
        assert!(error.contains("cluster.client_token_keys[0]"), "{error}");
        assert!(error.contains("at least 32"), "{error}");
        let error = ClientAuth::token(&[key(TokenAlgorithm::EdDsa, short)], None)
            .unwrap_err()
            .to_string();
        assert!(error.contains("not an Ed25519 public key"), "{error}");
        let error = format!(
            "{:#}",
            ClientAuth::token(
                &[key(TokenAlgorithm::Hs256, dir.path().join("missing"))],
                None
            )
            .unwrap_err()
        );
        assert!(error.contains("reading"), "{error}");
    }

    #[test]
    fn a_rotated_key_file_is_picked_up_and_a_bad_one_keeps_the_old_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("client.key");
        let old = "old-secret-old-secret-old-secret-0";
        let new = "new-secret-new-secret-new-secret-0";
        std::fs::write(&path, format!("{old}\n")).unwrap();
        let auth = ClientAuth::token(
            &[TokenKeyConfig {
                alg: TokenAlgorithm::Hs256,
                path: Some(path.clone()),
                secret: None,
            }],
            None,
        )
        .unwrap();
        let Mode::Token(verifier) = &*auth.mode else {
            unreachable!()
        };
        let claims = serde_json::json!({"sub": "p-1", "exp": now() + 60});
        assert!(auth.check("p-1", &sign(&claims, old)).is_ok());
        std::fs::write(&path, "short").unwrap();
        verifier.reload();
        assert!(
            auth.check("p-1", &sign(&claims, old)).is_ok(),
            "a bad file keeps the old key"
        );
        std::fs::write(&path, new).unwrap();
        verifier.reload();
        assert!(auth.check("p-1", &sign(&claims, new)).is_ok());
        assert_eq!(
            auth.check("p-1", &sign(&claims, old)).unwrap_err().reason(),
            "unknown_key"
        );
    }

    #[test]
    fn refusals_are_counted_by_reason() {
        let metrics = ClientAuthMetrics::default();
        let auth = hs256_auth(None).with_metrics(metrics.clone());
        let _ = auth.check("p-1", "");
        let _ = auth.check("p-1", "");
        assert_eq!(metrics.refused_count("missing"), 2);
        assert_eq!(
            ClientAuth::none().check("p-1", ""),
            Ok(Identity::Unauthenticated)
        );
    }
}
