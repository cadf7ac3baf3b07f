//! Following the config center: when `kafka.<link-id>` changes to a valid
//! value of a cluster that answers, switch the link to it at once and drain
//! the old cluster up to the high watermarks it had at the switch.
//!
//! A bad value (not JSON, no `bootstrap.servers`, a property outside the
//! center's allowlist, a cluster that does not answer) and a deleted key
//! leave the current link serving and are reported, naming the property,
//! in the log and at `/links`. The center's latest value wins:
//! flips in quick succession end on the last one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::runner::{FlowRunner, RunningConsumer};
use super::{KafkaLink, LinkGeneration, SwitchRecord};
use crate::center::{CenterState, Reachability};
use crate::kafka::admin::{TopicSpec, ensure_topics};
use crate::kafka::probe::probe_cluster;
use crate::kafka::{CenterPolicy, LinkInfo, RelayProducer};
use crate::telemetry::metrics::RelayMetrics;

/// How a link follows the center.
#[derive(Clone, Debug)]
pub struct SwitchOptions {
    /// How long the new cluster may take to answer a metadata request.
    pub probe_timeout: Duration,
    /// How long the old cluster is drained before the rest is left there.
    pub drain_timeout: Duration,
    /// Topics the relay writes to on this link (created on a new cluster).
    pub owned_topics: Vec<TopicSpec>,
    /// Options from the config file, under the center's value.
    pub base_options: std::collections::BTreeMap<String, String>,
    /// What the center's value may set (connection properties only).
    pub policy: CenterPolicy,
    /// Where switches and refusals are counted.
    pub metrics: Arc<RelayMetrics>,
    /// The node's tasks: the drain of an old cluster runs on it.
    pub tasks: TaskTracker,
}

/// Follows `center` for `link` until `shutdown`.
pub async fn follow_center(
    link: Arc<KafkaLink>,
    runners: Vec<Arc<FlowRunner>>,
    mut center: watch::Receiver<CenterState>,
    options: SwitchOptions,
    shutdown: CancellationToken,
) {
    let key = format!("{}{}", crate::center::KAFKA_KEY_PREFIX, link.id());
    // Reported once per deletion, not on every later change of other keys.
    let mut key_missing = false;
    let reachable = center.borrow().reachability == Reachability::Reachable;
    link.update_status(|s| s.center_reachable = Some(reachable));
    options.metrics.set_center_reachable(reachable);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = center.changed() => if changed.is_err() { return },
        }
        let state = center.borrow_and_update().clone();
        let reachable = state.reachability == Reachability::Reachable;
        link.update_status(|s| s.center_reachable = Some(reachable));
        options.metrics.set_center_reachable(reachable);
        if !reachable {
            continue;
        }
        let Some(value) = state.kafka_link(link.id()) else {
            if key_missing {
                continue;
            }
            key_missing = true;
            options.metrics.link_switch(link.id(), true);
            tracing::warn!(link = %link.id(), %key, "the key was deleted from the config center; keeping the current link");
            link.update_status(|s| {
                s.last_error = Some(format!("key `{key}` was deleted; keeping the current link"))
            });
            continue;
        };
        key_missing = false;
        let info = match LinkInfo::from_center_value(value, &options.policy) {
            Ok(mut info) => {
                for (k, v) in &options.base_options {
                    info.options.entry(k.clone()).or_insert_with(|| v.clone());
                }
                info
            }
            Err(problem) => {
                tracing::error!(link = %link.id(), %key, %problem, "bad value in the config center; keeping the current link");
                link.update_status(|s| {
                    s.last_error = Some(format!("bad value at `{key}`: {problem}"))
                });
                options.metrics.link_switch(link.id(), true);
                continue;
            }
        };
        if info == link.current().info {
            continue;
        }
        match switch(&link, &runners, info, &options, &shutdown).await {
            Ok(()) => options.metrics.link_switch(link.id(), false),
            Err(error) => {
                tracing::error!(link = %link.id(), error = %format!("{error:#}"), "link switch refused; keeping the current link");
                link.update_status(|s| s.last_error = Some(format!("{error:#}")));
                options.metrics.link_switch(link.id(), true);
            }
        }
    }
}

/// Switches `link` to `info`: checks the new cluster, starts consuming and
/// producing there, then drains the old one in the background.
async fn switch(
    link: &Arc<KafkaLink>,
    runners: &[Arc<FlowRunner>],
    info: LinkInfo,
    options: &SwitchOptions,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let at = SystemTime::now();
    probe_cluster(&info, options.probe_timeout)
        .await
        .with_context(|| {
            format!(
                "link `{}`: the new cluster {} does not answer",
                link.id(),
                info.bootstrap_servers
            )
        })?;
    ensure_topics(
        &info,
        &options.owned_topics,
        options.probe_timeout.max(Duration::from_secs(10)),
    )
    .await
    .context("preparing the relay's topics on the new cluster")?;
    let producer = RelayProducer::new(&info)?;
    let old = link.swap(LinkGeneration {
        info: info.clone(),
        producer,
        since: SystemTime::now(),
        source: "center",
    });
    tracing::info!(link = %link.id(), from = %old.info.bootstrap_servers, to = %info.bootstrap_servers, "switching link");
    link.update_status(|s| {
        s.switching = true;
        s.last_error = None;
    });

    // High watermarks of the old cluster at the switch: what producers left there.
    let mut drains = Vec::new();
    for runner in runners {
        let marks = old_cluster_marks(
            &old.info,
            runner.topic(),
            runner.group(),
            options.probe_timeout,
        )
        .await;
        match runner.start_on(&info) {
            Ok(Some(old_consumer)) => drains.push((runner.clone(), old_consumer, marks)),
            Ok(None) => {}
            Err(error) => {
                roll_back(link, &old, drains, &options.tasks);
                return Err(error.context(format!(
                    "flow `{}`: starting the consumer on the new cluster (switched back to the old one)",
                    runner.name
                )));
            }
        }
    }

    let link = link.clone();
    let drain_timeout = options.drain_timeout;
    let shutdown = shutdown.clone();
    options.tasks.spawn(async move {
        let (mut drained, mut left, mut timed_out) = (0u64, Some(0u64), false);
        for (flow, consumer, marks) in drains {
            let flow = &flow.name;
            let report = drain(consumer, marks, drain_timeout, &shutdown).await;
            tracing::info!(link = %link.id(), %flow, drained = report.drained, left = ?report.left_behind, timed_out = report.timed_out, "old cluster drained");
            drained += report.drained;
            left = left.zip(report.left_behind).map(|(a, b)| a + b);
            timed_out |= report.timed_out;
        }
        // Everything was produced through the old producer before the swap.
        let old_producer = old.producer.clone();
        let _ =
            tokio::task::spawn_blocking(move || old_producer.flush(Duration::from_secs(10))).await;
        link.record_switch(SwitchRecord {
            at_ms: at
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            from: old.info.redacted(),
            to: info.redacted(),
            duration_ms: started.elapsed().as_millis() as u64,
            drained,
            left_behind: left,
            drain_timed_out: timed_out,
        });
        link.update_status(|s| s.switching = false);
        tracing::info!(link = %link.id(), took = ?started.elapsed(), "link switch complete");
    });
    Ok(())
}

/// Undoes a switch that failed half-way: the flows already moved get their
/// consumers on the old cluster back (the new ones stop, finishing and
/// committing what they took), the link points at the old cluster again
/// (what was produced to the new one is flushed), and no switch is in
/// progress. Nothing is left split across the two clusters.
fn roll_back(
    link: &Arc<KafkaLink>,
    old: &LinkGeneration,
    moved: Vec<(Arc<FlowRunner>, RunningConsumer, Marks)>,
    tasks: &TaskTracker,
) {
    for (runner, old_consumer, _) in moved {
        if let Some(new_consumer) = runner.put_back(old_consumer) {
            tasks.spawn(async move {
                new_consumer.stop_and_join().await;
            });
        }
    }
    let abandoned = link.swap(LinkGeneration {
        info: old.info.clone(),
        producer: old.producer.clone(),
        since: old.since,
        source: old.source,
    });
    let producer = abandoned.producer.clone();
    tasks.spawn(async move {
        let _ = tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(10))).await;
    });
    link.update_status(|s| s.switching = false);
    tracing::warn!(link = %link.id(), from = %abandoned.info.bootstrap_servers, back_to = %old.info.bootstrap_servers, "link switch failed half-way; switched back");
}

/// Per partition: (high watermark at the switch, the group's position then).
type Marks = Option<HashMap<i32, (i64, i64)>>;

/// The old cluster's high watermarks and the group's committed positions;
/// `None` if it does not answer.
async fn old_cluster_marks(info: &LinkInfo, topic: &str, group: &str, timeout: Duration) -> Marks {
    let mut config = info.admin_config();
    config
        .set("group.id", group)
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = info.create(&config).ok()?;
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let metadata = consumer.fetch_metadata(Some(&topic), timeout).ok()?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)?
            .partitions()
            .iter()
            .map(|p| p.id())
            .collect();
        let mut tpl = TopicPartitionList::new();
        for p in &partitions {
            tpl.add_partition(&topic, *p);
        }
        let committed = consumer.committed_offsets(tpl, timeout).ok()?;
        let mut marks = HashMap::new();
        for p in partitions {
            let (_, high) = consumer.fetch_watermarks(&topic, p, timeout).ok()?;
            let position = match committed.find_partition(&topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => 0,
            };
            marks.insert(p, (high, position));
        }
        Some(marks)
    })
    .await
    .ok()
    .flatten()
}

/// Records below the marks' high watermarks that the consumer has not read:
/// per partition, the high watermark minus the furthest of its position and
/// the group's committed offset at the switch.
fn records_behind(marks: &HashMap<i32, (i64, i64)>, positions: &HashMap<i32, i64>) -> u64 {
    marks
        .iter()
        .map(|(partition, (high, committed))| {
            let at = positions
                .get(partition)
                .copied()
                .unwrap_or(*committed)
                .max(*committed);
            (high - at).max(0) as u64
        })
        .sum()
}

struct DrainReport {
    drained: u64,
    left_behind: Option<u64>,
    timed_out: bool,
}

/// Lets the old consumer run until it has read up to the marks (or the
/// timeout), then stops it (in-flight work finishes, offsets are committed).
async fn drain(
    old: RunningConsumer,
    marks: Marks,
    timeout: Duration,
    shutdown: &CancellationToken,
) -> DrainReport {
    let started = Instant::now();
    let consumed_before = old.consumer.consumed() as u64;
    let mut timed_out = false;
    if let Some(marks) = &marks {
        loop {
            if records_behind(marks, &old.consumer.positions()) == 0 || shutdown.is_cancelled() {
                break;
            }
            if started.elapsed() > timeout {
                timed_out = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let positions = old.consumer.positions();
    let drained = old.consumer.consumed() as u64 - consumed_before;
    old.stop_and_join().await;
    let left_behind = marks.map(|marks| records_behind(&marks, &positions));
    DrainReport {
        drained,
        left_behind,
        timed_out,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures::future::BoxFuture;
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer as _, ThreadedProducer};

    use super::*;
    use crate::kafka::consumer::{Completion, Outcome};
    use crate::kafka::{ConsumerOptions, InputRecord, MessageHandler};

    /// Keeps the values it was handed.
    #[derive(Default)]
    struct Collect(Mutex<Vec<Vec<u8>>>);

    impl MessageHandler for Collect {
        fn handle(
            &self,
            record: InputRecord,
            _abort: CancellationToken,
        ) -> BoxFuture<'static, Completion> {
            self.0
                .lock()
                .unwrap()
                .push(record.value.unwrap_or_default());
            let done: Completion = Box::pin(async { Outcome::Finished });
            Box::pin(std::future::ready(done))
        }
    }

    fn broker() -> (MockCluster<'static, DefaultProducerContext>, LinkInfo) {
        let kafka = MockCluster::new(1).unwrap();
        kafka.create_topic("in", 1, 1).unwrap();
        let info = LinkInfo {
            bootstrap_servers: kafka.bootstrap_servers(),
            options: [("fetch.wait.max.ms".to_string(), "10".to_string())].into(),
        };
        (kafka, info)
    }

    fn produce(info: &LinkInfo, value: &str) {
        let producer: ThreadedProducer<_> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &info.bootstrap_servers)
            .create()
            .unwrap();
        producer
            .send(BaseRecord::<(), str>::to("in").payload(value))
            .unwrap();
        producer.flush(Duration::from_secs(10)).unwrap();
    }

    fn runner(group: &str, handler: Arc<Collect>, shutdown: &CancellationToken) -> Arc<FlowRunner> {
        FlowRunner::new(
            group,
            group,
            "in",
            handler,
            ConsumerOptions::default(),
            shutdown.clone(),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_switch_that_fails_half_way_is_rolled_back_whole() {
        let (_old_kafka, old_info) = broker();
        let (_new_kafka, new_info) = broker();
        let link = KafkaLink::new("main", old_info.clone(), "config").unwrap();
        let shutdown = CancellationToken::new();
        let moved = Arc::new(Collect::default());
        let first = runner("moved", moved.clone(), &shutdown);
        first.start_on(&old_info).unwrap();
        // No group id: this flow's consumer cannot start anywhere, so the
        // switch fails after the first flow moved.
        let second = runner("", Arc::new(Collect::default()), &shutdown);
        let tasks = TaskTracker::new();
        let options = SwitchOptions {
            probe_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
            owned_topics: Vec::new(),
            base_options: Default::default(),
            policy: CenterPolicy { files_dir: None },
            metrics: Arc::new(RelayMetrics::new()),
            tasks: tasks.clone(),
        };
        let mut switches = link.switches();
        let error = switch(
            &link,
            &[first.clone(), second],
            new_info.clone(),
            &options,
            &shutdown,
        )
        .await
        .unwrap_err();
        assert!(
            format!("{error:#}").contains("switched back to the old one"),
            "{error:#}"
        );
        // The link points at the old cluster, with no switch in progress,
        // and whoever reads on the link's cluster was told twice.
        assert_eq!(link.current().info, old_info);
        assert!(!link.snapshot()["status"]["switching"].as_bool().unwrap());
        assert_eq!(*switches.borrow_and_update(), 2);
        // The consumer started on the new cluster has stopped, and the
        // first flow consumes the old cluster again, not the new one.
        tasks.close();
        tasks.wait().await;
        produce(&new_info, "on the new cluster");
        produce(&old_info, "on the old cluster");
        let deadline = Instant::now() + Duration::from_secs(20);
        while moved.0.lock().unwrap().is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(*moved.0.lock().unwrap(), [b"on the old cluster".to_vec()]);
        shutdown.cancel();
        if let Some(consumer) = first.take() {
            consumer.stop_and_join().await;
        }
    }
}
