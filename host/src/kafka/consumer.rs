//! The consumer of one flow: a dedicated thread polls librdkafka and hands
//! each partition's records, in offset order, to that partition's lane
//! ([`super::lane`], which starts them as the flow's [`DeliveryOrder`]
//! allows); offsets are stored only for finished work (highest contiguous
//! finished offset, see [`super::offsets`]) and librdkafka auto-commits
//! what is stored.
//!
//! Owns: the poll loop, the lanes' bounds (records queued, records whose
//! completion is pending, the flow's `max_in_flight`), pausing a partition
//! whose lane is backed up, draining and committing revoked partitions
//! inside the rebalance callback, and the drain-and-commit at shutdown.
//! What a record means is the [`MessageHandler`]'s business.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::BorrowedMessage;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::group_rejoin::{DEFAULT_SESSION_TIMEOUT, PeerLost, RejoinSchedule};
use super::lane::{Backlog, DeliveryOrder, LaneContext};
use super::link::LinkInfo;
use super::offsets::PartitionOffsets;
use super::record::InputRecord;

/// What became of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Everything it caused is done (delivered, returned, or dead-lettered):
    /// its offset may be committed.
    Finished,
    /// Given up because of shutdown or a revoked partition: its offset must
    /// not be committed, so it is consumed again later.
    Abandoned,
}

/// The part of a record's handling that may overlap with the next records of
/// the partition (typically: waiting for produce acknowledgements).
pub type Completion = BoxFuture<'static, Outcome>;

/// The ordered part of a record's handling, resolving to its [`Completion`].
pub type Handling = BoxFuture<'static, Completion>;

/// What a flow does with each consumed record.
pub trait MessageHandler: Send + Sync + 'static {
    /// Handles one record. Called in offset order per partition; the
    /// returned future does what must happen in order (e.g. delivery to the
    /// application) and resolves to a [`Completion`] that may run while the
    /// next records are handled. Whether the next record of the partition
    /// waits for the ordered part is the flow's [`DeliveryOrder`]: with
    /// `key`, only a record with the same key does. When `abort` is
    /// cancelled, give up and return [`Outcome::Abandoned`] as soon as possible.
    fn handle(&self, record: InputRecord, abort: CancellationToken) -> Handling;

    /// The most records of a partition that [`MessageHandler::handle_batch`]
    /// takes at once; 1 (the default): every record goes to
    /// [`MessageHandler::handle`] in a task of its own.
    fn batch_size(&self) -> usize {
        1
    }

    /// Handles records of one partition that are ready together (none of
    /// them waits for another under the flow's [`DeliveryOrder`]), in one
    /// task: resolves, once the work done for all of them at once is done
    /// (e.g. one plugin call per chain), to what remains of each record
    /// ([`BatchHandling`]). The default hands each record to `handle`.
    fn handle_batch(
        &self,
        records: Vec<InputRecord>,
        abort: CancellationToken,
    ) -> BoxFuture<'static, BatchHandling> {
        let alone = records
            .into_iter()
            .map(|record| self.handle(record, abort.clone()))
            .enumerate()
            .collect();
        Box::pin(std::future::ready(BatchHandling {
            together: None,
            alone,
        }))
    }
}

/// What remains of a batch's records once its batch step is done.
pub struct BatchHandling {
    /// The records (by place in the batch, ascending) whose ordered part
    /// the batch step has done, with one completion for all of them: each
    /// one's outcome, in the same order. A transform flow's records whose
    /// outputs are enqueued: one wake-up when Kafka has acknowledged them
    /// all, not one a record.
    pub together: Option<(Vec<usize>, BoxFuture<'static, Vec<Outcome>>)>,
    /// Each other record's remaining ordered part, like the future
    /// [`MessageHandler::handle`] returns, by place in the batch.
    pub alone: Vec<(usize, Handling)>,
}

impl std::fmt::Debug for BatchHandling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchHandling")
            .field(
                "together",
                &self.together.as_ref().map(|(places, _)| places),
            )
            .field(
                "alone",
                &self
                    .alone
                    .iter()
                    .map(|(place, _)| place)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Tuning of a [`PartitionedConsumer`].
#[derive(Clone, Debug)]
pub struct ConsumerOptions {
    /// How often librdkafka commits stored offsets.
    pub commit_interval: Duration,
    /// How long a revoked partition's in-flight work may take to finish
    /// before it is abandoned (and consumed again by the new owner); at
    /// most half of the link's `max.poll.interval.ms` ([`revoke_drain_bound`]).
    pub revoke_drain_timeout: Duration,
    /// How long in-flight work may take to finish at shutdown.
    pub shutdown_grace: Duration,
    /// Records queued for one partition's lane (not started yet) before
    /// the poll thread waits for it (up to `FULL_LANE_WAIT`), then pauses
    /// the partition if it is still full; resumed at half. Pausing makes
    /// librdkafka drop what it had fetched of the partition and fetch it
    /// again on resuming, so pausing often costs the broker dearly: the
    /// bound is high, a lane that is only behind is waited for rather than
    /// paused, and [`ConsumerOptions::max_queued_bytes_per_partition`]
    /// keeps the memory in check.
    pub max_queued_per_partition: usize,
    /// Bytes (keys, values, headers) queued for one partition's lane before
    /// it is waited for, then paused (as for the records); resumed at half.
    pub max_queued_bytes_per_partition: usize,
    /// Records of one partition whose completion is still pending.
    pub max_pending_per_partition: usize,
    /// Which records of a partition wait for each other.
    pub order: DeliveryOrder,
    /// Records of the whole flow whose ordered part runs at once.
    pub max_in_flight: usize,
    /// When set, records are fetched only while it holds `true`: while it
    /// is `false` every assigned partition is paused (work already taken
    /// finishes and is committed; nothing is skipped), and resumed when it
    /// turns `true` again. The cluster's live-node gate.
    pub gate: Option<tokio::sync::watch::Receiver<bool>>,
    /// When set, peers lost from the cluster: the consumer rejoins its
    /// group once each one's session must have timed out
    /// ([`super::group_rejoin`]). Its session
    /// timeout is then [`DEFAULT_SESSION_TIMEOUT`] unless the link sets
    /// `session.timeout.ms`. The cluster flow's, on a node of a cluster.
    pub lost_peers: Option<tokio::sync::watch::Receiver<Option<PeerLost>>>,
}

/// How long the poll thread waits for a full lane to drain before it
/// pauses the lane's partition.
const FULL_LANE_WAIT: Duration = Duration::from_millis(200);

/// How often it looks while it waits.
const FULL_LANE_POLL: Duration = Duration::from_millis(1);

/// Most records taken from librdkafka in one turn of the poll loop (those
/// it has ready; it is not waited for beyond the first).
const POLL_BATCH: usize = 64;

/// The default of `flows.max_in_flight`.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;

impl Default for ConsumerOptions {
    fn default() -> Self {
        ConsumerOptions {
            commit_interval: Duration::from_millis(500),
            revoke_drain_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(30),
            max_queued_per_partition: 20_000,
            max_queued_bytes_per_partition: 16 * 1024 * 1024,
            max_pending_per_partition: 1_000,
            order: DeliveryOrder::default(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            gate: None,
            lost_peers: None,
        }
    }
}

/// What the consumer did, reported when it stops.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConsumerReport {
    /// Records consumed.
    pub consumed: u64,
    /// Records whose work was unfinished at shutdown (consumed again after restart).
    pub abandoned_at_shutdown: usize,
    /// Times a lane stayed full and its partition was paused (librdkafka
    /// then drops what it had fetched of it, to fetch it again on resuming).
    pub lane_pauses: u64,
}

/// A running consumer; stop it with the shutdown token given to
/// [`PartitionedConsumer::start`], then [`PartitionedConsumer::join`].
pub struct PartitionedConsumer {
    done: oneshot::Receiver<ConsumerReport>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PartitionedConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionedConsumer")
            .field("topic", &self.shared.topic)
            .finish_non_exhaustive()
    }
}

struct Lane {
    tx: mpsc::UnboundedSender<Vec<InputRecord>>,
    backlog: Arc<Backlog>,
    /// Started and not yet completed.
    active: Arc<AtomicUsize>,
    stop_taking: CancellationToken,
    abort: CancellationToken,
    paused: bool,
    /// It stayed full and librdkafka refused to pause its partition (one
    /// being revoked, say): its records are taken without waiting for it
    /// until it drains to half, instead of each making the poll thread wait.
    unpausable: bool,
}

struct Shared {
    topic: Arc<str>,
    handler: Arc<dyn MessageHandler>,
    options: ConsumerOptions,
    /// Records of the flow whose ordered part runs now (`max_in_flight`).
    in_flight: Arc<Semaphore>,
    runtime: tokio::runtime::Handle,
    /// The partition workers and the tasks awaiting their completions;
    /// [`PartitionedConsumer::join`] waits for them.
    tasks: TaskTracker,
    lanes: Mutex<HashMap<i32, Lane>>,
    offsets: Mutex<HashMap<i32, PartitionOffsets>>,
    finished_tx: mpsc::UnboundedSender<(i32, i64)>,
    finished_rx: Mutex<mpsc::UnboundedReceiver<(i32, i64)>>,
    consumed: AtomicUsize,
    /// Times a full lane's partition was paused.
    lane_pauses: AtomicU64,
    /// Next offset to consume per partition (kept across revocations).
    positions: Mutex<HashMap<i32, i64>>,
    /// Records polled while the gate was closed, in poll order: not
    /// dispatched (nor counted as consumed) until it opens. librdkafka
    /// clears a pause when it applies a new assignment, so a fetch can
    /// return records of a partition paused in the rebalance callback.
    held: Mutex<Vec<InputRecord>>,
    /// Rejoining the group for lost peers, when asked to.
    rejoin: Option<Mutex<Rejoin>>,
}

struct Rejoin {
    lost_peers: tokio::sync::watch::Receiver<Option<PeerLost>>,
    schedule: RejoinSchedule,
}

struct RelayConsumerContext {
    shared: Arc<Shared>,
}

impl ClientContext for RelayConsumerContext {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::warn!(topic = %self.shared.topic, %error, reason, "kafka consumer error");
    }
}

impl ConsumerContext for RelayConsumerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let partitions: Vec<i32> = tpl
                .elements()
                .iter()
                .filter(|e| e.topic() == &*self.shared.topic)
                .map(|e| e.partition())
                .collect();
            tracing::info!(topic = %self.shared.topic, ?partitions, "partitions revoked; draining them");
            // Held records of these partitions are their new owner's.
            if let Ok(mut held) = self.shared.held.lock() {
                held.retain(|record| !partitions.contains(&record.partition));
            }
            self.shared.drain_partitions(
                consumer,
                &partitions,
                self.shared.options.revoke_drain_timeout,
            );
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let partitions: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
            tracing::info!(topic = %self.shared.topic, ?partitions, "partitions assigned");
            // With the gate closed, a partition assigned now must not yield
            // a record from the fetch that starts with the assignment.
            if self.shared.gate_closed() {
                for partition in partitions {
                    pause(consumer, &self.shared.topic, partition, true);
                }
            }
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(error) = result {
            // Nothing is lost: the stored offsets are committed next time.
            tracing::debug!(topic = %self.shared.topic, %error, "offset commit did not go through");
        }
    }
}

type RelayBaseConsumer = BaseConsumer<RelayConsumerContext>;

impl PartitionedConsumer {
    /// Subscribes `group` to `topic` on `link` and starts consuming on a
    /// dedicated thread. Records go to `handler`; the consumer stops,
    /// drains and commits when `shutdown` is cancelled.
    pub fn start(
        link: &LinkInfo,
        group: &str,
        topic: &str,
        handler: Arc<dyn MessageHandler>,
        mut options: ConsumerOptions,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Self> {
        let (finished_tx, finished_rx) = mpsc::unbounded_channel();
        let mut config = link.consumer_config(group, options.commit_interval);
        options.revoke_drain_timeout = revoke_drain_bound(options.revoke_drain_timeout, &config);
        let rejoin = options.lost_peers.clone().map(|lost_peers| {
            let (session_timeout, heartbeat_interval) = group_timeouts(link, &mut config);
            Mutex::new(Rejoin {
                lost_peers,
                schedule: RejoinSchedule::new(session_timeout, heartbeat_interval),
            })
        });
        let shared = Arc::new(Shared {
            topic: topic.into(),
            handler,
            in_flight: Arc::new(Semaphore::new(options.max_in_flight.max(1))),
            runtime: tokio::runtime::Handle::try_current()
                .context("the consumer must be started inside a tokio runtime")?,
            options: options.clone(),
            tasks: TaskTracker::new(),
            lanes: Mutex::new(HashMap::new()),
            offsets: Mutex::new(HashMap::new()),
            finished_tx,
            finished_rx: Mutex::new(finished_rx),
            consumed: AtomicUsize::new(0),
            lane_pauses: AtomicU64::new(0),
            positions: Mutex::new(HashMap::new()),
            held: Mutex::new(Vec::new()),
            rejoin,
        });
        let consumer: RelayBaseConsumer = link
            .create_with_context(
                &config,
                RelayConsumerContext {
                    shared: shared.clone(),
                },
            )
            .with_context(|| format!("creating a Kafka consumer for {}", link.bootstrap_servers))?;
        consumer
            .subscribe(&[topic])
            .with_context(|| format!("subscribing to topic `{topic}`"))?;

        let (done_tx, done) = oneshot::channel();
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name(format!("consumer-{topic}"))
            .spawn(move || {
                let report = thread_shared.run(&consumer, &shutdown);
                // Close (leave the group) before reporting done, so that a
                // joined consumer is really gone.
                drop(consumer);
                let _ = done_tx.send(report);
            })
            .context("starting the consumer thread")?;
        Ok(PartitionedConsumer { done, shared })
    }

    /// The next offset to consume of each partition this consumer has read
    /// from (highest consumed + 1). Used to drain a cluster up to the high
    /// watermarks it had when a link switched away from it.
    pub fn positions(&self) -> HashMap<i32, i64> {
        self.shared
            .positions
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default()
    }

    /// Records consumed so far.
    pub fn consumed(&self) -> usize {
        self.shared.consumed.load(Ordering::Relaxed)
    }

    /// Waits until the consumer has drained, committed and closed.
    pub async fn join(self) -> ConsumerReport {
        let report = self.done.await.unwrap_or_default();
        // Workers of abandoned partitions end once their aborted work has.
        self.shared.tasks.close();
        self.shared.tasks.wait().await;
        report
    }
}

impl Shared {
    fn run(
        self: &Arc<Self>,
        consumer: &RelayBaseConsumer,
        shutdown: &CancellationToken,
    ) -> ConsumerReport {
        let mut last_error: Option<Instant> = None;
        let mut gated = false;
        while !shutdown.is_cancelled() {
            if self.gate_closed() {
                if !gated {
                    tracing::warn!(topic = %self.topic, "consumption paused: the gate is closed (too few live nodes)");
                    gated = true;
                }
                // Every time: partitions assigned meanwhile are paused too.
                self.pause_assignment(consumer, true);
            } else {
                // Held records go first, in the order polled (also those
                // held while the gate closed and opened within one poll).
                let held = self.held.lock().map(|mut held| std::mem::take(&mut *held));
                self.dispatch(consumer, held.unwrap_or_default());
                if gated {
                    gated = false;
                    self.pause_assignment(consumer, false);
                    tracing::info!(topic = %self.topic, "consumption resumed: the gate is open again");
                }
            }
            match consumer.poll(Duration::from_millis(50)) {
                Some(Ok(message)) => {
                    let mut polled = Vec::with_capacity(POLL_BATCH);
                    self.take(consumer, message, &mut gated, &mut polled);
                    // Then what librdkafka has ready now, up to a batch:
                    // the records go to their lanes together (one message
                    // and at most one wake-up a lane), and the bookkeeping
                    // after the loop (finished offsets, rejoining, resuming
                    // lanes) is done once a batch, not once a record.
                    for _ in 1..POLL_BATCH {
                        match consumer.poll(Duration::ZERO) {
                            Some(Ok(message)) => {
                                self.take(consumer, message, &mut gated, &mut polled);
                            }
                            Some(Err(error)) => {
                                self.poll_failed(&error, &mut last_error);
                                break;
                            }
                            None => break,
                        }
                    }
                    self.dispatch(consumer, polled);
                }
                Some(Err(error)) => self.poll_failed(&error, &mut last_error),
                None => {}
            }
            self.apply_finished(consumer);
            self.rejoin_if_due(consumer);
            if !gated {
                self.resume_drained_lanes(consumer);
            }
        }
        self.shut_down(consumer)
    }

    /// A polled message: to `polled` (dispatched to its lane with the rest
    /// of the poll's batch), or held (its partition paused) while the gate
    /// is closed.
    fn take(
        self: &Arc<Self>,
        consumer: &RelayBaseConsumer,
        message: BorrowedMessage<'_>,
        gated: &mut bool,
        polled: &mut Vec<InputRecord>,
    ) {
        let record = InputRecord::from_borrowed(&message, &self.topic);
        // librdkafka's buffer goes back before any wait for a full lane.
        drop(message);
        if *gated || self.gate_closed() {
            // Fetched before the pause took effect: held (and its
            // partition paused) until the gate opens.
            pause(consumer, &self.topic, record.partition, true);
            // (So that the partition is resumed with the rest.)
            *gated = true;
            if let Ok(mut held) = self.held.lock() {
                held.push(record);
            }
        } else {
            polled.push(record);
        }
    }

    /// A poll's error: broker hiccups surface here, and librdkafka retries
    /// on its own; logged at most every 5 s.
    fn poll_failed(&self, error: &KafkaError, last_error: &mut Option<Instant>) {
        if last_error.is_none_or(|at| at.elapsed() > Duration::from_secs(5)) {
            tracing::warn!(topic = %self.topic, %error, "consuming");
            *last_error = Some(Instant::now());
        }
    }

    /// Rejoins the group when a lost peer's session must have ended.
    fn rejoin_if_due(&self, consumer: &RelayBaseConsumer) {
        let Some(rejoin) = &self.rejoin else {
            return;
        };
        let due = {
            let Ok(mut rejoin) = rejoin.lock() else {
                return;
            };
            let rejoin = &mut *rejoin;
            if rejoin.lost_peers.has_changed().unwrap_or(false) {
                let lost = rejoin.lost_peers.borrow_and_update().clone();
                if let Some(lost) = lost {
                    rejoin.schedule.peer_lost(lost);
                }
            }
            rejoin.schedule.due(Instant::now())
        };
        if let Some(node) = due {
            tracing::info!(topic = %self.topic, lost_peer = %node, "rejoining the consumer group: the lost peer's session has ended, and its partitions must be assigned again");
            // As a new member: a known member's JoinGroup may be answered
            // with the generation it is in (tansu does), dead member and all.
            consumer.unsubscribe();
            if let Err(error) = consumer.subscribe(&[&*self.topic]) {
                tracing::warn!(topic = %self.topic, %error, "rejoining the consumer group");
            }
        }
    }

    /// Whether the consumer's gate (if any) is closed now.
    fn gate_closed(&self) -> bool {
        self.options
            .gate
            .as_ref()
            .is_some_and(|gate| !*gate.borrow())
    }

    /// Pauses (or resumes) every partition assigned now; on resuming, a
    /// lane still paused for being full stays paused.
    fn pause_assignment(&self, consumer: &RelayBaseConsumer, paused: bool) {
        let Ok(assignment) = consumer.assignment() else {
            return;
        };
        let held_back: Vec<i32> = self
            .lanes
            .lock()
            .map(|lanes| {
                lanes
                    .iter()
                    .filter(|(_, lane)| lane.paused)
                    .map(|(partition, _)| *partition)
                    .collect()
            })
            .unwrap_or_default();
        for element in assignment.elements() {
            if element.topic() != &*self.topic
                || (!paused && held_back.contains(&element.partition()))
            {
                continue;
            }
            pause(consumer, &self.topic, element.partition(), paused);
        }
    }

    /// Sends polled records (in poll order) to their partitions' lanes,
    /// each lane's in one message; then waits for a lane left full (the
    /// poll thread's back-pressure), or pauses its partition.
    fn dispatch(self: &Arc<Self>, consumer: &RelayBaseConsumer, records: Vec<InputRecord>) {
        if records.is_empty() {
            return;
        }
        if let Ok(mut offsets) = self.offsets.lock() {
            for record in &records {
                offsets
                    .entry(record.partition)
                    .or_default()
                    .consumed(record.offset);
            }
        }
        self.consumed.fetch_add(records.len(), Ordering::Relaxed);
        if let Ok(mut positions) = self.positions.lock() {
            for record in &records {
                let next = positions.entry(record.partition).or_insert(0);
                *next = (*next).max(record.offset + 1);
            }
        }
        // Each partition's records, in poll order, and their bytes.
        let mut by_partition: Vec<(i32, Vec<InputRecord>, usize)> = Vec::new();
        for record in records {
            let size = record.size_bytes();
            match by_partition
                .iter_mut()
                .find(|(partition, ..)| *partition == record.partition)
            {
                Some((_, batch, bytes)) => {
                    batch.push(record);
                    *bytes += size;
                }
                None => by_partition.push((record.partition, vec![record], size)),
            }
        }
        let mut full = Vec::new();
        {
            let Ok(mut lanes) = self.lanes.lock() else {
                return;
            };
            for (partition, batch, bytes) in by_partition {
                let lane = lanes
                    .entry(partition)
                    .or_insert_with(|| self.spawn_lane(partition));
                let count = batch.len();
                lane.backlog.add(count, bytes);
                if lane.tx.send(batch).is_err() {
                    // The worker is gone (abandoned partition); the records
                    // stay uncommitted and are consumed again.
                    lane.backlog.remove(count, bytes);
                }
                if !lane.paused && !lane.unpausable && self.is_full(&lane.backlog) {
                    full.push((partition, lane.backlog.clone()));
                }
            }
        }
        for (partition, backlog) in full {
            self.wait_for_full_lane(consumer, partition, &backlog);
        }
    }

    /// A lane that is merely behind drains within moments: waiting for it
    /// keeps what librdkafka fetched ahead, where a pause would throw it
    /// away (to fetch it all again on resuming). librdkafka's own
    /// read-ahead bound holds the fetcher meanwhile. A lane still full
    /// after [`FULL_LANE_WAIT`] has its partition paused.
    fn wait_for_full_lane(&self, consumer: &RelayBaseConsumer, partition: i32, backlog: &Backlog) {
        let waited = Instant::now();
        while self.is_full(backlog) && waited.elapsed() < FULL_LANE_WAIT {
            std::thread::sleep(FULL_LANE_POLL);
        }
        if !self.is_full(backlog) {
            return;
        }
        // Stuck (a key whose record does not finish, an application that
        // does not answer): the other partitions must not wait for it.
        let Ok(mut lanes) = self.lanes.lock() else {
            return;
        };
        let Some(lane) = lanes.get_mut(&partition) else {
            return;
        };
        if lane.paused {
            return;
        }
        if pause(consumer, &self.topic, partition, true) {
            tracing::debug!(
                topic = %self.topic,
                partition,
                records = lane.backlog.records(),
                bytes = lane.backlog.bytes(),
                "lane full: partition paused"
            );
            self.lane_pauses.fetch_add(1, Ordering::Relaxed);
            lane.paused = true;
        } else {
            tracing::info!(
                topic = %self.topic,
                partition,
                "lane full and its partition could not be paused: its records are taken without waiting until it drains to half"
            );
            lane.unpausable = true;
        }
    }

    /// Whether a lane's backlog is at its bound (records or bytes).
    fn is_full(&self, backlog: &Backlog) -> bool {
        backlog.records() >= self.options.max_queued_per_partition
            || backlog.bytes() >= self.options.max_queued_bytes_per_partition
    }

    fn resume_drained_lanes(&self, consumer: &RelayBaseConsumer) {
        let Ok(mut lanes) = self.lanes.lock() else {
            return;
        };
        let low_water = self.options.max_queued_per_partition / 2;
        let low_water_bytes = self.options.max_queued_bytes_per_partition / 2;
        for (partition, lane) in lanes.iter_mut() {
            if lane.unpausable
                && lane.backlog.records() <= low_water
                && lane.backlog.bytes() <= low_water_bytes
            {
                lane.unpausable = false;
            }
            if lane.paused
                && lane.backlog.records() <= low_water
                && lane.backlog.bytes() <= low_water_bytes
                && pause(consumer, &self.topic, *partition, false)
            {
                tracing::debug!(topic = %self.topic, partition, "lane drained: partition resumed");
                lane.paused = false;
            }
        }
    }

    fn spawn_lane(self: &Arc<Self>, partition: i32) -> Lane {
        let (tx, rx) = mpsc::unbounded_channel::<Vec<InputRecord>>();
        let lane = LaneContext {
            partition,
            order: self.options.order,
            handler: self.handler.clone(),
            in_flight: self.in_flight.clone(),
            pending: Arc::new(Semaphore::new(
                self.options.max_pending_per_partition.max(1),
            )),
            backlog: Arc::new(Backlog::default()),
            active: Arc::new(AtomicUsize::new(0)),
            stop_taking: CancellationToken::new(),
            abort: CancellationToken::new(),
            finished_tx: self.finished_tx.clone(),
            tasks: self.tasks.clone(),
        };
        let handle = Lane {
            tx,
            backlog: lane.backlog.clone(),
            active: lane.active.clone(),
            stop_taking: lane.stop_taking.clone(),
            abort: lane.abort.clone(),
            paused: false,
            unpausable: false,
        };
        self.tasks.spawn_on(lane.run(rx), &self.runtime);
        handle
    }

    /// Applies finished offsets to the trackers and stores the commit
    /// positions that moved forward.
    fn apply_finished(&self, consumer: &RelayBaseConsumer) {
        let mut positions: HashMap<i32, i64> = HashMap::new();
        {
            let (Ok(mut rx), Ok(mut offsets)) = (self.finished_rx.lock(), self.offsets.lock())
            else {
                return;
            };
            while let Ok((partition, offset)) = rx.try_recv() {
                if let Some(position) = offsets.get_mut(&partition).and_then(|p| p.finished(offset))
                {
                    positions.insert(partition, position);
                }
            }
        }
        if positions.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for (partition, position) in positions {
            let _ = tpl.add_partition_offset(&self.topic, partition, Offset::Offset(position));
        }
        if let Err(error) = consumer.store_offsets(&tpl) {
            // A partition revoked meanwhile cannot be stored; its new owner
            // consumes from the last commit.
            tracing::debug!(topic = %self.topic, %error, "storing offsets");
        }
    }

    fn active_in(&self, partitions: Option<&[i32]>) -> usize {
        let Ok(lanes) = self.lanes.lock() else {
            return 0;
        };
        lanes
            .iter()
            .filter(|(p, _)| partitions.is_none_or(|ps| ps.contains(p)))
            .map(|(_, lane)| lane.active.load(Ordering::Relaxed))
            .sum()
    }

    /// Stops taking new records of `partitions`, waits up to `timeout` for
    /// their in-flight work, abandons the rest, stores and commits.
    fn drain_partitions(
        &self,
        consumer: &RelayBaseConsumer,
        partitions: &[i32],
        timeout: Duration,
    ) -> usize {
        let selected = |lanes: &HashMap<i32, Lane>| -> Vec<i32> {
            lanes
                .keys()
                .copied()
                .filter(|p| partitions.contains(p))
                .collect()
        };
        if let Ok(lanes) = self.lanes.lock() {
            for partition in selected(&lanes) {
                lanes[&partition].stop_taking.cancel();
            }
        }
        let deadline = Instant::now() + timeout;
        while self.active_in(Some(partitions)) > 0 && Instant::now() < deadline {
            self.apply_finished(consumer);
            std::thread::sleep(Duration::from_millis(5));
        }
        let abandoned = self.active_in(Some(partitions));
        if let Ok(mut lanes) = self.lanes.lock() {
            for partition in selected(&lanes) {
                if let Some(lane) = lanes.remove(&partition) {
                    lane.abort.cancel();
                }
            }
        }
        // Give aborted handlers a moment to return, so their state is settled.
        let settle = Instant::now() + Duration::from_secs(1);
        while self.active_in(None) > 0 && abandoned > 0 && Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.apply_finished(consumer);
        self.commit_positions(consumer, partitions);
        if let Ok(mut offsets) = self.offsets.lock() {
            for partition in partitions {
                offsets.remove(partition);
            }
        }
        if abandoned > 0 {
            tracing::warn!(topic = %self.topic, ?partitions, abandoned, "in-flight records abandoned; they will be consumed again");
        }
        abandoned
    }

    fn commit_positions(&self, consumer: &RelayBaseConsumer, partitions: &[i32]) {
        let mut tpl = TopicPartitionList::new();
        if let Ok(offsets) = self.offsets.lock() {
            for partition in partitions {
                if let Some(position) = offsets.get(partition).and_then(|p| p.committed_position())
                {
                    let _ =
                        tpl.add_partition_offset(&self.topic, *partition, Offset::Offset(position));
                }
            }
        }
        if tpl.count() == 0 {
            return;
        }
        match consumer.commit(&tpl, CommitMode::Sync) {
            Ok(()) => tracing::debug!(topic = %self.topic, "committed offsets"),
            Err(error) => tracing::warn!(topic = %self.topic, %error, "committing offsets"),
        }
    }

    fn shut_down(&self, consumer: &RelayBaseConsumer) -> ConsumerReport {
        let partitions: Vec<i32> = self
            .lanes
            .lock()
            .map(|lanes| lanes.keys().copied().collect())
            .unwrap_or_default();
        tracing::info!(topic = %self.topic, "consumer stopping: finishing in-flight work");
        let abandoned = self.drain_partitions(consumer, &partitions, self.options.shutdown_grace);
        consumer.unsubscribe();
        tracing::info!(topic = %self.topic, abandoned, "consumer stopped");
        ConsumerReport {
            consumed: self.consumed.load(Ordering::Relaxed) as u64,
            abandoned_at_shutdown: abandoned,
            lane_pauses: self.lane_pauses.load(Ordering::Relaxed),
        }
    }
}

/// Pauses or resumes one partition; true when it worked.
/// librdkafka's `max.poll.interval.ms` when the link does not set it.
const DEFAULT_MAX_POLL_INTERVAL: Duration = Duration::from_secs(300);

/// How long a revocation may wait for in-flight work: `configured`, but at
/// most half of the consumer's `max.poll.interval.ms`. The wait runs inside
/// the rebalance callback, where the consumer does not poll; one that does
/// not poll for the whole interval is put out of the group, and its
/// in-flight work is abandoned anyway (seen in the soak: a 10 s drain with
/// a 10 s interval, after every broker cut that outlasted the session).
fn revoke_drain_bound(configured: Duration, config: &rdkafka::ClientConfig) -> Duration {
    let max_poll = config
        .get("max.poll.interval.ms")
        .and_then(|ms| ms.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_MAX_POLL_INTERVAL);
    configured.min(max_poll / 2)
}

/// The session timeout and heartbeat interval of a consumer that rejoins for
/// lost peers: the link's when it sets them, else
/// [`DEFAULT_SESSION_TIMEOUT`] and a third of the session (set in `config`).
fn group_timeouts(link: &LinkInfo, config: &mut rdkafka::ClientConfig) -> (Duration, Duration) {
    let set_ms = |name: &str| {
        link.options
            .get(name)
            .and_then(|ms| ms.parse::<u64>().ok())
            .map(Duration::from_millis)
    };
    let session = set_ms("session.timeout.ms").unwrap_or_else(|| {
        config.set(
            "session.timeout.ms",
            DEFAULT_SESSION_TIMEOUT.as_millis().to_string(),
        );
        DEFAULT_SESSION_TIMEOUT
    });
    let heartbeat = set_ms("heartbeat.interval.ms").unwrap_or_else(|| {
        let third = session / 3;
        config.set("heartbeat.interval.ms", third.as_millis().to_string());
        third
    });
    (session, heartbeat)
}

fn pause(consumer: &RelayBaseConsumer, topic: &str, partition: i32, paused: bool) -> bool {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let result = if paused {
        consumer.pause(&tpl)
    } else {
        consumer.resume(&tpl)
    };
    match result {
        Ok(()) => true,
        Err(error) => {
            tracing::debug!(topic, partition, paused, %error, "pausing/resuming a partition");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_with(max_poll_ms: Option<&str>) -> rdkafka::ClientConfig {
        let mut config = rdkafka::ClientConfig::new();
        if let Some(ms) = max_poll_ms {
            config.set("max.poll.interval.ms", ms);
        }
        config
    }

    #[test]
    fn a_revocation_waits_at_most_half_the_poll_interval() {
        let ten = Duration::from_secs(10);
        // The soak's sidecar: a 10 s drain in a 10 s interval left the group.
        assert_eq!(
            revoke_drain_bound(ten, &config_with(Some("10000"))),
            Duration::from_secs(5)
        );
        // Shorter than half: as configured.
        assert_eq!(revoke_drain_bound(ten, &config_with(Some("60000"))), ten);
        // librdkafka's default interval (300 s) when the link sets none.
        assert_eq!(revoke_drain_bound(ten, &config_with(None)), ten);
        assert_eq!(
            revoke_drain_bound(Duration::from_secs(900), &config_with(None)),
            Duration::from_secs(150)
        );
    }
}
