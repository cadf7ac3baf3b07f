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
//! a [`Place`] in its line, in the partition's order, before its first
//! attempt. While nothing in a line has failed, a place goes at once (the
//! ones before it are handed over already). Once an attempt fails, the line
//! *recovers*: until every place taken before the failure is settled
//! (delivered, given up or aborted), a place attempts (a retry, or a new
//! delivery's first attempt) only when every earlier place is settled: one
//! at a time, in order. Afterwards, places that waited go in their order,
//! each once the one before it is handed over. So a process receives a
//! line's messages in order, retries included, except that a message it had
//! received before its connection was lost may come again (with the same
//! delivery id) before the ones after it. What this cannot mend: a process
//! that refuses (nacks) a message while it already holds the next ones of
//! the line gets the refused one again after them.
//!
//! Lines are found by a hash of what names them; two lines whose hashes
//! collide are one line, which only orders more. A line exists while it
//! has unsettled places, so the memory is that of the deliveries in flight.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher as _, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;

use crate::kafka::{DeliveryOrder, InputRecord};

/// The lines of one flow's cluster deliveries.
#[derive(Debug)]
pub struct DeliveryLines {
    order: DeliveryOrder,
    hasher: RandomState,
    lines: Mutex<HashMap<u64, Line>>,
    /// The lines recovering now.
    recovering: Gauge,
}

/// An unsettled place: its number, whether its first attempt has handed
/// the message over, and how to wake it while it waits for its turn.
#[derive(Debug)]
struct Unsettled {
    number: u64,
    handed_over: bool,
    /// Set while the place waits (waiting is the exception).
    wake: Option<Arc<Notify>>,
}

/// One line: its places not settled yet, in the order taken.
#[derive(Debug, Default)]
struct Line {
    /// The number the next place gets.
    next: u64,
    /// The places not settled, by ascending number.
    unsettled: VecDeque<Unsettled>,
    /// How many of them have not handed their message over (0 in the
    /// common case: then a new place goes at once without a look at them).
    not_handed_over: usize,
    /// Recovering until every place up to this one is settled.
    recovering_until: Option<u64>,
}

impl Line {
    /// Whether place `number` may attempt now: it is the oldest unsettled
    /// place; or, for a first attempt, the line is healthy and every
    /// earlier place has handed its message over.
    fn may_go(&self, number: u64, first: bool) -> bool {
        if self.unsettled.front().map(|u| u.number) == Some(number) {
            return true;
        }
        first
            && self.recovering_until.is_none()
            && self
                .unsettled
                .iter()
                .take_while(|u| u.number < number)
                .all(|u| u.handed_over)
    }

    /// Wakes the one place that may go after a change, if it waits: the
    /// oldest while the line recovers, else the first that has not handed
    /// its message over. (Only one place can be let go by a change, so
    /// waking the others would only make them look again.)
    fn wake_next(&self) {
        debug_assert_eq!(
            self.not_handed_over,
            self.unsettled.iter().filter(|u| !u.handed_over).count(),
            "the count of places not handed over"
        );
        let next = if self.recovering_until.is_some() {
            self.unsettled.front()
        } else if self.not_handed_over == 0 {
            None
        } else {
            self.unsettled.iter().find(|u| !u.handed_over)
        };
        if let Some(wake) = next.and_then(|u| u.wake.as_ref()) {
            wake.notify_one();
        }
    }

    fn find(&mut self, number: u64) -> Option<usize> {
        self.unsettled
            .binary_search_by_key(&number, |u| u.number)
            .ok()
    }
}

/// A delivery's place in its line, settled when dropped.
#[derive(Debug)]
pub struct Place {
    lines: Arc<DeliveryLines>,
    /// The line and the place's number; `None`: the flow keeps no order.
    at: Option<(u64, u64)>,
    /// It went at once when taken (and counts as handed over).
    goes_at_once: bool,
}

impl DeliveryLines {
    /// The lines of a flow with `order`; `recovering` counts the lines
    /// recovering from a failure.
    pub fn new(order: DeliveryOrder, recovering: Gauge) -> Arc<DeliveryLines> {
        Arc::new(DeliveryLines {
            order,
            hasher: RandomState::new(),
            lines: Mutex::new(HashMap::new()),
            recovering,
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Line>> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The line of a delivery of `input` to `process_id`.
    fn line_of(&self, process_id: &str, input: &InputRecord) -> Option<u64> {
        let partition = (process_id, &*input.topic, input.partition);
        match self.order {
            DeliveryOrder::None => None,
            DeliveryOrder::Partition => Some(self.hasher.hash_one(partition)),
            DeliveryOrder::Key => Some(self.hasher.hash_one((partition, input.key.as_deref()))),
        }
    }

    /// Takes the next place in the line of a delivery of `input` to
    /// `process_id` (call in the partition's order). A place that may go at
    /// once ([`Place::goes_at_once`]) counts as handed over from here: the
    /// caller hands its message over before the partition's next record of
    /// the line starts (the lane keeps them one after the other), so one
    /// lock serves the common case.
    pub fn take(self: &Arc<Self>, process_id: &str, input: &InputRecord) -> Place {
        let Some(line) = self.line_of(process_id, input) else {
            return Place {
                lines: self.clone(),
                at: None,
                goes_at_once: true,
            };
        };
        let mut lines = self.lock();
        let entry = lines.entry(line).or_default();
        let number = entry.next;
        entry.next += 1;
        let goes_at_once = entry.recovering_until.is_none() && entry.not_handed_over == 0;
        if !goes_at_once {
            entry.not_handed_over += 1;
        }
        entry.unsettled.push_back(Unsettled {
            number,
            handed_over: goes_at_once,
            wake: None,
        });
        drop(lines);
        Place {
            lines: self.clone(),
            at: Some((line, number)),
            goes_at_once,
        }
    }

    /// Whether place `number` of `line` may go now.
    fn may_go(&self, line: u64, number: u64, first: bool) -> bool {
        self.lock()
            .get(&line)
            .is_none_or(|l| l.may_go(number, first))
    }

    /// Waits until place `number` of `line` may go; true when it had to.
    async fn wait_turn(&self, line: u64, number: u64, first: bool) -> bool {
        let mut waited = false;
        loop {
            let wake = {
                let mut lines = self.lock();
                let Some(l) = lines.get_mut(&line) else {
                    return waited;
                };
                if l.may_go(number, first) {
                    return waited;
                }
                let Some(i) = l.find(number) else {
                    return waited;
                };
                // `notify_one` keeps a permit for a waiter not yet waiting,
                // so a change after the lock is released still wakes it.
                l.unsettled[i]
                    .wake
                    .get_or_insert_with(|| Arc::new(Notify::new()))
                    .clone()
            };
            wake.notified().await;
            waited = true;
        }
    }

    /// How many lines have unsettled places (for tests and stats).
    pub fn lines(&self) -> usize {
        self.lock().len()
    }

    /// How many lines recover from a failure (their deliveries go one at a
    /// time).
    pub fn recovering(&self) -> usize {
        self.lock()
            .values()
            .filter(|line| line.recovering_until.is_some())
            .count()
    }
}

impl Place {
    /// Whether its first attempt goes at once, as decided when it was taken
    /// (the line healthy, every earlier place handed over); otherwise it
    /// waits for [`Self::first_turn`] and then calls [`Self::handed_over`].
    pub fn goes_at_once(&self) -> bool {
        self.goes_at_once
    }

    /// Whether its first attempt may go now, without waiting.
    pub fn may_go_now(&self) -> bool {
        self.at
            .is_none_or(|(line, number)| self.lines.may_go(line, number, true))
    }

    /// Waits until its first attempt may go; true when it had to wait.
    pub async fn first_turn(&self) -> bool {
        match self.at {
            Some((line, number)) => self.lines.wait_turn(line, number, true).await,
            None => false,
        }
    }

    /// Its first attempt handed the message over: the next place may go.
    pub fn handed_over(&self) {
        let Some((key, number)) = self.at else { return };
        let mut lines = self.lines.lock();
        let Some(line) = lines.get_mut(&key) else {
            return;
        };
        if let Some(i) = line.find(number)
            && !std::mem::replace(&mut line.unsettled[i].handed_over, true)
        {
            line.not_handed_over -= 1;
        }
        line.wake_next();
    }

    /// An attempt failed: the line recovers until every place taken so far
    /// is settled.
    pub fn failed(&self) {
        let Some((line, _)) = self.at else { return };
        let mut lines = self.lines.lock();
        if let Some(line) = lines.get_mut(&line) {
            let last = line.next.saturating_sub(1);
            if line.recovering_until.is_none() {
                self.lines.recovering.inc();
            }
            line.recovering_until = Some(line.recovering_until.map_or(last, |b| b.max(last)));
        }
    }

    /// Waits until this place may attempt again: every earlier place of its
    /// line is settled. True when it had to wait.
    pub async fn turn(&self) -> bool {
        match self.at {
            Some((line, number)) => self.lines.wait_turn(line, number, false).await,
            None => false,
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let Some((key, number)) = self.at else { return };
        let mut lines = self.lines.lock();
        let Some(line) = lines.get_mut(&key) else {
            return;
        };
        if let Some(i) = line.find(number)
            && let Some(settled) = line.unsettled.remove(i)
            && !settled.handed_over
        {
            line.not_handed_over -= 1;
        }
        if let Some(until) = line.recovering_until
            && line
                .unsettled
                .front()
                .is_none_or(|oldest| oldest.number > until)
        {
            line.recovering_until = None;
            self.lines.recovering.dec();
        }
        if line.unsettled.is_empty() {
            lines.remove(&key);
        } else {
            line.wake_next();
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
            topic: "business".into(),
            partition,
            offset: 0,
            key: Some(key.as_bytes().to_vec()),
            value: None,
            headers: Vec::new(),
            timestamp_ms: None,
        }
    }

    /// Takes a place now; the future resolves once its first attempt may go,
    /// and hands over at once.
    fn join(
        lines: &Arc<DeliveryLines>,
        process_id: &str,
        input: &InputRecord,
    ) -> impl Future<Output = Place> + 'static + use<> {
        let place = lines.take(process_id, input);
        async move {
            place.first_turn().await;
            place.handed_over();
            place
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
        let lines = DeliveryLines::new(DeliveryOrder::Key, Gauge::default());
        let places: Vec<Place> =
            futures::future::join_all((0..5).map(|_| join(&lines, "p", &input(0, "k")))).await;
        assert_eq!(lines.lines(), 1);
        drop(places);
        assert_eq!(lines.lines(), 0, "no line is kept once its places settle");
    }

    #[tokio::test]
    async fn after_a_failure_places_go_one_at_a_time_in_order() {
        let recovering = Gauge::default();
        let lines = DeliveryLines::new(DeliveryOrder::Key, recovering.clone());
        let first = join(&lines, "p", &input(0, "k")).await;
        let second = join(&lines, "p", &input(0, "k")).await;
        // The second's attempt fails while the first is still in flight:
        // its retry waits for the first to settle.
        second.failed();
        second.failed();
        assert_eq!(recovering.get(), 1, "one line recovers, however often");
        let mut retry = Box::pin(second.turn());
        assert!(waits(&mut retry).await, "a retry overtook an earlier place");
        // A new delivery waits for both (the line recovers).
        let mut third = Box::pin(join(&lines, "p", &input(0, "k")));
        assert!(waits(&mut third).await, "a new delivery overtook a retry");
        drop(first);
        assert!(!waits(&mut retry).await, "the oldest unsettled place goes");
        drop(retry);
        assert!(waits(&mut third).await);
        assert_eq!(recovering.get(), 1);
        drop(second);
        assert_eq!(
            recovering.get(),
            0,
            "recovered once the failed place settled"
        );
        let third = third.now_or_never().expect("goes once the line is settled");
        // Recovered: the line pipelines again.
        let fourth = join(&lines, "p", &input(0, "k")).now_or_never();
        assert!(fourth.is_some());
        drop((third, fourth));
        assert_eq!(lines.lines(), 0);
    }

    #[tokio::test]
    async fn a_place_taken_before_the_failure_keeps_the_line_recovering() {
        let lines = DeliveryLines::new(DeliveryOrder::Key, Gauge::default());
        let first = join(&lines, "p", &input(0, "k")).await;
        let second = join(&lines, "p", &input(0, "k")).await;
        // The first fails and is then delivered by its retry; the second,
        // handed over before the failure, is still out: a new delivery
        // waits for it (it may fail too, and must not be overtaken).
        first.failed();
        first
            .turn()
            .now_or_never()
            .expect("the oldest goes at once");
        drop(first);
        let mut third = Box::pin(join(&lines, "p", &input(0, "k")));
        assert!(waits(&mut third).await);
        drop(second);
        assert!(third.now_or_never().is_some());
    }

    #[tokio::test]
    async fn other_keys_partitions_and_processes_are_other_lines() {
        let lines = DeliveryLines::new(DeliveryOrder::Key, Gauge::default());
        let stuck = join(&lines, "p", &input(0, "k")).await;
        let _later = join(&lines, "p", &input(0, "k")).await;
        stuck.failed();
        for (process, partition, key) in [("p", 0, "other"), ("p", 1, "k"), ("q", 0, "k")] {
            assert!(
                join(&lines, process, &input(partition, key))
                    .now_or_never()
                    .is_some(),
                "{process}/{partition}/{key} waited for another line"
            );
        }
        // With partition ordering, every key of the partition is one line.
        let lines = DeliveryLines::new(DeliveryOrder::Partition, Gauge::default());
        let stuck = join(&lines, "p", &input(0, "k")).await;
        stuck.failed();
        let mut other_key = Box::pin(join(&lines, "p", &input(0, "other")));
        assert!(waits(&mut other_key).await);
        drop(stuck);
        assert!(other_key.now_or_never().is_some());
        // With no ordering there are no lines.
        let lines = DeliveryLines::new(DeliveryOrder::None, Gauge::default());
        let stuck = join(&lines, "p", &input(0, "k")).await;
        stuck.failed();
        assert!(join(&lines, "p", &input(0, "k")).now_or_never().is_some());
        assert_eq!(lines.lines(), 0);
    }

    #[tokio::test]
    async fn after_recovery_waiting_places_go_in_order_each_once_the_one_before_is_handed_over() {
        let lines = DeliveryLines::new(DeliveryOrder::Key, Gauge::default());
        let failed = join(&lines, "p", &input(0, "k")).await;
        failed.failed();
        let first = lines.take("p", &input(0, "k"));
        let second = lines.take("p", &input(0, "k"));
        assert!(!first.goes_at_once() && !second.goes_at_once());
        assert!(!first.may_go_now() && !second.may_go_now());
        drop(failed);
        // Recovered; the first goes, the second only once the first has
        // handed its message over.
        assert!(first.may_go_now());
        let mut second_turn = Box::pin(second.first_turn());
        assert!(
            waits(&mut second_turn).await,
            "the second overtook the first"
        );
        first.handed_over();
        assert!(!waits(&mut second_turn).await);
        drop(second_turn);
        let third = lines.take("p", &input(0, "k"));
        assert!(!third.may_go_now(), "the third overtook the second");
        second.handed_over();
        // Healthy again: new places go at once.
        assert!(third.may_go_now());
        third.handed_over();
        let healthy = lines.take("p", &input(0, "k"));
        assert!(healthy.goes_at_once());
        // ... and the next too: one that went at once counts as handed over.
        assert!(lines.take("p", &input(0, "k")).goes_at_once());
    }

    #[tokio::test]
    async fn giving_up_a_waiting_place_lets_the_next_go() {
        let lines = DeliveryLines::new(DeliveryOrder::Key, Gauge::default());
        let first = join(&lines, "p", &input(0, "k")).await;
        first.failed();
        let mut second = Box::pin(join(&lines, "p", &input(0, "k")));
        assert!(waits(&mut second).await);
        // A third waits too; the second is aborted while it waits.
        let mut third = Box::pin(join(&lines, "p", &input(0, "k")));
        assert!(waits(&mut third).await);
        drop(second);
        drop(first);
        assert!(third.now_or_never().is_some());
        assert_eq!(lines.lines(), 0);
    }
}
