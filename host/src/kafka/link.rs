//! A Kafka link's connection info (what a config-center value holds) and the
//! librdkafka client configs built from it.
//!
//! The relay manages some properties itself (group, offset storage,
//! commits, producer durability); those cannot be overridden by passthrough
//! options. What a center value may set at all is [`CenterPolicy`]'s.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::{FromClientConfig, FromClientConfigAndContext};

use super::center_policy::CenterPolicy;
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

/// The producer settings the relay forces on every producer: what
/// at-least-once delivery rests on.
pub const DURABILITY: &[(&str, &str)] = &[("acks", "all"), ("enable.idempotence", "true")];

/// librdkafka defaults the relay changes (a link's options win over them),
/// with why.
///
/// `metadata.recovery.strategy`: librdkafka 2.12's default, `rebootstrap`
/// (KIP-1102), adds the bootstrap servers again as new broker objects when
/// every known broker looks down at once, which a network cut causes, and
/// never frees the ones they replace: each cut left about 100 KiB behind per
/// client (docs/RELIABILITY.md, soak of 2026-12-05). With `none` a client
/// keeps reconnecting to the brokers it knows. The price: a cluster whose
/// brokers all move to new addresses under an unchanged `bootstrap.servers`
/// is followed only after a config-center change or a restart. A link that
/// needs re-bootstrap sets `metadata.recovery.strategy = "rebootstrap"`.
pub const RELAY_DEFAULTS: &[(&str, &str)] = &[("metadata.recovery.strategy", "none")];

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
    /// and passed as text. Only connection properties are accepted, and
    /// files only inside the policy's directory (see [`CenterPolicy`]);
    /// properties the relay manages are refused. The error names the
    /// property that is wrong and never quotes a secret value.
    pub fn from_center_value(value: &str, policy: &CenterPolicy) -> Result<LinkInfo, String> {
        // Centers read bytes that are not UTF-8 with U+FFFD in their place.
        if value.contains(char::REPLACEMENT_CHARACTER) {
            return Err("not UTF-8 text (its bad bytes read as U+FFFD)".into());
        }
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
                let text = policy.check(&key, &text)?;
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
        for (key, value) in RELAY_DEFAULTS {
            config.set(*key, *value);
        }
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
    /// duplicates on its own retries: `acks=all` and idempotence are the
    /// relay's and win over any option (at-least-once rests on them;
    /// librdkafka then keeps at most 5 requests in flight and retries).
    pub fn producer_config(&self) -> ClientConfig {
        let mut config = self.base_config();
        if !self.options.contains_key("linger.ms") {
            config.set("linger.ms", "5");
        }
        for (key, value) in DURABILITY {
            config.set(*key, *value);
        }
        // `request.required.acks` is librdkafka's other name for `acks`.
        config.remove("request.required.acks");
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
    fn every_client_skips_rebootstrap_unless_the_link_asks_for_it() {
        let plain = LinkInfo {
            bootstrap_servers: "k:9092".into(),
            options: BTreeMap::new(),
        };
        let asks = LinkInfo {
            bootstrap_servers: "k:9092".into(),
            options: BTreeMap::from([(
                "metadata.recovery.strategy".to_string(),
                "rebootstrap".to_string(),
            )]),
        };
        for (info, expected) in [(&plain, "none"), (&asks, "rebootstrap")] {
            for config in [
                info.consumer_config("g", Duration::from_secs(1)),
                info.producer_config(),
                info.admin_config(),
            ] {
                assert_eq!(config.get("metadata.recovery.strategy"), Some(expected));
            }
        }
        // librdkafka knows the property and the value (a client is made).
        let _: rdkafka::producer::BaseProducer = plain.create(&plain.producer_config()).unwrap();
    }

    fn center_value(value: &str) -> Result<LinkInfo, String> {
        LinkInfo::from_center_value(value, &CenterPolicy::default())
    }

    #[test]
    fn parses_center_values_and_names_what_is_wrong() {
        let info = center_value(
            r#"{"bootstrap.servers": "k1:9092,k2:9092", "security.protocol": "sasl_ssl", "socket.timeout.ms": 30000}"#,
        )
        .unwrap();
        assert_eq!(info.bootstrap_servers, "k1:9092,k2:9092");
        assert_eq!(info.options["socket.timeout.ms"], "30000");
        assert_eq!(info.options["security.protocol"], "sasl_ssl");
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
            (
                r#"{"bootstrap.servers": "k:1", "plugin.library.paths": "/tmp/evil.so"}"#,
                "`plugin.library.paths` may not be set by the config center",
            ),
            (
                r#"{"bootstrap.servers": "k:1", "acks": 0}"#,
                "`acks` may not be set by the config center",
            ),
            (
                r#"{"bootstrap.servers": "k:1", "enable.idempotence": false}"#,
                "`enable.idempotence` may not be set",
            ),
            (
                r#"{"bootstrap.servers": "k:1", "ssl.key.location": "/etc/shadow"}"#,
                "`ssl.key.location` names a file",
            ),
        ] {
            let error = center_value(value).unwrap_err();
            assert!(error.contains(expected), "{value}: {error}");
        }
    }

    #[test]
    fn center_files_resolve_inside_the_files_dir_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), "pem").unwrap();
        let policy = CenterPolicy {
            files_dir: Some(dir.path().to_path_buf()),
        };
        let info = LinkInfo::from_center_value(
            r#"{"bootstrap.servers": "k:1", "ssl.ca.location": "ca.pem"}"#,
            &policy,
        )
        .unwrap();
        let resolved = dir.path().canonicalize().unwrap().join("ca.pem");
        assert_eq!(
            info.options["ssl.ca.location"],
            resolved.display().to_string()
        );
        let error = LinkInfo::from_center_value(
            r#"{"bootstrap.servers": "k:1", "ssl.key.location": "/etc/shadow", "ssl.key.password": "Sup3r-secret"}"#,
            &policy,
        )
        .unwrap_err();
        assert!(error.contains("`ssl.key.location`"), "{error}");
        assert!(error.contains("not inside"), "{error}");
        assert!(!error.contains("Sup3r-secret"), "{error}");
    }

    #[test]
    fn producers_always_wait_for_all_replicas_and_are_idempotent() {
        let info = LinkInfo {
            bootstrap_servers: "k:1".into(),
            options: BTreeMap::from([
                ("acks".to_string(), "0".to_string()),
                ("request.required.acks".to_string(), "1".to_string()),
                ("enable.idempotence".to_string(), "false".to_string()),
                ("linger.ms".to_string(), "50".to_string()),
            ]),
        };
        let config = info.producer_config();
        assert_eq!(config.get("acks"), Some("all"));
        assert_eq!(config.get("request.required.acks"), None);
        assert_eq!(config.get("enable.idempotence"), Some("true"));
        // Tuning stays the operator's.
        assert_eq!(config.get("linger.ms"), Some("50"));
        let config = LinkInfo {
            bootstrap_servers: "k:1".into(),
            options: BTreeMap::new(),
        }
        .producer_config();
        assert_eq!(config.get("acks"), Some("all"));
        assert_eq!(config.get("enable.idempotence"), Some("true"));
        assert_eq!(config.get("linger.ms"), Some("5"));
    }

    #[test]
    fn client_errors_never_show_secret_values() {
        // librdkafka (through rdkafka) quotes a refused property's value;
        // `sasl.oauthbearer.client.secret` is refused by a build without
        // libcurl (OIDC), which this one is (rdkafka without `curl`).
        let info = LinkInfo {
            bootstrap_servers: "127.0.0.1:1".into(),
            options: BTreeMap::from([
                (
                    "sasl.oauthbearer.client.secret".to_string(),
                    "Sup3r-secret-1".to_string(),
                ),
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
        assert!(error.contains("sasl.oauthbearer.client.secret"), "{error}");
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
        let error =
            center_value(r#"{"bootstrap.servers": "k:1", "sasl.password": ["Sup3r-secret"]}"#)
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
