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

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext};
use rdkafka::error::KafkaError;
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
}

/// A function a [`TailSink::Apply`] tail calls with each record, on its
/// reader thread.
pub type ApplyRecord = Box<dyn FnMut(RecordView<'_>) + Send>;

/// Makes the [`ApplyRecord`] of a tail once the records the topic holds at
/// start are known (see [`TopicTail::records_at_start`]): room for them can
/// be made before the first one is read.
pub type MakeApply = Box<dyn FnOnce(Option<u64>) -> ApplyRecord + Send>;

/// What a tail does with the records it reads, in partition order.
pub enum TailSink {
    /// Sends a copy of each to the channel ([`TailEvent::Record`]).
    Send,
    /// Calls the function with each, read in place; the channel gets only
    /// [`TailEvent::CaughtUp`]. The function must not block for long:
    /// the reader waits for it.
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
        // What a reader from the beginning has ahead of it (best effort).
        let records_at_start = (start == TailStart::Beginning)
            .then(|| {
                partitions.iter().try_fold(0u64, |sum, partition| {
                    let (low, high) = consumer
                        .fetch_watermarks(topic, *partition, Duration::from_secs(5))
                        .ok()?;
                    Some(sum + u64::try_from(high - low).unwrap_or_default())
                })
            })
            .flatten();
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
    events: &mpsc::Sender<TailEvent>,
    stop: &AtomicBool,
) {
    let mut not_at_end: HashSet<i32> = partitions.into_iter().collect();
    let mut caught_up = false;
    let mut last_error: Option<String> = None;
    let started = std::time::Instant::now();
    let mut stats = ReadStats::default();
    while !stop.load(Ordering::SeqCst) {
        let polled_at = std::time::Instant::now();
        let polled = consumer.poll(POLL);
        stats.polling += polled_at.elapsed();
        let event = match polled {
            None => {
                stats.empty_polls += 1;
                continue;
            }
            Some(Ok(message)) => {
                last_error = None;
                stats.records += 1;
                let handled_at = std::time::Instant::now();
                match &mut sink {
                    TailSink::Send => {
                        let record = InputRecord::from_borrowed(&message);
                        // librdkafka's buffer goes back before the wait.
                        drop(message);
                        if events.blocking_send(TailEvent::Record(record)).is_err() {
                            return;
                        }
                    }
                    TailSink::Apply(apply) => apply(RecordView::of_message(&message)),
                    // Made into `Apply` before the thread starts.
                    TailSink::ApplyWhenSized(_) => {}
                }
                stats.handling += handled_at.elapsed();
                continue;
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
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
