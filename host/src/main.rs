//! The `wasmrelay` binary: parse the command line, set up logging, run.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = wasmrelay::cli::Cli::parse();
    wasmrelay::telemetry::init(cli.log_format);
    wasmrelay::cli::run(cli)
}
