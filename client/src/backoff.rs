//! Exponential backoff with jitter between reconnection rounds.

use std::hash::{BuildHasher, RandomState};
use std::time::{Duration, Instant};

/// Pauses that double from `initial` up to `max`; each pause is drawn
/// uniformly from the upper half of the current step, so that many clients
/// cut off at once do not reconnect in lockstep.
#[derive(Debug)]
pub(crate) struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
    random: RandomState,
    draws: u64,
}

impl Backoff {
    /// A backoff starting at `initial` (clamped to `max`).
    pub(crate) fn new(initial: Duration, max: Duration) -> Backoff {
        let initial = initial.min(max);
        Backoff {
            initial,
            max,
            current: initial,
            random: RandomState::new(),
            draws: 0,
        }
    }

    /// The next pause; the step after it is twice as long (at most `max`).
    pub(crate) fn next_pause(&mut self) -> Duration {
        let step = self.current;
        self.current = (self.current * 2).min(self.max);
        let half = step / 2;
        let jitter_range = u64::try_from((step - half).as_micros()).unwrap_or(u64::MAX);
        self.draws += 1;
        let draw = self.random.hash_one((self.draws, Instant::now()));
        half + Duration::from_micros(draw % jitter_range.saturating_add(1))
    }

    /// Starts again from the initial pause (after a connection that stayed
    /// up long enough to be considered healthy).
    pub(crate) fn reset(&mut self) {
        self.current = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
