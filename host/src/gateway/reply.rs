//! Where the outcome of a delivery goes: to a task awaiting it (a
//! oneshot), or to an [`OutcomeSink`] that needs no task to wait: the mesh
//! link a forwarded message came on, which turns the outcome into the
//! `ForwardAck` for the node that forwarded it the moment the process
//! answers.
//!
//! A [`SinkReply`] is answered exactly once: when its delivery is
//! answered, refused, or lost with its connection, and also when it is
//! dropped unanswered (as lost), so the sender never waits for an outcome
//! that will not come.

use std::sync::Arc;

use tokio::sync::oneshot;

use super::session::{DeliverError, DeliveryResult};
use crate::pending::Answer;

/// Takes the outcomes of deliveries nobody awaits.
pub trait OutcomeSink: Send + Sync + std::fmt::Debug {
    /// The outcome of the delivery the sink numbered `token`: the process's
    /// answer (or its loss), or why the gateway did not take it.
    fn outcome(&self, token: u64, outcome: Result<DeliveryResult, DeliverError>);
}

/// A delivery's outcome, owed to whoever handed it over.
#[derive(Debug)]
pub enum Reply {
    /// A task awaiting it.
    Waiter(oneshot::Sender<DeliveryResult>),
    /// A sink.
    Sink(SinkReply),
}

impl Answer<DeliveryResult> for Reply {
    fn answer(self, answer: DeliveryResult) {
        match self {
            Reply::Waiter(waiter) => waiter.answer(answer),
            Reply::Sink(sink) => sink.send(Ok(answer)),
        }
    }
}

/// The outcome of delivery `token`, owed to a sink (see the module).
#[derive(Debug)]
pub struct SinkReply {
    /// Taken when answered.
    sink: Option<Arc<dyn OutcomeSink>>,
    token: u64,
}

impl SinkReply {
    /// The outcome of delivery `token`, for `sink`.
    pub fn new(sink: Arc<dyn OutcomeSink>, token: u64) -> SinkReply {
        SinkReply {
            sink: Some(sink),
            token,
        }
    }

    /// Hands the outcome to the sink.
    pub fn send(mut self, outcome: Result<DeliveryResult, DeliverError>) {
        if let Some(sink) = self.sink.take() {
            sink.outcome(self.token, outcome);
        }
    }
}

impl Drop for SinkReply {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            sink.outcome(
                self.token,
                Ok(DeliveryResult::Lost(
                    "the delivery was dropped unanswered".to_string(),
                )),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Debug, Default)]
    struct Outcomes(Mutex<Vec<(u64, Result<DeliveryResult, DeliverError>)>>);

    impl OutcomeSink for Outcomes {
        fn outcome(&self, token: u64, outcome: Result<DeliveryResult, DeliverError>) {
            self.0.lock().unwrap().push((token, outcome));
        }
    }

    #[test]
    fn a_sink_gets_each_outcome_once_and_a_dropped_reply_as_lost() {
        let outcomes = Arc::new(Outcomes::default());
        Reply::Sink(SinkReply::new(outcomes.clone(), 1)).answer(DeliveryResult::Acked);
        SinkReply::new(outcomes.clone(), 2).send(Err(DeliverError::NotHere("p".to_string())));
        drop(SinkReply::new(outcomes.clone(), 3));
        let got = std::mem::take(&mut *outcomes.0.lock().unwrap());
        assert_eq!(
            got,
            vec![
                (1, Ok(DeliveryResult::Acked)),
                (2, Err(DeliverError::NotHere("p".to_string()))),
                (
                    3,
                    Ok(DeliveryResult::Lost(
                        "the delivery was dropped unanswered".to_string()
                    ))
                ),
            ]
        );
    }
}
