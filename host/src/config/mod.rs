//! The relay's config file: reading it, `${VAR}` interpolation, parsing and
//! validation, and the errors that say what is wrong and where.
//!
//! Owns: the TOML schema (`schema.rs`, re-exported here), [`load`] and
//! [`parse`] (read, interpolate, parse, validate: nothing starts on a config
//! that fails), [`validate`] (every rule that a type cannot express, including
//! that plugin files exist), and [`ConfigError`], whose every message names
//! the file and the key (`flows[1].deliver.app.url`) or the line at fault.
//!
//! `${VAR}` interpolation happens on the raw text before parsing (the syntax
//! is in `interpolate.rs`: `${NAME}`, `${NAME:-default}`, `$$`; comments are
//! skipped). Values are inserted verbatim, not escaped for TOML: a value with
//! a quote or a newline can break the TOML around it, and a parse error on
//! such a line names the variable.
//! Relative paths in the config (`plugins.dir`) are used as they are, that
//! is, relative to the relay's working directory.

mod duration;
mod interpolate;
mod schema;
mod secret;
mod validate;

use std::fmt;
use std::path::{Path, PathBuf};

pub use schema::*;
pub use secret::{REDACTED, Secret, redact};
pub use validate::validate;

/// A config that passed [`validate`]: the only kind a node is built from.
/// Made by [`load`] and [`parse`] (or [`ValidatedConfig::new`] for a config
/// built in code), so nothing starts on a config that was not checked.
#[derive(Clone, Debug)]
pub struct ValidatedConfig(RelayConfig);

impl ValidatedConfig {
    /// Validates `config`; every problem is reported with its key.
    pub fn new(config: RelayConfig, origin: &str) -> Result<Self, ConfigError> {
        validate(&config).map_err(|problems| ConfigError::Invalid {
            origin: origin.to_string(),
            problems,
        })?;
        Ok(ValidatedConfig(config))
    }

    /// The config itself.
    pub fn into_inner(self) -> RelayConfig {
        self.0
    }
}

impl std::ops::Deref for ValidatedConfig {
    type Target = RelayConfig;
    fn deref(&self) -> &RelayConfig {
        &self.0
    }
}

/// What is wrong with a config file. Every message starts with
/// `config <file>` and names the line or the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {}: cannot read it: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A `${VAR}` could not be interpolated (unset variable, malformed `${`).
    #[error("config {origin} line {line}: {problem}")]
    Interpolation {
        /// The file (or what the text came from).
        origin: String,
        /// 1-based line in the file as written.
        line: usize,
        /// The variable's name as written.
        variable: String,
        /// What is wrong; names the variable.
        problem: String,
    },
    /// The text is not valid TOML, or does not fit the schema (unknown key,
    /// missing field, wrong type, bad duration, ...).
    #[error(
        "config {origin} line {line}, column {column}: {}{message}{}",
        key_prefix(key),
        variables_note(variables)
    )]
    Parse {
        /// The file (or what the text came from).
        origin: String,
        /// 1-based line in the file as written (before interpolation).
        line: usize,
        /// 1-based column, in characters, in the file as written.
        column: usize,
        /// Dotted path of the key at fault (`flows[0].deliverr`), empty for
        /// a TOML syntax error or a problem with the whole file.
        key: String,
        /// The TOML parser's message, e.g. ``unknown field `deliverr`,
        /// expected one of ...``.
        message: String,
        /// Environment variables whose values were inserted on that line:
        /// a value with a quote or a newline can break the TOML.
        variables: Vec<String>,
    },
    /// The config parsed but breaks one or more rules; all of them are
    /// listed, one per line.
    #[error("{}", invalid_lines(origin, problems))]
    Invalid {
        /// The file (or what the text came from).
        origin: String,
        /// Every problem found.
        problems: Vec<Problem>,
    },
}

/// One validation problem: the key at fault and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Dotted path of the key (`flows[1].deliver.app.url`,
    /// `links.main.options."group.id"`).
    pub key: String,
    /// What is wrong and, where it helps, what to do instead.
    pub problem: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.problem)
    }
}

fn key_prefix(key: &str) -> String {
    if key.is_empty() {
        String::new()
    } else {
        format!("{key}: ")
    }
}

fn variables_note(variables: &[String]) -> String {
    match variables {
        [] => String::new(),
        [one] => format!(
            " (this line has the value of environment variable `{one}` inserted verbatim: \
             check it for quotes, backslashes or newlines)"
        ),
        many => format!(
            " (this line has the values of environment variables {} inserted verbatim: \
             check them for quotes, backslashes or newlines)",
            many.iter()
                .map(|v| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn invalid_lines(origin: &str, problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("config {origin}: {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reads, interpolates (from the process environment), parses and validates
/// the config file at `path`.
pub fn load(path: &Path) -> Result<ValidatedConfig, ConfigError> {
    load_with_env(path, &|name| std::env::var(name).ok())
}

/// [`load`] with variables read through `env` instead of the process
/// environment.
pub fn load_with_env(
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ValidatedConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, &path.display().to_string(), env)
}

/// Interpolates, parses and validates config `text`. `origin` names where
/// the text came from in messages (usually the file's path); variables are
/// read through `env` (tests pass their own).
pub fn parse(
    text: &str,
    origin: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ValidatedConfig, ConfigError> {
    let interpolated =
        interpolate::interpolate(text, env).map_err(|e| ConfigError::Interpolation {
            origin: origin.to_string(),
            line: e.line,
            variable: e.variable,
            problem: e.problem,
        })?;
    let config = deserialize(&interpolated.text).map_err(|(key, error)| {
        let out = error.span().map_or(0, |span| span.start);
        let (line, column) = interpolate::line_and_column(text, interpolated.source_offset(out));
        ConfigError::Parse {
            origin: origin.to_string(),
            line,
            column,
            key,
            message: error.message().trim_end().to_string(),
            variables: interpolated.variables_on_line(line),
        }
    })?;
    ValidatedConfig::new(config, origin)
}

/// Parses TOML into the schema, keeping the path of the key at fault.
fn deserialize(text: &str) -> Result<RelayConfig, (String, toml::de::Error)> {
    let deserializer = toml::Deserializer::parse(text).map_err(|e| (String::new(), e))?;
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let key = key_path(e.path());
        (key, e.into_inner())
    })
}

/// `flows[0].deliver.app.url`, with keys that are not bare TOML keys quoted.
fn key_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut key = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => key.push_str(&format!("[{index}]")),
            Segment::Map { key: name } | Segment::Enum { variant: name } => {
                push_key(&mut key, name);
            }
            Segment::Unknown => push_key(&mut key, "?"),
        }
    }
    key
}

/// Appends `.name` (or `name` at the start) to a dotted key path.
fn push_key(path: &mut String, name: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(&key_segment(name));
}

/// `name` as a TOML key: bare when it can be, else quoted.
fn key_segment(name: &str) -> String {
    let bare = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        name.to_string()
    } else {
        format!("{name:?}")
    }
}

impl PluginsConfig {
    /// The plugin runtime's limits for these settings (the call deadline and
    /// the memory cap; instance counts keep the runtime's defaults).
    pub fn limits(&self) -> crate::plugin::PluginLimits {
        crate::plugin::PluginLimits {
            call_deadline: self.call_deadline,
            memory_cap_bytes: self.memory_cap_mib.saturating_mul(1024 * 1024),
            ..crate::plugin::PluginLimits::default()
        }
    }

    /// The file plugin `name` is loaded from: `<dir>/<name>.wasm`.
    pub fn plugin_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.wasm"))
    }
}

impl FlowConfig {
    /// The flow's consumer group: `group`, or `wasmrelay-<name>`.
    pub fn group_id(&self) -> String {
        self.group
            .clone()
            .unwrap_or_else(|| format!("wasmrelay-{}", self.name))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A temp dir with empty plugin files.
    fn plugins_dir(names: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for name in names {
            std::fs::write(dir.path().join(format!("{name}.wasm")), b"").unwrap();
        }
        dir
    }

    /// A small valid config; `extra_flow` is appended to the flow's table.
    fn config_text(dir: &Path, extra_flow: &str) -> String {
        format!(
            r#"[plugins]
dir = "{}"

[links.main]
bootstrap_servers = "127.0.0.1:9092"

[[flows]]
name = "orders"
link = "main"
input_topic = "in"
service_call = ["json-enrich"]
output_topic = "out"
dead_letter_topic = "dlq"
{extra_flow}
"#,
            dir.display()
        )
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn parse_err(text: &str) -> ConfigError {
        parse(text, "relay.toml", &no_env).unwrap_err()
    }

    #[test]
    fn minimal_config_parses_with_defaults() {
        let dir = plugins_dir(&["json-enrich"]);
        let config = parse(&config_text(dir.path(), ""), "relay.toml", &no_env).unwrap();
        assert_eq!(config.admin.listen.to_string(), "127.0.0.1:9464");
        assert_eq!(config.admin.token, None);
        assert!(config.plugins.watch);
        assert_eq!(config.plugins.call_deadline, Duration::from_millis(100));
        assert_eq!(config.shutdown_grace, Duration::from_secs(30));
        let flow = &config.flows[0];
        assert_eq!(flow.group_id(), "wasmrelay-orders");
        assert!(flow.deliver.is_none());
        assert_eq!(flow.retry, RetryConfig::default());
        assert_eq!(
            config.plugins.plugin_path("json-enrich"),
            dir.path().join("json-enrich.wasm")
        );
    }

    #[test]
    fn limits_map_to_the_plugin_runtime() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "").replace(
            "[plugins]\n",
            "[plugins]\ncall_deadline = \"250ms\"\nmemory_cap_mib = 16\n",
        );
        let config = parse(&text, "relay.toml", &no_env).unwrap();
        let limits = config.plugins.limits();
        assert_eq!(limits.call_deadline, Duration::from_millis(250));
        assert_eq!(limits.memory_cap_bytes, 16 * 1024 * 1024);
        let defaults = crate::plugin::PluginLimits::default();
        assert_eq!(limits.max_instances, defaults.max_instances);
        assert_eq!(limits.max_idle_instances, defaults.max_idle_instances);
    }

    #[test]
    fn explicit_group_is_used() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "group = \"billing\"");
        let config = parse(&text, "relay.toml", &no_env).unwrap();
        assert_eq!(config.flows[0].group_id(), "billing");
    }

    #[test]
    fn each_center_kind_takes_only_its_own_keys() {
        let dir = plugins_dir(&["json-enrich"]);
        let center = |table: &str| {
            parse_err(&format!(
                "{}\n[center]\n{table}\n",
                config_text(dir.path(), "")
            ))
            .to_string()
        };
        let msg = center("kind = \"dir\"\ndir = \"/tmp\"\nendpoints = [\"http://e:2379\"]");
        assert!(
            msg.contains("center: unknown field `endpoints`, expected one of `dir`"),
            "{msg}"
        );
        let msg = center("kind = \"etcd\"\nendpoints = [\"http://e:2379\"]\ndir = \"/tmp\"");
        assert!(msg.contains("unknown field `dir`"), "{msg}");
        let msg =
            center("kind = \"etcd\"\nendpoints = [\"http://e:2379\"]\nauth = { user = \"relay\" }");
        assert!(msg.contains("missing field `password`"), "{msg}");
        let msg = center("kind = \"zookeeper\"");
        assert!(msg.contains("zookeeper"), "{msg}");
        let msg = center("kind = \"dir\"");
        assert!(msg.contains("missing field `dir`"), "{msg}");
    }

    #[test]
    fn secrets_in_the_config_never_print() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = format!(
            "[admin]\ntoken = \"admin-Sup3r-secret\"\n{}\n[center]\nkind = \"etcd\"\nendpoints = [\"http://e:2379\"]\nallow_plaintext_password = true\nauth = {{ user = \"relay\", password = \"etcd-Sup3r-secret\" }}\n",
            config_text(dir.path(), "")
        )
        .replace(
            "bootstrap_servers = \"127.0.0.1:9092\"",
            "bootstrap_servers = \"127.0.0.1:9092\"\noptions = { \"sasl.password\" = \"kafka-Sup3r-secret\" }",
        );
        let config = parse(&text, "relay.toml", &no_env).unwrap();
        let shown = format!("{:?}", *config);
        assert!(shown.contains("sasl.password"), "{shown}");
        assert!(!shown.contains("Sup3r-secret"), "{shown}");
    }

    #[test]
    fn unknown_key_is_named_with_its_path_and_line() {
        let dir = plugins_dir(&["json-enrich"]);
        let err = parse_err(&config_text(dir.path(), "deliverr = 1"));
        let msg = err.to_string();
        assert!(
            msg.starts_with(
                "config relay.toml line 14, column 1: flows[0].deliverr: unknown field `deliverr`"
            ),
            "{msg}"
        );
        assert!(
            matches!(&err, ConfigError::Parse { key, .. } if key == "flows[0].deliverr"),
            "{err:?}"
        );
    }

    #[test]
    fn a_duration_over_a_year_is_refused_naming_its_key() {
        let dir = plugins_dir(&["json-enrich"]);
        // Parsed, it would panic the node when first added to a clock.
        let text = format!(
            "shutdown_grace = \"500000000years\"\n{}",
            config_text(dir.path(), "")
        );
        let msg = parse_err(&text).to_string();
        assert!(msg.contains("shutdown_grace"), "{msg}");
        assert!(
            msg.contains("is too long: a duration here is at most 1year"),
            "{msg}"
        );
        let text = config_text(dir.path(), "[flows.retry]\nbudget = \"400days\"");
        let msg = parse_err(&text).to_string();
        assert!(msg.contains("flows[0].retry.budget"), "{msg}");
        assert!(msg.contains("is too long"), "{msg}");
        // A year is still a duration.
        let text = config_text(dir.path(), "[flows.retry]\nbudget = \"365days\"");
        assert!(parse(&text, "relay.toml", &no_env).is_ok());
    }

    #[test]
    fn unknown_top_level_table_is_named() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = format!("{}\n[nodee]\nid = \"x\"\n", config_text(dir.path(), ""));
        let msg = parse_err(&text).to_string();
        assert!(msg.contains("nodee: unknown field `nodee`"), "{msg}");
    }

    #[test]
    fn missing_required_field_is_named() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "").replace("output_topic = \"out\"\n", "");
        let msg = parse_err(&text).to_string();
        assert!(
            msg.contains("flows[0]: missing field `output_topic`"),
            "{msg}"
        );
        assert!(msg.contains("line 7"), "{msg}");
    }

    #[test]
    fn bad_duration_is_named() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "[flows.retry]\nbudget = \"5 parsecs\"");
        let msg = parse_err(&text).to_string();
        assert!(
            msg.contains("line 15, column 10: flows[0].retry.budget: invalid value"),
            "{msg}"
        );
        assert!(msg.contains("expected a duration"), "{msg}");
    }

    #[test]
    fn wrong_type_and_unknown_delivery_kind_are_named() {
        let dir = plugins_dir(&["json-enrich"]);
        let msg = parse_err(&config_text(dir.path(), "[flows.deliver.pigeon]\n")).to_string();
        assert!(
            msg.contains("flows[0].deliver: unknown variant `pigeon`"),
            "{msg}"
        );
        let text = config_text(dir.path(), "").replace(
            "bootstrap_servers = \"127.0.0.1:9092\"",
            "bootstrap_servers = \"127.0.0.1:9092\"\noptions = { \"group.id\" = 3 }",
        );
        let msg = parse_err(&text).to_string();
        assert!(
            msg.contains("links.main.options.\"group.id\": invalid type"),
            "{msg}"
        );
    }

    #[test]
    fn ordering_defaults_to_key_and_names_a_bad_value() {
        let dir = plugins_dir(&["json-enrich"]);
        let config = parse(&config_text(dir.path(), ""), "relay.toml", &no_env).unwrap();
        assert_eq!(config.flows[0].ordering, crate::kafka::DeliveryOrder::Key);
        assert_eq!(config.flows[0].max_in_flight, 64);
        let text = config_text(dir.path(), "ordering = \"partition\"\nmax_in_flight = 256");
        let config = parse(&text, "relay.toml", &no_env).unwrap();
        assert_eq!(
            config.flows[0].ordering,
            crate::kafka::DeliveryOrder::Partition
        );
        assert_eq!(config.flows[0].max_in_flight, 256);
        let msg = parse_err(&config_text(dir.path(), "ordering = \"offset\"")).to_string();
        assert!(
            msg.contains("flows[0].ordering: unknown variant `offset`, expected one of `partition`, `key`, `none`"),
            "{msg}"
        );
    }

    #[test]
    fn syntax_error_has_the_line() {
        let msg = parse_err("[plugins]\ndir = \"x\"\"\n").to_string();
        assert!(
            msg.starts_with("config relay.toml line 2, column 10: "),
            "{msg}"
        );
    }

    #[test]
    fn unset_variable_is_named_with_the_line() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "[flows.deliver.app]\nurl = \"${APP_URL}\"");
        let err = parse_err(&text);
        assert_eq!(
            err.to_string(),
            "config relay.toml line 15: environment variable `APP_URL` is not set \
             (or write `${APP_URL:-default}`)"
        );
        assert!(
            matches!(&err, ConfigError::Interpolation { line: 15, variable, .. } if variable == "APP_URL")
        );
    }

    #[test]
    fn defaults_and_dollar_escapes_are_interpolated() {
        let dir = plugins_dir(&["json-enrich"]);
        let env = |name: &str| match name {
            "KAFKA" => Some("broker:9092".to_string()),
            "EMPTY" => Some(String::new()),
            _ => None,
        };
        let text = config_text(
            dir.path(),
            "[flows.deliver.app]\nurl = \"${APP_URL:-http://app:8080/$$x}\"",
        )
        .replace("127.0.0.1:9092", "${KAFKA}")
        .replace(
            "[plugins]\n",
            "[admin]\ntoken = \"t$$k$n\"\n\n[node]\nid = \"${EMPTY:-n1}\"\n\n[plugins]\n",
        );
        let config = parse(&text, "relay.toml", &env).unwrap();
        assert_eq!(config.links["main"].bootstrap_servers, "broker:9092");
        assert_eq!(
            config.admin.token.as_ref().map(|t| t.expose()),
            Some("t$k$n")
        );
        assert_eq!(config.node.id, "n1");
        let Some(DeliverConfig::App(app)) = &config.flows[0].deliver else {
            panic!("no app target")
        };
        assert_eq!(app.url, "http://app:8080/$x");
    }

    #[test]
    fn a_value_that_breaks_the_toml_names_the_variable() {
        let dir = plugins_dir(&["json-enrich"]);
        let env = |name: &str| (name == "APP_URL").then(|| "http://a\"\nevil = \"1".to_string());
        let text = config_text(dir.path(), "[flows.deliver.app]\nurl = \"${APP_URL}\"");
        let err = parse(&text, "relay.toml", &env).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("line 15"), "{msg}");
        assert!(
            msg.contains("environment variable `APP_URL` inserted verbatim"),
            "{msg}"
        );
        assert!(!msg.contains("http://a"), "the value is not shown: {msg}");
    }

    #[test]
    fn missing_plugin_file_is_named() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "data_return = [\"mask-fields\"]");
        let err = parse_err(&text);
        let expected = format!(
            "config relay.toml: flows[0].data_return[0]: plugin file {} does not exist",
            dir.path().join("mask-fields.wasm").display()
        );
        assert_eq!(err.to_string(), expected);
    }

    #[test]
    fn malformed_url_is_named() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "[flows.deliver.app]\nurl = \"not a url\"");
        let msg = parse_err(&text).to_string();
        assert!(
            msg.starts_with("config relay.toml: flows[0].deliver.app.url: is not a valid URL"),
            "{msg}"
        );
    }

    #[test]
    fn group_id_in_link_options_is_refused() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "").replace(
            "bootstrap_servers = \"127.0.0.1:9092\"",
            "bootstrap_servers = \"127.0.0.1:9092\"\noptions = { \"group.id\" = \"g\" }",
        );
        let msg = parse_err(&text).to_string();
        assert!(
            msg.starts_with("config relay.toml: links.main.options.\"group.id\": "),
            "{msg}"
        );
        assert!(msg.contains("per flow"), "{msg}");
    }

    #[test]
    fn unknown_link_is_named() {
        let dir = plugins_dir(&["json-enrich"]);
        let text = config_text(dir.path(), "").replace("link = \"main\"", "link = \"mian\"");
        let msg = parse_err(&text).to_string();
        assert!(
            msg.starts_with("config relay.toml: flows[0].link: no link `mian`"),
            "{msg}"
        );
    }

    #[test]
    fn duplicate_flow_names_are_refused() {
        let dir = plugins_dir(&["json-enrich"]);
        let second = "\n[[flows]]\nname = \"orders\"\nlink = \"main\"\ninput_topic = \"in2\"\n\
                      output_topic = \"out2\"\ndead_letter_topic = \"dlq2\"\n";
        let msg = parse_err(&config_text(dir.path(), second)).to_string();
        assert!(
            msg.starts_with("config relay.toml: flows[1].name: duplicate flow name `orders`"),
            "{msg}"
        );
    }

    #[test]
    fn every_problem_is_reported_one_per_line() {
        let dir = plugins_dir(&[]);
        let text =
            config_text(dir.path(), "group = \"\"").replace("link = \"main\"", "link = \"other\"");
        let err = parse_err(&text);
        let ConfigError::Invalid { problems, .. } = &err else {
            panic!("{err:?}")
        };
        let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "flows[0].link",
                "flows[0].group",
                "flows[0].service_call[0]"
            ]
        );
        let msg = err.to_string();
        assert_eq!(msg.lines().count(), 3, "{msg}");
        assert!(
            msg.lines()
                .all(|l| l.starts_with("config relay.toml: flows[0]."))
        );
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let dir = plugins_dir(&[]);
        let path = dir.path().join("nope.toml");
        let msg = load(&path).unwrap_err().to_string();
        assert!(
            msg.starts_with(&format!("config {}: cannot read it: ", path.display())),
            "{msg}"
        );
    }

    /// The sidecar example loads as it is with its four variables set.
    #[test]
    fn sidecar_center_example_loads() {
        let plugins = plugins_dir(&["json-enrich", "mask-fields"]);
        let center = tempfile::tempdir().unwrap();
        let (plugins_path, center_path) = (
            plugins.path().display().to_string(),
            center.path().display().to_string(),
        );
        let env = move |name: &str| match name {
            "APP_URL" => Some("http://127.0.0.1:8080/calls".to_string()),
            "PLUGINS_DIR" => Some(plugins_path.clone()),
            "CENTER_DIR" => Some(center_path.clone()),
            _ => None,
        };
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/sidecar-center/relay.toml");
        let config = load_with_env(&path, &env).unwrap();
        let Some(CenterConfig::Dir(center_config)) = config.center.as_ref() else {
            panic!("a dir center: {:?}", config.center);
        };
        assert_eq!(center_config.dir, center.path());
        assert!(config.links["main"].from_center);
    }

    #[test]
    fn cluster_example_loads() {
        let dir = plugins_dir(&[]);
        let plugins = dir.path().display().to_string();
        let env = move |name: &str| match name {
            "KAFKA_BOOTSTRAP" => Some("kafka:9092".to_string()),
            "NODE_ID" => Some("node-1".to_string()),
            "CLIENT_ADDR" => Some("0.0.0.0:7400".to_string()),
            "MESH_ADDR" => Some("0.0.0.0:7500".to_string()),
            "ADMIN_ADDR" => Some("127.0.0.1:9400".to_string()),
            "PLUGINS_DIR" => Some(plugins.clone()),
            "CLUSTER_SECRET" => Some("5e1f0c2b".repeat(8)),
            "CLIENT_TOKEN_KEY_FILE" => Some("/etc/wasmrelay/client-token.key".to_string()),
            _ => None,
        };
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/cluster/node.toml");
        // The secret comes from the environment only.
        let without_secret = |name: &str| (name != "CLUSTER_SECRET").then(|| env(name)).flatten();
        let error = load_with_env(&path, &without_secret)
            .unwrap_err()
            .to_string();
        assert!(error.contains("CLUSTER_SECRET"), "{error}");
        let config = load_with_env(&path, &env).unwrap();
        let cluster = config.cluster.as_ref().unwrap();
        assert_eq!(config.node.id, "node-1");
        assert_eq!(cluster.client_listen.to_string(), "0.0.0.0:7400");
        assert_eq!(cluster.heartbeat_topic, "wasmrelay.heartbeats");
        assert_eq!(cluster.routes_topic, "wasmrelay.routes");
        assert_eq!(cluster.alarm_topic.as_deref(), Some("wasmrelay.alarms"));
        assert_eq!(config.flows[0].input_topic, "business");
        assert_eq!(config.flows[0].output_topic, "business.replies");
        assert_eq!(config.flows[0].dead_letter_topic, "business.dlq");
        assert!(matches!(
            config.flows[0].deliver,
            Some(DeliverConfig::Cluster(_))
        ));
    }

    #[test]
    fn sidecar_example_loads() {
        let dir = plugins_dir(&["json-enrich", "mask-fields"]);
        let plugins = dir.path().display().to_string();
        let env = move |name: &str| match name {
            "KAFKA_BOOTSTRAP" => Some("kafka-1:9092,kafka-2:9092".to_string()),
            "APP_URL" => Some("http://127.0.0.1:8080/calls".to_string()),
            "PLUGINS_DIR" => Some(plugins.clone()),
            _ => None,
        };
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/sidecar/relay.toml");
        let config = load_with_env(&path, &env).unwrap();

        assert_eq!(config.node.id, "sidecar-1");
        assert_eq!(config.admin.listen.to_string(), "127.0.0.1:9464");
        assert_eq!(config.admin.token, None);
        assert_eq!(config.plugins.dir, dir.path());
        assert!(config.plugins.watch);
        assert_eq!(config.plugins.call_deadline, Duration::from_millis(100));
        assert_eq!(config.plugins.memory_cap_mib, 64);
        let enrich = &config.plugins.config["json-enrich"];
        assert_eq!(enrich["field"], "handled_by");
        assert_eq!(enrich["value"], "wasmrelay");
        assert_eq!(
            config.plugins.config["mask-fields"]["fields"],
            "card_number,password"
        );
        assert_eq!(config.links.len(), 1);
        assert_eq!(
            config.links["main"].bootstrap_servers,
            "kafka-1:9092,kafka-2:9092"
        );
        assert!(config.links["main"].options.is_empty());

        assert_eq!(config.flows.len(), 1);
        let flow = &config.flows[0];
        assert_eq!(flow.name, "orders");
        assert_eq!(flow.link, "main");
        assert_eq!(flow.input_topic, "service-calls");
        assert_eq!(flow.group_id(), "wasmrelay-orders");
        assert_eq!(flow.service_call, ["json-enrich"]);
        assert_eq!(flow.data_return, ["mask-fields"]);
        assert_eq!(flow.output_topic, "data-returns");
        assert_eq!(flow.dead_letter_topic, "service-calls.dlq");
        assert_eq!(flow.retry, RetryConfig::default());
        let Some(DeliverConfig::App(app)) = &flow.deliver else {
            panic!("no app target")
        };
        assert_eq!(app.url, "http://127.0.0.1:8080/calls");
        assert_eq!(app.timeout, Duration::from_secs(10));
        assert_eq!(app.concurrency, 64);

        // ADMIN_ADDR and NODE_ID override the defaults.
        let env2 = |name: &str| match name {
            "ADMIN_ADDR" => Some("127.0.0.1:9500".to_string()),
            "NODE_ID" => Some("sidecar-7".to_string()),
            other => env(other),
        };
        let config = load_with_env(&path, &env2).unwrap();
        assert_eq!(config.admin.listen.to_string(), "127.0.0.1:9500");
        assert_eq!(config.node.id, "sidecar-7");
        // Off loopback the example needs its token (commented out there).
        let env3 = |name: &str| match name {
            "ADMIN_ADDR" => Some("0.0.0.0:9500".to_string()),
            other => env(other),
        };
        let error = load_with_env(&path, &env3).unwrap_err().to_string();
        assert!(error.contains("admin.listen"), "{error}");
        assert!(error.contains("admin.token"), "{error}");
    }
}
