//! What a config-center value may set: connection properties only.
//!
//! Whoever can write one center key (a ConfigMap, an etcd key) must not be
//! able to run code in the relay or weaken its delivery guarantees, so a
//! center value is held to an allowlist: where the brokers are and how to
//! authenticate to them (SASL credentials, TLS material given inline as
//! PEM), the client's name and rack, and timeouts and backoffs. Anything
//! else is refused with an error naming the property: librdkafka plugins
//! (`plugin.library.paths`), OpenSSL engines and providers, commands
//! (`sasl.kerberos.kinit.cmd`), URLs librdkafka fetches, producer durability
//! (`acks`, idempotence, retries: the relay's), and every property not
//! listed (set those in the config file's `[links.<id>.options]`, which is
//! the operator's).
//!
//! Files (`ssl.ca.location`, `ssl.key.location`, `sasl.kerberos.keytab`...)
//! are allowed only inside the center's `files_dir`: the path is resolved
//! (symlinks and `..` included) and must stay inside that directory, and
//! the resolved path is what librdkafka gets. The directory is meant to be
//! written by the operator only (a mounted Secret): the check proves where
//! a path leads when the value arrives, not who wrote the file there.
//!
//! Owns the allowlist and the path check; not the parsing of a value (see
//! [`super::link::LinkInfo::from_center_value`]) nor the config file's
//! options (see `config::validate`).

use std::path::{Component, Path, PathBuf};

use super::link::is_secret;

/// Connection properties a center value may set as they are.
const CONNECTION_PROPERTIES: &[&str] = &[
    "security.protocol",
    "sasl.mechanism",
    "sasl.mechanisms",
    "sasl.username",
    "sasl.password",
    // OAUTHBEARER: credentials and the unsecured-JWT config, no URL or file.
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.method",
    "sasl.oauthbearer.client.id",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.scope",
    "sasl.oauthbearer.extensions",
    // TLS material inline, and how the broker is verified.
    "ssl.ca.pem",
    "ssl.certificate.pem",
    "ssl.key.pem",
    "ssl.key.password",
    "ssl.keystore.password",
    "ssl.endpoint.identification.algorithm",
    "ssl.cipher.suites",
    "ssl.curves.list",
    "ssl.sigalgs.list",
    "client.id",
    "client.rack",
    "client.dns.lookup",
    "broker.address.family",
];

/// Properties that take one of a few words, with the words.
const CHOICE_PROPERTIES: &[(&str, &[&str])] = &[
    // Whether to bootstrap again when every broker is down (see
    // `link::RELAY_DEFAULTS`).
    ("metadata.recovery.strategy", &["none", "rebootstrap"]),
];

/// Durations (milliseconds) and counts a center value may set; the value
/// must be a whole number.
const TIMING_PROPERTIES: &[&str] = &[
    "socket.timeout.ms",
    "socket.connection.setup.timeout.ms",
    "connections.max.idle.ms",
    "request.timeout.ms",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "metadata.max.age.ms",
    "topic.metadata.refresh.interval.ms",
    "reconnect.backoff.ms",
    "reconnect.backoff.max.ms",
    "retry.backoff.ms",
    "retry.backoff.max.ms",
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "max.poll.interval.ms",
    "sasl.kerberos.min.time.before.relogin",
];

/// Kerberos names: interpolated by librdkafka into the `kinit` shell
/// command, so only a conservative character set is accepted.
const KERBEROS_NAMES: &[&str] = &["sasl.kerberos.service.name", "sasl.kerberos.principal"];

/// Properties naming a file librdkafka reads: allowed inside `files_dir`.
const FILE_PROPERTIES: &[&str] = &[
    "ssl.ca.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.crl.location",
    "ssl.keystore.location",
    "sasl.kerberos.keytab",
    "https.ca.location",
    "sasl.oauthbearer.assertion.private.key.file",
    "sasl.oauthbearer.assertion.file",
    "sasl.oauthbearer.assertion.jwt.template.file",
];

/// Why a property outside the allowlist is refused, for the classes that
/// deserve more than "not a connection property".
fn refusal_reason(property: &str) -> &'static str {
    match property {
        "plugin.library.paths" | "ssl.engine.location" | "ssl.engine.id" | "ssl.providers" => {
            "it makes librdkafka load native code"
        }
        "sasl.kerberos.kinit.cmd" => "it is a command librdkafka runs",
        "sasl.oauthbearer.token.endpoint.url" => {
            "it is a URL librdkafka fetches (with the client secret); set it in the config file"
        }
        "acks"
        | "request.required.acks"
        | "enable.idempotence"
        | "enable.gapless.guarantee"
        | "max.in.flight"
        | "max.in.flight.requests.per.connection"
        | "retries"
        | "message.send.max.retries" => {
            "producer durability is the relay's: it always produces with acks=all and \
             idempotence"
        }
        p if p.starts_with("interceptor") || p.contains("_cb") => {
            "it is a hook into librdkafka, not a connection property"
        }
        _ => {
            "it is not a connection property (a center value may set `bootstrap.servers`, \
             `security.protocol`, SASL credentials, TLS material as inline PEM, `client.id`, \
             `client.rack`, timeouts and backoffs, and files inside the center's `files_dir`); \
             set it in the config file's `[links.<id>.options]`"
        }
    }
}

/// What a config-center value may set beyond the connection properties:
/// where the files it names must lie.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CenterPolicy {
    /// The directory files named by a center value must lie in (the
    /// center's `files_dir`); without it no file property is accepted.
    pub files_dir: Option<PathBuf>,
}

impl CenterPolicy {
    /// Checks one property of a center value (other than
    /// `bootstrap.servers`) and returns the value librdkafka gets: the
    /// value itself, or for a file the resolved path. The error names the
    /// property and never quotes a secret value.
    pub fn check(&self, property: &str, value: &str) -> Result<String, String> {
        if CONNECTION_PROPERTIES.contains(&property) {
            return Ok(value.to_string());
        }
        if TIMING_PROPERTIES.contains(&property) {
            return match value.trim().parse::<u64>() {
                Ok(_) => Ok(value.trim().to_string()),
                Err(_) => Err(format!(
                    "`{property}`: expected a whole number (milliseconds or a count), got `{value}`"
                )),
            };
        }
        if let Some((_, words)) = CHOICE_PROPERTIES.iter().find(|(p, _)| *p == property) {
            return if words.contains(&value) {
                Ok(value.to_string())
            } else {
                Err(format!(
                    "`{property}`: expected one of `{}`, got `{value}`",
                    words.join("`, `")
                ))
            };
        }
        if KERBEROS_NAMES.contains(&property) {
            let safe = !value.is_empty()
                && value
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-/@".contains(&b));
            return if safe {
                Ok(value.to_string())
            } else {
                Err(format!(
                    "`{property}` may hold only ASCII letters, digits and `._-/@` (librdkafka \
                     puts it into the kinit shell command)"
                ))
            };
        }
        if FILE_PROPERTIES.contains(&property) {
            return self.file(property, value);
        }
        Err(format!(
            "`{property}` may not be set by the config center: {}",
            refusal_reason(property)
        ))
    }

    /// A file property: the resolved path, when it lies inside `files_dir`.
    fn file(&self, property: &str, value: &str) -> Result<String, String> {
        // The path is not secret, but a property named like one is treated
        // as one everywhere: its value is not quoted.
        let shown = if is_secret(property) {
            String::new()
        } else {
            format!(" `{value}`")
        };
        if (property == "ssl.ca.location" || property == "https.ca.location") && value == "probe" {
            // The system's CA stores: no file of the center's choosing.
            return Ok(value.to_string());
        }
        let Some(dir) = &self.files_dir else {
            return Err(format!(
                "`{property}` names a file{shown}, and the center has no `files_dir` to hold \
                 such files: give the material inline as PEM, or set `files_dir` in `[center]`"
            ));
        };
        let path = Path::new(value);
        if value.is_empty() || path.components().any(|c| c == Component::ParentDir) {
            return Err(format!(
                "`{property}`: the path{shown} must name a file inside `files_dir` ({}) without \
                 `..`",
                dir.display()
            ));
        }
        let outside = || {
            format!(
                "`{property}`: the path{shown} is not inside the center's `files_dir` ({})",
                dir.display()
            )
        };
        let root = dir.canonicalize().map_err(|e| {
            format!(
                "`{property}`: the center's `files_dir` {} cannot be read: {e}",
                dir.display()
            )
        })?;
        let joined = if path.is_absolute() {
            path.to_path_buf()
        } else {
            root.join(path)
        };
        // A lexical check first, so that a path outside is refused as such
        // whether it exists or not (and its existence is not disclosed).
        if path.is_absolute() && !joined.starts_with(dir) && !joined.starts_with(&root) {
            return Err(outside());
        }
        let resolved = joined.canonicalize().map_err(|e| {
            format!("`{property}`: the file{shown} inside `files_dir` cannot be read: {e}")
        })?;
        if !resolved.starts_with(&root) {
            return Err(outside());
        }
        if !resolved.is_file() {
            return Err(format!("`{property}`: the path{shown} is not a file"));
        }
        let text = resolved.to_str().ok_or_else(outside)?;
        // `sasl.kerberos.keytab` goes into the kinit shell command, in quotes.
        if property == "sasl.kerberos.keytab"
            && !text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-/+@".contains(&b))
        {
            return Err(format!(
                "`{property}`: the resolved path may hold only ASCII letters, digits and \
                 `._-/+@` (librdkafka puts it into the kinit shell command)"
            ));
        }
        Ok(text.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(policy: &CenterPolicy, property: &str, value: &str) -> String {
        policy
            .check(property, value)
            .expect_err(&format!("`{property}` = `{value}` was accepted"))
    }

    #[test]
    fn connection_properties_pass_as_they_are() {
        let policy = CenterPolicy::default();
        for (property, value) in [
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanisms", "SCRAM-SHA-512"),
            ("sasl.username", "relay"),
            ("sasl.password", "pw"),
            ("ssl.ca.pem", "-----BEGIN CERTIFICATE-----\n..."),
            ("ssl.key.pem", "-----BEGIN PRIVATE KEY-----\n..."),
            ("ssl.endpoint.identification.algorithm", "https"),
            ("client.id", "relay-1"),
            ("client.rack", "eu-1a"),
            ("sasl.kerberos.principal", "relay/host@EXAMPLE.COM"),
        ] {
            assert_eq!(policy.check(property, value).as_deref(), Ok(value));
        }
        assert_eq!(
            policy.check("socket.timeout.ms", " 30000").as_deref(),
            Ok("30000")
        );
        let error = refused(&policy, "request.timeout.ms", "soon");
        assert!(error.contains("`request.timeout.ms`"), "{error}");
        assert_eq!(
            policy
                .check("metadata.recovery.strategy", "rebootstrap")
                .as_deref(),
            Ok("rebootstrap")
        );
        let error = refused(&policy, "metadata.recovery.strategy", "sometimes");
        assert!(
            error.contains("expected one of `none`, `rebootstrap`, got `sometimes`"),
            "{error}"
        );
    }

    #[test]
    fn code_commands_urls_and_durability_are_refused_by_name() {
        let policy = CenterPolicy::default();
        for (property, why) in [
            ("plugin.library.paths", "load native code"),
            ("ssl.engine.location", "load native code"),
            ("ssl.providers", "load native code"),
            ("sasl.kerberos.kinit.cmd", "a command"),
            ("sasl.oauthbearer.token.endpoint.url", "a URL"),
            ("acks", "durability is the relay's"),
            ("request.required.acks", "durability is the relay's"),
            ("enable.idempotence", "durability is the relay's"),
            ("max.in.flight.requests.per.connection", "durability"),
            ("retries", "durability"),
            ("interceptors", "a hook"),
            ("group.id", "not a connection property"),
            ("batch.num.messages", "not a connection property"),
            (
                "enable.ssl.certificate.verification",
                "[links.<id>.options]",
            ),
        ] {
            let error = refused(&policy, property, "x");
            assert!(error.starts_with(&format!("`{property}` ")), "{error}");
            assert!(error.contains(why), "{property}: {error}");
        }
    }

    #[test]
    fn kerberos_names_cannot_smuggle_shell() {
        let policy = CenterPolicy::default();
        for value in ["x; touch /tmp/p", "$(id)", "a`b`", "a b", ""] {
            let error = refused(&policy, "sasl.kerberos.principal", value);
            assert!(error.contains("kinit"), "{error}");
        }
    }

    #[test]
    fn files_are_refused_without_a_files_dir() {
        let error = refused(
            &CenterPolicy::default(),
            "ssl.ca.location",
            "/etc/ssl/ca.pem",
        );
        assert!(
            error.starts_with("`ssl.ca.location` names a file"),
            "{error}"
        );
        assert!(error.contains("files_dir"), "{error}");
        // The system stores are no file of the center's choosing.
        assert_eq!(
            CenterPolicy::default()
                .check("ssl.ca.location", "probe")
                .as_deref(),
            Ok("probe")
        );
    }

    #[test]
    fn files_inside_the_files_dir_pass_resolved() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("tls")).unwrap();
        std::fs::write(dir.path().join("tls/ca.pem"), "pem").unwrap();
        let policy = CenterPolicy {
            files_dir: Some(dir.path().to_path_buf()),
        };
        let root = dir.path().canonicalize().unwrap();
        let expected = root.join("tls/ca.pem").display().to_string();
        let absolute = dir.path().join("tls/ca.pem").display().to_string();
        assert_eq!(
            policy.check("ssl.ca.location", &absolute).as_deref(),
            Ok(expected.as_str())
        );
        // Relative to files_dir.
        assert_eq!(
            policy.check("ssl.ca.location", "tls/ca.pem").as_deref(),
            Ok(expected.as_str())
        );
        // A ConfigMap-style symlink that stays inside is fine.
        std::os::unix::fs::symlink("tls/ca.pem", dir.path().join("ca.pem")).unwrap();
        assert_eq!(
            policy.check("ssl.ca.location", "ca.pem").as_deref(),
            Ok(expected.as_str())
        );
    }

    #[test]
    fn files_outside_the_files_dir_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let policy = CenterPolicy {
            files_dir: Some(dir.path().to_path_buf()),
        };
        let error = refused(&policy, "ssl.key.location", "/etc/shadow");
        assert!(
            error.starts_with("`ssl.key.location`: the path is not inside"),
            "{error}"
        );
        // A secret-named property's path is not quoted.
        assert!(!error.contains("/etc/shadow"), "{error}");
        let error = refused(&policy, "ssl.ca.location", "/etc/passwd");
        assert!(error.contains("`/etc/passwd` is not inside"), "{error}");
        for dotted in [
            "../etc/passwd".to_string(),
            format!("{}/../x", dir.path().display()),
        ] {
            let error = refused(&policy, "ssl.ca.location", &dotted);
            assert!(error.contains("without `..`"), "{error}");
        }
        let error = refused(&policy, "ssl.ca.location", "missing.pem");
        assert!(error.contains("cannot be read"), "{error}");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let error = refused(&policy, "ssl.ca.location", "sub");
        assert!(error.contains("is not a file"), "{error}");
    }

    #[test]
    fn a_symlink_escaping_the_files_dir_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::fs::write(elsewhere.path().join("key.pem"), "pem").unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("key.pem"), dir.path().join("key.pem"))
            .unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), dir.path().join("linked")).unwrap();
        let policy = CenterPolicy {
            files_dir: Some(dir.path().to_path_buf()),
        };
        for path in [
            "key.pem".to_string(),
            "linked/key.pem".to_string(),
            dir.path().join("key.pem").display().to_string(),
        ] {
            let error = refused(&policy, "ssl.certificate.location", &path);
            assert!(error.contains("is not inside"), "{path}: {error}");
        }
    }
}
