//! Durations in the configuration: humantime text (`"30s"`, `"5m"`,
//! `"1h 30m"`), at most [`MAX_DURATION`]. Unbounded, a duration such as
//! `"500000000years"` parses, then panics the node the first time it is
//! added to a clock; bounded, it is refused when the file is read, naming
//! its key like every other bad value.

use std::time::Duration;

use serde::de::Error as _;
use serde::{Deserializer, Serializer};

/// The longest duration a setting takes: one year, humantime's (365.25
/// days; every timeout, interval and time to live of the relay is far below
/// it).
pub(super) const MAX_DURATION: Duration = Duration::from_secs(31_557_600);

/// Reads a duration, refusing one above [`MAX_DURATION`].
pub(super) fn deserialize<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Duration, D::Error> {
    let duration: Duration = humantime_serde::deserialize(deserializer)?;
    check(duration).map_err(D::Error::custom)
}

/// Writes a duration as humantime text.
pub(super) fn serialize<S: Serializer>(
    duration: &Duration,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    humantime_serde::serialize(duration, serializer)
}

/// `duration`, or why it is too long.
pub(super) fn check(duration: Duration) -> Result<Duration, String> {
    if duration > MAX_DURATION {
        return Err(format!(
            "`{}` is too long: a duration here is at most {}",
            humantime_serde::re::humantime::format_duration(duration),
            humantime_serde::re::humantime::format_duration(MAX_DURATION)
        ));
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_year_is_taken_and_longer_is_refused_with_both_lengths() {
        assert_eq!(check(MAX_DURATION), Ok(MAX_DURATION));
        let error = check(MAX_DURATION + Duration::from_secs(1)).unwrap_err();
        assert!(error.contains("is too long"), "{error}");
        assert!(error.contains("at most 1year"), "{error}");
    }
}
