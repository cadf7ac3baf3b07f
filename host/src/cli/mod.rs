//! The command line (`wasmrelay --help`): argument definitions and dispatch
//! to each subcommand. Nothing here does the work itself.

mod demo;
pub(crate) mod message_json;
mod plugin_bench;
mod plugin_new;
mod plugin_test;
mod plugin_wit;
mod run;
mod token;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::plugin::World;
use crate::telemetry::LogFormat;

pub use message_json::{MessageLine, parse_message_line, render_output_message};

/// wasmrelay: a Kafka message relay with WebAssembly plugins.
#[derive(Debug, Parser)]
#[command(name = "wasmrelay", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// Log line format on stderr: `text` for people, `json` for log shippers.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "WASMRELAY_LOG_FORMAT")]
    pub log_format: LogFormat,

    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// wasmrelay's subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a relay node with the given config file.
    ///
    /// Stops on SIGTERM or SIGINT: fetching stops, messages in flight are
    /// finished within the config's `shutdown_grace`, offsets committed,
    /// then exit 0. A second signal exits at once.
    Run(RunArgs),
    /// Run a self-contained demo: an embedded development broker (librdkafka's
    /// mock cluster), a demo application, the example plugins, and a stream
    /// of sample service calls, with a live summary.
    Demo(DemoArgs),
    /// Work with plugins (Wasm components) without running a relay.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// Client tokens: the credential a business process sends in its Hello.
    #[command(subcommand)]
    Token(TokenCommand),
}

/// `wasmrelay token ...`
#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Sign a token for a process id and print it.
    ///
    /// The token is a JWT: `sub` is the process id (or, for a pattern
    /// ending in `*`, `wasmrelay_process` holds the pattern), `exp` is now
    /// plus --ttl. A node accepts it when one of its
    /// `cluster.client_token_keys` verifies it.
    ///
    /// Keys: HS256 takes the same secret file the nodes read (its bytes,
    /// without a trailing newline, at least 32), made with e.g.
    /// `openssl rand -hex 32 > client-token.key`. EdDSA takes the Ed25519
    /// private key (`openssl genpkey -algorithm ed25519 -out issuer.pem`)
    /// whose public key the nodes hold
    /// (`openssl pkey -in issuer.pem -pubout -out issuer.pub.pem`).
    Issue(TokenIssueArgs),
}

/// Arguments of `wasmrelay token issue`.
#[derive(Debug, Args)]
pub struct TokenIssueArgs {
    /// The signing key file: the HS256 secret, or an Ed25519 private key
    /// (PEM) for EdDSA.
    #[arg(long, value_name = "FILE")]
    pub key: PathBuf,
    /// The algorithm.
    #[arg(long, value_enum, default_value_t = TokenAlg::Hs256)]
    pub alg: TokenAlg,
    /// The process id the token is for, or a prefix pattern such as
    /// `billing-*` (quote it in the shell).
    #[arg(long, value_name = "ID")]
    pub process: String,
    /// How long the token is valid, e.g. `15m`, `1h`, `30d`.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_duration)]
    pub ttl: std::time::Duration,
    /// The `aud` claim: the nodes' `cluster.client_token_audience`, when set.
    #[arg(long, value_name = "AUDIENCE")]
    pub audience: Option<String>,
}

/// The signature algorithm of `wasmrelay token issue`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TokenAlg {
    /// HMAC-SHA256 with a shared secret.
    #[value(name = "hs256", alias = "HS256")]
    Hs256,
    /// Ed25519.
    #[value(name = "eddsa", alias = "EdDSA")]
    EdDsa,
}

impl From<TokenAlg> for crate::config::TokenAlgorithm {
    fn from(alg: TokenAlg) -> Self {
        match alg {
            TokenAlg::Hs256 => crate::config::TokenAlgorithm::Hs256,
            TokenAlg::EdDsa => crate::config::TokenAlgorithm::EdDsa,
        }
    }
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let duration = humantime_serde::re::humantime::parse_duration(s)
        .map_err(|e| format!("`{s}` is not a duration (e.g. 15m, 1h, 30d): {e}"))?;
    if duration.is_zero() {
        return Err("must be more than zero".to_string());
    }
    Ok(duration)
}

/// `wasmrelay plugin ...`
#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Run a plugin over JSON lines and print what it does with each message.
    ///
    /// Input (stdin, or --input FILE): one message per line,
    /// `{"key": "...", "value": "...", "headers": {"name": "value"}}`; use
    /// `key_b64` / `value_b64` for binary data; `topic`, `partition`, `offset`
    /// and `timestamp_ms` are optional. For a router plugin a line may instead
    /// be `{"place": {"process_id": "p1", "nodes": [{"node_id": "a", "live":
    /// true, "connections": 3, "quota": 10}]}}` to try its placement.
    ///
    /// Output (stdout): one line per emitted message in the same shape with
    /// `"input": N` (the input's line number); `{"input": N, "dead_letter":
    /// "reason"}`, `{"input": N, "error": "..."}`; for a router `{"input": N,
    /// "route": "process-id" | null}` or `{"input": N, "place": "node" | null}`.
    ///
    /// Exit status: 0 when every line was run (plugin errors are output, not
    /// failures), 1 when the plugin cannot be loaded, 2 for bad input.
    Test(PluginTestArgs),
    /// Write the plugin contract (the WIT package `wasmrelay:plugin`, as
    /// this binary implements it) to DIR/plugin.wit, for toolchains that
    /// generate bindings from WIT: wit-bindgen (C, Rust), componentize-py,
    /// componentize-js.
    Wit(PluginWitArgs),
    /// Write a ready plugin project NAME/ in a language: the source, the WIT
    /// contract, `build.sh`, a sample `input.jsonl` and a README, then print
    /// the commands that build it and run it under `plugin test`.
    ///
    /// Each language's `build.sh` needs that language's toolchain (the
    /// project README names it); `scripts/setup.sh` of the wasmrelay
    /// repository installs them all. Exit status 2 for a bad name or an
    /// existing, non-empty NAME/.
    New(PluginNewArgs),
    /// Measure what a processor plugin costs in the relay's runtime and
    /// print it as one JSON line: component size, compile time at load,
    /// instantiation time and linear memory of a fresh instance, and time
    /// per `process` call on a JSON object value of --value-bytes.
    Bench(PluginBenchArgs),
}

/// Arguments of `wasmrelay plugin bench`.
#[derive(Debug, Args)]
pub struct PluginBenchArgs {
    /// The processor plugin component (`.wasm`).
    pub plugin: PathBuf,
    /// A config value for the plugin, as `key=value`; repeat for more.
    #[arg(long = "config", value_name = "KEY=VALUE", value_parser = parse_config_entry)]
    pub config: Vec<(String, String)>,
    /// Size of the JSON object value of the message processed, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 1024)]
    pub value_bytes: usize,
    /// Calls made before measuring.
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub warmup: u64,
    /// Calls measured, at least.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub min_calls: u64,
    /// Time spent measuring calls, at least, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub min_ms: u64,
    /// Memory cap of the plugin instance, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    pub memory_mib: u64,
}

/// Arguments of `wasmrelay plugin new`.
#[derive(Debug, Args)]
pub struct PluginNewArgs {
    /// The language of the plugin.
    #[arg(long, value_enum)]
    pub lang: plugin_new::PluginLang,
    /// The world the plugin implements (default: processor).
    #[arg(long, value_parser = parse_world)]
    pub world: Option<World>,
    /// The directory the project directory NAME is made in.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub dir: PathBuf,
    /// The plugin's name (lowercase letters, digits and hyphens): the
    /// project directory and `NAME.wasm`.
    pub name: String,
}

/// Arguments of `wasmrelay plugin wit`.
#[derive(Debug, Args)]
pub struct PluginWitArgs {
    /// The directory to write `plugin.wit` into (created if missing).
    #[arg(value_name = "DIR", default_value = "wit")]
    pub dir: PathBuf,
}

/// Arguments of `wasmrelay run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The relay's config file (TOML). `${VAR}` and `${VAR:-default}` are
    /// replaced with environment variables.
    #[arg(long, short, value_name = "FILE", env = "WASMRELAY_CONFIG")]
    pub config: PathBuf,
}

/// Arguments of `wasmrelay demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Stop after this many messages; without it the demo runs until Ctrl-C.
    #[arg(long, value_name = "N")]
    pub messages: Option<u64>,
    /// Messages produced per second.
    #[arg(long, value_name = "PER_SECOND", default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub rate: u32,
    /// Directory of the example plugins (`json-enrich.wasm`, `mask-fields.wasm`).
    #[arg(long, value_name = "DIR", default_value = "plugins/dist")]
    pub plugins: PathBuf,
}

/// Arguments of `wasmrelay plugin test`.
#[derive(Debug, Args)]
pub struct PluginTestArgs {
    /// The plugin component (`.wasm`, built for wasm32-wasip2).
    pub plugin: PathBuf,

    /// The world the plugin must implement; detected from its exports when omitted.
    #[arg(long, value_parser = parse_world)]
    pub world: Option<World>,

    /// A config value for the plugin, as `key=value`; repeat for more.
    #[arg(long = "config", value_name = "KEY=VALUE", value_parser = parse_config_entry)]
    pub config: Vec<(String, String)>,

    /// Read messages from this file instead of stdin.
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,

    /// Call `process-batch` with up to N messages at a time instead of
    /// `process` per message (processor plugins).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: Option<u32>,

    /// Deadline of one call, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 100)]
    pub deadline_ms: u64,

    /// Memory cap of the plugin instance, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    pub memory_mib: u64,
}

fn parse_world(s: &str) -> Result<World, String> {
    s.parse()
}

fn parse_config_entry(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((key, _)) if key.trim().is_empty() => {
            Err(format!("`{s}`: the key before `=` is empty"))
        }
        Some((key, value)) => Ok((key.trim().to_string(), value.to_string())),
        None => Err(format!("`{s}` is not of the form key=value")),
    }
}

/// The multi-threaded tokio runtime `run` and `demo` work on.
fn async_runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|error| {
            eprintln!("error: starting the async runtime: {error}");
            ExitCode::FAILURE
        })
}

/// Runs the parsed command line and says how the process should exit.
pub fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Run(args) => run::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Plugin(PluginCommand::Test(args)) => plugin_test::run(args),
        Command::Plugin(PluginCommand::Wit(args)) => plugin_wit::run(args),
        Command::Plugin(PluginCommand::New(args)) => plugin_new::run(args),
        Command::Plugin(PluginCommand::Bench(args)) => plugin_bench::run(args),
        Command::Token(TokenCommand::Issue(args)) => token::run(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_entries_need_a_key_and_an_equals_sign() {
        assert_eq!(
            parse_config_entry("field=a=b").unwrap(),
            ("field".to_string(), "a=b".to_string())
        );
        assert!(
            parse_config_entry("novalue")
                .unwrap_err()
                .contains("key=value")
        );
        assert!(parse_config_entry("=x").unwrap_err().contains("empty"));
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
