//! Keeping a flow's order through the retries of cluster deliveries.
//!
//! A cluster delivery is handed over in the partition's order, and its
//! acknowledgement is awaited off the ordered path, so that a process can
//! have many deliveries in flight. A failed attempt is retried after a
//! (jittered) pause; left alone, a retry could be overtaken by the next
//! deliveries of its key, or overtake another retry.
//!
//! The deliveries that must keep their order form a *line*: those to one
//! process from one topic partition, and with `key` ordering (the default)
//! of one key; with `none` ordering there are no lines. Each delivery takes
//! a [`Place`] in its line before its first attempt. While nothing in a
//! line has failed, a place never waits. Once an attempt fails, the line
//! *recovers*: until every place taken before the failure is settled
//! (delivered, given up or aborted), a place attempts (a retry, or a new
//! delivery's first attempt) only when every earlier place is settled: one
//! at a time, in order. So a process receives a line's messages in order,
//! retries included, except that a message it had received before its
//! connection was lost may come again (with the same delivery id) before
//! the ones after it. What this cannot mend: a process that refuses (nacks)
//! a message while it already holds the next ones of the line gets the
//! refused one again after them.
//!
//! Lines are found by a hash of what names them; two lines whose hashes
//! collide are one line, which only orders more. A line exists while it
//! has unsettled places, so the memory is that of the deliveries in flight.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher as _, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::kafka::{DeliveryOrder, InputRecord};

/// The lines of one flow's cluster deliveries.
#[derive(Debug)]
pub struct DeliveryLines {
    order: DeliveryOrder,
    hasher: RandomState,
    lines: Mutex<HashMap<u64, Line>>,
    /// Woken when a recovering line settles a place.
    turns: Notify,
}

/// One line: its places not settled yet, in the order taken.
#[derive(Debug, Default)]
struct Line {
    /// The number the next place gets.
    next: u64,
    /// The places not settled, ascending.
    unsettled: VecDeque<u64>,
    /// Recovering until every place up to this one is settled.
    recovering_until: Option<u64>,
}

impl Line {
    /// Whether place `number` may attempt now: it is the oldest unsettled
    /// place, or it is a first attempt and the line is healthy.
    fn may_go(&self, number: u64, first: bool) -> bool {
        self.unsettled.front() == Some(&number) || (first && self.recovering_until.is_none())
    }
}

/// A delivery's place in its line, settled when dropped.
#[derive(Debug)]
pub struct Place {
    lines: Arc<DeliveryLines>,
    /// The line and the place's number; `None`: the flow keeps no order.
    at: Option<(u64, u64)>,
}

impl DeliveryLines {
    /// The lines of a flow with `order`.
    pub fn new(order: DeliveryOrder) -> Arc<DeliveryLines> {
        Arc::new(DeliveryLines {
            order,
            hasher: RandomState::new(),
            lines: Mutex::new(HashMap::new()),
            turns: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Line>> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The line of a delivery of `input` to `process_id`.
    fn line_of(&self, process_id: &str, input: &InputRecord) -> Option<u64> {
        let partition = (process_id, input.topic.as_str(), input.partition);
        match self.order {
            DeliveryOrder::None => None,
            DeliveryOrder::Partition => Some(self.hasher.hash_one(partition)),
            DeliveryOrder::Key => Some(self.hasher.hash_one((partition, input.key.as_deref()))),
        }
    }

    /// Takes a place for a delivery of `input` to `process_id` now; the
    /// future resolves when its first attempt may go (at once unless the
    /// line recovers). Dropping the future gives the place up.
    pub fn join(
        self: &Arc<Self>,
        process_id: &str,
        input: &InputRecord,
    ) -> impl Future<Output = Place> + Send + 'static + use<> {
        let at = self.line_of(process_id, input).map(|line| {
            let mut lines = self.lock();
            let entry = lines.entry(line).or_default();
            let number = entry.next;
            entry.next += 1;
            entry.unsettled.push_back(number);
            (line, number)
        });
        let place = Place {
            lines: self.clone(),
            at,
        };
        async move {
            if let Some((line, number)) = place.at {
                place.lines.wait_turn(line, number, true).await;
            }
            place
        }
    }

    async fn wait_turn(&self, line: u64, number: u64, first: bool) {
        loop {
            let notified = self.turns.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a settle in between wakes it.
            notified.as_mut().enable();
            if self
                .lock()
                .get(&line)
                .is_none_or(|l| l.may_go(number, first))
            {
                return;
            }
            notified.await;
        }
    }

    /// How many lines have unsettled places (for tests and stats).
    pub fn lines(&self) -> usize {
        self.lock().len()
    }
}

impl Place {
    /// An attempt failed: the line recovers until every place taken so far
    /// is settled.
    pub fn failed(&self) {
        let Some((line, _)) = self.at else { return };
        let mut lines = self.lines.lock();
        if let Some(line) = lines.get_mut(&line) {
            let last = line.next.saturating_sub(1);
            line.recovering_until = Some(line.recovering_until.map_or(last, |b| b.max(last)));
        }
    }

    /// Waits until this place may attempt again: every earlier place of its
    /// line is settled.
    pub async fn turn(&self) {
        if let Some((line, number)) = self.at {
            self.lines.wait_turn(line, number, false).await;
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let Some((key, number)) = self.at else { return };
        let woke = {
            let mut lines = self.lines.lock();
            let Some(line) = lines.get_mut(&key) else {
                return;
            };
            if let Ok(i) = line.unsettled.binary_search(&number) {
                line.unsettled.remove(i);
            }
            let recovering = line.recovering_until.is_some();
            if let Some(until) = line.recovering_until
                && line.unsettled.front().is_none_or(|&oldest| oldest > until)
            {
                line.recovering_until = None;
            }
            if line.unsettled.is_empty() {
                lines.remove(&key);
            }
            recovering
        };
        if woke {
            self.lines.turns.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::FutureExt as _;

    use super::*;

    fn input(partition: i32, key: &str) -> InputRecord {
        InputRecord {
            topic: "business".to_string(),
            partition,
            offset: 0,
            key: Some(key.as_bytes().to_vec()),
            value: None,
            headers: Vec::new(),
            timestamp_ms: None,
        }
    }

    /// Whether `future` is still waiting after the runtime had a moment.
    async fn waits<F: Future>(future: &mut std::pin::Pin<Box<F>>) -> bool {
        tokio::time::timeout(Duration::from_millis(20), future.as_mut())
            .await
            .is_err()
    }

    #[tokio::test]
    async fn a_healthy_line_never_waits_and_is_gone_once_settled() {
        let lines = DeliveryLines::new(DeliveryOrder::Key);
        let places: Vec<Place> =
            futures::future::join_all((0..5).map(|_| lines.join("p", &input(0, "k")))).await;
        assert_eq!(lines.lines(), 1);
        drop(places);
        assert_eq!(lines.lines(), 0, "no line is kept once its places settle");
    }

    #[tokio::test]
    async fn after_a_failure_places_go_one_at_a_time_in_order() {
        let lines = DeliveryLines::new(DeliveryOrder::Key);
        let first = lines.join("p", &input(0, "k")).await;
        let second = lines.join("p", &input(0, "k")).await;
        // The second's attempt fails while the first is still in flight:
        // its retry waits for the first to settle.
        second.failed();
        let mut retry = Box::pin(second.turn());
        assert!(waits(&mut retry).await, "a retry overtook an earlier place");
        // A new delivery waits for both (the line recovers).
        let mut third = Box::pin(lines.join("p", &input(0, "k")));
        assert!(waits(&mut third).await, "a new delivery overtook a retry");
        drop(first);
        assert!(!waits(&mut retry).await, "the oldest unsettled place goes");
        drop(retry);
        assert!(waits(&mut third).await);
        drop(second);
        let third = third.now_or_never().expect("goes once the line is settled");
        // Recovered: the line pipelines again.
        let fourth = lines.join("p", &input(0, "k")).now_or_never();
        assert!(fourth.is_some());
        drop((third, fourth));
        assert_eq!(lines.lines(), 0);
    }

    #[tokio::test]
    async fn a_place_taken_before_the_failure_keeps_the_line_recovering() {
        let lines = DeliveryLines::new(DeliveryOrder::Key);
        let first = lines.join("p", &input(0, "k")).await;
        let second = lines.join("p", &input(0, "k")).await;
        // The first fails and is then delivered by its retry; the second,
        // handed over before the failure, is still out: a new delivery
        // waits for it (it may fail too, and must not be overtaken).
        first.failed();
        first
            .turn()
            .now_or_never()
            .expect("the oldest goes at once");
        drop(first);
        let mut third = Box::pin(lines.join("p", &input(0, "k")));
        assert!(waits(&mut third).await);
        drop(second);
        assert!(third.now_or_never().is_some());
    }

    #[tokio::test]
    async fn other_keys_partitions_and_processes_are_other_lines() {
        let lines = DeliveryLines::new(DeliveryOrder::Key);
        let stuck = lines.join("p", &input(0, "k")).await;
        let _later = lines.join("p", &input(0, "k")).await;
        stuck.failed();
        for (process, partition, key) in [("p", 0, "other"), ("p", 1, "k"), ("q", 0, "k")] {
            assert!(
                lines
                    .join(process, &input(partition, key))
                    .now_or_never()
                    .is_some(),
                "{process}/{partition}/{key} waited for another line"
            );
        }
        // With partition ordering, every key of the partition is one line.
        let lines = DeliveryLines::new(DeliveryOrder::Partition);
        let stuck = lines.join("p", &input(0, "k")).await;
        stuck.failed();
        let mut other_key = Box::pin(lines.join("p", &input(0, "other")));
        assert!(waits(&mut other_key).await);
        drop(stuck);
        assert!(other_key.now_or_never().is_some());
        // With no ordering there are no lines.
        let lines = DeliveryLines::new(DeliveryOrder::None);
        let stuck = lines.join("p", &input(0, "k")).await;
        stuck.failed();
        assert!(lines.join("p", &input(0, "k")).now_or_never().is_some());
        assert_eq!(lines.lines(), 0);
    }

    #[tokio::test]
    async fn giving_up_a_waiting_place_lets_the_next_go() {
        let lines = DeliveryLines::new(DeliveryOrder::Key);
        let first = lines.join("p", &input(0, "k")).await;
        first.failed();
        let mut second = Box::pin(lines.join("p", &input(0, "k")));
        assert!(waits(&mut second).await);
        // A third waits too; the second is aborted while it waits.
        let mut third = Box::pin(lines.join("p", &input(0, "k")));
        assert!(waits(&mut third).await);
        drop(second);
        drop(first);
        assert!(third.now_or_never().is_some());
        assert_eq!(lines.lines(), 0);
    }
}
