//! The rdkafka + tansu combination the relay relies on, against a real
//! broker: keyed records with headers through a 3-partition topic and a
//! consumer group that stores offsets by hand and commits them; the
//! committed offsets equal the high watermarks, and a second consumer of the
//! same group resumes where the first stopped, with nothing delivered twice,
//! also when the first stopped in the middle of the topic.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Timestamp;
use support::tansu::{ConsumedRecord, Tansu, TestRecord, unique_group};

use crate::support;

const TOPIC: &str = "smoke";
const PARTITIONS: i32 = 3;
const RECORDS: usize = 1_000;
/// Records produced after the first consumer is gone, per partition.
const LATER_PER_PARTITION: usize = 10;
const DEADLINE: Duration = Duration::from_secs(30);

fn now_ms() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

fn record(seq: usize) -> TestRecord {
    TestRecord::keyed(format!("key-{}", seq % 97), format!("value-{seq}"))
        .header("seq", seq.to_string())
        .header("kind", "smoke")
        .header("binary", vec![0, 0xff, (seq % 256) as u8])
}

/// Checks that a consumed record is `record(seq)` for the seq it names.
fn check(got: &ConsumedRecord, since_ms: i64) -> usize {
    let seq: usize = std::str::from_utf8(got.header("seq").expect("a seq header"))
        .unwrap()
        .parse()
        .unwrap();
    let sent = record(seq);
    assert_eq!(got.key, sent.key, "key of record {seq}");
    assert_eq!(got.value, sent.value, "value of record {seq}");
    assert_eq!(
        got.headers, sent.headers,
        "headers (and their order) of {seq}"
    );
    match got.timestamp {
        Timestamp::CreateTime(ms) => assert!(
            (since_ms - 1_000..=now_ms() + 1_000).contains(&ms),
            "record {seq} has create time {ms}, not within the test run"
        ),
        other => panic!("record {seq} has timestamp {other:?}, expected CreateTime"),
    }
    seq
}

/// Consumes from `consumer` until `count` records arrived, storing the offset
/// of each (`enable.auto.offset.store=false`), then commits synchronously.
/// Panics on a record seen twice (in `seen`) or after [`DEADLINE`].
async fn consume_and_commit(
    consumer: &StreamConsumer,
    count: usize,
    since_ms: i64,
    seen: &mut BTreeMap<usize, (i32, i64)>,
) -> Vec<ConsumedRecord> {
    let deadline = Instant::now() + DEADLINE;
    let mut got = Vec::with_capacity(count);
    while got.len() < count {
        let message = tokio::time::timeout_at(deadline.into(), consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("only {} of {count} records within {DEADLINE:?}", got.len()))
            .expect("consumer error");
        let record = ConsumedRecord::from_message(&message);
        let seq = check(&record, since_ms);
        if let Some(first) = seen.insert(seq, (record.partition, record.offset)) {
            panic!(
                "record {seq} delivered twice: at {first:?} and at {:?}",
                (record.partition, record.offset)
            );
        }
        consumer.store_offset_from_message(&message).unwrap();
        got.push(record);
    }
    consumer.commit_consumer_state(CommitMode::Sync).unwrap();
    got
}

fn group_consumer(kafka: &Tansu, group: &str) -> StreamConsumer {
    let consumer: StreamConsumer = kafka
        .consumer_config(group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[TOPIC]).unwrap();
    consumer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_consumer_commits_stored_offsets_and_a_second_member_resumes_there() {
    let started = Instant::now();
    let since_ms = now_ms();
    let kafka = Tansu::start();
    eprintln!("tansu answered after {:?}", started.elapsed());
    kafka.create_topic(TOPIC, PARTITIONS).await;

    // 1,000 keyed records with headers, all in flight at once.
    let t = Instant::now();
    let delivered = kafka.produce(TOPIC, (0..RECORDS).map(record)).await;
    eprintln!("produced {RECORDS} records in {:?}", t.elapsed());
    let mut per_partition: BTreeMap<i32, i64> = BTreeMap::new();
    for (partition, _) in &delivered {
        *per_partition.entry(*partition).or_default() += 1;
    }
    assert_eq!(
        per_partition.keys().copied().collect::<Vec<_>>(),
        (0..PARTITIONS).collect::<Vec<_>>(),
        "keys spread over every partition"
    );
    let high = kafka.high_watermarks(TOPIC).await;
    assert_eq!(
        high, per_partition,
        "high watermarks = records per partition"
    );

    // First member: every record once, offsets stored by hand and committed.
    let group = unique_group("smoke");
    let t = Instant::now();
    let mut seen = BTreeMap::new();
    let first = group_consumer(&kafka, &group);
    consume_and_commit(&first, RECORDS, since_ms, &mut seen).await;
    eprintln!(
        "consumed and committed {RECORDS} records in {:?}",
        t.elapsed()
    );
    assert_eq!(seen.len(), RECORDS);
    for (seq, (partition, offset)) in &seen {
        assert_eq!(
            delivered[*seq],
            (*partition, *offset),
            "record {seq} read where it was delivered"
        );
    }
    assert_eq!(kafka.committed_offsets(&group, TOPIC).await, high);
    drop(first); // closes the consumer: leaves the group

    // More records, then a second member of the same group: it starts at the
    // committed offsets, so it gets exactly the new ones. Any redelivery of
    // an old record would come before the new ones of its partition.
    let later = (RECORDS..RECORDS + LATER_PER_PARTITION * PARTITIONS as usize)
        .map(|seq| record(seq).in_partition(i32::try_from(seq % PARTITIONS as usize).unwrap()));
    kafka.produce(TOPIC, later).await;
    let t = Instant::now();
    let second = group_consumer(&kafka, &group);
    let resumed = consume_and_commit(
        &second,
        LATER_PER_PARTITION * PARTITIONS as usize,
        since_ms,
        &mut seen,
    )
    .await;
    eprintln!(
        "second member resumed and read {} records in {:?}",
        resumed.len(),
        t.elapsed()
    );
    for record in &resumed {
        assert!(
            record.offset >= high[&record.partition],
            "offset {} of partition {} was before the committed offset {}",
            record.offset,
            record.partition,
            high[&record.partition]
        );
    }
    let high_after = kafka.high_watermarks(TOPIC).await;
    assert_eq!(
        high_after,
        high.iter()
            .map(|(p, h)| (*p, h + LATER_PER_PARTITION as i64))
            .collect()
    );
    assert_eq!(kafka.committed_offsets(&group, TOPIC).await, high_after);
    drop(second);

    // The helper reading from the beginning sees everything, nothing more.
    let all = RECORDS + LATER_PER_PARTITION * PARTITIONS as usize;
    let everything = kafka
        .consume_all(TOPIC, all + 1, Duration::from_secs(1))
        .await;
    assert_eq!(everything.len(), all);
    eprintln!("whole test took {:?}", started.elapsed());
}

/// tansu skips the rest of a record batch when a fetch starts inside it; the
/// harness produces one record per batch so that a commit after any record
/// is a correct resume point. A member that commits part-way and leaves is
/// followed by one that gets exactly the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_resumes_from_a_commit_in_the_middle_of_a_partition() {
    const TOTAL: usize = 300;
    const FIRST: usize = 123;
    let since_ms = now_ms();
    let kafka = Tansu::start();
    kafka.create_topic(TOPIC, 1).await;
    kafka.produce(TOPIC, (0..TOTAL).map(record)).await;

    let group = unique_group("midway");
    let mut seen = BTreeMap::new();
    let first = group_consumer(&kafka, &group);
    consume_and_commit(&first, FIRST, since_ms, &mut seen).await;
    drop(first);
    let committed = kafka.committed_offsets(&group, TOPIC).await;
    assert_eq!(committed, BTreeMap::from([(0, FIRST as i64)]));

    let second = group_consumer(&kafka, &group);
    let rest = consume_and_commit(&second, TOTAL - FIRST, since_ms, &mut seen).await;
    assert_eq!(
        rest[0].offset, FIRST as i64,
        "resumed at the committed offset"
    );
    let offsets: Vec<i64> = rest.iter().map(|r| r.offset).collect();
    assert_eq!(offsets, (FIRST as i64..TOTAL as i64).collect::<Vec<_>>());
    assert_eq!(seen.len(), TOTAL);
    assert_eq!(
        kafka.committed_offsets(&group, TOPIC).await,
        kafka.high_watermarks(TOPIC).await
    );
}
