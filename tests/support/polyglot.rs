//! The example plugins in JavaScript, Python and C (`plugins/polyglot`):
//! building them with the pinned toolchains (`scripts/plugin-toolchains.sh`
//! installs them under [`tools_dir`]) and building a second version of one
//! from its source with another `PLUGIN_VERSION`, for hot-swap tests.
//!
//! A missing toolchain fails the test with the build's own message (which
//! says to run `scripts/setup.sh`); it never passes silently.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::repo_root;

/// Where `scripts/plugin-toolchains.sh` installs the plugin toolchains:
/// `$WASMRELAY_TOOLS`, default `~/.local/share/wasmrelay/tools`.
pub fn tools_dir() -> PathBuf {
    match std::env::var_os("WASMRELAY_TOOLS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
            .join(".local/share/wasmrelay/tools"),
    }
}

/// `PATH` with [`tools_dir`]`/bin` in front, for running a toolchain.
pub fn path_with_tools() -> std::ffi::OsString {
    let mut paths = vec![tools_dir().join("bin")];
    if let Some(path) = std::env::var_os("PATH") {
        paths.extend(std::env::split_paths(&path));
    }
    std::env::join_paths(paths).unwrap()
}

fn run_checked(command: &mut Command, what: &str) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: running {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}); the toolchains come from scripts/setup.sh (scripts/plugin-toolchains.sh):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Builds every example of `plugins/polyglot` (`build.sh`, a no-op when up
/// to date; once per test process) and returns its `dist/`.
pub fn polyglot_dist() -> &'static Path {
    static DIST: OnceLock<PathBuf> = OnceLock::new();
    DIST.get_or_init(|| {
        let dir = repo_root().join("plugins/polyglot");
        run_checked(
            Command::new("bash")
                .arg(dir.join("build.sh"))
                .env("PATH", path_with_tools()),
            "plugins/polyglot/build.sh",
        );
        dir.join("dist")
    })
}

/// A built example, by its dist name: `c-json-enrich`, `js-json-enrich`,
/// `js-route-by-field`, `js-fault`, `python-json-enrich`.
pub fn polyglot_plugin(name: &str) -> PathBuf {
    let path = polyglot_dist().join(format!("{name}.wasm"));
    assert!(path.is_file(), "{} was not built", path.display());
    path
}

/// Builds example `example` (e.g. `js/json-enrich`) of `world` again with
/// `PLUGIN_VERSION` set to `version` in its source, into `out`: a new
/// version in the same language, built by the same build script.
pub fn build_polyglot_version(example: &str, world: &str, version: u32, out: &Path) {
    let polyglot = repo_root().join("plugins/polyglot");
    let source_dir = polyglot.join(example);
    let name = source_dir.file_name().unwrap().to_owned();
    let scratch = tempfile::tempdir().unwrap();
    let copy = scratch.path().join(&name);
    std::fs::create_dir(&copy).unwrap();
    let mut marked = 0;
    for entry in std::fs::read_dir(&source_dir).unwrap() {
        let path = entry.unwrap().path();
        if !path.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let text: Vec<String> = text
            .split_inclusive('\n')
            .map(|line| {
                if line.contains("PLUGIN_VERSION")
                    && (line.contains("'1'") || line.contains("\"1\""))
                {
                    marked += 1;
                    line.replace("'1'", &format!("'{version}'"))
                        .replace("\"1\"", &format!("\"{version}\""))
                } else {
                    line.to_string()
                }
            })
            .collect();
        std::fs::write(copy.join(path.file_name().unwrap()), text.concat()).unwrap();
    }
    assert_eq!(
        marked, 1,
        "{example}: expected one `PLUGIN_VERSION = \"1\"` line"
    );
    let lang = example.split('/').next().unwrap();
    run_checked(
        Command::new("bash")
            .arg(polyglot.join(lang).join("build-one.sh"))
            .arg(world)
            .arg(&copy)
            .arg(out)
            .env("PATH", path_with_tools()),
        &format!("building {example} version {version}"),
    );
}
