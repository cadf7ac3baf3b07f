//! A Kafka link's connection info (what a config-center value holds) and the
//! librdkafka client configs built from it.
//!
//! The relay manages some properties itself (group, offset storage,
//! commits); those cannot be overridden by passthrough options.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::ClientConfig;

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
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkInfo {
    /// `host:port,host:port`.
    pub bootstrap_servers: String,
    /// Other librdkafka properties, passed through.
    pub options: BTreeMap<String, String>,
}

/// Property names whose values are secrets, redacted wherever link info is shown.
fn is_secret(property: &str) -> bool {
    let p = property.to_ascii_lowercase();
    p.contains("password") || p.contains("secret") || p.ends_with(".key") || p.contains("token")
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
                    return Err(format!(
                        "`{key}`: expected text, a number or a boolean, got {other}"
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

    /// The same info with secret values replaced by `***`.
    pub fn redacted(&self) -> LinkInfo {
        LinkInfo {
            bootstrap_servers: self.bootstrap_servers.clone(),
            options: self
                .options
                .iter()
                .map(|(k, v)| {
                    let shown = if is_secret(k) {
                        "***".to_string()
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
