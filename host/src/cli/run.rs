//! `wasmrelay run`: load and check the config, start a node, and turn
//! SIGTERM/SIGINT into a graceful shutdown (a second signal exits at once).

use std::process::ExitCode;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::RunArgs;
use crate::node::Node;
use crate::telemetry::metrics::RelayMetrics;

/// Exit status for a config that does not load or validate.
const EXIT_BAD_CONFIG: u8 = 2;
/// Exit status when the node fails to start or fails while running.
const EXIT_FAILED: u8 = 1;
/// Exit status after a second signal (128 + SIGINT, as shells expect).
const EXIT_FORCED: i32 = 130;

pub(super) fn run(args: RunArgs) -> ExitCode {
    let config = match crate::config::load(&args.config) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    let runtime = match super::async_runtime() {
        Ok(runtime) => runtime,
        Err(exit) => return exit,
    };
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        // Ended with the runtime when `run` returns.
        #[allow(clippy::disallowed_methods)]
        let signals = tokio::spawn(watch_signals(shutdown.clone()));
        let ran = async {
            let node = Node::build(config, Arc::new(RelayMetrics::new())).await?;
            node.run(shutdown).await
        }
        .await;
        signals.abort();
        match ran {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                tracing::error!("{error:#}");
                eprintln!("error: {error:#}");
                ExitCode::from(EXIT_FAILED)
            }
        }
    })
}

/// First SIGTERM/SIGINT: graceful shutdown. Second: exit now.
async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("could not install signal handlers; stop the relay with SIGKILL");
        return;
    };
    let wait = async {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    };
    let first = wait.await;
    tracing::info!(
        signal = first,
        "shutting down gracefully (send it again to exit at once)"
    );
    shutdown.cancel();
    let second = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::warn!(signal = second, "second signal: exiting now");
    std::process::exit(EXIT_FORCED);
}
