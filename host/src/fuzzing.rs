//! Entry points of the fuzz targets in `host/fuzz` (`scripts/fuzz.sh`):
//! each takes arbitrary bytes, hands them to one parser of input from
//! outside (a config file, a config-center value, a heartbeat or route
//! record read from Kafka, a `plugin test` input line) and checks what
//! must hold whatever the input: no panic, an error that says what is
//! wrong, and nothing taken on trust that did not pass its check.
//!
//! Not an API: hidden from the docs, compiled always so that the unit tests
//! below run every entry on its committed seeds, and clippy sees it.
//!
//! Records are described by the input: fields split at byte `0xFF`,
//! records at `0xFE`; a first byte of flags says how to sign the record
//! (with the cluster's key, another key, or not at all), so the fuzzer
//! reaches the parsing behind the MAC check as well as the check.

use std::time::Duration;

use wasmrelay_protocol::mesh_auth::{Key, Purpose, purpose_key};

use crate::cluster::membership::{self, MAC_HEADER};
use crate::cluster::routes::{self, ROUTE_GENERATION_HEADER, ROUTE_NODE_HEADER, RouteTable};
use crate::kafka::{CenterPolicy, InputRecord, LinkInfo};
use crate::telemetry::metrics::ClusterMetrics;

/// The name configs parsed here come from, in their error messages.
const CONFIG_ORIGIN: &str = "fuzz.toml";
const SECRET: &[u8] = b"fuzz-cluster-secret";
const OTHER_SECRET: &[u8] = b"another-cluster-secret";

/// A config file's text: interpolated (variables named `A` to `Z` are set,
/// others are not), parsed and validated.
pub fn config_text(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let env = |name: &str| (name.len() == 1).then(|| format!("value-of-{name}"));
    match crate::config::parse(text, CONFIG_ORIGIN, &env) {
        Ok(config) => {
            let _ = format!("{config:?}");
        }
        Err(error) => {
            let message = error.to_string();
            assert!(
                message.contains(CONFIG_ORIGIN),
                "a config error that does not name the file: {message}"
            );
        }
    }
}

/// A config-center value (`kafka.<id>`), checked with and without a files
/// directory. A secret property's value, when it occurs once in the input,
/// is in neither the error nor the parsed value's `Debug`.
pub fn center_value(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let secrets = secret_values(&text);
    for policy in [
        CenterPolicy { files_dir: None },
        CenterPolicy {
            files_dir: Some(std::env::temp_dir()),
        },
    ] {
        let shown = match LinkInfo::from_center_value(&text, &policy) {
            Ok(info) => {
                assert!(!info.bootstrap_servers.trim().is_empty());
                format!("{info:?}")
            }
            Err(error) => {
                assert!(!error.is_empty(), "an empty error for {text:?}");
                error
            }
        };
        for secret in &secrets {
            assert!(
                !shown.contains(secret.as_str()),
                "a secret value is shown: {shown}"
            );
        }
    }
}

/// The string values of secret properties in a JSON object, those that
/// occur once in `text` and are long enough not to occur by chance.
fn secret_values(text: &str) -> Vec<String> {
    let Ok(serde_json::Value::Object(object)) = serde_json::from_str(text) else {
        return Vec::new();
    };
    object
        .iter()
        .filter(|(key, _)| crate::kafka::link::is_secret(key))
        .filter_map(|(_, value)| value.as_str())
        .filter(|value| value.len() >= 8 && text.matches(*value).count() == 1)
        .map(str::to_string)
        .collect()
}

/// How a fuzzed record is signed, from its flags byte.
#[derive(Clone, Copy, Debug)]
struct Flags(u8);

impl Flags {
    /// A MAC with the cluster's key (else with another key).
    fn signed_right(self) -> bool {
        self.0 & 1 != 0
    }
    /// No MAC header at all.
    fn unsigned(self) -> bool {
        self.0 & 2 != 0
    }
    /// No value (a tombstone).
    fn tombstone(self) -> bool {
        self.0 & 4 != 0
    }
    /// A heartbeat's `sent_at_ms` set to now before signing, so that it
    /// is fresh.
    fn fresh(self) -> bool {
        self.0 & 8 != 0
    }
}

/// The fields of one fuzzed record: flags, key, value, then extra fields.
fn fields(record: &[u8]) -> (Flags, Vec<&[u8]>) {
    let mut fields = record.split(|b| *b == 0xFF);
    let flags = fields.next().and_then(|f| f.first().copied()).unwrap_or(0);
    (Flags(flags), fields.collect())
}

fn input_record(topic: &str, offset: i64, key: &[u8], value: Option<Vec<u8>>) -> InputRecord {
    InputRecord {
        topic: topic.into(),
        partition: 0,
        offset,
        key: Some(key.to_vec()),
        value,
        headers: Vec::new(),
        timestamp_ms: None,
    }
}

/// A heartbeat record read from the heartbeat topic; true when it was
/// taken. One that is taken carried the right MAC, its key is its node id,
/// and it is recent.
pub fn heartbeat_record(data: &[u8]) -> bool {
    let (flags, fields) = fields(data);
    let key = fields.first().copied().unwrap_or_default();
    let mut value = fields.get(1).map(|v| v.to_vec());
    if flags.fresh()
        && let Some(Ok(serde_json::Value::Object(mut beat))) = value
            .as_deref()
            .map(serde_json::from_slice::<serde_json::Value>)
    {
        beat.insert("sent_at_ms".into(), crate::cluster::now_ms().into());
        value = Some(serde_json::Value::Object(beat).to_string().into_bytes());
    }
    if flags.tombstone() {
        value = None;
    }
    let mut record = input_record("wasmrelay.heartbeats", 0, key, value);
    let cluster_key = key_of(SECRET, Purpose::HeartbeatRecord);
    if !flags.unsigned() {
        let signer = if flags.signed_right() {
            cluster_key.clone()
        } else {
            key_of(OTHER_SECRET, Purpose::HeartbeatRecord)
        };
        let mac =
            membership::heartbeat_mac(&signer, key, record.value.as_deref().unwrap_or_default());
        record.headers.push((MAC_HEADER.to_string(), mac));
    }
    let timeout = Duration::from_secs(3);
    match membership::open_heartbeat(&cluster_key, &record, timeout) {
        Ok(beat) => {
            assert!(
                flags.signed_right() && !flags.unsigned(),
                "a heartbeat without the cluster's MAC was taken: {beat:?}"
            );
            assert_eq!(beat.node_id.as_bytes(), key, "taken under another key");
            assert!(crate::cluster::now_ms() - beat.sent_at_ms <= 3_000 + 60_000);
            true
        }
        Err(why) => {
            assert!(!why.to_string().is_empty());
            false
        }
    }
}

/// A run of route records read from the routes topic, applied in order to
/// a new table, which is returned. A record without the cluster's MAC
/// changes nothing; a route the table holds came from a record with the
/// right MAC.
pub fn route_records(data: &[u8]) -> std::sync::Arc<RouteTable> {
    let table = route_table();
    let cluster_key = key_of(SECRET, Purpose::RouteRecord);
    let other_key = key_of(OTHER_SECRET, Purpose::RouteRecord);
    for (offset, record) in data.split(|b| *b == 0xFE).take(64).enumerate() {
        let (flags, fields) = fields(record);
        let process = fields.first().copied().unwrap_or_default();
        let value = (!flags.tombstone()).then(|| fields.get(1).copied().unwrap_or_default());
        let writer = fields.get(2).copied().unwrap_or_default();
        let generation = fields.get(3).copied().unwrap_or_default();
        let mut input = input_record(
            "wasmrelay.routes",
            i64::try_from(offset).unwrap_or(i64::MAX),
            process,
            value.map(<[u8]>::to_vec),
        );
        input
            .headers
            .push((ROUTE_NODE_HEADER.to_string(), writer.to_vec()));
        input
            .headers
            .push((ROUTE_GENERATION_HEADER.to_string(), generation.to_vec()));
        if !flags.unsigned() {
            let signer = if flags.signed_right() {
                &cluster_key
            } else {
                &other_key
            };
            let mac = match value {
                Some(value) => routes::route_mac(signer, process, value),
                None => {
                    let writer = String::from_utf8_lossy(writer);
                    let generation = std::str::from_utf8(generation)
                        .ok()
                        .and_then(|g| g.parse().ok())
                        .unwrap_or(0);
                    routes::removal_mac(signer, process, &writer, generation)
                }
            };
            input.headers.push((MAC_HEADER.to_string(), mac));
        }
        let process_id = String::from_utf8_lossy(process).into_owned();
        let before = table.holder(&process_id);
        table.apply(&input);
        let after = table.holder(&process_id);
        let trusted = flags.signed_right() && !flags.unsigned();
        if !trusted {
            assert_eq!(
                before, after,
                "a record without the cluster's MAC changed a route"
            );
        }
        if let (Some(node), Some(value)) = (&after, value)
            && before.as_ref() != Some(node)
        {
            // A route that changed came from this record's value.
            let named = serde_json::from_slice::<serde_json::Value>(value)
                .ok()
                .and_then(|v| v["node"].as_str().map(str::to_string));
            assert_eq!(
                named.as_ref(),
                Some(node),
                "a route to {node} from {value:?}"
            );
        }
    }
    assert!(table.len() <= 64);
    table
}

fn key_of(secret: &[u8], purpose: Purpose) -> Key {
    purpose_key(secret, purpose)
}

fn route_table() -> std::sync::Arc<RouteTable> {
    let gateway = crate::gateway::Gateway::new(
        Default::default(),
        crate::gateway::ClientAuth::none(),
        std::sync::Arc::new(crate::gateway::RefusingUpstream),
        None,
    );
    RouteTable::new(
        "fuzz-node",
        key_of(SECRET, Purpose::RouteRecord),
        Duration::from_secs(3),
        gateway,
        ClusterMetrics::default(),
    )
}

/// One input line of `wasmrelay plugin test` (a message or a placement
/// question as JSON).
pub fn message_line(data: &[u8]) {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(error) = crate::cli::message_json::parse_message_line(line) {
        assert!(!error.is_empty(), "an empty error for {line:?}");
    }
}

#[cfg(test)]
mod tests {
    //! Each entry on the committed seeds of its target
    //! (`host/fuzz/seeds/TARGET/`), so that a seed that breaks an
    //! assertion is found by `cargo test` too.
    use super::*;

    fn seeds(target: &str) -> Vec<Vec<u8>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/seeds")
            .join(target);
        let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("the seeds in {}: {e}", dir.display()))
            .map(|entry| std::fs::read(entry.unwrap().path()).unwrap())
            .collect();
        assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
        seeds.sort();
        seeds
    }

    #[test]
    fn every_entry_passes_its_seeds() {
        for (target, entry) in [
            ("config_text", config_text as fn(&[u8])),
            ("center_value", center_value),
            ("heartbeat_record", |data| {
                heartbeat_record(data);
            }),
            ("route_records", |data| {
                route_records(data);
            }),
            ("message_line", message_line),
        ] {
            for seed in seeds(target) {
                entry(&seed);
            }
        }
    }

    /// A record of the fuzz input format: flags, key, value.
    fn record(flags: u8, key: &[u8], value: &[u8]) -> Vec<u8> {
        let mut data = vec![flags, 0xFF];
        data.extend_from_slice(key);
        data.push(0xFF);
        data.extend_from_slice(value);
        data
    }

    #[test]
    fn only_a_fresh_heartbeat_with_the_clusters_mac_is_taken() {
        let beat = serde_json::json!({
            "node_id": "node-a", "client_addr": "x", "mesh_addr": "y", "admin_addr": "z",
            "connections": 0, "quota": 1, "started_at_ms": 0, "sent_at_ms": 0,
        })
        .to_string();
        let heartbeat = |flags| heartbeat_record(&record(flags, b"node-a", beat.as_bytes()));
        assert!(heartbeat(1 | 8), "fresh, the cluster's MAC");
        assert!(!heartbeat(8), "another cluster's MAC");
        assert!(!heartbeat(1 | 2 | 8), "no MAC");
        assert!(!heartbeat(1), "stale");
        assert!(!heartbeat(1 | 4 | 8), "no value");
        assert!(
            !heartbeat_record(&record(1 | 8, b"node-b", beat.as_bytes())),
            "under another node's key"
        );
    }

    #[test]
    fn only_a_route_with_the_clusters_mac_is_taken() {
        let value = br#"{"node":"node-b","registered_at_ms":0,"generation":1}"#;
        let holder = |flags| route_records(&record(flags, b"p-1", value)).holder("p-1");
        assert_eq!(holder(1), Some("node-b".to_string()));
        assert_eq!(holder(0), None, "another cluster's MAC");
        assert_eq!(holder(1 | 2), None, "no MAC");
        let mut then_removed = record(1, b"p-1", value);
        then_removed.push(0xFE);
        then_removed.extend(record(1 | 4, b"p-1", b""));
        then_removed.extend_from_slice(b"\xFFnode-b\xFF1");
        assert_eq!(
            route_records(&then_removed).holder("p-1"),
            None,
            "removed by its tombstone"
        );
    }
}
