//! Following every partition of a topic without a consumer group: the way
//! each node reads the cluster's heartbeats (from the end) and its route
//! table (from the beginning).
//!
//! A dedicated thread polls a `BaseConsumer` with partitions assigned, not
//! subscribed, so nodes never rebalance each other. What it does with a
//! record is the tail's [`TailSink`]: send a copy to a tokio channel
//! (back-pressure: the thread waits when the channel is full), or apply it
//! on the thread itself, read in place from librdkafka's buffer (no copy,
//! no channel hop, no task wake-up a record: reading a large topic is then
//! as fast as the apply, and librdkafka keeps fetching meanwhile). Once
//! every partition has reached its end for the first time,
//! [`TailEvent::CaughtUp`] is sent: the reader has seen everything written
//! before it started.
//!
//! Past that point, and from where each partition ended when a reader from
//! the beginning started, a partition's records come one offset after the
//! other
//! (the relay's producers are idempotent and write no transactions, and
//! compaction does not touch what is being written), so a record beyond the
//! next offset expected means the broker never gave the reader the ones in
//! between: [`TailEvent::Missed`]. tansu 0.6 does this when concurrent
//! producers' batches of a partition are stored out of offset order: a
//! fetch that passed the higher batch has moved beyond the lower one, which
//! librdkafka then drops as older than its position. The reader cannot
//! fetch them again (the broker hands them back in the same order); the
//! caller decides who must write them again.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message as _};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc;

use super::{InputRecord, LinkInfo, RecordView};

/// Where reading starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TailStart {
    /// The oldest record still in the topic.
    Beginning,
    /// Only records written from now on.
    End,
}

/// What a tail sends to its channel.
#[derive(Debug)]
pub enum TailEvent {
    /// A record, in partition order (from a [`TailSink::Send`] tail).
    Record(InputRecord),
    /// Every partition has been read to its end once: every record before
    /// it was sent, or applied.
    CaughtUp,
    /// After it had read `partition` to its end once, the reader got a
    /// record at offset `to` when the next one it expected was `from`: the
    /// broker never delivered offsets `from..to` to it.
    Missed {
        /// The partition.
        partition: i32,
        /// The first offset missed.
        from: i64,
        /// The offset of the record that came instead (one past the last
        /// offset missed).
        to: i64,
    },
}

/// A function a [`TailSink::Apply`] tail calls with the records, on its
/// reader thread: those ready together (at most [`APPLY_BATCH`]), in the
/// order read.
pub type ApplyRecord = Box<dyn FnMut(&[RecordView<'_>]) + Send>;

/// The most records a [`TailSink::Apply`] tail hands over at once: those
/// librdkafka has ready when the first arrives, so that applying them can
/// be done a batch at a time (nothing waits to fill one).
pub const APPLY_BATCH: usize = 256;

/// Makes the [`ApplyRecord`] of a tail once the records the topic holds at
/// start are known (see [`TopicTail::records_at_start`]): room for them can
/// be made before the first one is read.
pub type MakeApply = Box<dyn FnOnce(Option<u64>) -> ApplyRecord + Send>;

/// What a tail does with the records it reads, in partition order.
pub enum TailSink {
    /// Sends a copy of each to the channel ([`TailEvent::Record`]).
    Send,
    /// Calls the function with them, read in place, a batch at a time (the
    /// records ready together); the channel gets only the other events
    /// ([`TailEvent::CaughtUp`], [`TailEvent::Missed`]). The function must
    /// not block for long: the reader waits for it.
    Apply(ApplyRecord),
    /// As [`TailSink::Apply`], with the function made before reading starts.
    ApplyWhenSized(MakeApply),
}

impl std::fmt::Debug for TailSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TailSink::Send => "Send",
            TailSink::Apply(_) | TailSink::ApplyWhenSized(_) => "Apply",
        })
    }
}

/// A running tail; stops when dropped or [`TopicTail::stop`]ped.
#[derive(Debug)]
pub struct TopicTail {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    records_at_start: Option<u64>,
}

/// Logs client errors, except reaching the end of a partition (the tail
/// asks to be told, and it is no error).
struct TailContext {
    topic: String,
}

impl ClientContext for TailContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let end_of_partition = matches!(
            error,
            KafkaError::PartitionEOF(_)
                | KafkaError::Global(rdkafka::types::RDKafkaErrorCode::PartitionEOF)
        );
        if !end_of_partition {
            tracing::warn!(topic = %self.topic, %error, reason, "kafka reader error");
        }
    }
}

impl ConsumerContext for TailContext {}

type TailConsumer = BaseConsumer<TailContext>;

/// Names `<topic>/<key>`: the first record of that key the tail of that
/// topic gets once it is at the end is skipped as if the broker had never
/// delivered it (not applied, not sent, not counted as read: the next
/// record of its partition is then a [`TailEvent::Missed`]). Fault
/// injection for the tests.
pub const SKIP_ONCE_ENV: &str = "WASMRELAY_TEST_TAIL_SKIP_ONCE";

/// How long one poll waits.
const POLL: Duration = Duration::from_millis(100);
/// `queued.max.messages.kbytes` of a tail's consumer (see [`TopicTail::start`]).
const QUEUED_KBYTES: u32 = 2 * 1024;
/// `fetch.queue.backoff.ms` of a tail's consumer (see [`TopicTail::start`]).
const FETCH_QUEUE_BACKOFF_MS: u32 = 5;
/// `fetch.max.bytes` of a tail's consumer (see [`TopicTail::start`]).
const FETCH_MAX_BYTES: u32 = 1024 * 1024;

impl TopicTail {
    /// Starts reading every partition of `topic` from `start`, giving each
    /// record to `sink` and telling `events` when it caught up. Fails when
    /// the topic's metadata cannot be read.
    pub fn start(
        info: &LinkInfo,
        topic: &str,
        start: TailStart,
        reader_name: &str,
        sink: TailSink,
        events: mpsc::Sender<TailEvent>,
    ) -> anyhow::Result<TopicTail> {
        let mut config = info.admin_config();
        config
            .set("group.id", format!("wasmrelay-tail-{reader_name}"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true");
        // What librdkafka fetches ahead of the thread, unless the link says
        // otherwise: its default (64 MiB) is memory a node keeps (freed
        // buffers stay with the allocator) after reading a large routes
        // topic, and a few MiB keep the thread busy as well.
        if config.get("queued.max.messages.kbytes").is_none() {
            config.set("queued.max.messages.kbytes", QUEUED_KBYTES.to_string());
        }
        // Once the read-ahead is full, librdkafka waits this long before it
        // fetches again (1 s by default): with a small read-ahead the thread
        // then drains it and waits, most of the time of a large catch-up.
        if config.get("fetch.queue.backoff.ms").is_none() {
            config.set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS.to_string());
        }
        // A fetch response is one buffer, freed once its last record is:
        // small ones (50 MiB by default) keep what a large catch-up leaves
        // behind in the allocator small too.
        if config.get("fetch.max.bytes").is_none() {
            config.set("fetch.max.bytes", FETCH_MAX_BYTES.to_string());
        }
        let consumer: TailConsumer = info
            .create_with_context(
                &config,
                TailContext {
                    topic: topic.to_string(),
                },
            )
            .with_context(|| format!("creating a reader of `{topic}`"))?;
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .with_context(|| format!("reading the metadata of `{topic}`"))?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.name() == topic)
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        if partitions.is_empty() {
            anyhow::bail!("topic `{topic}` has no partitions (does it exist?)");
        }
        let mut assignment = TopicPartitionList::new();
        let offset = match start {
            TailStart::Beginning => Offset::Beginning,
            TailStart::End => Offset::End,
        };
        for partition in &partitions {
            assignment
                .add_partition_offset(topic, *partition, offset)
                .with_context(|| format!("assigning `{topic}` [{partition}]"))?;
        }
        // What a reader from the beginning has ahead of it, and the offset
        // each partition starts at (best effort).
        let watermarks: Option<Vec<(i32, i64, i64)>> = (start == TailStart::Beginning)
            .then(|| {
                partitions
                    .iter()
                    .map(|partition| {
                        let (low, high) = consumer
                            .fetch_watermarks(topic, *partition, Duration::from_secs(5))
                            .ok()?;
                        Some((*partition, low, high))
                    })
                    .collect()
            })
            .flatten();
        let records_at_start = watermarks.as_ref().map(|marks| {
            marks
                .iter()
                .map(|(_, low, high)| u64::try_from(high - low).unwrap_or_default())
                .sum()
        });
        let gaps = OffsetGaps::starting_at(watermarks.iter().flatten().copied());
        consumer
            .assign(&assignment)
            .with_context(|| format!("assigning the partitions of `{topic}`"))?;
        let sink = match sink {
            TailSink::ApplyWhenSized(make) => TailSink::Apply(make(records_at_start)),
            sink => sink,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let topic_name = topic.to_string();
        let thread = std::thread::Builder::new()
            .name(format!("tail-{topic}"))
            .spawn(move || {
                poll_loop(
                    &consumer,
                    &topic_name,
                    partitions,
                    sink,
                    gaps,
                    &events,
                    &thread_stop,
                );
            })
            .context("starting the reader thread")?;
        Ok(TopicTail {
            stop,
            thread: Some(thread),
            records_at_start,
        })
    }

    /// The records in the topic when a tail from the beginning started
    /// (the sum over its partitions of high minus low watermark); `None`
    /// for a tail from the end, or when the watermarks could not be read.
    pub fn records_at_start(&self) -> Option<u64> {
        self.records_at_start
    }

    /// Stops reading and waits for the thread.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for TopicTail {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// The offset each partition's next record should have, to notice the
/// records a broker never delivered ([`TailEvent::Missed`]): once the
/// partition was read to its end, or from its high watermark when the
/// reader started on (below it, compaction may have removed offsets).
#[derive(Debug, Default)]
struct OffsetGaps {
    next: HashMap<i32, i64>,
    /// Where each partition ended when the reader started.
    written_since: HashMap<i32, i64>,
    at_end: HashSet<i32>,
}

impl OffsetGaps {
    /// Expecting each partition's first record at its low watermark, and
    /// every record from its high watermark on (`(partition, low, high)`);
    /// a partition not given is expected from its first record once read
    /// to its end.
    fn starting_at(watermarks: impl IntoIterator<Item = (i32, i64, i64)>) -> OffsetGaps {
        let mut gaps = OffsetGaps::default();
        for (partition, low, high) in watermarks {
            gaps.next.insert(partition, low);
            gaps.written_since.insert(partition, high);
        }
        gaps
    }

    /// Whether offsets from `from` on of `partition` must all come.
    fn expects_all(&self, partition: i32, from: i64) -> bool {
        self.at_end.contains(&partition)
            || self
                .written_since
                .get(&partition)
                .is_some_and(|high| from >= *high)
    }

    /// `partition` was read to its end.
    fn at_end(&mut self, partition: i32) {
        self.at_end.insert(partition);
    }

    /// Notes a record at `offset` of `partition`; the event for the offsets
    /// missed before it, if the partition had been read to its end and the
    /// record is beyond the next one expected.
    fn record(&mut self, partition: i32, offset: i64) -> Option<TailEvent> {
        let expected = self.next.insert(partition, offset + 1);
        match expected {
            Some(from) if offset > from && self.expects_all(partition, from) => {
                Some(TailEvent::Missed {
                    partition,
                    from,
                    to: offset,
                })
            }
            // An offset below the one expected (librdkafka delivers none):
            // the expectation does not go back.
            Some(from) if offset < from => {
                self.next.insert(partition, from);
                None
            }
            _ => None,
        }
    }
}

/// Where a reader's time went until it caught up (logged at debug).
#[derive(Default)]
struct ReadStats {
    records: u64,
    empty_polls: u64,
    polling: Duration,
    /// Sending to the channel, or applying.
    handling: Duration,
}

fn poll_loop(
    consumer: &TailConsumer,
    topic: &str,
    partitions: Vec<i32>,
    mut sink: TailSink,
    mut gaps: OffsetGaps,
    events: &mpsc::Sender<TailEvent>,
    stop: &AtomicBool,
) {
    let mut skip_once: Option<Vec<u8>> = std::env::var(SKIP_ONCE_ENV).ok().and_then(|named| {
        let (named_topic, key) = named.split_once('/')?;
        (named_topic == topic).then(|| key.as_bytes().to_vec())
    });
    let mut not_at_end: HashSet<i32> = partitions.into_iter().collect();
    let mut caught_up = false;
    let mut last_error: Option<String> = None;
    let started = std::time::Instant::now();
    let mut stats = ReadStats::default();
    // What a poll for more records of a batch got instead, handled next.
    let mut carried = None;
    // Shared by the records sent on.
    let shared_topic: Arc<str> = topic.into();
    while !stop.load(Ordering::SeqCst) {
        let polled = match carried.take() {
            Some(polled) => Some(polled),
            None => {
                let polled_at = std::time::Instant::now();
                let polled = consumer.poll(POLL);
                stats.polling += polled_at.elapsed();
                polled
            }
        };
        let event = match polled {
            None => {
                stats.empty_polls += 1;
                continue;
            }
            Some(Ok(message)) => {
                last_error = None;
                if skips(&mut skip_once, caught_up, topic, &message) {
                    continue;
                }
                let handled_at = std::time::Instant::now();
                let mut missed = Vec::new();
                match &mut sink {
                    TailSink::Send => {
                        stats.records += 1;
                        missed.extend(gaps.record(message.partition(), message.offset()));
                        let record = InputRecord::from_borrowed(&message, &shared_topic);
                        // librdkafka's buffer goes back before the wait.
                        drop(message);
                        if events.blocking_send(TailEvent::Record(record)).is_err() {
                            return;
                        }
                    }
                    TailSink::Apply(apply) => {
                        // With the records librdkafka has ready now.
                        let mut batch = vec![message];
                        while batch.len() < APPLY_BATCH {
                            match consumer.poll(Duration::ZERO) {
                                Some(Ok(message)) => {
                                    if !skips(&mut skip_once, caught_up, topic, &message) {
                                        batch.push(message);
                                    }
                                }
                                other => {
                                    carried = other;
                                    break;
                                }
                            }
                        }
                        stats.records += batch.len() as u64;
                        missed.extend(
                            batch
                                .iter()
                                .filter_map(|m| gaps.record(m.partition(), m.offset())),
                        );
                        let views: Vec<RecordView<'_>> =
                            batch.iter().map(RecordView::of_message).collect();
                        apply(&views);
                    }
                    // Made into `Apply` before the thread starts.
                    TailSink::ApplyWhenSized(_) => {}
                }
                stats.handling += handled_at.elapsed();
                for event in missed {
                    if events.blocking_send(event).is_err() {
                        return;
                    }
                }
                continue;
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                gaps.at_end(partition);
                not_at_end.remove(&partition);
                if caught_up || !not_at_end.is_empty() {
                    continue;
                }
                caught_up = true;
                tracing::debug!(%topic, seconds = started.elapsed().as_secs_f64(), records = stats.records, polling_s = stats.polling.as_secs_f64(), handling_s = stats.handling.as_secs_f64(), sink = ?sink, empty_polls = stats.empty_polls, "reader at the end of every partition");
                TailEvent::CaughtUp
            }
            Some(Err(error)) => {
                let text = error.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(%topic, error = %text, "reading the topic failed; retrying");
                    last_error = Some(text);
                }
                continue;
            }
        };
        last_error = None;
        if events.blocking_send(event).is_err() {
            return;
        }
    }
}

/// Whether `message` is the one [`SKIP_ONCE_ENV`] names, read after the
/// catch-up: it is skipped (once) as if the broker had not delivered it.
fn skips(
    skip_once: &mut Option<Vec<u8>>,
    caught_up: bool,
    topic: &str,
    message: &BorrowedMessage<'_>,
) -> bool {
    let named = skip_once
        .as_deref()
        .is_some_and(|key| message.key() == Some(key));
    if !caught_up || !named {
        return false;
    }
    *skip_once = None;
    tracing::warn!(%topic, partition = message.partition(), offset = message.offset(), "skipping a record as if the broker had not delivered it ({SKIP_ONCE_ENV})");
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn missed(event: Option<TailEvent>) -> Option<(i32, i64, i64)> {
        match event {
            Some(TailEvent::Missed {
                partition,
                from,
                to,
            }) => Some((partition, from, to)),
            Some(other) => panic!("not a miss: {other:?}"),
            None => None,
        }
    }

    #[test]
    fn a_record_beyond_the_next_offset_after_the_end_was_reached_is_a_miss() {
        let mut gaps = OffsetGaps::starting_at([(0, 0, 100), (1, 0, 100)]);
        for offset in 0..3 {
            assert_eq!(missed(gaps.record(0, offset)), None);
        }
        gaps.at_end(0);
        assert_eq!(missed(gaps.record(0, 3)), None, "the next one");
        assert_eq!(missed(gaps.record(0, 7)), Some((0, 4, 7)));
        assert_eq!(missed(gaps.record(0, 8)), None, "expected after the miss");
        // An empty partition read to its end: its first record is expected
        // at the low watermark.
        gaps.at_end(1);
        assert_eq!(missed(gaps.record(1, 5)), Some((1, 0, 5)));
    }

    #[test]
    fn offsets_skipped_below_the_start_s_high_watermark_are_compaction_not_a_miss() {
        let mut gaps = OffsetGaps::starting_at([(0, 0, 60)]);
        assert_eq!(missed(gaps.record(0, 10)), None);
        assert_eq!(missed(gaps.record(0, 50)), None);
        // Written after the reader started: every offset comes, even
        // before the reader is at the end.
        assert_eq!(missed(gaps.record(0, 60)), None);
        assert_eq!(missed(gaps.record(0, 62)), Some((0, 61, 62)));
        gaps.at_end(0);
        assert_eq!(missed(gaps.record(0, 63)), None);
    }

    #[test]
    fn a_partition_without_watermarks_is_checked_once_read_to_its_end() {
        let mut gaps = OffsetGaps::starting_at([]);
        assert_eq!(missed(gaps.record(2, 30)), None);
        assert_eq!(missed(gaps.record(2, 35)), None, "not at the end yet");
        gaps.at_end(2);
        assert_eq!(missed(gaps.record(2, 36)), None);
        assert_eq!(missed(gaps.record(2, 38)), Some((2, 37, 38)));
        // A lower offset (never delivered by librdkafka) does not move the
        // expectation back.
        assert_eq!(missed(gaps.record(2, 10)), None);
        assert_eq!(missed(gaps.record(2, 39)), None);
    }
}
