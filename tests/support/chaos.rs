//! The bookkeeping of a chaos scenario (`tests/e2e/chaos.rs`, run by
//! `scripts/chaos.sh`): how long it runs, the longest time delivery stood
//! still while work was waiting, and the one row it reports.
//!
//! A scenario produces a steady [`Load`] for [`scenario_duration`] while
//! it injects its fault, then waits for the rest to drain; it calls
//! [`ChaosRun::observe`] whenever it looks at how much was delivered, and
//! ends with [`ChaosRun::finish`], which prints the row (a line starting
//! with [`ROW_PREFIX`], JSON after it) and fails the test on any loss.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use rdkafka::ClientConfig;
use rdkafka::producer::FutureProducer;
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::tansu::TestRecord;

/// How the row of a scenario starts in the test's output.
pub const ROW_PREFIX: &str = "chaos-row ";

/// How long a scenario runs its load and fault: `WASMRELAY_CHAOS_SECONDS`
/// (`scripts/chaos.sh --full` sets it), 20 s by default (CI's short mode).
pub fn scenario_duration() -> Duration {
    match std::env::var("WASMRELAY_CHAOS_SECONDS") {
        Ok(text) => Duration::from_secs(text.trim().parse().unwrap_or_else(|_| {
            panic!("WASMRELAY_CHAOS_SECONDS is not a number of seconds: {text:?}")
        })),
        Err(_) => Duration::from_secs(20),
    }
}

/// One scenario's run: its clock, what was produced, and the longest stall.
#[derive(Debug)]
pub struct ChaosRun {
    scenario: &'static str,
    started: Instant,
    duration: Duration,
    produced: usize,
    /// The delivered count last seen, and since when it stood there.
    last_delivered: usize,
    standing_since: Instant,
    max_stall: Duration,
}

/// What a scenario counted at its end, for [`ChaosRun::finish`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    /// Distinct messages that reached their destination.
    pub delivered: usize,
    /// Deliveries of a message already delivered (the same delivery id).
    pub duplicated: usize,
    /// Distinct messages written to a dead-letter topic instead.
    pub dead_lettered: usize,
}

impl ChaosRun {
    /// Starts the clock of `scenario`.
    pub fn start(scenario: &'static str) -> ChaosRun {
        let now = Instant::now();
        ChaosRun {
            scenario,
            started: now,
            duration: scenario_duration(),
            produced: 0,
            last_delivered: 0,
            standing_since: now,
            max_stall: Duration::ZERO,
        }
    }

    /// Whether the load and fault phase is still on.
    pub fn running(&self) -> bool {
        self.started.elapsed() < self.duration
    }

    /// Time since the start.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The length of the load and fault phase.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// Looks at the delivered count (distinct messages, dead letters
    /// included) against the produced one: while some of what was produced
    /// is still waiting, the time it does not move is a stall.
    pub fn observe(&mut self, produced: usize, delivered: usize) {
        self.produced = self.produced.max(produced);
        let now = Instant::now();
        if delivered != self.last_delivered || delivered >= self.produced {
            self.last_delivered = delivered;
            self.standing_since = now;
            return;
        }
        self.max_stall = self.max_stall.max(now - self.standing_since);
    }

    /// After the load (`produced` messages in all): waits, observing,
    /// until `delivered()` reaches `produced`, for at most `timeout`;
    /// panics naming the shortfall if it does not, with `context()` (logs)
    /// in the message.
    pub async fn drain(
        &mut self,
        produced: usize,
        timeout: Duration,
        mut delivered: impl FnMut() -> usize,
        context: impl Fn() -> String,
    ) {
        self.produced = produced;
        let deadline = Instant::now() + timeout;
        loop {
            let now = delivered();
            self.observe(produced, now);
            if now >= self.produced {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {now} of {} messages delivered {timeout:?} after the load ended; \
                 the longest stall was {:?}\n{}",
                self.scenario,
                self.produced,
                self.max_stall,
                context()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Prints the scenario's row and fails the test if anything was lost.
    pub fn finish(self, outcome: Outcome) {
        let accounted = outcome.delivered + outcome.dead_lettered;
        let lost = self.produced.saturating_sub(accounted);
        let row = serde_json::json!({
            "scenario": self.scenario,
            "seconds": self.duration.as_secs(),
            "produced": self.produced,
            "delivered": outcome.delivered,
            "duplicated": outcome.duplicated,
            "dead_lettered": outcome.dead_lettered,
            "lost": lost,
            "max_stall_ms": u64::try_from(self.max_stall.as_millis()).unwrap_or(u64::MAX),
        });
        // The row is this run's result: scripts/chaos.sh collects it from
        // the test's output.
        #[allow(clippy::print_stdout)]
        {
            println!("{ROW_PREFIX}{row}");
        }
        assert_eq!(lost, 0, "{}: messages lost: {row}", self.scenario);
    }
}

/// A steady load: records produced to a topic at a fixed rate by a task of
/// its own, so that a fault that blocks the broker blocks neither the test
/// nor the count (librdkafka keeps what it cannot send yet, up to five
/// minutes).
#[derive(Debug)]
pub struct Load {
    acknowledged: Arc<AtomicUsize>,
    stop: CancellationToken,
    task: JoinHandle<usize>,
}

impl Load {
    /// Produces `record(n)` for n = 0, 1, … to `topic`, `per_second`
    /// records a second in ticks of 50 ms, with a producer made from
    /// `config` (one record per batch, see [`crate::tansu::Tansu::produce`]).
    pub fn start(
        mut config: ClientConfig,
        topic: &str,
        per_second: usize,
        record: impl Fn(usize) -> TestRecord + Send + 'static,
    ) -> Load {
        let producer: FutureProducer = config
            .set("batch.num.messages", "1")
            .set("message.timeout.ms", "300000")
            .create()
            .expect("creating the load's producer");
        let topic = topic.to_owned();
        let acknowledged = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let per_tick = per_second.div_ceil(20).max(1);
        let counted = acknowledged.clone();
        let stopped = stop.clone();
        // Joined by `Load::stop`; aborted with the test's runtime otherwise.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(async move {
            let mut sent = 0;
            let mut in_flight = FuturesUnordered::new();
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tokio::select! {
                    _ = stopped.cancelled() => break,
                    _ = tick.tick() => {
                        for _ in 0..per_tick {
                            let record = record(sent);
                            let producer = producer.clone();
                            let topic = topic.clone();
                            in_flight.push(async move {
                                producer
                                    .send(record.to_future_record(&topic), Duration::from_secs(300))
                                    .await
                            });
                            sent += 1;
                        }
                    }
                    Some(delivery) = in_flight.next(), if !in_flight.is_empty() => {
                        acknowledge(delivery, &counted);
                    }
                }
            }
            while let Some(delivery) = in_flight.next().await {
                acknowledge(delivery, &counted);
            }
            sent
        });
        Load {
            acknowledged,
            stop,
            task,
        }
    }

    /// Records the broker acknowledged so far.
    pub fn acknowledged(&self) -> usize {
        self.acknowledged.load(Ordering::SeqCst)
    }

    /// Stops producing, waits for every record in flight to be
    /// acknowledged, and returns how many were produced.
    pub async fn stop(self) -> usize {
        self.stop.cancel();
        let acknowledged = self.acknowledged.clone();
        let sent = self.task.await.expect("the load's task");
        assert_eq!(
            sent,
            acknowledged.load(Ordering::SeqCst),
            "records the broker never took"
        );
        sent
    }
}

fn acknowledge(delivery: OwnedDeliveryResult, acknowledged: &AtomicUsize) {
    match delivery {
        Ok(_) => {
            acknowledged.fetch_add(1, Ordering::SeqCst);
        }
        Err((e, _)) => panic!("the load could not produce a record: {e}"),
    }
}
