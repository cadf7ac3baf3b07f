//! `wasi-adapter OUT`: writes wasmtime 48's WASI preview1 reactor adapter
//! (`wasi_snapshot_preview1.reactor.wasm`) to OUT, atomically.

use std::process::ExitCode;

fn main() -> ExitCode {
    let Some(out) = std::env::args_os().nth(1) else {
        eprintln!("usage: wasi-adapter OUT.wasm");
        return ExitCode::from(2);
    };
    let out = std::path::PathBuf::from(out);
    let tmp = out.with_extension("wasm.tmp");
    let bytes = wasi_preview1_component_adapter_provider::WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER;
    if let Err(error) = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &out)) {
        eprintln!("wasi-adapter: writing {}: {error}", out.display());
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
