//! Producing with back-pressure: a record is enqueued in librdkafka's queue
//! at once (waiting while the queue is full), and its acknowledgement is a
//! future awaited by whoever needs it, so many records are in flight at once
//! and nobody waits for acknowledgements one by one.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};

use super::link::LinkInfo;
use super::record::OutputRecord;

/// How long to wait before retrying an enqueue into a full queue.
const QUEUE_FULL_BACKOFF: Duration = Duration::from_millis(5);

/// Where a produced record landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// Partition written.
    pub partition: i32,
    /// Offset written.
    pub offset: i64,
}

/// The acknowledgement of an enqueued record: resolves once Kafka has
/// written it, or refused it. A named future (not an `async` block), so
/// that whoever keeps many of them keeps them without a box each.
#[must_use = "a record's acknowledgement says whether it was written"]
pub struct Ack {
    delivery: DeliveryFuture,
}

impl std::fmt::Debug for Ack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ack").finish_non_exhaustive()
    }
}

impl Future for Ack {
    type Output = Result<Delivered, KafkaError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.delivery)
            .poll(cx)
            .map(|result| match result {
                Ok(Ok(delivery)) => Ok(Delivered {
                    partition: delivery.partition,
                    offset: delivery.offset,
                }),
                Ok(Err((error, _message))) => Err(error),
                Err(_canceled) => Err(KafkaError::Canceled),
            })
    }
}

/// A producer of one link.
#[derive(Clone)]
pub struct RelayProducer {
    inner: FutureProducer,
}

impl std::fmt::Debug for RelayProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayProducer").finish_non_exhaustive()
    }
}

impl RelayProducer {
    /// Creates a producer for a link (it connects lazily).
    pub fn new(link: &LinkInfo) -> anyhow::Result<Self> {
        let inner: FutureProducer = link
            .create(&link.producer_config())
            .with_context(|| format!("creating a Kafka producer for {}", link.bootstrap_servers))?;
        Ok(RelayProducer { inner })
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
    /// out of its own future.
    pub fn enqueue_now_with(
        &self,
        topic: &str,
        record: &OutputRecord,
        extra: &[(&str, &[u8])],
    ) -> Option<Result<Ack, KafkaError>> {
        let mut future_record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic);
        if let Some(headers) = record.rdkafka_headers(extra) {
            future_record = future_record.headers(headers);
        }
        if let Some(key) = &record.key {
            future_record = future_record.key(key.as_slice());
        }
        if let Some(value) = &record.value {
            future_record = future_record.payload(value.as_slice());
        }
        match self.inner.send_result(future_record) {
            Ok(delivery) => Some(Ok(Ack { delivery })),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => None,
            Err((error, _)) => Some(Err(error)),
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
