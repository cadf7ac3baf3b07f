//! Answers awaited by sequence number: a frame goes out with a `seq`, the
//! peer's answer comes back with the same `seq`, and whoever sent it waits on
//! a oneshot, or gets it some other way ([`Answer`]: e.g. a forward's
//! answer goes straight back on the mesh link it came from). Shared by the
//! gateway (deliveries awaiting Ack/Nack) and the mesh (forwards awaiting
//! ForwardAck).
//!
//! Registering runs the caller's enqueue step under the lock, so an answer
//! can never be looked up before its request is registered, and closing
//! (which answers everything still pending) can never miss one. A request
//! may hold something until it is answered (the mesh: its room in the
//! process's window), dropped when the answer arrives, whether or not its
//! asker still waits.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Mutex, MutexGuard};

use tokio::sync::oneshot;

/// Where a request's answer goes.
pub trait Answer<T>: Send {
    /// Hands over the answer.
    fn answer(self, answer: T);
}

impl<T: Send> Answer<T> for oneshot::Sender<T> {
    fn answer(self, answer: T) {
        // The asker may have stopped waiting.
        let _ = self.send(answer);
    }
}

/// Why a request was not registered.
#[derive(Debug, PartialEq, Eq)]
pub enum NotRegistered<E> {
    /// The table was closed: no answer will ever come.
    Closed,
    /// The caller's enqueue step refused (queue full, frame too large...).
    Refused(E),
}

/// Requests awaiting their answer (of type `T`, handed to an `A`), by
/// sequence number; closed for good once the connection they went out on
/// ends.
#[derive(Debug)]
pub struct PendingAnswers<T, H = (), A = oneshot::Sender<T>> {
    waiting: Mutex<Option<Waiting<A, H>>>,
    answers: PhantomData<fn(T)>,
}

/// Each pending request's answer and what it holds, by seq (our own
/// numbers: a fast hash will do).
type Waiting<A, H> = HashMap<u64, (A, H), foldhash::fast::RandomState>;

impl<T, H, A> Default for PendingAnswers<T, H, A> {
    fn default() -> Self {
        PendingAnswers {
            waiting: Mutex::new(Some(HashMap::default())),
            answers: PhantomData,
        }
    }
}

impl<T: Send> PendingAnswers<T> {
    /// Runs `enqueue` (given how many are pending now; it sends the request
    /// and returns its seq) and registers the request under that seq.
    pub fn register<E>(
        &self,
        enqueue: impl FnOnce(usize) -> Result<u64, E>,
    ) -> Result<oneshot::Receiver<T>, NotRegistered<E>> {
        self.register_holding((), enqueue)
    }
}

impl<T: Send, H> PendingAnswers<T, H> {
    /// [`PendingAnswers::register`], the request holding `held` until it
    /// is answered, forgotten or closed.
    pub fn register_holding<E>(
        &self,
        held: H,
        enqueue: impl FnOnce(usize) -> Result<u64, E>,
    ) -> Result<oneshot::Receiver<T>, NotRegistered<E>> {
        let (tx, rx) = oneshot::channel();
        match self.register_answer(tx, held, enqueue) {
            Ok(()) => Ok(rx),
            Err((_, why)) => Err(why),
        }
    }
}

impl<T, H, A: Answer<T>> PendingAnswers<T, H, A> {
    /// Runs `enqueue` (as [`PendingAnswers::register`]) and registers the
    /// request, its answer to go to `answer`; when it is not registered,
    /// `answer` comes back with the reason.
    pub fn register_answer<E>(
        &self,
        answer: A,
        held: H,
        enqueue: impl FnOnce(usize) -> Result<u64, E>,
    ) -> Result<(), (A, NotRegistered<E>)> {
        let mut waiting = self.lock();
        let Some(map) = waiting.as_mut() else {
            return Err((answer, NotRegistered::Closed));
        };
        match enqueue(map.len()) {
            Ok(seq) => {
                map.insert(seq, (answer, held));
                Ok(())
            }
            Err(refused) => Err((answer, NotRegistered::Refused(refused))),
        }
    }

    /// Delivers the answer to request `seq`; false when no such request is
    /// pending.
    pub fn resolve(&self, seq: u64, answer: T) -> bool {
        let sender = self.lock().as_mut().and_then(|map| map.remove(&seq));
        match sender {
            Some((sender, _held)) => {
                sender.answer(answer);
                true
            }
            None => false,
        }
    }

    /// Forgets request `seq` without answering it (its asker stopped
    /// waiting); false when no such request is pending.
    pub fn forget(&self, seq: u64) -> bool {
        self.lock()
            .as_mut()
            .is_some_and(|map| map.remove(&seq).is_some())
    }

    /// Closes the table and answers every pending request with
    /// `answer()`; returns how many there were. Idempotent.
    pub fn close(&self, answer: impl Fn() -> T) -> usize {
        let pending = self.lock().take();
        let mut count = 0;
        for (_, (sender, _held)) in pending.into_iter().flatten() {
            sender.answer(answer());
            count += 1;
        }
        count
    }

    /// Requests pending now.
    pub fn len(&self) -> usize {
        self.lock().as_ref().map_or(0, HashMap::len)
    }

    /// True when nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Option<Waiting<A, H>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn answers_reach_their_request_and_closing_answers_the_rest() {
        let pending = PendingAnswers::<&str>::default();
        let first = pending.register(|_| Ok::<_, ()>(1)).unwrap();
        let second = pending.register(|count| {
            assert_eq!(count, 1);
            Ok::<_, ()>(2)
        });
        assert!(pending.resolve(1, "acked"));
        assert!(!pending.resolve(1, "again"), "answered twice");
        assert_eq!(first.await.unwrap(), "acked");
        assert_eq!(
            pending.register(|_| Err::<u64, _>("full")).unwrap_err(),
            NotRegistered::Refused("full")
        );
        assert_eq!(pending.close(|| "lost"), 1);
        assert_eq!(second.unwrap().await.unwrap(), "lost");
        assert_eq!(
            pending.register(|_| Ok::<_, ()>(3)).unwrap_err(),
            NotRegistered::Closed
        );
    }

    #[tokio::test]
    async fn what_a_request_holds_is_dropped_when_it_is_answered_even_if_no_one_waits() {
        let held = std::sync::Arc::new(());
        let pending = PendingAnswers::<&str, std::sync::Arc<()>>::default();
        let answer = pending
            .register_holding(held.clone(), |_| Ok::<_, ()>(1))
            .unwrap();
        drop(answer);
        assert_eq!(std::sync::Arc::strong_count(&held), 2);
        assert!(pending.resolve(1, "acked"));
        assert_eq!(std::sync::Arc::strong_count(&held), 1);
        pending
            .register_holding(held.clone(), |_| Ok::<_, ()>(2))
            .unwrap();
        assert_eq!(pending.close(|| "lost"), 1);
        assert_eq!(std::sync::Arc::strong_count(&held), 1);
    }
}
