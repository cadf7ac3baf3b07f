//! [`ClientConfig`]: where the relay nodes are, who this process is, how
//! patiently to connect, and whether over TLS.

use std::time::Duration;

use crate::error::ClientError;
use crate::tls::ClientTls;
use crate::token::Token;

/// How a [`Client`](crate::Client) connects and reconnects.
///
/// Build it with [`ClientConfig::new`] and change the fields that need it:
///
/// ```
/// use std::time::Duration;
/// use wasmrelay_client::ClientConfig;
///
/// let mut config = ClientConfig::new(["10.0.0.1:7400", "10.0.0.2:7400"], "billing-worker-1")
///     .with_token_file("/var/run/secrets/wasmrelay/token");
/// config.max_backoff = Duration::from_secs(10);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClientConfig {
    /// The client addresses (`host:port`) of relay nodes. They are tried in
    /// order; after a connection is lost, the next attempt starts with the
    /// address after the one that was connected last, so the list rotates.
    pub addresses: Vec<String>,
    /// The business process id to register (see
    /// [`check_process_id`](wasmrelay_protocol::check_process_id)).
    pub process_id: String,
    /// Free text the node logs, e.g. `"billing-worker/2.3.1"`. Default
    /// `"wasmrelay-client/<crate version>"`.
    pub client_name: String,
    /// The pause before the first reconnection attempt after a connection
    /// is lost; it doubles after every failed round up to `max_backoff`
    /// (with jitter). Default 100 ms.
    pub initial_backoff: Duration,
    /// The longest pause between reconnection rounds. Default 5 s.
    pub max_backoff: Duration,
    /// After a `Rebalance` (the node moves this process to another node),
    /// the client waits a random pause of up to this long before it
    /// reconnects, so that many processes moved at once do not all dial
    /// the same node in the same instant. Default 1 s; zero reconnects at
    /// once.
    pub rebalance_jitter: Duration,
    /// How long one address may take for the TCP connection, the TLS
    /// handshake (with [`tls`](ClientConfig::tls)) and the `Hello` /
    /// `Welcome` exchange together. Default 5 s.
    pub connect_timeout: Duration,
    /// The largest frame this client reads or writes (length prefix
    /// excluded). Sends are also limited by the maximum the node announces
    /// in its `Welcome`. Default
    /// [`DEFAULT_MAX_FRAME_BYTES`](wasmrelay_protocol::DEFAULT_MAX_FRAME_BYTES).
    pub max_frame_bytes: usize,
    /// How long [`Client::send`](crate::Client::send) may take in total:
    /// waiting for a connection while disconnected, then waiting for the
    /// node's `SendAck`. Default 30 s.
    pub send_timeout: Duration,
    /// The token sent in every `Hello`: a JWT for
    /// [`process_id`](ClientConfig::process_id) signed by a key the cluster
    /// trusts (`wasmrelay token issue` makes one). Read again for every
    /// connection attempt, so a file or function can hand out refreshed
    /// tokens. Without it only a node with `client_auth = "none"` accepts
    /// the process. Default: none.
    pub token: Option<Token>,
    /// TLS towards every node, redirect targets included: which CA the
    /// nodes' certificates must chain to, an optional client certificate.
    /// A handshake that fails is a failed attempt on that address, its
    /// reason naming the cause. Default: none (plain TCP).
    pub tls: Option<ClientTls>,
}

impl ClientConfig {
    /// A configuration with the default timeouts for `process_id`, connecting
    /// to `addresses` (`host:port` each).
    pub fn new<A, S>(addresses: A, process_id: impl Into<String>) -> ClientConfig
    where
        A: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ClientConfig {
            addresses: addresses.into_iter().map(Into::into).collect(),
            process_id: process_id.into(),
            client_name: format!("wasmrelay-client/{}", env!("CARGO_PKG_VERSION")),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            rebalance_jitter: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(5),
            max_frame_bytes: wasmrelay_protocol::DEFAULT_MAX_FRAME_BYTES,
            send_timeout: Duration::from_secs(30),
            token: None,
            tls: None,
        }
    }

    /// This configuration with a fixed token.
    pub fn with_token(mut self, token: impl Into<String>) -> ClientConfig {
        self.token = Some(Token::new(token));
        self
    }

    /// This configuration with a token read from `path` for every
    /// connection attempt.
    pub fn with_token_file(mut self, path: impl AsRef<std::path::Path>) -> ClientConfig {
        self.token = Some(Token::from_file(path));
        self
    }

    /// This configuration with a token from `token` for every connection
    /// attempt.
    pub fn with_token_fn<F>(mut self, token: F) -> ClientConfig
    where
        F: Fn() -> Result<String, String> + Send + Sync + 'static,
    {
        self.token = Some(Token::from_fn(token));
        self
    }

    /// This configuration connecting over TLS.
    pub fn with_tls(mut self, tls: ClientTls) -> ClientConfig {
        self.tls = Some(tls);
        self
    }

    /// Checks the configuration before connecting.
    pub(crate) fn validate(&self) -> Result<(), ClientError> {
        let invalid = |reason: String| Err(ClientError::InvalidConfig(reason));
        if self.addresses.is_empty() {
            return invalid("no relay node address is configured".to_string());
        }
        if let Some(address) = self.addresses.iter().find(|a| a.trim().is_empty()) {
            return invalid(format!("the address {address:?} is empty"));
        }
        if let Err(reason) = wasmrelay_protocol::check_process_id(&self.process_id) {
            return invalid(reason);
        }
        if self.initial_backoff.is_zero() || self.max_backoff < self.initial_backoff {
            return invalid(format!(
                "the backoff must satisfy 0 < initial_backoff ({:?}) <= max_backoff ({:?})",
                self.initial_backoff, self.max_backoff
            ));
        }
        if self.connect_timeout.is_zero() || self.send_timeout.is_zero() {
            return invalid("connect_timeout and send_timeout must not be zero".to_string());
        }
        if self.max_frame_bytes < 1024 || self.max_frame_bytes > u32::MAX as usize {
            return invalid(format!(
                "max_frame_bytes is {}; it must be between 1 KiB and 4 GiB",
                self.max_frame_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let config = ClientConfig::new(["a:1"], "p");
        assert_eq!(config.addresses, vec!["a:1".to_string()]);
        assert!(config.client_name.starts_with("wasmrelay-client/"));
        assert_eq!(config.initial_backoff, Duration::from_millis(100));
        assert_eq!(config.max_backoff, Duration::from_secs(5));
        assert_eq!(config.rebalance_jitter, Duration::from_secs(1));
        assert_eq!(config.connect_timeout, Duration::from_secs(5));
        assert_eq!(
            config.max_frame_bytes,
            wasmrelay_protocol::DEFAULT_MAX_FRAME_BYTES
        );
        assert!(config.validate().is_ok());
    }

    #[test]
    fn invalid_configurations_are_refused() {
        let no_address = ClientConfig::new(Vec::<String>::new(), "p");
        assert!(no_address.validate().is_err());
        let bad_id = ClientConfig::new(["a:1"], "");
        assert!(bad_id.validate().is_err());
        let mut bad_backoff = ClientConfig::new(["a:1"], "p");
        bad_backoff.max_backoff = bad_backoff.initial_backoff / 2;
        assert!(bad_backoff.validate().is_err());
    }
}
