//! The route publisher: writes this node's routes and tombstones to the
//! routes topic, in the order it looks at its processes. It looks at a
//! process when its registration here changed ([`RegistrationChanges`]: a
//! set, so a process that reconnects many times while Kafka is out of
//! reach is looked at once), and when the table asks for its route again
//! (anti-entropy, the holder's last word, a peer's lookup).
//!
//! What it writes is decided when it looks, from the state then, never
//! from an old copy: a record Kafka refused after taking it is not sent
//! again as it was (a later record of the same process may have landed
//! meanwhile, and compaction keeps the last), but its process is looked at
//! again in order with the rest: the route of a process still here, the
//! tombstone of one still gone.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{REPUBLISH_TURN, ROUTE_GENERATION_HEADER, RouteTable, lock};
use crate::gateway::RegistrationChanges;
use crate::kafka::OutputRecord;
use crate::kafka::producer::Delivered;
use crate::link::KafkaLink;

/// Where the publisher writes route records: the cluster's Kafka link (a
/// test may give a sink of its own).
pub trait RouteSink: Send + Sync + 'static {
    /// Enqueues `record` on `topic`, in call order, resolving to the wait
    /// for its acknowledgement; an error when it could not be enqueued.
    fn enqueue(
        &self,
        topic: &str,
        record: &OutputRecord,
    ) -> BoxFuture<'static, Result<AckWait, String>>;
}

/// The wait for a route record's acknowledgement: where it landed, or why
/// it did not.
pub type AckWait = BoxFuture<'static, Result<Delivered, String>>;

impl RouteSink for KafkaLink {
    fn enqueue(
        &self,
        topic: &str,
        record: &OutputRecord,
    ) -> BoxFuture<'static, Result<AckWait, String>> {
        let producer = self.producer();
        let topic = topic.to_string();
        let record = record.clone();
        Box::pin(async move {
            match producer.enqueue(&topic, &record).await {
                Ok(ack) => {
                    Ok(Box::pin(async move { ack.await.map_err(|e| e.to_string()) }) as AckWait)
                }
                Err(error) => Err(error.to_string()),
            }
        })
    }
}

/// Publishes this node's registration changes (from the gateway), and the
/// routes the table asks to write again, to the routes topic until
/// `shutdown`. A record Kafka does not take is retried; one it refused
/// after taking it is not sent again as it was (a later record of its
/// process may have landed meanwhile) but looked at again in order: the
/// route of a process still here, the tombstone of one still gone.
pub async fn publish_routes(
    table: Arc<RouteTable>,
    sink: Arc<dyn RouteSink>,
    topic: String,
    registrations: Arc<RegistrationChanges>,
    shutdown: CancellationToken,
) {
    // Acknowledgements are awaited aside, each in a task of its own.
    let acks = TaskTracker::new();
    let publisher = Publisher {
        table: &table,
        sink: &sink,
        topic: &topic,
        acks: &acks,
        shutdown: &shutdown,
    };
    publisher.run(&registrations).await;
    acks.close();
    acks.wait().await;
}

/// Processes whose registration changed, taken per turn.
const REGISTRATIONS_TURN: usize = 256;

/// What the publisher does next.
enum Next {
    Registrations,
    Republish,
}

struct Publisher<'a> {
    table: &'a Arc<RouteTable>,
    sink: &'a Arc<dyn RouteSink>,
    topic: &'a str,
    acks: &'a TaskTracker,
    shutdown: &'a CancellationToken,
}

impl Publisher<'_> {
    /// Writes the records of registration changes and of the routes to
    /// write again, in the order it looks at them, until `shutdown`.
    async fn run(&self, registrations: &RegistrationChanges) {
        loop {
            let next = tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => return,
                _ = registrations.added() => Next::Registrations,
                _ = self.table.republish.added() => Next::Republish,
            };
            let more = match next {
                Next::Registrations => {
                    let (changes, more) = registrations.take(REGISTRATIONS_TURN);
                    for (process_id, connection) in changes {
                        if !self.registration_changed(process_id, connection).await {
                            return;
                        }
                    }
                    if more {
                        registrations.wake();
                    }
                    continue;
                }
                Next::Republish => {
                    let (processes, more) = self.table.take_republish(REPUBLISH_TURN);
                    for process_id in processes {
                        if !self.write_again(process_id).await {
                            return;
                        }
                    }
                    more
                }
            };
            if more {
                self.table.republish.wake();
            }
        }
    }

    /// Publishes that `process_id` is connected here on `connection` now
    /// (`None`: no longer): its route, its tombstone, or nothing when that
    /// is what was published last. False on shutdown.
    async fn registration_changed(&self, process_id: String, connection: Option<u64>) -> bool {
        let published = self.table.local_connection(&process_id);
        match (connection, published) {
            (Some(now), Some(before)) if now == before => true,
            (Some(connection_id), _) => {
                let registered_at_ms = crate::cluster::now_ms();
                let generation =
                    self.table
                        .next_generation(&process_id, registered_at_ms, connection_id);
                let record = self
                    .table
                    .route_record(&process_id, registered_at_ms, generation);
                self.write(process_id, record, Some((connection_id, generation)))
                    .await
            }
            (None, Some(connection_id)) => match self.table.goodbye(&process_id, connection_id) {
                Some(record) => self.write(process_id, record, None).await,
                None => true,
            },
            (None, None) => true,
        }
    }

    /// Writes the route of `process_id` again if it is still connected
    /// here (checked now, in order with the registrations: a process gone
    /// since gets no route after its goodbye), else a refused tombstone of
    /// it again if one is still due. False on shutdown.
    async fn write_again(&self, process_id: String) -> bool {
        if let Some((record, connection)) = self.table.route_again(&process_id) {
            lock(&self.table.goodbyes_again).remove(&process_id);
            return self.write(process_id, record, Some(connection)).await;
        }
        match self.table.goodbye_again(&process_id) {
            Some(record) => self.write(process_id, record, None).await,
            None => true,
        }
    }

    /// Enqueues `record` (the route or tombstone of `process_id`) in call
    /// order and waits for its acknowledgement aside, noting where a route
    /// of `connection` (its id and generation) landed; false on shutdown.
    async fn write(
        &self,
        process_id: String,
        record: OutputRecord,
        connection: Option<(u64, u64)>,
    ) -> bool {
        let ack = loop {
            match self.sink.enqueue(self.topic, &record).await {
                Ok(ack) => break ack,
                Err(error) => {
                    tracing::warn!(topic = %self.topic, process = %process_id, %error, "writing a route failed; retrying");
                    tokio::select! {
                        _ = self.shutdown.cancelled() => return false,
                        _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                }
            }
        };
        let table = self.table.clone();
        let topic = self.topic.to_string();
        let generation_of_tombstone = match connection {
            Some(_) => None,
            None => tombstone_generation(&record),
        };
        self.acks.spawn(async move {
            match ack.await {
                Ok(delivered) => {
                    table.wrote(
                        &process_id,
                        delivered.partition,
                        delivered.offset,
                        generation_of_tombstone,
                    );
                    if let Some((connection_id, generation)) = connection {
                        table.local_registered(
                            &process_id,
                            connection_id,
                            (generation, delivered.partition, delivered.offset),
                        );
                    }
                }
                Err(error) => {
                    // Not sent again as it was: a later record of the
                    // process may have landed since. Looked at again in
                    // order with the rest.
                    tracing::warn!(%topic, process = %process_id, %error, "a route record was not written; looking at the process again");
                    match generation_of_tombstone {
                        Some(generation) => table.request_goodbye_again(&process_id, generation),
                        None => table.request_republish(std::iter::once(process_id.as_str())),
                    }
                }
            }
        });
        true
    }
}

/// The generation a tombstone written by this node ends (its header).
fn tombstone_generation(record: &OutputRecord) -> Option<u64> {
    record
        .headers
        .iter()
        .find(|(name, _)| name == ROUTE_GENERATION_HEADER)
        .and_then(|(_, value)| std::str::from_utf8(value).ok()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tokio::sync::{oneshot, watch};

    use super::super::tests::table;
    use super::*;

    type AckSender = oneshot::Sender<Result<Delivered, String>>;

    /// A routes topic whose acknowledgements the test gives, and which can
    /// be made to take nothing (Kafka out of reach).
    struct Topic {
        written: Mutex<Vec<(OutputRecord, Option<AckSender>)>>,
        open: watch::Sender<bool>,
    }

    #[derive(Clone)]
    struct FakeSink(Arc<Topic>);

    impl RouteSink for FakeSink {
        fn enqueue(
            &self,
            _topic: &str,
            record: &OutputRecord,
        ) -> BoxFuture<'static, Result<AckWait, String>> {
            let topic = self.0.clone();
            let record = record.clone();
            Box::pin(async move {
                let mut open = topic.open.subscribe();
                let _ = open.wait_for(|open| *open).await;
                let (ack, acked) = oneshot::channel();
                topic.written.lock().unwrap().push((record, Some(ack)));
                Ok(
                    Box::pin(async move { acked.await.unwrap_or_else(|_| Err("dropped".into())) })
                        as AckWait,
                )
            })
        }
    }

    impl FakeSink {
        fn new() -> FakeSink {
            FakeSink(Arc::new(Topic {
                written: Mutex::default(),
                open: watch::channel(true).0,
            }))
        }

        /// What was written: process and, for a route, true.
        fn written(&self) -> Vec<(String, bool)> {
            self.0
                .written
                .lock()
                .unwrap()
                .iter()
                .map(|(record, _)| {
                    (
                        String::from_utf8(record.key.clone().unwrap()).unwrap(),
                        record.value.is_some(),
                    )
                })
                .collect()
        }

        fn generation(&self, index: usize) -> u64 {
            let written = self.0.written.lock().unwrap();
            let record = &written[index].0;
            match &record.value {
                Some(value) => {
                    serde_json::from_slice::<super::super::RouteValue>(value)
                        .unwrap()
                        .generation
                }
                None => tombstone_generation(record).unwrap(),
            }
        }

        /// Acknowledges record `index` (or refuses it).
        fn ack(&self, index: usize, ok: bool) {
            let ack = self.0.written.lock().unwrap()[index].1.take().unwrap();
            let _ = ack.send(if ok {
                Ok(Delivered {
                    partition: 0,
                    offset: i64::try_from(index).unwrap(),
                })
            } else {
                Err("Broker: Message size too large".into())
            });
        }
    }

    struct Running {
        sink: FakeSink,
        registrations: Arc<RegistrationChanges>,
        stop: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    fn start() -> Running {
        let sink = FakeSink::new();
        let registrations = Arc::new(RegistrationChanges::default());
        let stop = CancellationToken::new();
        // Awaited in `Running::stop`.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(publish_routes(
            table(),
            Arc::new(sink.clone()),
            "routes".into(),
            registrations.clone(),
            stop.clone(),
        ));
        Running {
            sink,
            registrations,
            stop,
            task,
        }
    }

    /// Lets every task run until nothing is ready (the clock is paused).
    async fn settle() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    fn route(process: &str) -> (String, bool) {
        (process.to_string(), true)
    }

    fn tombstone(process: &str) -> (String, bool) {
        (process.to_string(), false)
    }

    impl Running {
        async fn stop(self) {
            self.stop.cancel();
            // Unanswered acknowledgements end (as refusals) for the
            // publisher to finish waiting for them.
            for (_, ack) in self.sink.0.written.lock().unwrap().iter_mut() {
                drop(ack.take());
            }
            self.task.await.unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_route_is_not_written_again_after_the_goodbye_that_followed_it() {
        let running = start();
        running.registrations.add("p", Some(1));
        settle().await;
        running.registrations.add("p", None);
        settle().await;
        assert_eq!(running.sink.written(), [route("p"), tombstone("p")]);
        running.sink.ack(1, true);
        // Refused after the tombstone was taken: sending the route again
        // would put it after the tombstone, routing a process that left.
        running.sink.ack(0, false);
        settle().await;
        assert_eq!(running.sink.written(), [route("p"), tombstone("p")]);
        running.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_route_of_a_process_still_here_is_written_again() {
        let running = start();
        running.registrations.add("p", Some(1));
        settle().await;
        running.sink.ack(0, false);
        settle().await;
        assert_eq!(running.sink.written(), [route("p"), route("p")]);
        assert_eq!(running.sink.generation(1), running.sink.generation(0));
        running.sink.ack(1, true);
        running.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_tombstone_is_written_again_unless_the_process_came_back() {
        let running = start();
        running.registrations.add("p", Some(1));
        settle().await;
        running.registrations.add("p", None);
        settle().await;
        running.sink.ack(0, true);
        running.sink.ack(1, false);
        settle().await;
        assert_eq!(
            running.sink.written(),
            [route("p"), tombstone("p"), tombstone("p")]
        );
        assert_eq!(running.sink.generation(2), running.sink.generation(0));
        running.sink.ack(2, true);

        // The process registers again before its refused tombstone is
        // looked at: its new route stands, with no tombstone after it.
        running.registrations.add("q", Some(2));
        settle().await;
        running.registrations.add("q", None);
        settle().await;
        running.registrations.add("q", Some(3));
        settle().await;
        running.sink.ack(3, true);
        running.sink.ack(5, true);
        running.sink.ack(4, false);
        settle().await;
        // (Looked at again, the process's current route is written again:
        // redundant, and harmless.)
        let written = running.sink.written();
        assert_eq!(written[3..6], [route("q"), tombstone("q"), route("q")]);
        assert!(
            written[6..].iter().all(|(_, is_route)| *is_route),
            "a tombstone after the new route: {written:?}"
        );
        running.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_process_reconnecting_while_kafka_is_out_of_reach_waits_once() {
        let running = start();
        running.sink.0.open.send_replace(false);
        running.registrations.add("p", Some(1));
        settle().await;
        for connection in 2..=10_000 {
            running.registrations.add("p", Some(connection));
            running.registrations.add("p", None);
        }
        running.registrations.add("p", Some(10_001));
        // The publisher holds the first change; the rest is one entry.
        assert_eq!(running.registrations.len(), 1);
        running.sink.0.open.send_replace(true);
        settle().await;
        // The route it was writing when Kafka went away, then the state
        // now: connected on 10,001.
        assert_eq!(running.sink.written(), [route("p"), route("p")]);
        assert!(running.sink.generation(1) > running.sink.generation(0));
        running.stop().await;
    }
}
