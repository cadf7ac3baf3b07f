//! Shared helpers of the integration tests: building the example plugins
//! once per test process and laying out plugin directories.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub mod app;
pub mod etcd;
pub mod processes;
pub mod relay;
pub mod tansu;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
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
