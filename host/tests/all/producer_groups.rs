//! Records enqueued as one group (a transform flow's batch) against a real
//! broker: their acknowledgements come together, each at its place, with
//! one wake-up of the waiter; a record refused at once, a place never
//! enqueued and a producer destroyed with records in flight each settle
//! their place, so nobody waits forever.

use std::collections::BTreeMap;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use wasmrelay::kafka::producer::Refused;
use wasmrelay::kafka::{LinkInfo, OutputRecord, RelayProducer};

use crate::support::tansu::Tansu;

fn link(bootstrap: String) -> LinkInfo {
    LinkInfo {
        bootstrap_servers: bootstrap,
        options: BTreeMap::from([("broker.address.family".to_string(), "v4".to_string())]),
    }
}

fn record(value: impl Into<Vec<u8>>) -> OutputRecord {
    OutputRecord {
        key: Some(b"k".to_vec()),
        value: Some(value.into()),
        headers: Vec::new(),
    }
}

/// Counts its wake-ups, and tells the waiting test thread.
struct CountingWaker {
    wakes: AtomicUsize,
    thread: std::thread::Thread,
}

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.thread.unpark();
    }
}

/// Polls `future` on this thread until it is ready (within `within`):
/// its output, with the polls it took and the wake-ups it had.
fn block_on_counting<F: Future>(future: F, within: Duration) -> (F::Output, usize, usize) {
    let counter = Arc::new(CountingWaker {
        wakes: AtomicUsize::new(0),
        thread: std::thread::current(),
    });
    let waker = Waker::from(counter.clone());
    let mut context = Context::from_waker(&waker);
    let mut future = pin!(future);
    let deadline = std::time::Instant::now() + within;
    let mut polls = 0;
    loop {
        polls += 1;
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return (output, polls, counter.wakes.load(Ordering::SeqCst));
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "not ready within {within:?}");
        std::thread::park_timeout(left);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_groups_records_are_acknowledged_together_each_at_its_place() {
    let kafka = Tansu::start();
    kafka.create_topic("groups", 1).await;
    let producer = RelayProducer::new(&link(kafka.bootstrap())).unwrap();
    // A first record, so that the group below does not wait for the
    // producer's start.
    producer.send("groups", &record("warm-up")).await.unwrap();

    let mut group = producer.group(50);
    for n in 0..50 {
        assert!(group.enqueue_now("groups", &record(format!("r{n}")), &[("h", b"v")]));
    }
    assert_eq!(group.enqueued(), 50);
    let acks = group.acks();
    let (results, polls, wakes) =
        tokio::task::spawn_blocking(move || block_on_counting(acks, Duration::from_secs(30)))
            .await
            .unwrap();
    let offsets: Vec<i64> = results
        .iter()
        .map(|result| result.as_ref().expect("every record written").offset)
        .collect();
    assert_eq!(
        offsets,
        (1..51).collect::<Vec<_>>(),
        "each result at its record's place, in the order enqueued"
    );
    assert!(
        wakes <= 1 && polls <= 2,
        "the waiter was woken {wakes} times and polled {polls} times for one group"
    );
    let read = kafka
        .consume_all("groups", 51, Duration::from_secs(30))
        .await;
    let values: Vec<String> = read
        .iter()
        .skip(1)
        .map(|r| String::from_utf8(r.value.clone().unwrap()).unwrap())
        .collect();
    assert_eq!(values, (0..50).map(|n| format!("r{n}")).collect::<Vec<_>>());
    assert!(
        read.iter()
            .skip(1)
            .all(|r| r.header("h") == Some(&b"v"[..]))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_record_and_a_place_never_enqueued_settle_their_places() {
    let kafka = Tansu::start();
    kafka.create_topic("refusals", 1).await;
    let producer = RelayProducer::new(&link(kafka.bootstrap())).unwrap();
    let mut group = producer.group(5);
    assert!(group.enqueue_now("refusals", &record("first"), &[]));
    // Over librdkafka's `message.max.bytes` (1 MB): refused at once.
    assert!(group.enqueue_now("refusals", &record(vec![b'x'; 2_000_000]), &[]));
    assert!(group.enqueue_now("refusals", &record("third"), &[]));
    // The last two places are never enqueued (the work was aborted).
    let results = tokio::time::timeout(Duration::from_secs(30), group.acks())
        .await
        .expect("the group settled");
    assert_eq!(results.len(), 5);
    assert!(results[0].is_ok(), "{:?}", results[0]);
    match &results[1] {
        Err(Refused {
            error: KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge),
            record: Some(record),
        }) => assert_eq!(
            record.value.as_ref().map(Vec::len),
            Some(2_000_000),
            "the refused record is handed back, for its dead letter"
        ),
        other => panic!("{other:?}"),
    }
    assert!(results[2].is_ok(), "{:?}", results[2]);
    assert!(
        results[3..].iter().all(|result| matches!(
            result,
            Err(Refused {
                error: KafkaError::Canceled,
                record: None
            })
        )),
        "{:?}",
        &results[3..]
    );
    // A group of none is done at once.
    let nothing = producer.group(0).acks();
    assert!(nothing.await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_destroyed_with_records_in_flight_settles_them() {
    // Nothing listens there: the records stay in librdkafka's queue.
    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = unused.local_addr().unwrap();
    drop(unused);
    let producer = RelayProducer::new(&link(address.to_string())).unwrap();
    let mut group = producer.group(3);
    for n in 0..3 {
        assert!(group.enqueue_now("nowhere", &record(format!("r{n}")), &[]));
    }
    let acks = group.acks();
    let lone = producer
        .enqueue_now_with("nowhere", &record("lone"), &[])
        .expect("room in the queue")
        .expect("enqueued");
    // The last handle: destroying the producer purges its queue.
    tokio::task::spawn_blocking(move || drop(producer))
        .await
        .unwrap();
    let results = tokio::time::timeout(Duration::from_secs(10), acks)
        .await
        .expect("the group settled when its producer was destroyed");
    assert_eq!(results.len(), 3);
    // Purged: each handed back as it was enqueued, for a dead letter.
    for (n, result) in results.iter().enumerate() {
        match result {
            Err(Refused {
                record: Some(record),
                ..
            }) => assert_eq!(record.value.as_deref(), Some(format!("r{n}").as_bytes())),
            other => panic!("record {n}: {other:?}"),
        }
    }
    let lone = tokio::time::timeout(Duration::from_secs(10), lone)
        .await
        .expect("the lone record settled too");
    assert!(lone.is_err(), "{lone:?}");
}
