//! Retrying with exponential backoff inside a time budget, giving up early
//! when the work is aborted (shutdown, revoked partition).

use std::time::Instant;

use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::Backoff;

use crate::config::RetryConfig;

/// The result of one attempt; `E` says what went wrong.
#[derive(Debug)]
pub enum Attempt<T, E = String> {
    /// Done.
    Success(T),
    /// Failed in a way that may pass on a later attempt.
    Retry(E),
    /// Failed for good: do not retry (dead-letter).
    GiveUp(E),
}

/// The result of retrying.
#[derive(Debug, PartialEq, Eq)]
pub enum Retried<T, E = String> {
    /// An attempt succeeded.
    Success(T),
    /// Failed for good, or the budget ran out (`budget_spent`).
    Failed {
        /// The last attempt's error.
        error: E,
        /// Attempts made.
        attempts: u32,
        /// True when retries stopped because the time budget was spent.
        budget_spent: bool,
    },
    /// Aborted before success: the caller must not treat the work as done.
    Aborted,
}

/// The dead-letter reason of a retried failure: the last error, and the
/// attempts made when the budget ran out.
pub(crate) fn failure_reason(error: &str, attempts: u32, budget_spent: bool) -> String {
    if budget_spent {
        format!("{error} (retry budget spent after {attempts} attempts)")
    } else {
        error.to_string()
    }
}

/// Runs `attempt` until it succeeds, gives up, the budget is spent, or
/// `abort` is cancelled. `on_retry` is called before each wait (for metrics).
pub async fn retry<T, E, F, Fut>(
    policy: &RetryConfig,
    abort: &CancellationToken,
    on_retry: impl FnMut(&E),
    attempt: F,
) -> Retried<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Attempt<T, E>>,
{
    retry_after(None, policy, abort, on_retry, attempt).await
}

/// [`retry`], when the first attempt was already made elsewhere (a batch's
/// one call for many records): `first` is its result, which counts as
/// attempt 1 and is followed, if it asks for a retry, by the same pause
/// as any other.
pub async fn retry_after<T, E, F, Fut>(
    mut first: Option<Attempt<T, E>>,
    policy: &RetryConfig,
    abort: &CancellationToken,
    mut on_retry: impl FnMut(&E),
    mut attempt: F,
) -> Retried<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Attempt<T, E>>,
{
    let started = Instant::now();
    let mut backoff = Backoff::new(policy.initial_backoff, policy.max_backoff);
    let mut attempts = 0u32;
    loop {
        if abort.is_cancelled() {
            return Retried::Aborted;
        }
        attempts += 1;
        let result = match first.take() {
            Some(result) => result,
            None => tokio::select! {
                biased;
                _ = abort.cancelled() => return Retried::Aborted,
                result = attempt() => result,
            },
        };
        let error = match result {
            Attempt::Success(value) => return Retried::Success(value),
            Attempt::GiveUp(error) => {
                return Retried::Failed {
                    error,
                    attempts,
                    budget_spent: false,
                };
            }
            Attempt::Retry(error) => error,
        };
        let pause = backoff.next_pause();
        if started.elapsed() + pause > policy.budget {
            return Retried::Failed {
                error,
                attempts,
                budget_spent: true,
            };
        }
        on_retry(&error);
        tokio::select! {
            biased;
            _ = abort.cancelled() => return Retried::Aborted,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn policy(budget_ms: u64) -> RetryConfig {
        RetryConfig {
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(40),
            budget: Duration::from_millis(budget_ms),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retries_until_success() {
        let mut calls = 0;
        let mut retries = 0;
        let result: Retried<i32> = retry(
            &policy(10_000),
            &CancellationToken::new(),
            |_| retries += 1,
            || {
                calls += 1;
                let n = calls;
                async move {
                    if n < 4 {
                        Attempt::Retry("not yet".to_string())
                    } else {
                        Attempt::Success(n)
                    }
                }
            },
        )
        .await;
        assert_eq!(result, Retried::Success(4));
        assert_eq!(retries, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_attempt_made_elsewhere_counts_and_is_followed_by_a_pause() {
        let started = tokio::time::Instant::now();
        let mut calls = 0;
        let mut retries = 0;
        let result: Retried<i32> = retry_after(
            Some(Attempt::Retry("the batch's call failed".to_string())),
            &policy(10_000),
            &CancellationToken::new(),
            |_| retries += 1,
            || {
                calls += 1;
                async { Attempt::Success(7) }
            },
        )
        .await;
        assert_eq!(result, Retried::Success(7));
        assert_eq!((calls, retries), (1, 1), "one more call, after one retry");
        assert!(
            started.elapsed() >= Duration::from_millis(5),
            "paused first: at least half the 10 ms initial pause"
        );

        // A first attempt that settled is the result, with no call.
        let mut calls = 0;
        let given_up: Retried<i32> = retry_after(
            Some(Attempt::GiveUp("refused".to_string())),
            &policy(10_000),
            &CancellationToken::new(),
            |_| {},
            || {
                calls += 1;
                async { Attempt::Success(7) }
            },
        )
        .await;
        assert_eq!(
            given_up,
            Retried::Failed {
                error: "refused".to_string(),
                attempts: 1,
                budget_spent: false
            }
        );
        assert_eq!(calls, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_when_the_budget_is_spent() {
        let result: Retried<()> = retry(
            &policy(200),
            &CancellationToken::new(),
            |_| {},
            || async { Attempt::Retry("app answered 500".to_string()) },
        )
        .await;
        match result {
            Retried::Failed {
                error,
                attempts,
                budget_spent,
            } => {
                assert!(error.contains("app answered 500"), "{error}");
                assert!(attempts > 3, "{attempts}");
                assert!(budget_spent);
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn give_up_is_immediate_and_abort_wins() {
        let result: Retried<()> = retry(
            &policy(10_000),
            &CancellationToken::new(),
            |_| {},
            || async { Attempt::GiveUp("400".to_string()) },
        )
        .await;
        assert_eq!(
            result,
            Retried::Failed {
                error: "400".into(),
                attempts: 1,
                budget_spent: false
            }
        );
        let abort = CancellationToken::new();
        abort.cancel();
        let result: Retried<()> = retry(
            &policy(10_000),
            &abort,
            |_: &String| {},
            || async { Attempt::Success(()) },
        )
        .await;
        assert_eq!(result, Retried::Aborted);
    }
}
