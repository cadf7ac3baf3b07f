//! `wasmrelay plugin wit [DIR]`: writes the plugin contract (the WIT package
//! `wasmrelay:plugin`, `wit/plugin.wit` of this repository, embedded in the
//! binary) into a directory, for toolchains that generate bindings from WIT
//! files (wit-bindgen, componentize-py, componentize-js).
//!
//! Owns only writing the file; scaffolding a whole project is
//! [`super::plugin_new`]'s job.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::PluginWitArgs;

/// The plugin contract this binary implements, byte for byte.
pub(crate) const PLUGIN_WIT: &str = include_str!("../../../wit/plugin.wit");

/// The file name the contract is written under.
pub(crate) const PLUGIN_WIT_FILE: &str = "plugin.wit";

pub(super) fn run(args: PluginWitArgs) -> ExitCode {
    match write_wit(&args.dir) {
        Ok(path) => {
            eprintln!("wrote {}", path.display());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Writes [`PLUGIN_WIT`] to `dir/plugin.wit`, creating `dir` (and its
/// parents) if needed, and returns the path written. An existing
/// `plugin.wit` is replaced: it is the contract of this binary that counts.
pub(crate) fn write_wit(dir: &Path) -> Result<PathBuf, String> {
    if dir.exists() && !dir.is_dir() {
        return Err(format!(
            "{} exists and is not a directory: give the directory to write {PLUGIN_WIT_FILE} into",
            dir.display()
        ));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| format!("creating directory {}: {e}", dir.display()))?;
    let path = dir.join(PLUGIN_WIT_FILE);
    std::fs::write(&path, PLUGIN_WIT).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_embedded_contract_creating_the_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b/wit");
        let path = write_wit(&dir).unwrap();
        assert_eq!(path, dir.join("plugin.wit"));
        let written = std::fs::read_to_string(&path).unwrap();
        assert_eq!(written, PLUGIN_WIT);
        assert!(written.contains("package wasmrelay:plugin@0.1.0;"));
        // Again over an existing file: replaced, same bytes.
        std::fs::write(&path, "stale").unwrap();
        write_wit(&dir).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), PLUGIN_WIT);
    }

    #[test]
    fn a_file_in_place_of_the_directory_is_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("wit");
        std::fs::write(&file, "x").unwrap();
        let error = write_wit(&file).unwrap_err();
        assert!(error.contains("is not a directory"), "{error}");
        assert!(error.contains(&file.display().to_string()), "{error}");
    }
}
