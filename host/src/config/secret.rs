//! A value that must never be printed: passwords, tokens, the cluster
//! secret, secret librdkafka properties.
//!
//! [`Secret`] renders as `***` in `Debug`, `Display` and when serialized, so
//! a secret cannot reach a log line, an admin API body or an error text by
//! accident; [`Secret::expose`] is the one way to the value, for the code
//! that hands it to a client library. [`redact`] scrubs known secret values
//! out of text that came from elsewhere (librdkafka echoes property values
//! in its configuration errors).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What a secret looks like wherever it is shown.
pub const REDACTED: &str = "***";

/// A secret string. Compares by value; prints as [`REDACTED`].
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value itself, for the client library that needs it. Never log
    /// or format what this returns.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// True when the value is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Secret)
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

/// `text` with every occurrence of each secret's value replaced by
/// [`REDACTED`] (values shorter than 3 characters are left alone: replacing
/// them would garble the text and they cannot be guessed from it anyway).
pub fn redact<'a>(text: &str, secrets: impl IntoIterator<Item = &'a Secret>) -> String {
    let mut values: Vec<&str> = secrets
        .into_iter()
        .map(Secret::expose)
        .filter(|v| v.len() >= 3)
        .collect();
    // Longest first, so a secret containing another is replaced whole.
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
    let mut out = text.to_string();
    for value in values {
        out = out.replace(value, REDACTED);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_prints_its_value() {
        let secret = Secret::new("hunter2-password");
        assert_eq!(format!("{secret}"), REDACTED);
        assert_eq!(format!("{secret:?}"), REDACTED);
        assert_eq!(format!("{:?}", Some(&secret)), "Some(***)");
        assert_eq!(
            serde_json::to_string(&secret).unwrap_or_default(),
            "\"***\""
        );
        assert_eq!(secret.expose(), "hunter2-password");
    }

    #[test]
    fn redact_scrubs_every_occurrence_longest_first() {
        let secrets = [Secret::new("abc"), Secret::new("abcdef")];
        assert_eq!(
            redact("x abcdef y abc z abcdef", &secrets),
            "x *** y *** z ***"
        );
        assert_eq!(redact("ab", &[Secret::new("ab")]), "ab");
    }
}
