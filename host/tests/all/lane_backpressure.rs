//! A flow consumer's back-pressure on a real broker: a lane that is only
//! behind is waited for, so what librdkafka fetched ahead is kept (a pause
//! would throw it away and fetch it all again); a lane that stays full (a
//! record that does not finish) has its partition paused, so the other
//! partitions go on.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use wasmrelay::kafka::consumer::Handling;
use wasmrelay::kafka::{
    ConsumerOptions, DeliveryOrder, HandleOutcome, InputRecord, LinkInfo, MessageHandler,
    PartitionedConsumer,
};

use crate::support::tansu::{Tansu, TestRecord, unique_group};

const DEADLINE: Duration = Duration::from_secs(60);

/// Finishes each record after `delay`; records of `stuck_partition` only
/// once `release` turns true. Counts what it started and finished, per
/// partition.
struct Handler {
    delay: Duration,
    stuck_partition: Option<i32>,
    release: watch::Receiver<bool>,
    finished: Arc<Mutex<HashMap<i32, usize>>>,
    started: Arc<Mutex<HashMap<i32, usize>>>,
}

impl MessageHandler for Handler {
    fn handle(&self, record: InputRecord, _abort: CancellationToken) -> Handling {
        let delay = self.delay;
        let mut release =
            (self.stuck_partition == Some(record.partition)).then(|| self.release.clone());
        let finished = self.finished.clone();
        *self
            .started
            .lock()
            .unwrap()
            .entry(record.partition)
            .or_default() += 1;
        // The ordered part yields the completion: that is the contract.
        #[allow(clippy::async_yields_async)]
        let ordered = async move {
            if let Some(release) = release.as_mut() {
                let _ = release.wait_for(|released| *released).await;
            }
            tokio::time::sleep(delay).await;
            *finished
                .lock()
                .unwrap()
                .entry(record.partition)
                .or_default() += 1;
            async { HandleOutcome::Finished }.boxed()
        };
        ordered.boxed()
    }
}

fn link(kafka: &Tansu) -> LinkInfo {
    LinkInfo {
        bootstrap_servers: kafka.bootstrap(),
        options: BTreeMap::from(
            [
                ("broker.address.family", "v4"),
                ("fetch.wait.max.ms", "10"),
                ("session.timeout.ms", "6000"),
                ("heartbeat.interval.ms", "500"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string())),
        ),
    }
}

/// A consumer of `topic` in a group of its own, and what stops it.
fn start(
    kafka: &Tansu,
    topic: &str,
    handler: Handler,
    options: ConsumerOptions,
) -> (PartitionedConsumer, CancellationToken, String) {
    let shutdown = CancellationToken::new();
    let group = unique_group(topic);
    let consumer = PartitionedConsumer::start(
        &link(kafka),
        &group,
        topic,
        Arc::new(handler),
        options,
        shutdown.clone(),
    )
    .unwrap();
    (consumer, shutdown, group)
}

async fn wait_for(
    what: &str,
    finished: &Mutex<HashMap<i32, usize>>,
    done: impl Fn(&HashMap<i32, usize>) -> bool,
) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let now = finished.lock().unwrap().clone();
        if done(&now) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {DEADLINE:?}; finished per partition: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_that_is_only_behind_is_waited_for_and_never_paused() {
    let kafka = Tansu::start();
    let topic = "behind";
    kafka.create_topic(topic, 1).await;
    const RECORDS: usize = 600;
    kafka
        .produce(
            topic,
            (0..RECORDS).map(|n| TestRecord::keyed(format!("k{n}"), "v").in_partition(0)),
        )
        .await;
    let finished = Arc::new(Mutex::new(HashMap::new()));
    let (_release, release) = watch::channel(true);
    let handler = Handler {
        delay: Duration::from_millis(2),
        stuck_partition: None,
        release,
        finished: finished.clone(),
        started: Arc::default(),
    };
    // The lane holds 20 records at most, and drains at about 2,000 a
    // second: always full, never for long.
    let options = ConsumerOptions {
        max_queued_per_partition: 20,
        order: DeliveryOrder::None,
        max_in_flight: 4,
        ..ConsumerOptions::default()
    };
    let (consumer, shutdown, group) = start(&kafka, topic, handler, options);
    wait_for("every record finished", &finished, |f| {
        f.get(&0).copied().unwrap_or(0) >= RECORDS
    })
    .await;
    shutdown.cancel();
    let report = consumer.join().await;
    assert_eq!(report.consumed, RECORDS as u64, "{report:?}");
    assert_eq!(
        report.lane_pauses, 0,
        "a lane that drains was paused, which drops what librdkafka fetched ahead: {report:?}"
    );
    assert_eq!(
        kafka.committed_offsets(&group, topic).await,
        BTreeMap::from([(0, RECORDS as i64)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_that_stays_full_is_paused_and_the_other_partitions_go_on() {
    let kafka = Tansu::start();
    let topic = "stuck";
    kafka.create_topic(topic, 2).await;
    const PER_PARTITION: usize = 100;
    let in_partition = |partition: i32| {
        (0..PER_PARTITION).map(move |n| {
            TestRecord::keyed(format!("k{partition}-{n}"), "v").in_partition(partition)
        })
    };
    kafka.produce(topic, in_partition(0)).await;
    let finished = Arc::new(Mutex::new(HashMap::new()));
    let started = Arc::new(Mutex::new(HashMap::new()));
    let (release_tx, release) = watch::channel(false);
    let handler = Handler {
        delay: Duration::ZERO,
        stuck_partition: Some(0),
        release,
        finished: finished.clone(),
        started: started.clone(),
    };
    // Partition order: partition 0's first record holds up the rest of it,
    // which fill its lane of 5.
    let options = ConsumerOptions {
        max_queued_per_partition: 5,
        order: DeliveryOrder::Partition,
        ..ConsumerOptions::default()
    };
    let (consumer, shutdown, group) = start(&kafka, topic, handler, options);
    wait_for("partition 0's first record started", &started, |s| {
        s.get(&0).is_some()
    })
    .await;
    // Partition 1's records come after partition 0 is stuck: the poll
    // thread must not wait for partition 0's lane for good.
    kafka.produce(topic, in_partition(1)).await;
    wait_for(
        "partition 1 finished while partition 0 is stuck",
        &finished,
        |f| f.get(&1).copied().unwrap_or(0) >= PER_PARTITION,
    )
    .await;
    assert_eq!(finished.lock().unwrap().get(&0), None);
    assert_eq!(started.lock().unwrap().get(&0), Some(&1));
    release_tx.send(true).unwrap();
    wait_for("partition 0 finished once released", &finished, |f| {
        f.get(&0).copied().unwrap_or(0) >= PER_PARTITION
    })
    .await;
    shutdown.cancel();
    let report = consumer.join().await;
    assert!(report.lane_pauses >= 1, "{report:?}");
    assert_eq!(
        kafka.committed_offsets(&group, topic).await,
        BTreeMap::from([(0, PER_PARTITION as i64), (1, PER_PARTITION as i64)])
    );
}
