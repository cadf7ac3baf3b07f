//! What the tests of every crate share (`wasmrelay_test_support`): the
//! end-to-end scenarios in `tests/e2e` and the host's own integration tests
//! (`host/tests/all`, which reach this crate through `host/tests/support`)
//! and benches. It owns starting the outside world a test needs (a tansu
//! broker, an etcd server, a test application, business processes on the
//! SDK, the real `wasmrelay` binary) and building what a test runs (the
//! example plugins, that binary) once per test process. It holds no test:
//! the scenarios stay in the crate whose code they exercise.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub mod app;
pub mod chaos;
pub mod client_tokens;
pub mod cpu;
pub mod etcd;
pub mod fault_proxy;
pub mod pki;
pub mod plugin_cli;
pub mod polyglot;
pub mod processes;
pub mod relay;
pub mod tansu;
pub mod tls_terminator;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Criterion's point estimate (mean, ns per iteration) of benchmark `bench`
/// in `group`, from its last run's `estimates.json` (under
/// `$CARGO_TARGET_DIR`, or the repository's `target`); `None` when it has
/// not run (filtered out). The benches print their ratios from it.
pub fn criterion_mean_ns(group: &str, bench: &str) -> Option<f64> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let path = target
        .join("criterion")
        .join(group.replace('/', "_"))
        .join(bench)
        .join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["mean"]["point_estimate"].as_f64()
}

/// Builds the plugins workspace (`plugins/build.sh`, a no-op when up to
/// date) and returns `plugins/dist`. Panics with the build's output if it
/// fails: a test that needs plugins must not pass without them.
pub fn plugins_dist() -> &'static Path {
    static DIST: OnceLock<PathBuf> = OnceLock::new();
    DIST.get_or_init(|| {
        let root = repo_root();
        let output = Command::new("bash")
            .arg(root.join("plugins/build.sh"))
            .current_dir(root.join("plugins"))
            .output()
            .expect("running plugins/build.sh (is bash installed?)");
        assert!(
            output.status.success(),
            "plugins/build.sh failed (it needs the wasm32-wasip2 target: `rustup target add wasm32-wasip2`):\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        root.join("plugins/dist")
    })
}

/// The `wasmrelay` binary of this checkout, built first if it is missing or
/// out of date (`cargo build --locked -p wasmrelay --bin wasmrelay`, once per
/// test process; a quick no-op when it is current). Panics with cargo's
/// output if the build fails: a test must not run a stale binary.
pub fn wasmrelay_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| cargo_build(&["-p", "wasmrelay", "--bin", "wasmrelay"], "wasmrelay"))
}

/// The example client (`client/examples/relay-client.rs`), built like
/// [`wasmrelay_binary`].
pub fn relay_client_example() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        cargo_build(
            &["-p", "wasmrelay-client", "--example", "relay-client"],
            "examples/relay-client",
        )
    })
}

/// What a run of the example client left: whether it exited with success,
/// and what it printed.
#[derive(Debug)]
pub struct ClientRun {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the example client as process `process_id` on `addr` with `args`
/// until it exits (at most 30 s).
pub async fn run_relay_client(addr: &str, process_id: &str, args: &[&str]) -> ClientRun {
    let child = tokio::process::Command::new(relay_client_example())
        .args(["--connect", addr, "--process-id", process_id])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting relay-client");
    let output = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("relay-client did not exit within 30 s")
        .expect("waiting for relay-client");
    ClientRun {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs `cargo build --locked` on the `targets` and returns the executable
/// at `output` under the profile directory; panics with cargo's output if
/// the build fails.
///
/// Only a package's own tests get `CARGO_BIN_EXE_*`, so what is built is
/// found from where cargo put the running test:
/// `<target dir>/<profile dir>/deps/<test>-<hash>`. The build goes to that
/// target dir with the profile of that profile dir (`debug` is the dev
/// profile, `release` the release one, any other is a custom profile's
/// name), so the test runs what the same build of the same checkout made.
fn cargo_build(targets: &[&str], output: &str) -> PathBuf {
    let test = std::env::current_exe().expect("the path of the running test");
    let profile_dir = test
        .parent()
        .filter(|dir| dir.ends_with("deps"))
        .and_then(Path::parent)
        .unwrap_or_else(|| {
            panic!(
                "{} is not in a cargo profile's deps directory: cannot tell where to build {output}",
                test.display()
            )
        });
    let target_dir = profile_dir.parent().unwrap();
    // Cargo runs tests with CARGO set to itself; by hand, take the one in PATH.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(&cargo);
    // What cargo sets for running this test is not what a build by hand
    // has: left in, it makes build scripts that watch it (ring's watches
    // CARGO_MANIFEST_DIR) run again, rebuilding ring, rustls and all that
    // depends on them here and again at the next build by hand.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || matches!(
                &*name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "OUT_DIR"
            )
        {
            build.env_remove(&*name);
        }
    }
    build
        .args(["build", "--locked"])
        .args(targets)
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(repo_root());
    match profile_dir.file_name().and_then(|name| name.to_str()) {
        Some("debug") => {}
        Some("release") => {
            build.arg("--release");
        }
        Some(custom) => {
            build.args(["--profile", custom]);
        }
        None => panic!("{} has no profile name", profile_dir.display()),
    }
    let result = build
        .output()
        .unwrap_or_else(|e| panic!("running {build:?}: {e}"));
    assert!(
        result.status.success(),
        "building {output} failed: {build:?}\n{}\n{}",
        String::from_utf8_lossy(&result.stdout),
        String::from_utf8_lossy(&result.stderr)
    );
    let executable = profile_dir.join(format!("{output}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        executable.is_file(),
        "{build:?} succeeded but did not leave {}",
        executable.display()
    );
    executable
}

/// The path of a built example plugin, e.g. `plugin("passthrough")`.
pub fn plugin(name: &str) -> PathBuf {
    let path = plugins_dist().join(format!("{name}.wasm"));
    assert!(path.is_file(), "{} was not built", path.display());
    path
}

/// The bytes of a built example plugin.
pub fn plugin_bytes(name: &str) -> Vec<u8> {
    std::fs::read(plugin(name)).unwrap()
}

/// Writes `bytes` to `dir/name` the way deploy tools do: into a temporary
/// file in the same directory, then an atomic rename over the target.
pub fn write_then_rename(dir: &Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

/// The `version-tag` plugin with its 16-byte marker replaced by
/// `wasmrelay-v-NNNN`: a distinct version that says which one it is.
pub fn version_tag_bytes(version: u32) -> Vec<u8> {
    const MARKER: &[u8] = b"wasmrelay-v-0000";
    let mut bytes = plugin_bytes("version-tag");
    let at = bytes
        .windows(MARKER.len())
        .position(|w| w == MARKER)
        .expect("version-tag.wasm carries its marker");
    let tag = format!("wasmrelay-v-{version:04}");
    bytes[at..at + MARKER.len()].copy_from_slice(tag.as_bytes());
    bytes
}
