//! The plugin executor: a few dedicated threads that run processor calls,
//! merging the messages waiting for the same plugin version into one
//! `process-batch` call.
//!
//! Why not one blocking-pool task per call: a call of a small plugin takes
//! under a microsecond, and handing each one to a pool thread and back costs
//! several. Here every record in flight asks for its call (a [`Job`]); a free
//! executor thread takes the oldest job and every other queued job for the
//! same version (up to [`MAX_BATCH_MESSAGES`] messages), makes one call and
//! answers each job with its own part. Nothing waits to fill a batch: a
//! batch is what is ready, so latency is never traded for it.
//!
//! Handing a job to a sleeping thread costs a futex wake and two context
//! switches, many times the call itself. So a thread that runs out of jobs
//! keeps looking for a while ([`SPIN`]) before it sleeps, and a caller wakes
//! a thread only when none is awake: under steady traffic the jobs flow
//! without a system call, and an idle relay sleeps as before.
//!
//! When a merged call fails as a whole (a trap, the deadline, the memory
//! cap), the jobs are called again one by one, so only the job that caused
//! it gets the error.
//!
//! Every job is answered with its messages handed back, even when the call
//! panics in the host ([`call`]): a caller that gave its messages away for
//! the call gets them back for its retry or dead letter, and the thread
//! goes on.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::bindings::{Message, Outcome};
use super::error::{PluginError, VersionLabel};
use super::version::PluginVersion;

/// The most messages merged into one call.
pub const MAX_BATCH_MESSAGES: usize = 256;

/// How long a thread out of jobs keeps looking for one before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// The answers to one job: one per message, or an error for all of them.
pub type BatchAnswers = Result<Vec<Result<Outcome, PluginError>>, PluginError>;

/// One call asked for: messages for a version, and where the answers go
/// (with the messages, handed back: a caller that still needs them, for a
/// retry or a dead letter, need not copy them first).
struct Job {
    version: Arc<PluginVersion>,
    messages: Vec<Message>,
    reply: oneshot::Sender<(Vec<Message>, BatchAnswers)>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
    /// Threads waiting on `ready`.
    sleeping: usize,
    /// Threads out of jobs and looking for one before they sleep.
    looking: usize,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

/// Runs processor calls on its own threads; dropping it stops the threads
/// once the queued jobs are done.
pub struct PluginExecutor {
    shared: Arc<Shared>,
    threads: usize,
}

impl std::fmt::Debug for PluginExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginExecutor")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl PluginExecutor {
    /// Starts `threads` executor threads (at least one).
    pub fn start(threads: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
        });
        let threads = threads.max(1);
        for index in 0..threads {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("plugin-exec-{index}"))
                .spawn(move || shared.work())?;
        }
        Ok(PluginExecutor { shared, threads })
    }

    /// One thread per core, and at least two, so that one slow call does
    /// not hold up every other.
    pub fn default_threads() -> usize {
        std::thread::available_parallelism()
            .map(usize::from)
            .unwrap_or(2)
            .max(2)
    }

    /// Processes `messages` with `version` (one answer per message, in
    /// order), possibly in one call with other jobs for the same version.
    pub async fn process_batch(
        &self,
        version: Arc<PluginVersion>,
        messages: Vec<Message>,
    ) -> (Vec<Message>, BatchAnswers) {
        let (reply, answer) = oneshot::channel();
        let wake = {
            let mut queue = self
                .shared
                .queue
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            queue.jobs.push_back(Job {
                version: version.clone(),
                messages,
                reply,
            });
            // A thread looking for a job finds it without being told (one
            // busy with a call does not count: it may be a slow one).
            queue.sleeping > 0 && queue.jobs.len() > queue.looking
        };
        if wake {
            self.shared.ready.notify_one();
        }
        answer.await.unwrap_or_else(|_| {
            // Only at shutdown (the messages went with the job); worth a
            // retry, not a dead letter.
            (
                Vec::new(),
                Err(PluginError::Instantiate {
                    version: version.label().clone(),
                    cause: "the plugin executor stopped before answering".into(),
                }),
            )
        })
    }
}

impl Drop for PluginExecutor {
    fn drop(&mut self) {
        if let Ok(mut queue) = self.shared.queue.lock() {
            queue.closed = true;
        }
        self.shared.ready.notify_all();
    }
}

impl Shared {
    fn work(&self) {
        while let Some(jobs) = self.next_jobs() {
            run(jobs);
        }
    }

    /// The oldest job and the queued jobs for the same version after it (up
    /// to [`MAX_BATCH_MESSAGES`] messages); `None` once closed and empty.
    /// Looks for [`SPIN`] before it sleeps.
    fn next_jobs(&self) -> Option<Vec<Job>> {
        let mut queue = self
            .queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut looking_since: Option<Instant> = None;
        loop {
            if let Some(first) = queue.jobs.pop_front() {
                if looking_since.is_some() {
                    queue.looking -= 1;
                }
                let mut messages = first.messages.len();
                let mut jobs = vec![first];
                let mut index = 0;
                while index < queue.jobs.len() && messages < MAX_BATCH_MESSAGES {
                    let job = &queue.jobs[index];
                    if Arc::ptr_eq(&job.version, &jobs[0].version)
                        && messages + job.messages.len() <= MAX_BATCH_MESSAGES
                    {
                        messages += job.messages.len();
                        if let Some(job) = queue.jobs.remove(index) {
                            jobs.push(job);
                        }
                    } else {
                        index += 1;
                    }
                }
                return Some(jobs);
            }
            if queue.closed {
                if looking_since.is_some() {
                    queue.looking -= 1;
                }
                return None;
            }
            let since = *looking_since.get_or_insert_with(|| {
                queue.looking += 1;
                Instant::now()
            });
            if since.elapsed() < SPIN {
                drop(queue);
                std::thread::yield_now();
                queue = self
                    .queue
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                continue;
            }
            queue.looking -= 1;
            queue.sleeping += 1;
            queue = self
                .ready
                .wait(queue)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            queue.sleeping -= 1;
            looking_since = None;
        }
    }
}

/// `version`'s call for `messages`; a panic in the host during the call is
/// its answer as a retryable error (the messages stay with the caller, and
/// the thread goes on).
pub(crate) fn call(version: &PluginVersion, messages: &[Message]) -> BatchAnswers {
    answer_even_if_it_panics(version.label(), || version.process_batch(messages))
}

/// What `call_plugin` answers, or, should it panic, an error saying so
/// (retryable: the call may pass on another instance).
fn answer_even_if_it_panics(
    label: &VersionLabel,
    call_plugin: impl FnOnce() -> BatchAnswers,
) -> BatchAnswers {
    std::panic::catch_unwind(AssertUnwindSafe(call_plugin)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string());
        tracing::error!(plugin = %label, panic = %what, "a plugin call panicked in the host");
        Err(PluginError::Instantiate {
            version: label.clone(),
            cause: format!("the call panicked in the host: {what}"),
        })
    })
}

/// Makes one call for `jobs` (all for one version) and answers each, with
/// its messages handed back; a failed merged call is made again job by job.
fn run(mut jobs: Vec<Job>) {
    if jobs.len() == 1 {
        let job = jobs.pop().expect("one job");
        let answers = call(&job.version, &job.messages);
        let _ = job.reply.send((job.messages, answers));
        return;
    }
    let version = jobs[0].version.clone();
    let counts: Vec<usize> = jobs.iter().map(|job| job.messages.len()).collect();
    let mut merged = Vec::with_capacity(counts.iter().sum());
    for job in &mut jobs {
        merged.append(&mut job.messages);
    }
    let answers = call(&version, &merged);
    // Give the messages back to their jobs.
    let mut merged = merged.into_iter();
    for (job, count) in jobs.iter_mut().zip(&counts) {
        job.messages = merged.by_ref().take(*count).collect();
    }
    match answers {
        Ok(answers) => {
            let mut answers = answers.into_iter();
            for (job, count) in jobs.into_iter().zip(counts) {
                let _ = job
                    .reply
                    .send((job.messages, Ok(answers.by_ref().take(count).collect())));
            }
        }
        Err(_) => {
            // Call each alone: the failure may be one job's.
            for job in jobs {
                let answers = call(&job.version, &job.messages);
                let _ = job.reply.send((job.messages, answers));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label() -> VersionLabel {
        VersionLabel {
            name: "p".into(),
            sha256: "0".repeat(64),
        }
    }

    #[test]
    fn a_call_that_panics_in_the_host_is_answered_with_a_retryable_error() {
        let answer = answer_even_if_it_panics(&label(), || panic!("host bug"));
        match answer {
            Err(error @ PluginError::Instantiate { .. }) => {
                assert!(error.is_retryable());
                assert!(error.to_string().contains("host bug"), "{error}");
            }
            other => panic!("expected an error, got {other:?}"),
        }
        // A call that does not panic is answered as it answers.
        assert!(matches!(
            answer_even_if_it_panics(&label(), || Ok(Vec::new())),
            Ok(answers) if answers.is_empty()
        ));
    }
}
