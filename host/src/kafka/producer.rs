//! Producing with back-pressure: a record is enqueued in librdkafka's queue
//! at once (waiting while the queue is full), and its acknowledgement is a
//! future awaited by whoever needs it, so many records are in flight at once
//! and nobody waits for acknowledgements one by one.
//!
//! Acknowledgements come from librdkafka's delivery reports, on the
//! producer's polling thread, through the producer's context
//! ([`AckContext`]). Records enqueued together as an [`AckGroup`] (a batch
//! of a transform flow) are acknowledged together: the reports fill the
//! group's results, and whoever waits for them ([`GroupAcks`]) is woken
//! once, when the last one is in, not once a record. A lone record
//! ([`RelayProducer::enqueue`]) is a group of one.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use anyhow::Context as _;
use rdkafka::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message as _;
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer as _, ProducerContext, ThreadedProducer,
};
use slab::Slab;

use super::link::LinkInfo;
use super::record::OutputRecord;

/// How long to wait before retrying an enqueue into a full queue.
const QUEUE_FULL_BACKOFF: Duration = Duration::from_millis(5);

/// A record's delivery opaque: its group's key in the registry in the high
/// half, its place in the group in the low half.
const INDEX_BITS: u32 = 32;
const INDEX_MASK: usize = (1 << INDEX_BITS) - 1;

/// Where a produced record landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// Partition written.
    pub partition: i32,
    /// Offset written.
    pub offset: i64,
}

/// A record's acknowledgement: where it was written, or why not.
pub type AckResult = Result<Delivered, KafkaError>;

/// A record of a group that was not written: why, and the record as it was
/// enqueued (from librdkafka's report, headers added at enqueueing
/// included), for its dead letter. `None` only when the record never
/// reached librdkafka (never enqueued, or its producer destroyed before
/// reporting): whoever waits must then give the input up, to be consumed
/// again.
#[derive(Debug)]
pub struct Refused {
    /// Why.
    pub error: KafkaError,
    /// The record, when librdkafka handed it back (boxed: a result of
    /// every record of a group has room for it).
    pub record: Option<Box<OutputRecord>>,
}

impl Refused {
    fn without_record(error: KafkaError) -> Self {
        Refused {
            error,
            record: None,
        }
    }
}

/// A grouped record's acknowledgement.
pub type GroupResult = Result<Delivered, Refused>;

/// What a group's acknowledgements have come to so far.
struct GroupState {
    /// Each record's result, once settled.
    results: Vec<Option<GroupResult>>,
    /// Records not settled yet.
    remaining: usize,
    /// Who waits for the last one.
    waker: Option<Waker>,
}

/// A group's state, shared by its records' reports and its waiter.
struct GroupShared {
    state: Mutex<GroupState>,
}

impl GroupShared {
    fn new(size: usize) -> Self {
        GroupShared {
            state: Mutex::new(GroupState {
                results: (0..size).map(|_| None).collect(),
                remaining: size,
                waker: None,
            }),
        }
    }

    /// Settles record `index` (once; a second report of it is ignored).
    /// `Some(waker)` when it was the group's last: the group is done, and
    /// the waiter (if any yet) is to be woken.
    fn settle(&self, index: usize, result: GroupResult) -> Option<Option<Waker>> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = state.results.get_mut(index)?;
        if slot.is_some() {
            return None;
        }
        *slot = Some(result);
        state.remaining -= 1;
        if state.remaining > 0 {
            return None;
        }
        Some(state.waker.take())
    }

    /// Every record not settled yet settled as cancelled (the producer is
    /// gone); the waiter woken.
    fn cancel_rest(&self) {
        let waker = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let mut cancelled = 0;
            for slot in state.results.iter_mut().filter(|slot| slot.is_none()) {
                *slot = Some(Err(Refused::without_record(KafkaError::Canceled)));
                cancelled += 1;
            }
            state.remaining -= cancelled;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The producer's context: the groups with records in flight, by key,
/// settled by librdkafka's delivery reports.
#[derive(Default)]
pub struct AckContext {
    groups: Mutex<Slab<Arc<GroupShared>>>,
}

impl std::fmt::Debug for AckContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AckContext").finish_non_exhaustive()
    }
}

impl ClientContext for AckContext {}

impl ProducerContext for AckContext {
    type DeliveryOpaque = usize;

    fn delivery(&self, report: &DeliveryResult<'_>, opaque: usize) {
        let result = match report {
            Ok(message) => Ok(Delivered {
                partition: message.partition(),
                offset: message.offset(),
            }),
            Err((error, message)) => Err(Refused {
                error: error.clone(),
                record: Some(Box::new(OutputRecord::from_message(message))),
            }),
        };
        self.settle(opaque >> INDEX_BITS, opaque & INDEX_MASK, result);
    }
}

impl AckContext {
    /// Registers a group whose records are about to be enqueued.
    fn register(&self, group: Arc<GroupShared>) -> usize {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups.insert(group)
    }

    /// Settles a record of group `key`; the group leaves the registry with
    /// its last record (so a key is reused only once nothing can report to
    /// it any more).
    fn settle(&self, key: usize, index: usize, result: GroupResult) {
        let done = {
            let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(group) = groups.get(key) else {
                return;
            };
            let done = group.settle(index, result);
            if done.is_some() {
                groups.remove(key);
            }
            done
        };
        if let Some(Some(waker)) = done {
            waker.wake();
        }
    }
}

impl Drop for AckContext {
    /// The producer is destroyed (it purged its queue and waited for the
    /// reports first): whatever is still unreported is cancelled, so that
    /// nobody waits for it forever.
    fn drop(&mut self) {
        let groups = std::mem::take(
            self.groups
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for (_, group) in groups {
            group.cancel_rest();
        }
    }
}

/// The acknowledgements of an [`AckGroup`]'s records: resolves, once
/// every one is in, to each record's result in the order enqueued.
#[must_use = "a record's acknowledgement says whether it was written"]
pub struct GroupAcks {
    shared: Arc<GroupShared>,
}

impl std::fmt::Debug for GroupAcks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupAcks").finish_non_exhaustive()
    }
}

impl Future for GroupAcks {
    type Output = Vec<GroupResult>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self
            .shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if state.remaining > 0 {
            match &state.waker {
                Some(waker) if waker.will_wake(cx.waker()) => {}
                _ => state.waker = Some(cx.waker().clone()),
            }
            return Poll::Pending;
        }
        let results = std::mem::take(&mut state.results);
        Poll::Ready(
            results
                .into_iter()
                .map(|result| result.unwrap_or(Err(Refused::without_record(KafkaError::Canceled))))
                .collect(),
        )
    }
}

/// The acknowledgement of one enqueued record: resolves once Kafka has
/// written it, or refused it.
#[must_use = "a record's acknowledgement says whether it was written"]
#[derive(Debug)]
pub struct Ack {
    acks: GroupAcks,
}

impl Future for Ack {
    type Output = AckResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.acks)
            .poll(cx)
            .map(|mut results| match results.pop() {
                Some(Ok(delivered)) => Ok(delivered),
                Some(Err(refused)) => Err(refused.error),
                None => Err(KafkaError::Canceled),
            })
    }
}

/// Records enqueued as one group, whose acknowledgements arrive together
/// ([`AckGroup::acks`]). Each of its `size` places is settled exactly once:
/// by the record's delivery report, by a refusal at enqueueing, or, for a
/// place never enqueued, as cancelled when the group is dropped.
pub struct AckGroup {
    producer: RelayProducer,
    shared: Arc<GroupShared>,
    /// The registry's key (unused for an empty group).
    key: usize,
    /// The next place to enqueue.
    next: usize,
    size: usize,
}

impl std::fmt::Debug for AckGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AckGroup")
            .field("next", &self.next)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl AckGroup {
    /// Enqueues the group's next record, unless librdkafka's queue is full
    /// (false: try again later). A record refused at once (too large, an
    /// unknown topic) is taken, its refusal (with a copy of it) its result.
    ///
    /// # Panics
    /// When all `size` records are enqueued already.
    pub fn enqueue_now(
        &mut self,
        topic: &str,
        record: &OutputRecord,
        extra: &[(&str, &[u8])],
    ) -> bool {
        match self.send_next(topic, record, extra) {
            Sent::Enqueued => true,
            Sent::QueueFull => false,
            Sent::Refused(error) => {
                let refused = Refused {
                    error,
                    record: Some(Box::new(record.clone())),
                };
                self.settle_last(Err(refused));
                true
            }
        }
    }

    /// Hands the next record to librdkafka; a refusal is not settled yet
    /// (see [`AckGroup::settle_last`]), but the place is taken.
    fn send_next(&mut self, topic: &str, record: &OutputRecord, extra: &[(&str, &[u8])]) -> Sent {
        assert!(
            self.next < self.size,
            "a group of {} records takes no more",
            self.size
        );
        let opaque = (self.key << INDEX_BITS) | self.next;
        let mut base: BaseRecord<'_, [u8], [u8], usize> = BaseRecord::with_opaque_to(topic, opaque);
        if let Some(headers) = record.rdkafka_headers(extra) {
            base = base.headers(headers);
        }
        if let Some(key) = &record.key {
            base = base.key(key.as_slice());
        }
        if let Some(value) = &record.value {
            base = base.payload(value.as_slice());
        }
        let sent = match self.producer.inner.send(base) {
            Ok(()) => Sent::Enqueued,
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                return Sent::QueueFull;
            }
            Err((error, _)) => Sent::Refused(error),
        };
        self.next += 1;
        sent
    }

    /// Settles the place last taken (a record refused at once).
    fn settle_last(&self, result: GroupResult) {
        let index = self.next - 1;
        self.producer
            .inner
            .context()
            .settle(self.key, index, result);
    }

    /// [`AckGroup::enqueue_now`], waiting while the queue is full.
    pub async fn enqueue(&mut self, topic: &str, record: &OutputRecord, extra: &[(&str, &[u8])]) {
        while !self.enqueue_now(topic, record, extra) {
            tokio::time::sleep(QUEUE_FULL_BACKOFF).await;
        }
    }

    /// Records enqueued so far.
    pub fn enqueued(&self) -> usize {
        self.next
    }

    /// The group's acknowledgements. The places not enqueued by now are
    /// settled as cancelled.
    pub fn acks(self) -> GroupAcks {
        GroupAcks {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for AckGroup {
    fn drop(&mut self) {
        let context = self.producer.inner.context();
        for index in self.next..self.size {
            context.settle(
                self.key,
                index,
                Err(Refused::without_record(KafkaError::Canceled)),
            );
        }
    }
}

/// What handing a record to librdkafka came to.
enum Sent {
    /// In librdkafka's queue: its delivery report settles its place.
    Enqueued,
    /// The queue is full: try again later (the place is not taken).
    QueueFull,
    /// Refused at once (too large, an unknown topic).
    Refused(KafkaError),
}

/// A producer of one link.
#[derive(Clone)]
pub struct RelayProducer {
    inner: Arc<ThreadedProducer<AckContext>>,
}

impl std::fmt::Debug for RelayProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayProducer").finish_non_exhaustive()
    }
}

impl RelayProducer {
    /// Creates a producer for a link (it connects lazily).
    pub fn new(link: &LinkInfo) -> anyhow::Result<Self> {
        let inner: ThreadedProducer<AckContext> = link
            .create_with_context(&link.producer_config(), AckContext::default())
            .with_context(|| format!("creating a Kafka producer for {}", link.bootstrap_servers))?;
        Ok(RelayProducer {
            inner: Arc::new(inner),
        })
    }

    /// A group of `size` records to enqueue, acknowledged together.
    pub fn group(&self, size: usize) -> AckGroup {
        assert!(size <= INDEX_MASK, "a group of {size} records is too large");
        let shared = Arc::new(GroupShared::new(size));
        let key = if size == 0 {
            0
        } else {
            self.inner.context().register(shared.clone())
        };
        AckGroup {
            producer: self.clone(),
            shared,
            key,
            next: 0,
            size,
        }
    }

    /// Enqueues `record` for `topic`, waiting while librdkafka's queue is
    /// full, and returns the acknowledgement as a future. The record is in
    /// flight once this returns; await the future to know it was written.
    pub async fn enqueue(&self, topic: &str, record: &OutputRecord) -> Result<Ack, KafkaError> {
        self.enqueue_with(topic, record, &[]).await
    }

    /// [`RelayProducer::enqueue`] with `extra` headers after the record's
    /// own (replacing those of the same names), copied straight into
    /// librdkafka's.
    pub async fn enqueue_with(
        &self,
        topic: &str,
        record: &OutputRecord,
        extra: &[(&str, &[u8])],
    ) -> Result<Ack, KafkaError> {
        loop {
            match self.enqueue_now_with(topic, record, extra) {
                Some(enqueued) => return enqueued,
                // Boxed: rare, and every enqueue's future would carry the
                // timer otherwise.
                None => Box::pin(tokio::time::sleep(QUEUE_FULL_BACKOFF)).await,
            }
        }
    }

    /// [`RelayProducer::enqueue_with`] without waiting: `None` while
    /// librdkafka's queue is full. A caller that tries first keeps the wait
    /// out of its own future. A record refused at once is an `Err` here
    /// (not an acknowledgement).
    pub fn enqueue_now_with(
        &self,
        topic: &str,
        record: &OutputRecord,
        extra: &[(&str, &[u8])],
    ) -> Option<Result<Ack, KafkaError>> {
        let mut group = self.group(1);
        match group.send_next(topic, record, extra) {
            Sent::Enqueued => Some(Ok(Ack { acks: group.acks() })),
            Sent::QueueFull => None,
            Sent::Refused(error) => {
                // Settled, so that the group leaves the registry; the
                // caller has the record and gets the error here.
                group.settle_last(Err(Refused::without_record(error.clone())));
                Some(Err(error))
            }
        }
    }

    /// Enqueues and waits for the acknowledgement.
    pub async fn send(&self, topic: &str, record: &OutputRecord) -> Result<Delivered, KafkaError> {
        self.enqueue(topic, record).await?.await
    }

    /// Waits until everything enqueued is acknowledged or `timeout` passes.
    /// Blocks: call from a blocking context or `spawn_blocking`.
    pub fn flush(&self, timeout: Duration) -> Result<(), KafkaError> {
        self.inner.flush(timeout)
    }

    /// Records enqueued and not yet acknowledged.
    pub fn in_flight(&self) -> i32 {
        self.inner.in_flight_count()
    }
}

#[cfg(test)]
mod tests {
    /// The relay links the librdkafka of `vendor/rdkafka-sys`, patched
    /// (vendor/README.md): its idempotent producer does not spin while its
    /// in-flight window is full, and asks for its producer id as soon as a
    /// broker connection is up. Re-vendoring without a patch fails here.
    #[test]
    fn the_vendored_librdkafka_carries_its_patches() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../vendor");
        for name in [
            "librdkafka-idempotent-producer-spin.patch",
            "librdkafka-idempotent-producer-first-pid.patch",
        ] {
            let patch = std::fs::read_to_string(format!("{root}/{name}")).expect("the patch file");
            // Each file's section starts at its `+++ b/<path>` line.
            let mut added = 0;
            for section in patch.split("\n+++ b/").skip(1) {
                let (path, body) = section.split_once('\n').expect("a patched file's path");
                let source =
                    std::fs::read_to_string(format!("{root}/rdkafka-sys/librdkafka/{path}"))
                        .unwrap_or_else(|e| panic!("{name}: the vendored {path}: {e}"));
                for line in body
                    .lines()
                    .filter(|line| line.starts_with('+') && !line.starts_with("+++"))
                    .map(|line| &line[1..])
                    .filter(|line| !line.trim().is_empty())
                {
                    assert!(
                        source.lines().any(|source_line| source_line == line),
                        "vendor/rdkafka-sys/librdkafka/{path} lacks the line {line:?} of {name}"
                    );
                    added += 1;
                }
            }
            assert!(added >= 5, "{name} adds lines ({added} found)");
        }
        let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock"))
            .expect("Cargo.lock");
        let entry = lock
            .split("[[package]]")
            .find(|package| package.contains("name = \"rdkafka-sys\""))
            .expect("rdkafka-sys in Cargo.lock");
        assert!(
            !entry.contains("source = "),
            "rdkafka-sys must come from vendor/ (a path), not a registry: {entry}"
        );
    }

    /// CPU time of the calling thread so far, in clock ticks (10 ms).
    fn thread_cpu_ticks() -> u64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("the thread's stat");
        // After the command name (in parentheses): state is field 3, utime
        // and stime are fields 14 and 15.
        let fields: Vec<&str> = stat[stat.rfind(')').expect("comm") + 2..]
            .split(' ')
            .collect();
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
    }

    /// The relay builds rdkafka from `vendor/rdkafka`, patched so that a
    /// poll's wait of a fraction of a millisecond is asked of librdkafka
    /// rounded up, not down to no wait at all (vendor/README.md). rdkafka's
    /// polling loops (the producer's polling thread, the consumer's poll)
    /// ask again until their deadline passes: rounded down, every poll
    /// ended by spinning on a core for its last fraction of a millisecond.
    /// Here polls of 1.5 ms each would spin a third of the time (about
    /// 20 ticks in 600 ms); waiting, they take next to nothing.
    #[test]
    fn a_poll_waits_out_its_last_fraction_of_a_millisecond() {
        use rdkafka::config::ClientConfig;
        use rdkafka::producer::{BaseProducer, Producer as _};
        // Nothing listens there: the producer has nothing to do.
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:9")
            .set("log_level", "0")
            .create()
            .expect("a producer");
        let before = thread_cpu_ticks();
        let started = std::time::Instant::now();
        let mut polls = 0;
        while started.elapsed() < std::time::Duration::from_millis(600) {
            producer.poll(std::time::Duration::from_micros(1_500));
            polls += 1;
        }
        let spent = thread_cpu_ticks() - before;
        assert!(
            spent < 8,
            "{polls} polls of 1.5 ms took {spent} ticks of CPU in 600 ms: rdkafka spins instead of waiting"
        );
        assert_eq!(producer.in_flight_count(), 0);
    }
}
