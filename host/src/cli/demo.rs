//! `wasmrelay demo`: runs [`crate::demo`] with Ctrl-C as the stop.

use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

use super::DemoArgs;
use crate::demo::DemoOptions;

pub(super) fn run(args: DemoArgs) -> ExitCode {
    let runtime = match super::async_runtime() {
        Ok(runtime) => runtime,
        Err(exit) => return exit,
    };
    let options = DemoOptions {
        messages: args.messages,
        rate: args.rate,
        plugins_dir: args.plugins,
    };
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        let on_ctrl_c = shutdown.clone();
        // Aborted when the demo returns.
        #[allow(clippy::disallowed_methods)]
        let ctrl_c = tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                on_ctrl_c.cancel();
            }
        });
        let ran = crate::demo::run(options, shutdown).await;
        ctrl_c.abort();
        match ran {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("error: {error:#}");
                ExitCode::FAILURE
            }
        }
    })
}
