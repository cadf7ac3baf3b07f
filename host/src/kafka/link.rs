//! A Kafka link's connection info (what a config-center value holds) and the
//! librdkafka client configs built from it.
//!
//! The relay manages some properties itself (group, offset storage,
//! commits); those cannot be overridden by passthrough options.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::{FromClientConfig, FromClientConfigAndContext};

use crate::config::{REDACTED, Secret, redact};

/// librdkafka properties the relay sets itself.
pub const MANAGED_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "enable.partition.eof",
    "transactional.id",
];

/// Where a Kafka cluster is and how to talk to it.
///
/// Secret property values (see [`is_secret`]) never leave it in clear:
/// `Debug` and `Serialize` show them as `***`, and errors of librdkafka
/// clients made through [`LinkInfo::create`] have them scrubbed.
#[derive(Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// `host:port,host:port`.
    pub bootstrap_servers: String,
    /// Other librdkafka properties, passed through.
    pub options: BTreeMap<String, String>,
}

/// Property names whose values are secrets, redacted wherever link info is
/// shown: passwords, secrets, tokens, private keys (`ssl.key.pem`,
/// `*.key`), and the SASL configs that embed credentials.
pub fn is_secret(property: &str) -> bool {
    let p = property.to_ascii_lowercase();
    p.contains("password")
        || p.contains("secret")
        || p.contains("token")
        || p.ends_with(".key")
        || p.starts_with("ssl.key")
        || p == "sasl.oauthbearer.config"
        || p == "sasl.jaas.config"
}

impl std::fmt::Debug for LinkInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = self.redacted();
        f.debug_struct("LinkInfo")
            .field("bootstrap_servers", &shown.bootstrap_servers)
            .field("options", &shown.options)
            .finish()
    }
}

impl serde::Serialize for LinkInfo {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let shown = self.redacted();
        let mut out = serializer.serialize_struct("LinkInfo", 2)?;
        out.serialize_field("bootstrap_servers", &shown.bootstrap_servers)?;
        out.serialize_field("options", &shown.options)?;
        out.end()
    }
}

impl LinkInfo {
    /// Parses a config-center value: a JSON object of librdkafka properties
    /// with `bootstrap.servers` present. Numbers and booleans are accepted
    /// and passed as text; properties the relay manages (other than
    /// `bootstrap.servers`) are refused. The error says what is wrong.
    pub fn from_center_value(value: &str) -> Result<LinkInfo, String> {
        let parsed: serde_json::Value =
            serde_json::from_str(value).map_err(|e| format!("not JSON: {e}"))?;
        let serde_json::Value::Object(object) = parsed else {
            return Err("not a JSON object of librdkafka properties".into());
        };
        let mut options = BTreeMap::new();
        let mut bootstrap_servers = None;
        for (key, value) in object {
            let text = match value {
                serde_json::Value::String(s) => s,
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => b.to_string(),
                other => {
                    // A secret's value is not quoted, even a malformed one.
                    let got = if is_secret(&key) {
                        REDACTED.to_string()
                    } else {
                        other.to_string()
                    };
                    return Err(format!(
                        "`{key}`: expected text, a number or a boolean, got {got}"
                    ));
                }
            };
            if key == "bootstrap.servers" {
                bootstrap_servers = Some(text);
            } else if MANAGED_PROPERTIES.contains(&key.as_str()) {
                return Err(format!(
                    "`{key}` is managed by the relay and cannot be set here"
                ));
            } else {
                options.insert(key, text);
            }
        }
        let bootstrap_servers = bootstrap_servers
            .filter(|s| !s.trim().is_empty())
            .ok_or_else(|| "`bootstrap.servers` is missing or empty".to_string())?;
        Ok(LinkInfo {
            bootstrap_servers,
            options,
        })
    }

    /// The values of the secret properties.
    pub fn secrets(&self) -> Vec<Secret> {
        self.options
            .iter()
            .filter(|(k, _)| is_secret(k))
            .map(|(_, v)| Secret::new(v.clone()))
            .collect()
    }

    /// `text` with this link's secret values replaced by `***`.
    pub fn redact(&self, text: &str) -> String {
        redact(text, &self.secrets())
    }

    /// Creates a librdkafka client from `config` (one of this info's
    /// configs). librdkafka's error text may quote property values: it is
    /// scrubbed of this link's secrets.
    pub fn create<T: FromClientConfig>(&self, config: &ClientConfig) -> anyhow::Result<T> {
        config
            .create()
            .map_err(|e| anyhow::anyhow!("{}", self.redact(&e.to_string())))
    }

    /// [`LinkInfo::create`] with a client context.
    pub fn create_with_context<C, T>(&self, config: &ClientConfig, context: C) -> anyhow::Result<T>
    where
        C: ClientContext,
        T: FromClientConfigAndContext<C>,
    {
        config
            .create_with_context(context)
            .map_err(|e| anyhow::anyhow!("{}", self.redact(&e.to_string())))
    }

    /// The same info with secret values replaced by `***`.
    pub fn redacted(&self) -> LinkInfo {
        LinkInfo {
            bootstrap_servers: self.bootstrap_servers.clone(),
            options: self
                .options
                .iter()
                .map(|(k, v)| {
                    let shown = if is_secret(k) {
                        REDACTED.to_string()
                    } else {
                        v.clone()
                    };
                    (k.clone(), shown)
                })
                .collect(),
        }
    }

    fn base_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        for (key, value) in &self.options {
            config.set(key, value);
        }
        config.set("bootstrap.servers", &self.bootstrap_servers);
        config
    }

    /// Config of a consumer in `group` that stores offsets only when told
    /// (`enable.auto.offset.store=false`) and auto-commits what was stored.
    pub fn consumer_config(&self, group: &str, commit_interval: Duration) -> ClientConfig {
        let mut config = self.base_config();
        config
            .set("group.id", group)
            .set("enable.auto.commit", "true")
            .set(
                "auto.commit.interval.ms",
                commit_interval.as_millis().to_string(),
            )
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false");
        if !self.options.contains_key("auto.offset.reset") {
            config.set("auto.offset.reset", "earliest");
        }
        config
    }

    /// Config of a producer that waits for all in-sync replicas and never
    /// duplicates on its own retries.
    pub fn producer_config(&self) -> ClientConfig {
        let mut config = self.base_config();
        for (key, value) in [("acks", "all"), ("linger.ms", "5")] {
            if !self.options.contains_key(key) {
                config.set(key, value);
            }
        }
        config
    }

    /// Config of an admin or metadata client.
    pub fn admin_config(&self) -> ClientConfig {
        self.base_config()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_secrets_only() {
        let info = LinkInfo {
            bootstrap_servers: "k:9092".into(),
            options: BTreeMap::from([
                ("sasl.password".to_string(), "hunter2".to_string()),
                ("ssl.key.password".to_string(), "x".to_string()),
                ("sasl.username".to_string(), "relay".to_string()),
            ]),
        };
        let shown = info.redacted();
        assert_eq!(shown.options["sasl.password"], "***");
        assert_eq!(shown.options["ssl.key.password"], "***");
        assert_eq!(shown.options["sasl.username"], "relay");
    }

    #[test]
    fn parses_center_values_and_names_what_is_wrong() {
        let info = LinkInfo::from_center_value(
            r#"{"bootstrap.servers": "k1:9092,k2:9092", "security.protocol": "sasl_ssl", "socket.timeout.ms": 30000, "enable.idempotence": true}"#,
        )
        .unwrap();
        assert_eq!(info.bootstrap_servers, "k1:9092,k2:9092");
        assert_eq!(info.options["socket.timeout.ms"], "30000");
        assert_eq!(info.options["enable.idempotence"], "true");
        for (value, expected) in [
            ("kafka:9092", "not JSON"),
            ("[1, 2]", "not a JSON object"),
            (
                r#"{"security.protocol": "ssl"}"#,
                "`bootstrap.servers` is missing",
            ),
            (
                r#"{"bootstrap.servers": " "}"#,
                "`bootstrap.servers` is missing",
            ),
            (
                r#"{"bootstrap.servers": "k:1", "group.id": "x"}"#,
                "`group.id` is managed",
            ),
            (
                r#"{"bootstrap.servers": "k:1", "sasl": {"a": 1}}"#,
                "`sasl`: expected text",
            ),
        ] {
            let error = LinkInfo::from_center_value(value).unwrap_err();
            assert!(error.contains(expected), "{value}: {error}");
        }
    }

    #[test]
    fn client_errors_never_show_secret_values() {
        // librdkafka (through rdkafka) quotes a refused property's value;
        // `ssl.key.password` is refused by a build without OpenSSL.
        let info = LinkInfo {
            bootstrap_servers: "127.0.0.1:1".into(),
            options: BTreeMap::from([
                ("ssl.key.password".to_string(), "Sup3r-secret-1".to_string()),
                ("sasl.password".to_string(), "Sup3r-secret-2".to_string()),
            ]),
        };
        let raw = info
            .producer_config()
            .create::<rdkafka::producer::BaseProducer>()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            raw.contains("Sup3r-secret-1"),
            "the raw error no longer quotes the value; pick another refused secret property: {raw}"
        );
        let error = info
            .create::<rdkafka::producer::BaseProducer>(&info.producer_config())
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(error.contains("ssl.key.password"), "{error}");
        assert!(!error.contains("Sup3r-secret"), "{error}");
        assert!(!format!("{info:?}").contains("Sup3r-secret"));
        assert!(
            !serde_json::to_string(&info)
                .unwrap_or_default()
                .contains("Sup3r-secret")
        );
    }

    #[test]
    fn a_malformed_secret_in_a_center_value_is_not_quoted() {
        let error = LinkInfo::from_center_value(
            r#"{"bootstrap.servers": "k:1", "sasl.password": ["Sup3r-secret"]}"#,
        )
        .unwrap_err();
        assert!(error.contains("`sasl.password`"), "{error}");
        assert!(!error.contains("Sup3r-secret"), "{error}");
    }

    #[test]
    fn managed_properties_win_over_options() {
        let info = LinkInfo {
            bootstrap_servers: "real:9092".into(),
            options: BTreeMap::from([("bootstrap.servers".to_string(), "wrong:1".to_string())]),
        };
        let config = info.consumer_config("g", Duration::from_secs(1));
        assert_eq!(config.get("bootstrap.servers"), Some("real:9092"));
        assert_eq!(config.get("enable.auto.offset.store"), Some("false"));
    }
}
