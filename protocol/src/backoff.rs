//! Exponential backoff with jitter: the one pacing of every retry loop in
//! wasmrelay (flow retries, cluster deliveries, etcd reconnects, mesh
//! links, the client SDK's reconnects).
//!
//! It lives in the protocol crate because that is the crate the relay and
//! the client SDK share; it knows nothing of frames.

use std::time::Duration;

use rand::Rng as _;

/// Pauses that double from `initial` up to `max`; each pause is drawn
/// uniformly from the upper half of the current step (`[step/2, step]`), so
/// that many parties failing at once do not retry in lockstep.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    /// A backoff starting at `initial` (clamped to `max`).
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        let initial = initial.min(max);
        Backoff {
            initial,
            max,
            current: initial,
        }
    }

    /// The next pause; the step after it is twice as long (at most `max`).
    pub fn next_pause(&mut self) -> Duration {
        let step = self.current;
        self.current = (self.current * 2).min(self.max);
        let half = step / 2;
        let spread = u64::try_from((step - half).as_micros()).unwrap_or(u64::MAX);
        half + Duration::from_micros(rand::rng().random_range(0..=spread))
    }

    /// Starts again from the initial pause (after a success, or a
    /// connection that stayed up long enough to count as healthy).
    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}

/// A pause drawn uniformly from `[0, max]`: spreads a crowd told to do the
/// same thing at once (e.g. processes told to reconnect elsewhere by a
/// `Rebalance`) over `max`.
pub fn jitter(max: Duration) -> Duration {
    let spread = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(rand::rng().random_range(0..=spread))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_bound_and_spreads() {
        let max = Duration::from_millis(1000);
        let pauses: Vec<Duration> = (0..200).map(|_| jitter(max)).collect();
        assert!(pauses.iter().all(|p| *p <= max));
        assert!(pauses.iter().any(|p| *p < max / 2));
        assert!(pauses.iter().any(|p| *p > max / 2));
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn pauses_double_up_to_the_maximum_with_jitter() {
        let initial = Duration::from_millis(100);
        let max = Duration::from_millis(800);
        let mut backoff = Backoff::new(initial, max);
        for step in [100, 200, 400, 800, 800, 800] {
            let step = Duration::from_millis(step);
            let pause = backoff.next_pause();
            assert!(pause >= step / 2 && pause <= step, "{pause:?} for {step:?}");
        }
        backoff.reset();
        assert!(backoff.next_pause() <= initial);
    }

    #[test]
    fn pauses_are_spread_not_identical() {
        let mut pauses = std::collections::BTreeSet::new();
        for _ in 0..20 {
            pauses
                .insert(Backoff::new(Duration::from_secs(1), Duration::from_secs(1)).next_pause());
        }
        assert!(pauses.len() > 1, "twenty draws gave one pause: {pauses:?}");
    }

    #[test]
    fn an_initial_pause_above_the_maximum_is_clamped() {
        let mut backoff = Backoff::new(Duration::from_secs(10), Duration::from_secs(1));
        assert!(backoff.next_pause() <= Duration::from_secs(1));
    }
}
