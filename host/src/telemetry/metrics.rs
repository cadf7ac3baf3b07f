//! Every metric the relay exports, named in one place, in the Prometheus
//! text format served at `/metrics`.
//!
//! Labels are bounded: a flow's name, a plugin's name. Nothing per message,
//! per key or per process id.

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LinkLabels {
    link: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FlowLabels {
    flow: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabels {
    plugin: String,
}

fn plugin_call_histogram() -> Histogram {
    // 10 µs .. ~2.6 s
    Histogram::new(exponential_buckets(0.000_01, 4.0, 10))
}

/// The relay's metrics.
pub struct RelayMetrics {
    registry: Mutex<Registry>,
    consumed: Family<FlowLabels, Counter>,
    delivered: Family<FlowLabels, Counter>,
    returned: Family<FlowLabels, Counter>,
    dead_lettered: Family<FlowLabels, Counter>,
    retried: Family<FlowLabels, Counter>,
    in_progress: Family<FlowLabels, Gauge>,
    awaiting_ack: Family<FlowLabels, Gauge>,
    lines_recovering: Family<FlowLabels, Gauge>,
    plugin_call_seconds: Family<PluginLabels, Histogram, fn() -> Histogram>,
    link_switches: Family<LinkLabels, Counter>,
    link_switches_refused: Family<LinkLabels, Counter>,
    center_reachable: Gauge,
    cluster: ClusterMetrics,
    admin: AdminMetrics,
    client_auth: ClientAuthMetrics,
    /// The tokio tasks alive, read at each render (a leak of tasks shows
    /// here first; the soak watches it).
    runtime_tasks: Gauge,
    /// glibc's heap, read at each render: bytes allocated and not freed
    /// (what a leak raises) and bytes free in its arenas.
    heap_in_use_bytes: Gauge,
    heap_free_bytes: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Hellos refused for their credential, by reason (a fixed set:
/// `gateway::auth::Refusal::reason`); cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct ClientAuthMetrics {
    refused: Family<ReasonLabels, Counter>,
}

impl ClientAuthMetrics {
    /// Counts one refused Hello.
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// Refused Hellos of `reason` so far.
    pub fn refused_count(&self, reason: &'static str) -> u64 {
        self.refused.get_or_create(&ReasonLabels { reason }).get()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TimeoutLabels {
    timeout: &'static str,
}

/// The admin listener's connections; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct AdminMetrics {
    /// Admin connections open now.
    pub open: Gauge,
    /// Connections closed as soon as accepted: `max_connections` were open.
    pub refused: Counter,
    timed_out: Family<TimeoutLabels, Counter>,
}

impl AdminMetrics {
    /// Counts a connection closed by the header timeout (`header = true`)
    /// or the idle timeout.
    pub fn timed_out(&self, header: bool) {
        let timeout = if header { "header" } else { "idle" };
        self.timed_out
            .get_or_create(&TimeoutLabels { timeout })
            .inc();
    }
}

/// Gauges of the cluster as this node sees it; cheap to clone and set.
#[derive(Clone, Debug, Default)]
pub struct ClusterMetrics {
    /// Nodes whose heartbeats arrive in time (this one included).
    pub live_nodes: Gauge,
    /// 1 while fewer nodes than `min_live_nodes` are live.
    pub alarm: Gauge,
    /// Business processes connected to this node.
    pub connections: Gauge,
    /// Routes (process id → node) in this node's route table.
    pub routes: Gauge,
    /// Heartbeat and route records ignored because they did not
    /// authenticate or could not be read, by topic and reason.
    pub records_rejected: Family<RecordRejectedLabels, Counter>,
    /// Offsets of the routes topic the broker never delivered to this
    /// node's reader (the writers were asked to write them again).
    pub route_records_missed: Counter,
    /// Heartbeats with this node's id from another instance (a twin).
    pub twin_heartbeats: Counter,
    /// Processes this node told to reconnect elsewhere to even out load.
    pub rebalance_moves: Counter,
    /// Processes this node told to reconnect elsewhere while evacuated.
    pub evacuation_moves: Counter,
    /// 1 while this node is moving processes (a rebalance round or an
    /// evacuation).
    pub rebalancing: Gauge,
}

/// The labels of `wasmrelay_cluster_records_rejected_total`: bounded (the
/// cluster's two topics, a fixed set of reasons).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RecordRejectedLabels {
    /// The heartbeat or the routes topic.
    pub topic: String,
    /// `missing_mac`, `bad_mac`, `malformed`, `stale` or `replayed`.
    pub reason: String,
}

impl ClusterMetrics {
    /// Counts a rejected record of `topic`.
    pub fn record_rejected(&self, topic: &str, reason: &str) {
        self.records_rejected
            .get_or_create(&RecordRejectedLabels {
                topic: topic.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }
}

impl std::fmt::Debug for RelayMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayMetrics").finish_non_exhaustive()
    }
}

/// The counters of one flow, cheap to clone and increment.
#[derive(Clone, Debug)]
pub struct FlowMetrics {
    /// Input records consumed.
    pub consumed: Counter,
    /// Service calls the application accepted (2xx).
    pub delivered: Counter,
    /// Data-return (or transform output) records acknowledged by Kafka.
    pub returned: Counter,
    /// Records written to the dead-letter topic.
    pub dead_lettered: Counter,
    /// Retries (each wait before another attempt counts once).
    pub retried: Counter,
    /// Records consumed and not finished yet: in a plugin, at the
    /// application, or waiting for Kafka to acknowledge their outputs.
    pub in_progress: Gauge,
    /// Of those, the records past their ordered part that wait for
    /// acknowledgements: Kafka's of their outputs (and, in a cluster flow,
    /// the process's of its delivery). High when the broker is slow.
    pub awaiting_ack: Gauge,
    /// Lines of a cluster flow's deliveries (one process, partition and
    /// key) recovering from a failed attempt: their deliveries go one at a
    /// time until the failed ones are settled. Stays up while a process
    /// keeps failing its deliveries.
    pub lines_recovering: Gauge,
}

/// Holds units of a gauge while alive: [`HeldGauge::hold`] increments,
/// dropping decrements, so every way out of a piece of work (finished,
/// failed, abandoned) gives it back. Held for a batch, it is given back
/// unit by unit as its parts are [split](HeldGauge::split) off.
#[derive(Debug)]
pub struct HeldGauge {
    gauge: Gauge,
    units: i64,
}

impl HeldGauge {
    /// Increments `gauge` until the returned value is dropped.
    pub fn hold(gauge: &Gauge) -> HeldGauge {
        HeldGauge::hold_many(gauge, 1)
    }

    /// Adds `units` to `gauge` until the returned value is dropped.
    pub fn hold_many(gauge: &Gauge, units: usize) -> HeldGauge {
        let units = i64::try_from(units).unwrap_or(i64::MAX);
        gauge.inc_by(units);
        HeldGauge {
            gauge: gauge.clone(),
            units,
        }
    }

    /// Moves `units` (at most those held) to a value of their own.
    pub fn split(&mut self, units: usize) -> HeldGauge {
        let units = i64::try_from(units).unwrap_or(i64::MAX).min(self.units);
        self.units -= units;
        HeldGauge {
            gauge: self.gauge.clone(),
            units,
        }
    }
}

impl Drop for HeldGauge {
    fn drop(&mut self) {
        if self.units != 0 {
            self.gauge.dec_by(self.units);
        }
    }
}

impl Default for RelayMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RelayMetrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("wasmrelay");
        let consumed = Family::<FlowLabels, Counter>::default();
        let delivered = Family::<FlowLabels, Counter>::default();
        let returned = Family::<FlowLabels, Counter>::default();
        let dead_lettered = Family::<FlowLabels, Counter>::default();
        let retried = Family::<FlowLabels, Counter>::default();
        let in_progress = Family::<FlowLabels, Gauge>::default();
        let awaiting_ack = Family::<FlowLabels, Gauge>::default();
        let lines_recovering = Family::<FlowLabels, Gauge>::default();
        let plugin_call_seconds =
            Family::<PluginLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                plugin_call_histogram,
            );
        registry.register(
            "messages_consumed",
            "Input records consumed, per flow",
            consumed.clone(),
        );
        registry.register(
            "messages_delivered",
            "Service calls the application accepted, per flow",
            delivered.clone(),
        );
        registry.register(
            "messages_returned",
            "Data-return or output records acknowledged by Kafka, per flow",
            returned.clone(),
        );
        registry.register(
            "messages_dead_lettered",
            "Records written to the dead-letter topic, per flow",
            dead_lettered.clone(),
        );
        registry.register(
            "retries",
            "Retries of failed attempts, per flow",
            retried.clone(),
        );
        registry.register(
            "plugin_call_seconds",
            "Duration of plugin calls (one message or one batch), per plugin",
            plugin_call_seconds.clone(),
        );
        let link_switches = Family::<LinkLabels, Counter>::default();
        let link_switches_refused = Family::<LinkLabels, Counter>::default();
        let center_reachable = Gauge::default();
        registry.register(
            "link_switches",
            "Kafka link switches started after a config-center change, per link",
            link_switches.clone(),
        );
        registry.register(
            "link_switches_refused",
            "Config-center values refused (bad value, cluster not answering, key deleted), per link",
            link_switches_refused.clone(),
        );
        registry.register(
            "center_reachable",
            "1 while the config center can be read, 0 while the last good values are used",
            center_reachable.clone(),
        );
        let cluster = ClusterMetrics::default();
        registry.register(
            "cluster_live_nodes",
            "Relay nodes whose heartbeats arrive within the node timeout, this one included",
            cluster.live_nodes.clone(),
        );
        registry.register(
            "cluster_alarm",
            "1 while fewer relay nodes than min_live_nodes are live",
            cluster.alarm.clone(),
        );
        registry.register(
            "cluster_connections",
            "Business processes connected to this node",
            cluster.connections.clone(),
        );
        registry.register(
            "cluster_routes",
            "Process routes in this node's route table",
            cluster.routes.clone(),
        );
        registry.register(
            "cluster_records_rejected",
            "Heartbeat and route records ignored: no or a wrong MAC, unreadable, stale or replayed, per topic and reason",
            cluster.records_rejected.clone(),
        );
        registry.register(
            "cluster_route_records_missed",
            "Offsets of the routes topic the broker never delivered to this node's reader; the nodes that wrote them are asked to write them again",
            cluster.route_records_missed.clone(),
        );
        registry.register(
            "cluster_twin_heartbeats",
            "Heartbeats with this node's id from another instance of it",
            cluster.twin_heartbeats.clone(),
        );
        registry.register(
            "cluster_rebalance_moves",
            "Processes told to reconnect to another node because this one held more than its share",
            cluster.rebalance_moves.clone(),
        );
        registry.register(
            "cluster_evacuation_moves",
            "Processes told to reconnect to another node because this one is being evacuated",
            cluster.evacuation_moves.clone(),
        );
        registry.register(
            "cluster_rebalancing",
            "1 while this node is moving processes to other nodes (rebalance or evacuation)",
            cluster.rebalancing.clone(),
        );
        let admin = AdminMetrics::default();
        registry.register(
            "admin_connections",
            "Connections open on the admin listener",
            admin.open.clone(),
        );
        registry.register(
            "admin_connections_refused",
            "Admin connections closed as soon as accepted because max_connections were open",
            admin.refused.clone(),
        );
        registry.register(
            "admin_connections_timed_out",
            "Admin connections closed by the header or the idle timeout, per timeout",
            admin.timed_out.clone(),
        );
        let client_auth = ClientAuthMetrics::default();
        registry.register(
            "client_auth_refused",
            "Client Hellos refused for a missing or invalid credential, per reason",
            client_auth.refused.clone(),
        );
        let runtime_tasks = Gauge::default();
        registry.register(
            "runtime_tasks",
            "Tokio tasks alive in the relay's runtime",
            runtime_tasks.clone(),
        );
        let heap_in_use_bytes = Gauge::default();
        registry.register(
            "heap_in_use_bytes",
            "Bytes of glibc's heap allocated and not freed (mallinfo2: arenas and mmap); unlike the resident size, free memory the allocator keeps is not counted, except the chunks in the threads' caches (tcache), which glibc counts as in use",
            heap_in_use_bytes.clone(),
        );
        let heap_free_bytes = Gauge::default();
        registry.register(
            "heap_free_bytes",
            "Bytes free in glibc's arenas, kept by the allocator for reuse (mallinfo2)",
            heap_free_bytes.clone(),
        );
        registry.register(
            "messages_in_progress",
            "Records consumed and not finished yet (in plugins, at the application, or awaiting Kafka's acknowledgement), per flow",
            in_progress.clone(),
        );
        registry.register(
            "messages_awaiting_ack",
            "Records past their ordered part that wait for acknowledgements (Kafka's of their outputs, a process's of its delivery), per flow",
            awaiting_ack.clone(),
        );
        registry.register(
            "delivery_lines_recovering",
            "Lines of a cluster flow's deliveries (one process, partition and key) going one at a time after a failed attempt, until the failed ones are delivered or dead-lettered, per flow",
            lines_recovering.clone(),
        );
        RelayMetrics {
            runtime_tasks,
            heap_in_use_bytes,
            heap_free_bytes,
            in_progress,
            awaiting_ack,
            lines_recovering,
            cluster,
            client_auth,
            admin,
            registry: Mutex::new(registry),
            link_switches,
            link_switches_refused,
            center_reachable,
            consumed,
            delivered,
            returned,
            dead_lettered,
            retried,
            plugin_call_seconds,
        }
    }

    /// The counters of flow `name` (created at zero on first use, so they
    /// show in `/metrics` before the first message).
    pub fn flow(&self, name: &str) -> FlowMetrics {
        let labels = FlowLabels {
            flow: name.to_string(),
        };
        FlowMetrics {
            consumed: self.consumed.get_or_create(&labels).clone(),
            delivered: self.delivered.get_or_create(&labels).clone(),
            returned: self.returned.get_or_create(&labels).clone(),
            dead_lettered: self.dead_lettered.get_or_create(&labels).clone(),
            retried: self.retried.get_or_create(&labels).clone(),
            in_progress: self.in_progress.get_or_create(&labels).clone(),
            awaiting_ack: self.awaiting_ack.get_or_create(&labels).clone(),
            lines_recovering: self.lines_recovering.get_or_create(&labels).clone(),
        }
    }

    /// Records one plugin call's duration.
    pub fn observe_plugin_call(&self, plugin: &str, took: Duration) {
        self.plugin_call_histogram(plugin)
            .observe(took.as_secs_f64());
    }

    /// The histogram of calls of `plugin`, to keep where calls are made
    /// for every record (a lookup by label allocates and takes a lock).
    pub fn plugin_call_histogram(&self, plugin: &str) -> Histogram {
        self.plugin_call_seconds
            .get_or_create(&PluginLabels {
                plugin: plugin.to_string(),
            })
            .clone()
    }

    /// Counts a link switch (or a refused center value) of link `link`.
    pub fn link_switch(&self, link: &str, refused: bool) {
        let labels = LinkLabels {
            link: link.to_string(),
        };
        let family = if refused {
            &self.link_switches_refused
        } else {
            &self.link_switches
        };
        family.get_or_create(&labels).inc();
    }

    /// The cluster gauges.
    pub fn cluster(&self) -> ClusterMetrics {
        self.cluster.clone()
    }

    /// Registers the placement counters of a cluster node's gateway
    /// (once, when the cluster flow starts).
    pub fn register_placement(&self, stats: &crate::gateway::GatewayStats) {
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        registry.register(
            "cluster_clients_redirected",
            "New processes redirected to another node by the placement",
            stats.redirected_counter(),
        );
        registry.register(
            "cluster_clients_refused_full",
            "New processes refused because this node, and the cluster, had no room",
            stats.refused_full_counter(),
        );
    }

    /// The admin listener's connection metrics.
    pub fn admin(&self) -> AdminMetrics {
        self.admin.clone()
    }

    /// The client authentication counters.
    pub fn client_auth(&self) -> ClientAuthMetrics {
        self.client_auth.clone()
    }

    /// Whether the config center can be read.
    pub fn set_center_reachable(&self, reachable: bool) {
        self.center_reachable.set(i64::from(reachable));
    }

    /// All metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let alive = runtime.metrics().num_alive_tasks();
            self.runtime_tasks
                .set(i64::try_from(alive).unwrap_or(i64::MAX));
        }
        if let Some(heap) = wasmrelay_malloc::heap_usage() {
            let bytes = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
            self.heap_in_use_bytes.set(bytes(heap.in_use_bytes));
            self.heap_free_bytes.set(bytes(heap.free_bytes));
        }
        let mut out = String::new();
        if let Ok(registry) = self.registry.lock() {
            // Writing to a String cannot fail.
            let _ = encode(&mut out, &registry);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    // The handles are kept and the tasks aborted at the end.
    #[allow(clippy::disallowed_methods)]
    async fn renders_the_tasks_alive_in_the_runtime() {
        let metrics = RelayMetrics::new();
        let waiting: Vec<_> = (0..3)
            .map(|_| tokio::spawn(std::future::pending::<()>()))
            .collect();
        let text = metrics.render();
        assert!(text.contains("wasmrelay_runtime_tasks 3"), "{text}");
        let heap_in_use: u64 = text
            .lines()
            .find_map(|line| line.strip_prefix("wasmrelay_heap_in_use_bytes "))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no wasmrelay_heap_in_use_bytes: {text}"));
        assert!(heap_in_use > 0, "{text}");
        for task in &waiting {
            task.abort();
        }
    }

    #[test]
    fn a_held_gauge_counts_while_alive_and_is_given_back_on_drop() {
        let metrics = RelayMetrics::new();
        let flow = metrics.flow("orders");
        let first = HeldGauge::hold(&flow.in_progress);
        let second = HeldGauge::hold(&flow.in_progress);
        let waiting = HeldGauge::hold(&flow.awaiting_ack);
        let shows = |sample: &str| {
            let text = metrics.render();
            assert!(text.contains(sample), "{sample} not in:\n{text}");
        };
        shows(r#"wasmrelay_messages_in_progress{flow="orders"} 2"#);
        shows(r#"wasmrelay_messages_awaiting_ack{flow="orders"} 1"#);
        drop((first, second, waiting));
        shows(r#"wasmrelay_messages_in_progress{flow="orders"} 0"#);
        shows(r#"wasmrelay_messages_awaiting_ack{flow="orders"} 0"#);
    }

    #[test]
    fn a_gauge_held_for_a_batch_is_given_back_part_by_part() {
        let metrics = RelayMetrics::new();
        let flow = metrics.flow("orders");
        let shows = |sample: &str| {
            let text = metrics.render();
            assert!(text.contains(sample), "{sample} not in:\n{text}");
        };
        let mut batch = HeldGauge::hold_many(&flow.in_progress, 5);
        let one = batch.split(1);
        let rest = batch.split(3);
        shows(r#"wasmrelay_messages_in_progress{flow="orders"} 5"#);
        drop(one);
        shows(r#"wasmrelay_messages_in_progress{flow="orders"} 4"#);
        drop(rest);
        shows(r#"wasmrelay_messages_in_progress{flow="orders"} 1"#);
        // More than held: only what is held moves.
        let last = batch.split(7);
        drop(batch);
        shows(r#"wasmrelay_messages_in_progress{flow="orders"} 1"#);
        drop(last);
        shows(r#"wasmrelay_messages_in_progress{flow="orders"} 0"#);
    }

    #[test]
    fn renders_flow_counters_and_plugin_histogram() {
        let metrics = RelayMetrics::new();
        let flow = metrics.flow("orders");
        flow.consumed.inc();
        flow.dead_lettered.inc_by(2);
        metrics.observe_plugin_call("mask-fields", Duration::from_micros(30));
        let text = metrics.render();
        assert!(
            text.contains(r#"wasmrelay_messages_consumed_total{flow="orders"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"wasmrelay_messages_dead_lettered_total{flow="orders"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"wasmrelay_plugin_call_seconds_count{plugin="mask-fields"} 1"#),
            "{text}"
        );
    }
}
