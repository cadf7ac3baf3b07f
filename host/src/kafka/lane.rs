//! One partition's worker (a *lane*): takes the partition's records in
//! offset order and starts their handling as the flow's [`DeliveryOrder`]
//! allows, with at most `max_in_flight` records of the whole flow being
//! handled at once.
//!
//! - `partition`: one record of the partition at a time (the next starts
//!   when the previous one's ordered part is done).
//! - `key` (the default): records with different keys are handled
//!   together; records with the same key strictly one after the other, in
//!   offset order. Records without a key count as one key.
//! - `none`: no order at all, only the `max_in_flight` bound.
//!
//! The order is over the ordered part of the handling (plugin chains,
//! delivery with its retries, dead-lettering decisions, enqueueing the
//! outputs); waiting for produce acknowledgements (the [`Completion`])
//! overlaps with anything. A delivery whose answer comes later (to a
//! cluster's business process) is handed over in the ordered part and
//! keeps the order through its retries itself (see
//! `flow::DeliveryTarget`). Offsets finish out of order and are committed
//! only up to the highest contiguous finished one
//! ([`super::offsets::PartitionOffsets`]), so a crash re-delivers every
//! record that was not finished, in order per key.
//!
//! Like Confluent's Parallel Consumer (`KEY` ordering) and Dapr's
//! `app-max-concurrency`.
//!
//! The lane is one task. A record's ordered part is polled there once;
//! when it is done at once (the common case of a cluster delivery, handed
//! to a connection's or a mesh link's queue) the next record of its key
//! starts in the same step and the lane waits for the completion itself,
//! with the others of the partition. Only an ordered part that has to wait
//! (an HTTP call, a plugin chain, a full queue) gets a task of its own.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use futures::FutureExt as _;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::consumer::{Completion, Handling, MessageHandler, Outcome};
use super::record::InputRecord;

/// Records a lane makes ready in one step when the handler takes them one
/// at a time: one wake-up of the lane starts several.
const ADMITTED_AT_ONCE: usize = 32;

/// Batches of a lane in their handler's batch step at once (a transform
/// flow's plugin call). While one is there, the records that arrive wait,
/// ready, and go together in the next batch: without this bound every
/// record or two became a batch of its own as it arrived (1.8 records a
/// plugin call in `relay_throughput`), each with its own hop to the plugin
/// executor and back. The records of a batch that has passed that step run
/// on as before, so a record retrying with backoff does not hold the lane.
const BATCHES_IN_STEP: usize = 1;

/// In which order a flow handles the records of one partition
/// (`flows.ordering`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryOrder {
    /// One record of a partition at a time.
    Partition,
    /// Records with the same key one at a time, in offset order; different
    /// keys concurrently.
    #[default]
    Key,
    /// Any order; only `max_in_flight` bounds the concurrency.
    None,
}

impl std::fmt::Display for DeliveryOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeliveryOrder::Partition => "partition",
            DeliveryOrder::Key => "key",
            DeliveryOrder::None => "none",
        })
    }
}

/// Which records must wait for each other: those with the same slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Slot {
    /// Every record of the partition (`partition` ordering).
    Partition,
    /// Records whose key hashes to this (records without a key are one
    /// key). Two keys with the same hash share a slot, which only orders
    /// more; the hash is keyed per process, so keys cannot be chosen to
    /// collide.
    Key(u64),
}

/// Hashes keys into slots: foldhash with one random seed per process,
/// several times faster than the standard SipHash for a key of a few
/// bytes (a collision only orders two keys' records one after the other).
static KEY_HASHER: std::sync::LazyLock<foldhash::fast::RandomState> =
    std::sync::LazyLock::new(foldhash::fast::RandomState::default);

/// Slots with a record in progress, and the records waiting for each (a
/// slot is already a hash: hashed again cheaply).
type BusySlots = HashMap<Slot, VecDeque<InputRecord>, foldhash::fast::RandomState>;

impl DeliveryOrder {
    fn slot(self, record: &InputRecord) -> Option<Slot> {
        match self {
            DeliveryOrder::Partition => Some(Slot::Partition),
            DeliveryOrder::Key => Some(Slot::Key(KEY_HASHER.hash_one(record.key.as_deref()))),
            DeliveryOrder::None => None,
        }
    }
}

/// Records sent to a lane and not started yet (queued, or waiting for
/// their key): how many and their bytes. The consumer pauses the partition
/// when either is too high.
#[derive(Debug, Default)]
pub(super) struct Backlog {
    records: AtomicUsize,
    bytes: AtomicUsize,
}

impl Backlog {
    /// `records` of `bytes` together were sent to the lane.
    pub(super) fn add(&self, records: usize, bytes: usize) {
        self.records.fetch_add(records, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `records` of `bytes` together were started (or will never be).
    pub(super) fn remove(&self, records: usize, bytes: usize) {
        self.records.fetch_sub(records, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Records waiting.
    pub(super) fn records(&self) -> usize {
        self.records.load(Ordering::Relaxed)
    }

    /// Their bytes.
    pub(super) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// What a lane shares with its consumer.
pub(super) struct LaneContext {
    pub(super) partition: i32,
    pub(super) order: DeliveryOrder,
    pub(super) handler: Arc<dyn MessageHandler>,
    /// Records of the whole flow whose ordered part is running.
    pub(super) in_flight: Arc<Semaphore>,
    /// Records of this partition whose completion is still pending.
    pub(super) pending: Arc<Semaphore>,
    /// Records sent to the lane and not started yet.
    pub(super) backlog: Arc<Backlog>,
    /// Started and not yet completed.
    pub(super) active: Arc<AtomicUsize>,
    /// Stop starting records (revocation, shutdown).
    pub(super) stop_taking: CancellationToken,
    /// Give up work in progress.
    pub(super) abort: CancellationToken,
    /// Where finished offsets go.
    pub(super) finished_tx: mpsc::UnboundedSender<(i32, i64)>,
    /// The handling tasks.
    pub(super) tasks: TaskTracker,
}

impl LaneContext {
    /// Runs the lane until `stop_taking` or until `records` closes. Records
    /// still waiting for their key then are dropped unfinished (consumed
    /// again later); started ones run on in `tasks`.
    ///
    /// Records that can start together (their slots free) are taken
    /// together, up to the handler's [`MessageHandler::batch_size`], and
    /// handed to the handler as one batch when it takes batches.
    ///
    /// A record handled alone is started here: its ordered part is polled
    /// once in the lane, and when it is done at once (a delivery handed to
    /// a connection's queue, say) its slot is free for the next record
    /// without a task or a message in between, and the lane itself waits
    /// for its completion (with the others', in [`Waiting`]). Only an
    /// ordered part that has to wait gets a task of its own.
    pub(super) async fn run(self, mut records: mpsc::UnboundedReceiver<Vec<InputRecord>>) {
        let most = self.handler.batch_size().max(1);
        // Records made ready in one step: a batch, and at least a few, so
        // that one wake-up starts several records handled one by one.
        let admitted = most.max(ADMITTED_AT_ONCE);
        let mut lane = LaneState {
            settled: self.settled(),
            busy: BusySlots::default(),
            ready: VecDeque::new(),
            waiting: FuturesUnordered::new(),
            batches_in_step: 0,
        };
        let (slot_free_tx, mut slot_free) = mpsc::unbounded_channel::<Freed>();
        let (step_done_tx, mut step_done) = mpsc::unbounded_channel::<()>();
        loop {
            tokio::select! {
                biased;
                _ = self.stop_taking.cancelled() => break,
                Some(()) = step_done.recv() => {
                    lane.batches_in_step -= 1;
                    while step_done.try_recv().is_ok() {
                        lane.batches_in_step -= 1;
                    }
                }
                Some(freed) = slot_free.recv() => {
                    freed.free(&mut lane.busy, &mut lane.ready);
                    while lane.ready.len() < admitted {
                        let Ok(freed) = slot_free.try_recv() else { break };
                        freed.free(&mut lane.busy, &mut lane.ready);
                    }
                }
                arrived = records.recv() => {
                    let Some(arrived) = arrived else { break };
                    for record in arrived {
                        self.admit(record, &mut lane.busy, &mut lane.ready);
                    }
                    while lane.ready.len() < admitted {
                        let Ok(arrived) = records.try_recv() else { break };
                        for record in arrived {
                            self.admit(record, &mut lane.busy, &mut lane.ready);
                        }
                    }
                }
                Some(done) = lane.waiting.next(), if !lane.waiting.is_empty() => {
                    lane.settled.settle(done);
                }
            }
            if !lane.ready.is_empty() && !self.start(&mut lane, &slot_free_tx, &step_done_tx).await
            {
                break;
            }
        }
        // Completions the lane was waiting for run on without it.
        if !lane.waiting.is_empty() {
            let settled = lane.settled;
            let mut waiting = lane.waiting;
            self.tasks.spawn(async move {
                while let Some(done) = waiting.next().await {
                    settled.settle(done);
                }
            });
        }
    }

    /// A record arrived: ready to start, or waiting for its slot.
    fn admit(
        &self,
        record: InputRecord,
        busy: &mut BusySlots,
        ready: &mut VecDeque<(InputRecord, Option<Slot>)>,
    ) {
        match self.order.slot(&record) {
            Some(slot) => match busy.get_mut(&slot) {
                Some(waiting) => waiting.push_back(record),
                None => {
                    busy.insert(slot, VecDeque::new());
                    ready.push_back((record, Some(slot)));
                }
            },
            None => ready.push_back((record, None)),
        }
    }

    /// What reports a record's completion.
    fn settled(&self) -> Settled {
        Settled {
            partition: self.partition,
            finished_tx: self.finished_tx.clone(),
            active: self.active.clone(),
        }
    }

    /// Starts the ready records, in order, as the flow and the partition
    /// have room (settling completions meanwhile); false when the lane must
    /// stop instead. A record handled at once frees its slot here, so the
    /// next record of the slot is started in the same call. Batches wait
    /// while [`BATCHES_IN_STEP`] are in their batch step (`step_done` says
    /// when one has left it).
    async fn start(
        &self,
        lane: &mut LaneState,
        slot_free: &mpsc::UnboundedSender<Freed>,
        step_done: &mpsc::UnboundedSender<()>,
    ) -> bool {
        let most = self.handler.batch_size().max(1);
        while !lane.ready.is_empty() {
            if most > 1 && lane.batches_in_step >= BATCHES_IN_STEP {
                break;
            }
            let wanted = lane.ready.len().min(most);
            // Room now (the usual case) is taken without waiting.
            let (pending, in_flight) = match self.room_now(wanted) {
                Some(room) => room,
                None if self.stop_taking.is_cancelled() => return false,
                None => match self.wait_for_room(lane, wanted).await {
                    Some(room) => room,
                    None => return false,
                },
            };
            let taken = in_flight.num_permits();
            self.active.fetch_add(taken, Ordering::Relaxed);
            if most == 1 {
                // One record (`wanted` was 1).
                if let Some((record, slot)) = lane.ready.pop_front() {
                    self.backlog.remove(1, record.size_bytes());
                    self.start_one(lane, record, slot, (pending, in_flight), slot_free);
                    // Records handled at once do not yield on their own.
                    tokio::task::consume_budget().await;
                }
            } else {
                let taken: Vec<_> = lane.ready.drain(..taken).collect();
                let bytes = taken.iter().map(|(record, _)| record.size_bytes()).sum();
                self.backlog.remove(taken.len(), bytes);
                let started = Started {
                    settled: lane.settled.clone(),
                    slot_free: slot_free.clone(),
                };
                lane.batches_in_step += 1;
                let in_step = InStep(step_done.clone());
                self.start_batch(taken, started, in_step, pending, in_flight);
            }
        }
        true
    }

    /// Permits for up to `wanted` records, if the partition and the flow
    /// have room for at least one now and the lane is not stopping.
    fn room_now(&self, wanted: usize) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        if self.stop_taking.is_cancelled() {
            return None;
        }
        let mut pending = take_up_to(&self.pending, wanted)?;
        let in_flight = take_up_to(&self.in_flight, pending.num_permits())?;
        // Fewer in flight than pending: the surplus goes back.
        drop(pending.split(pending.num_permits() - in_flight.num_permits()));
        Some((pending, in_flight))
    }

    /// Waits for permits for up to `wanted` records (settling completions
    /// meanwhile: room is what they give back); `None` when the lane must
    /// stop.
    async fn wait_for_room(
        &self,
        lane: &mut LaneState,
        wanted: usize,
    ) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        let permits = async {
            let mut pending = acquire_up_to(&self.pending, wanted).await?;
            let in_flight = acquire_up_to(&self.in_flight, pending.num_permits()).await?;
            // Fewer in flight than pending: the surplus goes back.
            drop(pending.split(pending.num_permits() - in_flight.num_permits()));
            Some((pending, in_flight))
        };
        let mut permits = std::pin::pin!(permits);
        loop {
            tokio::select! {
                biased;
                _ = self.stop_taking.cancelled() => return None,
                permits = &mut permits => return permits,
                Some(done) = lane.waiting.next(), if !lane.waiting.is_empty() => {
                    lane.settled.settle(done);
                }
            }
        }
    }

    /// Starts one record: its ordered part is polled here once; done at
    /// once, its slot is freed and its completion waited for by the lane,
    /// else the rest of its handling runs in a task.
    fn start_one(
        &self,
        lane: &mut LaneState,
        record: InputRecord,
        slot: Option<Slot>,
        (pending, in_flight): (OwnedSemaphorePermit, OwnedSemaphorePermit),
        slot_free: &mpsc::UnboundedSender<Freed>,
    ) {
        let offset = record.offset;
        let mut handling = self.handler.handle(record, self.abort.clone());
        match (&mut handling).now_or_never() {
            Some(completion) => {
                drop(in_flight);
                if let Some(slot) = slot {
                    free(slot, &mut lane.busy, &mut lane.ready);
                }
                lane.waiting.push(Completing {
                    completion,
                    offset,
                    pending: Some(pending),
                });
            }
            None => {
                let started = Started {
                    settled: lane.settled.clone(),
                    slot_free: slot_free.clone(),
                };
                self.tasks.spawn(async move {
                    started
                        .run(handling, offset, slot, (pending, in_flight))
                        .await;
                });
            }
        }
    }

    /// Hands `taken` to the handler as one batch and runs what remains of
    /// each record in one task: the records the batch step finished share
    /// one completion (and give their slots back at once), the others go on
    /// each with its own permits. `in_step` is let go once the batch step
    /// is done (or the task is dropped).
    fn start_batch(
        &self,
        taken: Vec<(InputRecord, Option<Slot>)>,
        started: Started,
        in_step: InStep,
        mut pending: OwnedSemaphorePermit,
        mut in_flight: OwnedSemaphorePermit,
    ) {
        let mut positions = Vec::with_capacity(taken.len());
        let mut records = Vec::with_capacity(taken.len());
        for (record, slot) in taken {
            positions.push((record.offset, slot));
            records.push(record);
        }
        let batch = self.handler.handle_batch(records, self.abort.clone());
        self.tasks.spawn(async move {
            let handled = batch.await;
            drop(in_step);
            let together = handled.together.map(|(places, completion)| {
                let count = places.len();
                // Their ordered part is done: their in-flight permits and
                // their slots go back now, their pending permits once
                // their completion is settled.
                drop(in_flight.split(count));
                let pending = pending
                    .split(count)
                    .expect("a pending permit for each record");
                let slots: Vec<Slot> = places
                    .iter()
                    .filter_map(|&place| positions.get(place).and_then(|(_, slot)| *slot))
                    .collect();
                if !slots.is_empty() {
                    let _ = started.slot_free.send(Freed::Many(slots));
                }
                let offsets: Vec<i64> = places
                    .iter()
                    .filter_map(|&place| positions.get(place).map(|(offset, _)| *offset))
                    .collect();
                let settled = started.settled.clone();
                async move {
                    let outcomes = completion.await;
                    settled.settle_many(&offsets, &outcomes, pending);
                }
            });
            let mut each: FuturesUnordered<_> = handled
                .alone
                .into_iter()
                .map(|(place, handling)| {
                    let (offset, slot) = positions[place];
                    // As many permits of each as records taken: one each.
                    let permits = (
                        pending.split(1).expect("a pending permit for each record"),
                        in_flight
                            .split(1)
                            .expect("an in-flight permit for each record"),
                    );
                    started.run(handling, offset, slot, permits)
                })
                .collect();
            let alone = async { while each.next().await.is_some() {} };
            match together {
                Some(together) => {
                    futures::join!(together, alone);
                }
                None => alone.await,
            }
        });
    }
}

/// A batch in its batch step: tells the lane when dropped.
struct InStep(mpsc::UnboundedSender<()>);

impl Drop for InStep {
    fn drop(&mut self) {
        // The lane may be gone (stopped); then nobody needs to know.
        let _ = self.0.send(());
    }
}

/// What the lane keeps between its steps.
struct LaneState {
    /// Reports the completions the lane settles (made once per lane).
    settled: Settled,
    /// Slots with a record in progress, and the records waiting for them.
    busy: BusySlots,
    /// Records whose slot is free, in order, not started yet.
    ready: VecDeque<(InputRecord, Option<Slot>)>,
    /// Completions of records whose ordered part was done at once.
    waiting: FuturesUnordered<Completing>,
    /// Batches in their batch step ([`BATCHES_IN_STEP`] at most).
    batches_in_step: usize,
}

/// A record's completion, with its offset and its permit of the
/// partition's pending records (given back when it is settled).
struct Completing {
    completion: Completion,
    offset: i64,
    pending: Option<OwnedSemaphorePermit>,
}

impl Future for Completing {
    type Output = (i64, Outcome, OwnedSemaphorePermit);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let outcome = std::task::ready!(self.completion.poll_unpin(cx));
        let pending = self.pending.take().expect("a completion is settled once");
        Poll::Ready((self.offset, outcome, pending))
    }
}

/// Reports completions: finished offsets to the consumer, and the count
/// of records started and not completed.
#[derive(Clone)]
struct Settled {
    partition: i32,
    finished_tx: mpsc::UnboundedSender<(i32, i64)>,
    active: Arc<AtomicUsize>,
}

impl Settled {
    /// Completions of several records done together: each one's outcome,
    /// in the order of `offsets` (an outcome missing counts as abandoned),
    /// then their pending permits given back.
    fn settle_many(&self, offsets: &[i64], outcomes: &[Outcome], pending: OwnedSemaphorePermit) {
        for (offset, outcome) in offsets.iter().zip(outcomes) {
            if *outcome == Outcome::Finished {
                let _ = self.finished_tx.send((self.partition, *offset));
            }
        }
        self.active.fetch_sub(offsets.len(), Ordering::Relaxed);
        drop(pending);
    }

    /// A record's completion is done: reported finished (if it is), then
    /// its pending permit given back.
    fn settle(&self, (offset, outcome, pending): (i64, Outcome, OwnedSemaphorePermit)) {
        if outcome == Outcome::Finished {
            let _ = self.finished_tx.send((self.partition, offset));
        }
        self.active.fetch_sub(1, Ordering::Relaxed);
        drop(pending);
    }
}

/// What a record started in a task of its own gives back when its parts
/// are done.
#[derive(Clone)]
struct Started {
    settled: Settled,
    slot_free: mpsc::UnboundedSender<Freed>,
}

impl Started {
    /// Runs a record's ordered part (then frees its slot and its in-flight
    /// permit) and its completion (then reports it finished, if it is).
    fn run(
        &self,
        handling: Handling,
        offset: i64,
        slot: Option<Slot>,
        (pending, in_flight): (OwnedSemaphorePermit, OwnedSemaphorePermit),
    ) -> impl Future<Output = ()> + Send + 'static {
        let started = self.clone();
        async move {
            let completion = handling.await;
            // The ordered part is done: the slot's next record may start.
            drop(in_flight);
            if let Some(slot) = slot {
                let _ = started.slot_free.send(Freed::One(slot));
            }
            let outcome = completion.await;
            started.settled.settle((offset, outcome, pending));
        }
    }
}

/// Slots whose records' ordered parts are done.
enum Freed {
    /// One record's.
    One(Slot),
    /// A batch's records' (one message for all of them).
    Many(Vec<Slot>),
}

impl Freed {
    /// Makes the next record waiting for each slot ready.
    fn free(self, busy: &mut BusySlots, ready: &mut VecDeque<(InputRecord, Option<Slot>)>) {
        match self {
            Freed::One(slot) => free(slot, busy, ready),
            Freed::Many(slots) => {
                for slot in slots {
                    free(slot, busy, ready);
                }
            }
        }
    }
}

/// A slot's record is done: the next one waiting for it is ready.
fn free(slot: Slot, busy: &mut BusySlots, ready: &mut VecDeque<(InputRecord, Option<Slot>)>) {
    match busy.get_mut(&slot).and_then(VecDeque::pop_front) {
        Some(record) => ready.push_back((record, Some(slot))),
        None => {
            busy.remove(&slot);
        }
    }
}

/// At least one and at most `wanted` permits of `semaphore` if one is free
/// now.
fn take_up_to(semaphore: &Arc<Semaphore>, wanted: usize) -> Option<OwnedSemaphorePermit> {
    let free = semaphore.available_permits().min(wanted);
    if free == 0 {
        return None;
    }
    semaphore.clone().try_acquire_many_owned(free as u32).ok()
}

/// At least one and at most `wanted` permits of `semaphore`: waits for the
/// first, takes more only if they are free now. `None` when closed.
async fn acquire_up_to(semaphore: &Arc<Semaphore>, wanted: usize) -> Option<OwnedSemaphorePermit> {
    let mut permit = semaphore.clone().acquire_owned().await.ok()?;
    let more = semaphore.available_permits().min(wanted.saturating_sub(1));
    if more > 0
        && let Ok(extra) = semaphore.clone().try_acquire_many_owned(more as u32)
    {
        permit.merge(extra);
    }
    Some(permit)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use futures::FutureExt as _;
    use futures::future::BoxFuture;

    use super::*;
    use crate::kafka::consumer::{BatchHandling, Completion};

    /// Records what ran when: per key, the offsets in the order their
    /// ordered part started, whether two of a key overlapped, and the most
    /// records in progress at once.
    #[derive(Default)]
    struct Log {
        started: HashMap<Option<Vec<u8>>, Vec<i64>>,
        running_keys: HashMap<Option<Vec<u8>>, usize>,
        overlaps: usize,
        running: usize,
        most_running: usize,
        finished: Vec<i64>,
        /// The size of each batch handed to `handle_batch`.
        batches: Vec<usize>,
    }

    struct SlowHandler {
        log: Arc<Mutex<Log>>,
        batch_size: usize,
        /// Records at even offsets of a batch are done in its batch step.
        split: bool,
    }

    impl MessageHandler for SlowHandler {
        fn batch_size(&self) -> usize {
            self.batch_size
        }

        fn handle_batch(
            &self,
            records: Vec<InputRecord>,
            abort: CancellationToken,
        ) -> BoxFuture<'static, BatchHandling> {
            assert!(records.len() <= self.batch_size, "a batch over its size");
            self.log.lock().unwrap().batches.push(records.len());
            // With `split`, records at even offsets are done in the batch
            // step (their ordered parts run there, and they complete
            // together), the others go on alone, as a transform flow
            // splits a batch.
            let split = self.split;
            let (together, alone): (Vec<_>, Vec<_>) = records
                .into_iter()
                .map(|record| {
                    let in_step = split && record.offset % 2 == 0;
                    (in_step, self.handle(record, abort.clone()))
                })
                .enumerate()
                .partition(|(_, (done_in_step, _))| *done_in_step);
            let alone = alone
                .into_iter()
                .map(|(place, (_, handling))| (place, handling))
                .collect();
            async move {
                let (places, handlings): (Vec<usize>, Vec<Handling>) = together
                    .into_iter()
                    .map(|(place, (_, handling))| (place, handling))
                    .unzip();
                let together = if places.is_empty() {
                    None
                } else {
                    let completions = futures::future::join_all(handlings).await;
                    let completion = futures::future::join_all(completions).boxed();
                    Some((places, completion))
                };
                BatchHandling { together, alone }
            }
            .boxed()
        }

        fn handle(
            &self,
            record: InputRecord,
            _abort: CancellationToken,
        ) -> BoxFuture<'static, Completion> {
            let log = self.log.clone();
            // Yields the completion, which the lane awaits separately.
            #[allow(clippy::async_yields_async)]
            let handling = async move {
                {
                    let mut log = log.lock().unwrap();
                    log.started
                        .entry(record.key.clone())
                        .or_default()
                        .push(record.offset);
                    let same_key = log.running_keys.entry(record.key.clone()).or_default();
                    *same_key += 1;
                    if *same_key > 1 {
                        log.overlaps += 1;
                    }
                    log.running += 1;
                    log.most_running = log.most_running.max(log.running);
                }
                // Uneven work, so that a later record could overtake.
                tokio::time::sleep(Duration::from_millis(1 + (record.offset % 4) as u64)).await;
                {
                    let mut log = log.lock().unwrap();
                    log.running -= 1;
                    *log.running_keys.get_mut(&record.key).unwrap() -= 1;
                    log.finished.push(record.offset);
                }
                async { Outcome::Finished }.boxed()
            };
            handling.boxed()
        }
    }

    fn record(offset: i64, key: Option<&str>) -> InputRecord {
        InputRecord {
            topic: "t".into(),
            partition: 0,
            offset,
            key: key.map(|k| k.as_bytes().to_vec()),
            value: Some(b"v".to_vec()),
            headers: Vec::new(),
            timestamp_ms: None,
        }
    }

    /// Runs `records` through one lane and returns the log and the offsets
    /// reported finished.
    async fn run_lane(
        order: DeliveryOrder,
        max_in_flight: usize,
        records: Vec<InputRecord>,
    ) -> (Log, Vec<i64>) {
        run_lane_in_batches(order, max_in_flight, 1, records).await
    }

    /// [`run_lane`] with a handler that takes batches of up to `batch_size`.
    async fn run_lane_in_batches(
        order: DeliveryOrder,
        max_in_flight: usize,
        batch_size: usize,
        records: Vec<InputRecord>,
    ) -> (Log, Vec<i64>) {
        run_lane_in_split_batches(order, max_in_flight, batch_size, false, records).await
    }

    /// [`run_lane_in_batches`]; with `split`, a batch's records at even
    /// offsets are done in its batch step and complete together.
    async fn run_lane_in_split_batches(
        order: DeliveryOrder,
        max_in_flight: usize,
        batch_size: usize,
        split: bool,
        records: Vec<InputRecord>,
    ) -> (Log, Vec<i64>) {
        let log = Arc::new(Mutex::new(Log::default()));
        let handler = Arc::new(SlowHandler {
            log: log.clone(),
            batch_size,
            split,
        });
        let finished = run_lane_with(handler, order, max_in_flight, 1_000, records).await;
        let log = std::mem::take(&mut *log.lock().unwrap());
        (log, finished)
    }

    /// Runs `records` through one lane with `handler`, at most `pending`
    /// records of the partition completing at once; the offsets reported
    /// finished.
    async fn run_lane_with(
        handler: Arc<dyn MessageHandler>,
        order: DeliveryOrder,
        max_in_flight: usize,
        pending: usize,
        records: Vec<InputRecord>,
    ) -> Vec<i64> {
        let count = records.len();
        let mut lane = TestLane::start(handler, order, max_in_flight, pending, records);
        let finished = lane.finished_offsets(count, Duration::from_secs(10)).await;
        assert_eq!(lane.backlog.records(), 0, "every record was started");
        assert_eq!(lane.backlog.bytes(), 0);
        drop(lane.records);
        lane.tasks.close();
        lane.tasks.wait().await;
        finished
    }

    /// A lane of partition 0 running in `tasks`, with `records` sent to it
    /// (and its sender kept, so it runs until stopped).
    struct TestLane {
        records: mpsc::UnboundedSender<Vec<InputRecord>>,
        finished: mpsc::UnboundedReceiver<(i32, i64)>,
        tasks: TaskTracker,
        stop_taking: CancellationToken,
        active: Arc<AtomicUsize>,
        backlog: Arc<Backlog>,
    }

    impl TestLane {
        fn start(
            handler: Arc<dyn MessageHandler>,
            order: DeliveryOrder,
            max_in_flight: usize,
            pending: usize,
            records: Vec<InputRecord>,
        ) -> TestLane {
            let (finished_tx, finished) = mpsc::unbounded_channel();
            let tasks = TaskTracker::new();
            let lane = LaneContext {
                partition: 0,
                order,
                handler,
                in_flight: Arc::new(Semaphore::new(max_in_flight)),
                pending: Arc::new(Semaphore::new(pending)),
                backlog: Arc::new(Backlog::default()),
                active: Arc::new(AtomicUsize::new(0)),
                stop_taking: CancellationToken::new(),
                abort: CancellationToken::new(),
                finished_tx,
                tasks: tasks.clone(),
            };
            let (tx, rx) = mpsc::unbounded_channel();
            for record in records {
                lane.backlog.add(1, record.size_bytes());
                tx.send(vec![record]).unwrap();
            }
            let test_lane = TestLane {
                records: tx,
                finished,
                tasks: tasks.clone(),
                stop_taking: lane.stop_taking.clone(),
                active: lane.active.clone(),
                backlog: lane.backlog.clone(),
            };
            tasks.spawn(lane.run(rx));
            test_lane
        }

        /// The next `count` offsets reported finished, each within `within`
        /// of the one before (else the test fails).
        async fn finished_offsets(&mut self, count: usize, within: Duration) -> Vec<i64> {
            let mut finished = Vec::with_capacity(count);
            while finished.len() < count {
                let (_, offset) = tokio::time::timeout(within, self.finished.recv())
                    .await
                    .unwrap_or_else(|_| {
                        panic!("{} of {count} records finished in time", finished.len())
                    })
                    .expect("the lane's finished channel is open");
                finished.push(offset);
            }
            finished
        }
    }

    /// What a [`QuickHandler`] saw: per key, the offsets in the order their
    /// ordered part ran; the most completions pending at once; and which
    /// ordered parts had to wait (ran in a task).
    #[derive(Default)]
    struct QuickLog {
        started: HashMap<Option<Vec<u8>>, Vec<i64>>,
        pending: usize,
        most_pending: usize,
        waited: usize,
    }

    /// A handler whose ordered part is done at once (as a cluster delivery
    /// handed to a connection's queue), except for every `wait_every`-th
    /// record's, which waits a moment; each completion takes a while (the
    /// process's answer), unevenly.
    struct QuickHandler {
        log: Arc<Mutex<QuickLog>>,
        wait_every: i64,
        /// Completions wait for this before they end.
        release: Arc<tokio::sync::Notify>,
        released: Arc<std::sync::atomic::AtomicBool>,
    }

    impl QuickHandler {
        fn new(wait_every: i64) -> Self {
            QuickHandler {
                log: Arc::default(),
                wait_every,
                release: Arc::default(),
                released: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            }
        }
    }

    impl MessageHandler for QuickHandler {
        fn handle(
            &self,
            record: InputRecord,
            _abort: CancellationToken,
        ) -> BoxFuture<'static, Completion> {
            let log = self.log.clone();
            let waits = record.offset % self.wait_every == self.wait_every - 1;
            let release = self.release.clone();
            let released = self.released.clone();
            #[allow(clippy::async_yields_async)]
            let handling = async move {
                if waits {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    log.lock().unwrap().waited += 1;
                }
                {
                    let mut log = log.lock().unwrap();
                    log.started
                        .entry(record.key.clone())
                        .or_default()
                        .push(record.offset);
                    log.pending += 1;
                    log.most_pending = log.most_pending.max(log.pending);
                }
                async move {
                    tokio::time::sleep(Duration::from_micros(100 * (record.offset % 7) as u64))
                        .await;
                    while !released.load(Ordering::SeqCst) {
                        let notified = release.notified();
                        if released.load(Ordering::SeqCst) {
                            break;
                        }
                        notified.await;
                    }
                    log.lock().unwrap().pending -= 1;
                    Outcome::Finished
                }
                .boxed()
            };
            handling.boxed()
        }
    }

    fn keyed(count: i64, keys: i64) -> Vec<InputRecord> {
        (0..count)
            .map(|offset| record(offset, Some(&format!("k{}", offset % keys))))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn key_order_runs_keys_together_and_each_key_in_offset_order() {
        let (log, finished) = run_lane(DeliveryOrder::Key, 16, keyed(400, 20)).await;
        assert_eq!(log.overlaps, 0, "two records of one key ran at once");
        for (key, offsets) in &log.started {
            assert!(
                offsets.is_sorted(),
                "key {key:?} started out of offset order: {offsets:?}"
            );
            assert_eq!(offsets.len(), 20);
        }
        assert!(
            log.most_running > 4,
            "different keys should run together, at most {} did",
            log.most_running
        );
        assert!(log.most_running <= 16, "max_in_flight exceeded");
        assert_eq!(finished.len(), 400);
        assert!(
            !log.finished.is_sorted(),
            "records of different keys finish out of order"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_without_a_key_are_ordered_as_one_key() {
        let records = (0..50).map(|offset| record(offset, None)).collect();
        let (log, _) = run_lane(DeliveryOrder::Key, 16, records).await;
        assert_eq!(log.most_running, 1);
        assert!(log.started[&None].is_sorted());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn partition_order_runs_one_record_at_a_time() {
        let (log, finished) = run_lane(DeliveryOrder::Partition, 16, keyed(100, 20)).await;
        assert_eq!(log.most_running, 1);
        assert!(finished.is_sorted(), "{finished:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_order_is_bounded_by_max_in_flight_only() {
        // One key: with `none` its records still run together.
        let records = (0..200).map(|offset| record(offset, Some("k"))).collect();
        let (log, _) = run_lane(DeliveryOrder::None, 8, records).await;
        assert!(log.overlaps > 0);
        assert_eq!(log.most_running, 8, "fills max_in_flight and no more");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_lane_starts_nothing_more() {
        let log = Arc::new(Mutex::new(Log::default()));
        let handler = Arc::new(SlowHandler {
            log: log.clone(),
            batch_size: 1,
            split: false,
        });
        let lane = TestLane::start(handler, DeliveryOrder::Key, 1, 1_000, keyed(100, 100));
        tokio::time::sleep(Duration::from_millis(20)).await;
        lane.stop_taking.cancel();
        lane.tasks.close();
        tokio::time::timeout(Duration::from_secs(5), lane.tasks.wait())
            .await
            .expect("the lane and its work end");
        let started: usize = log.lock().unwrap().started.values().map(Vec::len).sum();
        assert!(
            (1..100).contains(&started),
            "{started} started: some, not all"
        );
    }

    /// Takes batches of up to 64; the first batch's step (its
    /// `handle_batch` future) waits until `release` is notified, the
    /// others' are done at once. Each record finishes at once.
    struct GatedBatches {
        batches: Arc<Mutex<Vec<Vec<i64>>>>,
        release: Arc<tokio::sync::Notify>,
        first_taken: std::sync::atomic::AtomicBool,
    }

    impl MessageHandler for GatedBatches {
        fn batch_size(&self) -> usize {
            64
        }

        fn handle_batch(
            &self,
            records: Vec<InputRecord>,
            abort: CancellationToken,
        ) -> BoxFuture<'static, BatchHandling> {
            self.batches
                .lock()
                .unwrap()
                .push(records.iter().map(|r| r.offset).collect());
            let gate =
                (!self.first_taken.swap(true, Ordering::SeqCst)).then(|| self.release.clone());
            let alone = records
                .into_iter()
                .map(|record| self.handle(record, abort.clone()))
                .enumerate()
                .collect();
            async move {
                if let Some(gate) = gate {
                    gate.notified().await;
                }
                BatchHandling {
                    together: None,
                    alone,
                }
            }
            .boxed()
        }

        fn handle(&self, _record: InputRecord, _abort: CancellationToken) -> Handling {
            let completion: Completion = async { Outcome::Finished }.boxed();
            futures::future::ready(completion).boxed()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_that_arrive_while_a_batch_is_in_its_step_go_together_in_the_next() {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new(tokio::sync::Notify::new());
        let handler = Arc::new(GatedBatches {
            batches: batches.clone(),
            release: release.clone(),
            first_taken: Default::default(),
        });
        let mut lane = TestLane::start(
            handler,
            DeliveryOrder::None,
            64,
            1_000,
            vec![record(0, None)],
        );
        while batches.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Nine more arrive one by one while the first batch is in its step.
        for offset in 1..10 {
            let late = record(offset, None);
            lane.backlog.add(1, late.size_bytes());
            lane.records.send(vec![late]).unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(
            *batches.lock().unwrap(),
            vec![vec![0]],
            "no batch starts while one is in its step"
        );
        release.notify_one();
        lane.finished_offsets(10, Duration::from_secs(10)).await;
        assert_eq!(
            *batches.lock().unwrap(),
            vec![vec![0], (1..10).collect::<Vec<_>>()],
            "the nine that waited go in one batch"
        );
        lane.stop_taking.cancel();
        lane.tasks.close();
        lane.tasks.wait().await;
    }

    /// Takes batches of up to 8, each record of which the batch step
    /// finishes, with one completion for the batch that waits for
    /// `release` and then abandons the records at offsets in `abandon`.
    struct Together {
        release: Arc<tokio::sync::Notify>,
        abandon: Vec<i64>,
    }

    impl MessageHandler for Together {
        fn batch_size(&self) -> usize {
            8
        }

        fn handle_batch(
            &self,
            records: Vec<InputRecord>,
            _abort: CancellationToken,
        ) -> BoxFuture<'static, BatchHandling> {
            let outcomes: Vec<Outcome> = records
                .iter()
                .map(|record| {
                    if self.abandon.contains(&record.offset) {
                        Outcome::Abandoned
                    } else {
                        Outcome::Finished
                    }
                })
                .collect();
            let release = self.release.clone();
            let completion = async move {
                release.notified().await;
                outcomes
            }
            .boxed();
            let places = (0..records.len()).collect();
            async move {
                BatchHandling {
                    together: Some((places, completion)),
                    alone: Vec::new(),
                }
            }
            .boxed()
        }

        fn handle(&self, _record: InputRecord, _abort: CancellationToken) -> Handling {
            unreachable!("every record comes in a batch")
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_completed_together_free_their_keys_at_once_and_settle_each() {
        let release = Arc::new(tokio::sync::Notify::new());
        let handler = Arc::new(Together {
            release: release.clone(),
            abandon: vec![2, 5],
        });
        // Two keys, four records each: a batch holds one record of each
        // key, so the next of a key starts only once its slot is free.
        let records = (0..8)
            .map(|offset| record(offset, Some(if offset % 2 == 0 { "a" } else { "b" })))
            .collect();
        let mut lane = TestLane::start(handler, DeliveryOrder::Key, 64, 64, records);
        // Every batch's ordered part is done in its step: all eight start
        // while no completion has come (the slots came back at once).
        tokio::time::timeout(Duration::from_secs(5), async {
            while lane.backlog.records() > 0 || lane.active.load(Ordering::SeqCst) < 8 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("all eight started before any completion");
        assert!(lane.finished.try_recv().is_err(), "nothing finished yet");
        // Four batches (one record of each key per batch), released one
        // by one.
        for _ in 0..4 {
            release.notify_one();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut finished = lane.finished_offsets(6, Duration::from_secs(5)).await;
        finished.sort_unstable();
        assert_eq!(
            finished,
            vec![0, 1, 3, 4, 6, 7],
            "the abandoned are not finished"
        );
        tokio::time::timeout(Duration::from_secs(5), async {
            while lane.active.load(Ordering::SeqCst) > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("every record settled");
        lane.stop_taking.cancel();
        lane.tasks.close();
        lane.tasks.wait().await;
    }

    /// With and without records done in the batch step (`split`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_keep_each_key_in_offset_order_and_the_in_flight_bound() {
        for split in [false, true] {
            let (log, finished) =
                run_lane_in_split_batches(DeliveryOrder::Key, 32, 16, split, keyed(600, 40)).await;
            assert_eq!(log.overlaps, 0, "two records of one key ran at once");
            for (key, offsets) in &log.started {
                assert!(
                    offsets.is_sorted(),
                    "key {key:?} started out of offset order: {offsets:?}"
                );
            }
            assert!(log.most_running <= 32, "max_in_flight exceeded");
            assert!(
                log.batches.iter().any(|&size| size > 1),
                "ready records were taken together: {:?}",
                log.batches
            );
            assert!(log.batches.iter().all(|&size| size <= 16));
            assert_eq!(log.batches.iter().sum::<usize>(), 600);
            let mut finished = finished;
            finished.sort_unstable();
            assert_eq!(finished, (0..600).collect::<Vec<_>>(), "each finished once");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_batches_one_key_still_runs_one_record_at_a_time() {
        let records = (0..60).map(|offset| record(offset, Some("k"))).collect();
        let (log, finished) = run_lane_in_batches(DeliveryOrder::Key, 32, 16, records).await;
        assert_eq!(log.most_running, 1);
        assert!(
            log.batches.iter().all(|&size| size == 1),
            "{:?}",
            log.batches
        );
        assert!(finished.is_sorted(), "{finished:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_batches_no_order_fills_max_in_flight_and_no_more() {
        let records = (0..300).map(|offset| record(offset, Some("k"))).collect();
        let (log, finished) = run_lane_in_batches(DeliveryOrder::None, 8, 64, records).await;
        assert_eq!(log.most_running, 8);
        assert!(
            log.batches.iter().all(|&size| size <= 8),
            "{:?}",
            log.batches
        );
        assert_eq!(finished.len(), 300);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ordered_parts_done_at_once_keep_key_order_and_overlap_their_completions() {
        // Every 5th ordered part waits (a task of its own); the rest are
        // done at once in the lane.
        let handler = Arc::new(QuickHandler::new(5));
        let log = handler.log.clone();
        let finished = run_lane_with(handler, DeliveryOrder::Key, 16, 1_000, keyed(600, 6)).await;
        let log = log.lock().unwrap();
        for (key, offsets) in &log.started {
            assert!(
                offsets.is_sorted(),
                "key {key:?} started out of offset order: {offsets:?}"
            );
            assert_eq!(offsets.len(), 100);
        }
        assert_eq!(log.waited, 120, "every 5th ordered part waited");
        assert!(
            log.most_pending > 16,
            "completions overlap beyond max_in_flight (it bounds ordered parts only): {}",
            log.most_pending
        );
        let mut finished = finished;
        finished.sort_unstable();
        assert_eq!(finished, (0..600).collect::<Vec<_>>(), "each finished once");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lane_waiting_for_room_settles_the_completions_that_give_it() {
        // One key, ordered parts done at once, room for 8 pending
        // completions: the lane waits for room that only the completions
        // it waits for can give back.
        let handler = Arc::new(QuickHandler::new(i64::MAX));
        let log = handler.log.clone();
        let records = (0..300).map(|offset| record(offset, Some("k"))).collect();
        let finished = run_lane_with(handler, DeliveryOrder::Key, 4, 8, records).await;
        assert_eq!(finished.len(), 300);
        let log = log.lock().unwrap();
        assert!(
            log.most_pending <= 8,
            "{} pending at once",
            log.most_pending
        );
        assert_eq!(log.waited, 0);
        assert!(log.started[&Some(b"k".to_vec())].is_sorted());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completions_waited_for_by_a_stopped_lane_still_finish() {
        let handler = Arc::new(QuickHandler::new(i64::MAX));
        handler.released.store(false, Ordering::SeqCst);
        let (release, released) = (handler.release.clone(), handler.released.clone());
        let log = handler.log.clone();
        let mut lane = TestLane::start(handler, DeliveryOrder::Key, 64, 1_000, keyed(50, 50));
        let (stop_taking, active) = (lane.stop_taking.clone(), lane.active.clone());
        // Every record is started and waits for its completion.
        tokio::time::timeout(Duration::from_secs(5), async {
            while log.lock().unwrap().pending < 50 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("all 50 started");
        stop_taking.cancel();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(active.load(Ordering::SeqCst), 50, "none completed yet");
        released.store(true, Ordering::SeqCst);
        release.notify_waiters();
        let mut finished = lane.finished_offsets(50, Duration::from_secs(5)).await;
        finished.sort_unstable();
        assert_eq!(finished, (0..50).collect::<Vec<_>>());
        lane.tasks.close();
        tokio::time::timeout(Duration::from_secs(5), lane.tasks.wait())
            .await
            .expect("the lane and its work end");
        assert_eq!(active.load(Ordering::SeqCst), 0);
    }
}
