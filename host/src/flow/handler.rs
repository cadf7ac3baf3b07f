//! What a flow does with each consumed record (the [`MessageHandler`] of a
//! flow's consumer):
//!
//! service-call chain → delivery target → data-return chain → output topic.
//! The target is a [`DeliveryTarget`]: the application over HTTP, or the
//! business process each message names in the relay cluster (whose replies
//! come back as upstream sends, not here); a transform flow has no target
//! (chain → output topic).
//! Anything that cannot get through goes to the dead-letter topic with the
//! stage and reason; the input counts as finished only when every record it
//! caused is acknowledged by Kafka (output or dead letter).
//!
//! Delivery to the application happens in partition order; waiting for
//! produce acknowledgements overlaps with the next records (see
//! [`crate::kafka::consumer::Completion`]).

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use rdkafka::error::KafkaError;
use tokio_util::sync::CancellationToken;

use super::chain::{BatchResult, PluginChain};
use super::dead_letter::{DROPPED_HEADER, Stage, dead_letter_record, without_the_message};
use super::origin::OriginHeaders;
use super::retry::{Attempt, Retried, failure_reason, retry_after};
use super::target::{Delivery, DeliveryEnd, DeliveryTarget};
use crate::config::RetryConfig;
use crate::kafka::consumer::{BatchHandling, Completion, Handling, MessageHandler, Outcome};
use crate::kafka::producer::{Ack, Refused};
use crate::kafka::{InputRecord, OutputRecord};
use crate::link::KafkaLink;
use crate::telemetry::metrics::{FlowMetrics, HeldGauge};

/// Waits between attempts to write a dead letter that Kafka refused.
const DEAD_LETTER_RETRY: Duration = Duration::from_millis(500);

/// Everything a flow needs to handle a record.
#[derive(Debug)]
pub struct FlowHandler {
    /// The flow's name.
    pub name: String,
    /// This node's id (in dead-letter headers).
    pub node: String,
    /// Applied to each input.
    pub service_call: PluginChain,
    /// Where service calls go; `None`: the flow is a transform (chain
    /// output to the output topic).
    pub target: Option<Arc<dyn DeliveryTarget>>,
    /// Applied to each data-return (or transform output).
    pub data_return: PluginChain,
    /// The flow's link: data-returns and dead letters go to its current cluster.
    pub link: Arc<KafkaLink>,
    /// Where data-returns go.
    pub output_topic: String,
    /// Where dead letters go.
    pub dead_letter_topic: String,
    /// Retry policy.
    pub retry: RetryConfig,
    /// The flow's counters.
    pub metrics: FlowMetrics,
}

/// A produce that is in flight: the record, where to, and its acknowledgement.
struct InFlight {
    record: OutputRecord,
    dead_letter: bool,
    /// Its acknowledgement, or the error that refused it at once.
    ack: Result<Ack, KafkaError>,
}

impl InFlight {
    /// A produce enqueued, or refused at once.
    fn new(record: OutputRecord, dead_letter: bool, ack: Result<Ack, KafkaError>) -> Self {
        InFlight {
            record,
            dead_letter,
            ack,
        }
    }
}

/// Handles records of one flow; cheap to clone.
#[derive(Clone, Debug)]
pub struct FlowMessageHandler {
    flow: Arc<FlowHandler>,
}

impl FlowMessageHandler {
    /// Wraps a flow for its consumer.
    pub fn new(flow: FlowHandler) -> Self {
        FlowMessageHandler {
            flow: Arc::new(flow),
        }
    }
}

/// The most records of a partition a transform flow takes in one batch (one
/// plugin call per chain for all of them).
pub const MAX_BATCH_RECORDS: usize = crate::plugin::executor::MAX_BATCH_MESSAGES;

impl MessageHandler for FlowMessageHandler {
    fn handle(&self, record: InputRecord, abort: CancellationToken) -> Handling {
        // The ordered part resolves to the completion, which the consumer
        // awaits separately. Boxed as it is: a block around it would hold
        // the record twice (its capture, and the call's argument).
        self.flow
            .clone()
            .handle_in_order(record, abort, None)
            .boxed()
    }

    /// A transform flow takes the ready records of a partition in batches:
    /// its ordered part is the chains and the enqueueing, work of the same
    /// length for every record. A flow that delivers (to the application or
    /// the cluster's processes) takes them one by one: a slow delivery must
    /// not hold back the records that started with it.
    fn batch_size(&self) -> usize {
        if self.flow.target.is_none() {
            MAX_BATCH_RECORDS
        } else {
            1
        }
    }

    fn handle_batch(
        &self,
        records: Vec<InputRecord>,
        abort: CancellationToken,
    ) -> BoxFuture<'static, BatchHandling> {
        let flow = self.flow.clone();
        async move { flow.handle_batch_in_order(records, abort).await }.boxed()
    }
}

/// What a batch began for one of its records before the record's own
/// ordered part: the record counted as consumed and in progress, and the
/// service-call chain's first attempt made for the whole batch.
struct Started {
    in_progress: HeldGauge,
    first_attempt: BatchResult,
    message: BatchMessage,
}

/// Where a record's message is after its batch's first attempt.
enum BatchMessage {
    /// Still in the record: no plugin call was made for it.
    InInput,
    /// Taken out of the record for the call, and handed back by it.
    Back(OutputRecord),
    /// Taken out and not handed back: the plugin executor stopped before
    /// answering (only at shutdown). The record is given up, to be consumed
    /// again.
    Lost,
}

/// The records of a batch that its batch step finished: their places in
/// the batch, the inputs, and the outputs of each to enqueue.
#[derive(Default)]
struct Together {
    places: Vec<usize>,
    inputs: Vec<InputRecord>,
    outputs: Vec<Vec<OutputRecord>>,
}

impl Together {
    fn push(&mut self, place: usize, input: InputRecord, outputs: Vec<OutputRecord>) {
        self.places.push(place);
        self.inputs.push(input);
        self.outputs.push(outputs);
    }
}

fn abandoned() -> Completion {
    async { Outcome::Abandoned }.boxed()
}

/// The input as a message, before any chain: its value and headers moved
/// out of `input`, its key copied. Once the message is made, the record's
/// handling reads only the input's place (topic, partition, offset,
/// timestamp) and key: every dead letter is made from the message, which
/// the chains and the delivery target hand back when they fail.
fn take_original(input: &mut InputRecord) -> OutputRecord {
    OutputRecord {
        key: input.key.clone(),
        value: input.value.take(),
        headers: std::mem::take(&mut input.headers),
    }
}

impl FlowHandler {
    /// A transform flow without a data-return chain: a record its batch's
    /// first plugin attempt settled has nothing left but producing its
    /// outputs, and such records complete together, holding only their
    /// inputs' keys and places while Kafka acknowledges them.
    pub fn completes_batches_together(&self) -> bool {
        self.target.is_none() && self.data_return.is_empty()
    }

    /// The first attempt at the service-call chain for every record of a
    /// batch, in one plugin call per plugin. A transform flow's records
    /// that it settled (their outputs made, no data-return chain) are
    /// enqueued at once, in order, as one group whose acknowledgements
    /// complete them together; every other record goes on alone with its
    /// own ordered part, starting from that attempt (a record it did not
    /// settle runs its chain again alone, with retries).
    async fn handle_batch_in_order(
        self: Arc<Self>,
        mut inputs: Vec<InputRecord>,
        abort: CancellationToken,
    ) -> BatchHandling {
        // Counted from here: the batch's call is part of each record's work.
        self.metrics.consumed.inc_by(inputs.len() as u64);
        let mut in_progress = HeldGauge::hold_many(&self.metrics.in_progress, inputs.len());
        let (first_attempts, messages): (Vec<BatchResult>, Vec<BatchMessage>) =
            if self.service_call.is_empty() {
                inputs.iter().map(|_| (None, BatchMessage::InInput)).unzip()
            } else {
                // The messages go to the call and come back with its
                // answers: no copy is made in case the call fails.
                let taken: Vec<OutputRecord> = inputs.iter_mut().map(take_original).collect();
                let items = inputs.iter().zip(taken).collect();
                let (results, given) = self.service_call.apply_batch(items).await;
                let given = given
                    .into_iter()
                    .map(|message| message.map_or(BatchMessage::Lost, BatchMessage::Back));
                (results, given.collect())
            };
        let done_by_the_batch = self.completes_batches_together();
        let mut together = Together::default();
        let mut alone = Vec::new();
        for (place, ((mut input, first_attempt), message)) in inputs
            .into_iter()
            .zip(first_attempts)
            .zip(messages)
            .enumerate()
        {
            let outputs = match (first_attempt, message) {
                (Some(Attempt::Success(outputs)), _) if done_by_the_batch => Ok(outputs),
                (None, BatchMessage::InInput)
                    if done_by_the_batch && self.service_call.is_empty() =>
                {
                    Ok(vec![take_original(&mut input)])
                }
                other => Err(other),
            };
            match outputs {
                Ok(outputs) => together.push(place, input, outputs),
                Err((first_attempt, message)) => {
                    let started = Started {
                        in_progress: in_progress.split(1),
                        first_attempt,
                        message,
                    };
                    // As in `handle`: the ordered part yields the completion.
                    let handling = self
                        .clone()
                        .handle_in_order(input, abort.clone(), Some(started))
                        .boxed();
                    alone.push((place, handling));
                }
            }
        }
        let together = if together.places.is_empty() {
            None
        } else {
            let places = std::mem::take(&mut together.places);
            let completion = self.enqueue_together(together, in_progress, abort).await;
            Some((places, completion))
        };
        BatchHandling { together, alone }
    }

    /// Enqueues the outputs of `together`'s records in order, as one group,
    /// and returns the completion of all of them: each one's outcome once
    /// Kafka has acknowledged the group (a refused output dead-lettered,
    /// as in [`FlowHandler::complete`]). Records not wholly enqueued when
    /// the work is aborted (waiting for room in the producer's queue) are
    /// abandoned. `in_progress`: the records' gauge, given back with the
    /// completion.
    async fn enqueue_together(
        self: &Arc<Self>,
        together: Together,
        in_progress: HeldGauge,
        abort: CancellationToken,
    ) -> BoxFuture<'static, Vec<Outcome>> {
        let Together {
            inputs, outputs, ..
        } = together;
        let producer = self.link.producer();
        let mut group = producer.group(outputs.iter().map(Vec::len).sum());
        // The place of each output's record. The outputs themselves are not
        // kept: librdkafka hands a refused one back, for its dead letter.
        let mut produced: Vec<usize> = Vec::with_capacity(outputs.len());
        // Records whose outputs are all enqueued (the first ones).
        let mut enqueued = inputs.len();
        'records: for (place, (input, records)) in inputs.iter().zip(outputs).enumerate() {
            let origin = OriginHeaders::of(input);
            let (origin, count) = origin.pairs();
            for record in records {
                if !group.enqueue_now(&self.output_topic, &record, &origin[..count]) {
                    tokio::select! {
                        _ = abort.cancelled() => {
                            enqueued = place;
                            break 'records;
                        }
                        () = group.enqueue(&self.output_topic, &record, &origin[..count]) => {}
                    }
                }
                produced.push(place);
            }
        }
        let acks = group.acks();
        let awaiting_ack = HeldGauge::hold_many(&self.metrics.awaiting_ack, inputs.len());
        let flow = self.clone();
        async move {
            let _held = (in_progress, awaiting_ack);
            let results = acks.await;
            let mut outcomes: Vec<Outcome> = (0..inputs.len())
                .map(|place| {
                    if place < enqueued {
                        Outcome::Finished
                    } else {
                        Outcome::Abandoned
                    }
                })
                .collect();
            let mut returned = 0;
            for (place, result) in produced.into_iter().zip(results) {
                match result {
                    Ok(_) => returned += 1,
                    Err(_) if outcomes[place] == Outcome::Abandoned => {}
                    // Not handed back (its producer destroyed before
                    // reporting): the input is consumed again.
                    Err(Refused { record: None, .. }) => outcomes[place] = Outcome::Abandoned,
                    Err(Refused {
                        error,
                        record: Some(record),
                    }) => {
                        let reason = format!("producing to `{}`: {error}", flow.output_topic);
                        let record =
                            flow.dead_letter(*record, &inputs[place], &Stage::Produce, &reason);
                        if !Box::pin(flow.write_dead_letter(record, &abort)).await {
                            outcomes[place] = Outcome::Abandoned;
                        }
                    }
                }
            }
            flow.metrics.returned.inc_by(returned);
            outcomes
        }
        .boxed()
    }

    /// The ordered part: chains and application delivery; produces are
    /// enqueued, and the returned completion waits for their acknowledgements.
    /// `started`: what a batch began for this record (counted, and the
    /// service-call chain's first attempt), if it came in one.
    async fn handle_in_order(
        self: Arc<Self>,
        mut input: InputRecord,
        abort: CancellationToken,
        started: Option<Started>,
    ) -> Completion {
        // Given back however the record ends, with the completion below.
        let in_progress;
        let mut outputs: Vec<OutputRecord> = Vec::new();
        let mut dead_letters: Vec<OutputRecord> = Vec::new();

        // The locals of each step are scoped to it: a local's storage in
        // the future lasts to the end of its scope, even when moved out
        // earlier, and every record in flight has this future.
        let calls = {
            let (first_attempt, batch_message);
            (in_progress, first_attempt, batch_message) = match started {
                Some(started) => (started.in_progress, started.first_attempt, started.message),
                None => {
                    self.metrics.consumed.inc();
                    let in_progress = HeldGauge::hold(&self.metrics.in_progress);
                    (in_progress, None, BatchMessage::InInput)
                }
            };
            // A chain's run is boxed (and skipped when the chain is
            // empty): it would otherwise make every record's future larger
            // than the allocator's thread cache takes.
            let message = match batch_message {
                BatchMessage::InInput => take_original(&mut input),
                BatchMessage::Back(message) => message,
                BatchMessage::Lost => return abandoned(),
            };
            let service_call = if self.service_call.is_empty() {
                ChainRun::Output(vec![message])
            } else {
                Box::pin(self.run_chain_after(
                    first_attempt,
                    &self.service_call,
                    &input,
                    message,
                    &abort,
                ))
                .await
            };
            match service_call {
                ChainRun::Output(calls) => calls,
                ChainRun::DeadLetter(record) => {
                    dead_letters.push(record);
                    Vec::new()
                }
                ChainRun::Aborted => return abandoned(),
            }
        };

        let mut deliveries: Vec<BoxFuture<'static, DeliveryEnd>> = Vec::new();
        let returns = match &self.target {
            None => calls,
            Some(target) => {
                let mut returns = Vec::new();
                for call in calls {
                    match target.deliver(&input, call, &abort).await {
                        Delivery::Answered(records) => {
                            self.metrics.delivered.inc();
                            returns.extend(records);
                        }
                        Delivery::Pending(end) => deliveries.push(end),
                        Delivery::Failed {
                            stage,
                            reason,
                            call,
                        } => {
                            dead_letters.push(self.dead_letter(call, &input, &stage, &reason));
                        }
                        Delivery::Aborted => return abandoned(),
                    }
                }
                returns
            }
        };

        // The outputs' origin headers are added as they are enqueued.
        if self.data_return.is_empty() {
            outputs = returns;
        } else if !returns.is_empty() {
            let ran = Box::pin(self.run_data_returns(
                returns,
                &input,
                &abort,
                &mut outputs,
                &mut dead_letters,
            ));
            if !ran.await {
                return abandoned();
            }
        }

        // Enqueue everything now (in order), await acknowledgements later.
        // Waiting for room in the producer's queue is boxed: rare, and it
        // would make every record's future larger.
        let produced = outputs.len() + dead_letters.len();
        let mut in_flight = Vec::with_capacity(produced);
        if produced > 0 {
            let mut produces = outputs
                .into_iter()
                .map(|r| (r, false))
                .chain(dead_letters.into_iter().map(|r| (r, true)));
            if let Some(waiting) = self.enqueue_now(&input, &mut produces, &mut in_flight) {
                Box::pin(self.enqueue_rest(&input, waiting, produces, &mut in_flight)).await;
            }
        }
        let flow = self.clone();
        let awaiting_ack = HeldGauge::hold(&self.metrics.awaiting_ack);
        if deliveries.is_empty() && !in_flight.is_empty() {
            // Nothing delivered, only produced (a transform flow): the
            // completion is the wait for the acknowledgements itself, one
            // box less a record.
            return flow
                .complete(input, in_flight, abort, (in_progress, awaiting_ack))
                .boxed();
        }
        // The future of every record in flight: kept small for the common
        // case (one delivery, nothing to produce), the rest boxed.
        async move {
            let held = (in_progress, awaiting_ack);
            if deliveries.len() == 1 {
                let delivery = deliveries.pop().expect("one delivery");
                let end = delivery.await;
                if !matches!(end, DeliveryEnd::Delivered) {
                    let settled = Box::pin(flow.settle_delivery(end, &input, &abort));
                    if !settled.await {
                        return Outcome::Abandoned;
                    }
                } else {
                    flow.metrics.delivered.inc();
                }
            } else if !deliveries.is_empty() {
                let settled = Box::pin(flow.settle_deliveries(deliveries, &input, &abort));
                if !settled.await {
                    return Outcome::Abandoned;
                }
            }
            if in_flight.is_empty() {
                return Outcome::Finished;
            }
            Box::pin(flow.complete(input, in_flight, abort, held)).await
        }
        .boxed()
    }

    /// Runs each data-return through the data-return chain: its outputs
    /// (with the origin headers) to `outputs`, a failure to `dead_letters`;
    /// false when aborted.
    async fn run_data_returns(
        &self,
        returns: Vec<OutputRecord>,
        input: &InputRecord,
        abort: &CancellationToken,
        outputs: &mut Vec<OutputRecord>,
        dead_letters: &mut Vec<OutputRecord>,
    ) -> bool {
        for data_return in returns {
            match self
                .run_chain(&self.data_return, input, data_return, abort)
                .await
            {
                ChainRun::Output(records) => outputs.extend(records),
                ChainRun::DeadLetter(record) => dead_letters.push(record),
                ChainRun::Aborted => return false,
            }
        }
        true
    }

    /// Enqueues `produces` (made from `input`) in order while the producer's
    /// queue has room; the first that finds it full is returned, not
    /// enqueued.
    fn enqueue_now(
        &self,
        input: &InputRecord,
        produces: &mut impl Iterator<Item = (OutputRecord, bool)>,
        in_flight: &mut Vec<InFlight>,
    ) -> Option<(OutputRecord, bool)> {
        let producer = self.link.producer();
        let origin = OriginHeaders::of(input);
        let (origin, count) = origin.pairs();
        for (record, dead_letter) in produces {
            let extra = origin_headers(&origin[..count], dead_letter);
            match producer.enqueue_now_with(self.topic(dead_letter), &record, extra) {
                Some(enqueued) => in_flight.push(InFlight::new(record, dead_letter, enqueued)),
                None => return Some((record, dead_letter)),
            }
        }
        None
    }

    /// Enqueues `waiting` and then `rest`, in order, each waiting for room
    /// in the producer's queue when it is full.
    async fn enqueue_rest(
        &self,
        input: &InputRecord,
        waiting: (OutputRecord, bool),
        rest: impl Iterator<Item = (OutputRecord, bool)>,
        in_flight: &mut Vec<InFlight>,
    ) {
        let origin = OriginHeaders::of(input);
        let (origin, count) = origin.pairs();
        for (record, dead_letter) in std::iter::once(waiting).chain(rest) {
            let producer = self.link.producer();
            let extra = origin_headers(&origin[..count], dead_letter);
            let enqueued = producer
                .enqueue_with(self.topic(dead_letter), &record, extra)
                .await;
            in_flight.push(InFlight::new(record, dead_letter, enqueued));
        }
    }

    /// Where a produce goes: the output topic, or the dead-letter topic.
    fn topic(&self, dead_letter: bool) -> &str {
        if dead_letter {
            &self.dead_letter_topic
        } else {
            &self.output_topic
        }
    }

    /// Waits for several deliveries of one record together (one waiting
    /// for its turn in a line, see `cluster::delivery_lines`, may wait for
    /// another record's delivery, which may wait for a later one of
    /// these), then settles each; false when aborted.
    async fn settle_deliveries(
        &self,
        deliveries: Vec<BoxFuture<'static, DeliveryEnd>>,
        input: &InputRecord,
        abort: &CancellationToken,
    ) -> bool {
        let ends = futures::future::join_all(deliveries).await;
        for end in ends {
            if !self.settle_delivery(end, input, abort).await {
                return false;
            }
        }
        true
    }

    /// Counts a delivery delivered, or writes the dead letter of one given
    /// up; false when aborted.
    async fn settle_delivery(
        &self,
        end: DeliveryEnd,
        input: &InputRecord,
        abort: &CancellationToken,
    ) -> bool {
        match end {
            DeliveryEnd::Delivered => {
                self.metrics.delivered.inc();
                true
            }
            DeliveryEnd::Aborted => false,
            DeliveryEnd::GaveUp { reason, call } => {
                let record = self.dead_letter(call, input, &Stage::Deliver, &reason);
                Box::pin(self.write_dead_letter(record, abort)).await
            }
        }
    }

    /// Runs a chain with retries; a failure becomes a dead letter of the
    /// message as it was before the chain.
    async fn run_chain(
        &self,
        chain: &PluginChain,
        input: &InputRecord,
        message: OutputRecord,
        abort: &CancellationToken,
    ) -> ChainRun {
        self.run_chain_after(None, chain, input, message, abort)
            .await
    }

    /// [`Self::run_chain`], its first attempt's result given when a batch
    /// made it (`None`: not made, or not settled by the batch).
    async fn run_chain_after(
        &self,
        first_attempt: BatchResult,
        chain: &PluginChain,
        input: &InputRecord,
        message: OutputRecord,
        abort: &CancellationToken,
    ) -> ChainRun {
        if chain.is_empty() {
            return ChainRun::Output(vec![message]);
        }
        let retried = retry_after(
            first_attempt,
            &self.retry,
            abort,
            |_| {
                self.metrics.retried.inc();
            },
            || chain.apply(input, message.clone()),
        )
        .await;
        match retried {
            Retried::Success(records) => ChainRun::Output(records),
            Retried::Failed {
                error,
                attempts,
                budget_spent,
            } => {
                let reason = failure_reason(&error.reason, attempts, budget_spent);
                ChainRun::DeadLetter(self.dead_letter(
                    message,
                    input,
                    &Stage::Plugin(error.plugin),
                    &reason,
                ))
            }
            Retried::Aborted => ChainRun::Aborted,
        }
    }

    fn dead_letter(
        &self,
        failed: OutputRecord,
        input: &InputRecord,
        stage: &Stage,
        reason: &str,
    ) -> OutputRecord {
        tracing::warn!(flow = %self.name, delivery_id = %input.delivery_id(), %stage, reason, "dead-lettering");
        dead_letter_record(failed, input, &self.name, &self.node, stage, reason)
    }

    /// Waits for every acknowledgement; a refused output is dead-lettered, a
    /// refused dead letter is written again until Kafka takes it (or the work
    /// is aborted, in which case the input is consumed again later). `_held`:
    /// the record's gauges (in progress, awaiting acknowledgement), given
    /// back when it ends.
    async fn complete(
        self: Arc<Self>,
        input: InputRecord,
        in_flight: Vec<InFlight>,
        abort: CancellationToken,
        _held: (HeldGauge, HeldGauge),
    ) -> Outcome {
        for produce in in_flight {
            let result = match produce.ack {
                Ok(ack) => ack.await,
                Err(error) => Err(error),
            };
            match (result, produce.dead_letter) {
                (Ok(_), false) => {
                    self.metrics.returned.inc();
                }
                (Ok(_), true) => {
                    self.metrics.dead_lettered.inc();
                }
                (Err(error), false) => {
                    let reason = format!("producing to `{}`: {error}", self.output_topic);
                    let record = self.dead_letter(produce.record, &input, &Stage::Produce, &reason);
                    if !Box::pin(self.write_dead_letter(record, &abort)).await {
                        return Outcome::Abandoned;
                    }
                }
                (Err(error), true) => {
                    tracing::warn!(flow = %self.name, %error, "writing a dead letter failed; retrying");
                    if !Box::pin(self.write_dead_letter(produce.record, &abort)).await {
                        return Outcome::Abandoned;
                    }
                }
            }
        }
        Outcome::Finished
    }

    /// Writes a dead letter until Kafka acknowledges it (without the
    /// message once it is refused as too large); false if aborted first.
    async fn write_dead_letter(&self, mut record: OutputRecord, abort: &CancellationToken) -> bool {
        loop {
            match self
                .link
                .producer()
                .send(&self.dead_letter_topic, &record)
                .await
            {
                Ok(_) => {
                    self.metrics.dead_lettered.inc();
                    return true;
                }
                Err(error) if is_too_large(&error) && record.header(DROPPED_HEADER).is_none() => {
                    tracing::warn!(flow = %self.name, topic = %self.dead_letter_topic, %error, "a dead letter is too large for its topic; writing it without the message");
                    record = without_the_message(&record);
                    continue;
                }
                Err(error) => {
                    tracing::error!(flow = %self.name, topic = %self.dead_letter_topic, %error, "writing a dead letter failed; retrying");
                }
            }
            tokio::select! {
                _ = abort.cancelled() => return false,
                _ = tokio::time::sleep(DEAD_LETTER_RETRY) => {}
            }
        }
    }
}

/// The headers added to a produce as it is enqueued: an output gets its
/// input's origin headers; a dead letter has them already, among its own
/// (see [`dead_letter_record`]).
fn origin_headers<'a>(
    origin: &'a [(&'static str, &'a [u8])],
    dead_letter: bool,
) -> &'a [(&'a str, &'a [u8])] {
    if dead_letter { &[] } else { origin }
}

/// True when Kafka (or librdkafka, before sending) refused a record as
/// larger than `message.max.bytes`: writing it again cannot help.
fn is_too_large(error: &KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode;
    matches!(
        error,
        KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge)
    )
}

enum ChainRun {
    Output(Vec<OutputRecord>),
    DeadLetter(OutputRecord),
    Aborted,
}
