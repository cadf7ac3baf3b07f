//! A new producer's first records, against a real broker: the relay's
//! producer is idempotent, and librdkafka (unpatched) asks for its producer
//! id on a 500 ms timer when no broker connection is up yet, which at start
//! it never is. Every record produced in the meantime waited: a relay that
//! had just started (or had switched to a new Kafka) held its first
//! records for 0.5-1 s (`bench/RESULTS.md`, "The producer's first 500 ms").
//! The vendored librdkafka asks again as soon as a connection is up
//! (`vendor/librdkafka-idempotent-producer-first-pid.patch`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use wasmrelay::kafka::{LinkInfo, OutputRecord, RelayProducer};

use crate::support::tansu::Tansu;

const TOPIC: &str = "first-records";
/// Fresh producers measured; the median of their first acknowledgements is
/// checked, so one slow start (a loaded machine) does not fail the test.
const PRODUCERS: usize = 5;
/// Well under the 500 ms librdkafka's timer waits without the patch
/// (502-503 ms each), and far over what a first record takes with it on
/// loopback (54 ms: one 50 ms retry, then the connection that comes up).
const BOUND: Duration = Duration::from_millis(250);

#[tokio::test]
async fn a_new_producers_first_record_is_acknowledged_without_waiting_for_a_timer() {
    let kafka = Tansu::start();
    kafka.create_topic(TOPIC, 1).await;
    let link = LinkInfo {
        bootstrap_servers: kafka.bootstrap(),
        options: BTreeMap::from([("broker.address.family".to_string(), "v4".to_string())]),
    };
    let record = OutputRecord {
        key: Some(b"k".to_vec()),
        value: Some(b"first".to_vec()),
        headers: Vec::new(),
    };
    let mut took = Vec::new();
    for _ in 0..PRODUCERS {
        let started = Instant::now();
        let producer = RelayProducer::new(&link).unwrap();
        tokio::time::timeout(Duration::from_secs(30), producer.send(TOPIC, &record))
            .await
            .expect("the first record acknowledged within 30 s")
            .expect("the first record written");
        took.push(started.elapsed());
    }
    took.sort();
    let median = took[PRODUCERS / 2];
    eprintln!("first records acknowledged after {took:?}");
    assert!(
        median < BOUND,
        "a new producer's first record took {median:?} (median; all: {took:?}), \
         not under {BOUND:?}: is librdkafka's producer-id patch gone from vendor/?"
    );
}
