//! The `wasmrelay` binary: limit glibc's malloc arenas, parse the command
//! line, set up logging, run.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Before any thread starts (wasmrelay_malloc says why).
    let arena_max = wasmrelay_malloc::limit_arenas();
    let cli = wasmrelay::cli::Cli::parse();
    wasmrelay::telemetry::init(cli.log_format);
    tracing::debug!(
        ?arena_max,
        "glibc malloc arenas limited (None: MALLOC_ARENA_MAX decides)"
    );
    wasmrelay::cli::run(cli)
}
