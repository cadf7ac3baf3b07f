//! Logs and metrics. Logging: `tracing` to stderr, readable text by default
//! or JSON lines for log shippers; the level comes from `RUST_LOG` (default
//! `info`). Metrics: [`metrics`].

pub mod metrics;

use tracing_subscriber::EnvFilter;

/// Format of log lines on stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber. Safe to call once per process.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal: a log file or a collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if let Err(error) = installed {
        eprintln!("warning: logging was already initialised: {error}");
    }
}
