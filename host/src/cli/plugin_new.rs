//! `wasmrelay plugin new --lang rust|js|python|c [--world processor|router]
//! NAME`: writes a ready plugin project (source, the WIT contract, a build
//! script, a sample input, a README with the edit-build-test loop) from
//! templates embedded in the binary (`host/templates/`), and prints the
//! commands that build it and run it under `wasmrelay plugin test`.
//!
//! Owns the templates and filling them in. It runs no toolchain: each
//! project's `build.sh` does, and says which tool is missing.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::PluginNewArgs;
use super::plugin_wit::{PLUGIN_WIT, PLUGIN_WIT_FILE};
use crate::plugin::World;

/// The languages `plugin new` has templates for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PluginLang {
    /// Rust with wit-bindgen, built with `cargo build --target wasm32-wasip2`.
    Rust,
    /// JavaScript, built with componentize-js (npm).
    Js,
    /// Python, built with componentize-py (PyPI).
    Python,
    /// C with wasi-libc, built with clang, wit-bindgen and wasm-tools.
    C,
}

impl PluginLang {
    fn as_str(self) -> &'static str {
        match self {
            PluginLang::Rust => "rust",
            PluginLang::Js => "js",
            PluginLang::Python => "python",
            PluginLang::C => "c",
        }
    }

    fn title(self) -> &'static str {
        match self {
            PluginLang::Rust => "Rust",
            PluginLang::Js => "JavaScript",
            PluginLang::Python => "Python",
            PluginLang::C => "C",
        }
    }

    /// What `build.sh` needs, for the README.
    fn tools(self) -> &'static str {
        match self {
            PluginLang::Rust => {
                "Rust with the `wasm32-wasip2` target (`rustup target add wasm32-wasip2`)"
            }
            PluginLang::Js => {
                "componentize-js 0.23.0 (`npm install -g @bytecodealliance/componentize-js@0.23.0`)"
            }
            PluginLang::Python => "componentize-py 0.25.1 (`pip install componentize-py==0.25.1`)",
            PluginLang::C => {
                "clang, wasm-ld and wasi-libc (Debian `clang lld wasi-libc`), wit-bindgen 0.61.1 and \
                 wasm-tools 1.263.0 (`cargo install --locked wit-bindgen-cli@0.61.1 wasm-tools@1.263.0`), \
                 and the WASI preview1 reactor adapter of wasmtime 48 (crate \
                 `wasi-preview1-component-adapter-provider`; `build.sh` looks for it at \
                 `$WASI_ADAPTER` or `$WASMRELAY_TOOLS/share/wasi_snapshot_preview1.reactor.wasm`)"
            }
        }
    }
}

/// One file of a template: its path in the project, its text (with
/// `{{name}}`, `{{name_snake}}`, `{{world}}`, ... still in it), and whether
/// it is a script to mark executable.
struct TemplateFile {
    path: &'static str,
    text: &'static str,
    executable: bool,
}

const fn file(path: &'static str, text: &'static str) -> TemplateFile {
    TemplateFile {
        path,
        text,
        executable: false,
    }
}

const fn script(path: &'static str, text: &'static str) -> TemplateFile {
    TemplateFile {
        path,
        text,
        executable: true,
    }
}

const README: &str = include_str!("../../templates/README.md");
const PROCESSOR_INPUT: &str = include_str!("../../templates/processor.jsonl");
const ROUTER_INPUT: &str = include_str!("../../templates/router.jsonl");

/// The files of the template for `lang` and `world` (the WIT contract, the
/// input and the README are added by [`scaffold`]).
fn template(lang: PluginLang, world: World) -> Vec<TemplateFile> {
    let processor = world == World::Processor;
    match lang {
        PluginLang::Rust => vec![
            file(
                "Cargo.toml",
                include_str!("../../templates/rust/Cargo.toml"),
            ),
            script("build.sh", include_str!("../../templates/rust/build.sh")),
            file(
                "src/lib.rs",
                if processor {
                    include_str!("../../templates/rust/processor.rs")
                } else {
                    include_str!("../../templates/rust/router.rs")
                },
            ),
            file(".gitignore", "/target\n/*.wasm\n"),
        ],
        PluginLang::Js => vec![
            script("build.sh", include_str!("../../templates/js/build.sh")),
            file(
                "{{name}}.js",
                if processor {
                    include_str!("../../templates/js/processor.js")
                } else {
                    include_str!("../../templates/js/router.js")
                },
            ),
            file(".gitignore", "/*.wasm\n"),
        ],
        PluginLang::Python => vec![
            script("build.sh", include_str!("../../templates/python/build.sh")),
            file(
                "app.py",
                if processor {
                    include_str!("../../templates/python/processor.py")
                } else {
                    include_str!("../../templates/python/router.py")
                },
            ),
            file(".gitignore", "/*.wasm\n__pycache__/\n"),
        ],
        PluginLang::C => vec![
            script("build.sh", include_str!("../../templates/c/build.sh")),
            file(
                "{{name_snake}}.c",
                if processor {
                    include_str!("../../templates/c/processor.c")
                } else {
                    include_str!("../../templates/c/router.c")
                },
            ),
            file(".gitignore", "/gen\n/*.wasm\n"),
        ],
    }
}

/// The source file an author edits, for the README.
fn source_file(lang: PluginLang) -> &'static str {
    match lang {
        PluginLang::Rust => "src/lib.rs",
        PluginLang::Js => "{{name}}.js",
        PluginLang::Python => "app.py",
        PluginLang::C => "{{name_snake}}.c",
    }
}

/// A plugin name: lowercase ASCII letters and digits in words joined by
/// single hyphens, starting with a letter (it becomes a file name, a crate
/// name and, with `_` for `-`, a C identifier).
fn check_name(name: &str) -> Result<(), String> {
    let valid_words = name.split('-').all(|word| {
        !word.is_empty()
            && word
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    });
    let starts_with_letter = name.bytes().next().is_some_and(|b| b.is_ascii_lowercase());
    if name.len() > 64 || !valid_words || !starts_with_letter {
        return Err(format!(
            "`{name}` is not a plugin name: use lowercase letters, digits and single hyphens, \
             starting with a letter, at most 64 characters (e.g. `my-plugin`)"
        ));
    }
    Ok(())
}

/// Fills in the placeholders of a template text.
fn fill(text: &str, lang: PluginLang, world: World, name: &str) -> String {
    let router_output = if world == World::Router {
        "; for a router, `{\"input\": N, \"route\": ...}` and, for `place` lines, \
         `{\"input\": N, \"place\": ...}`"
    } else {
        ""
    };
    text.replace("{{source}}", source_file(lang))
        .replace("{{tools}}", lang.tools())
        .replace("{{router_output}}", router_output)
        .replace("{{lang_title}}", lang.title())
        .replace("{{lang}}", lang.as_str())
        .replace("{{world}}", world.as_str())
        .replace("{{name_snake}}", &name.replace('-', "_"))
        .replace("{{name}}", name)
}

/// What [`scaffold`] made: the project directory and the commands to run
/// next (from the directory `plugin new` ran in).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Scaffolded {
    pub(crate) dir: PathBuf,
    pub(crate) build: String,
    pub(crate) test: String,
}

/// Writes the project `parent/name` for `lang` and `world`. Refuses a
/// `parent/name` that exists and is not an empty directory.
pub(crate) fn scaffold(
    parent: &Path,
    name: &str,
    lang: PluginLang,
    world: World,
) -> Result<Scaffolded, String> {
    check_name(name)?;
    let dir = parent.join(name);
    if dir.exists() {
        let empty = std::fs::read_dir(&dir)
            .map(|mut entries| entries.next().is_none())
            .unwrap_or(false);
        if !empty {
            return Err(format!(
                "{} already exists and is not an empty directory: choose another name or --dir",
                dir.display()
            ));
        }
    }
    let mut files = template(lang, world);
    files.push(file("README.md", README));
    files.push(file(
        "input.jsonl",
        match world {
            World::Processor => PROCESSOR_INPUT,
            World::Router => ROUTER_INPUT,
        },
    ));
    for template_file in &files {
        let path = dir.join(fill(template_file.path, lang, world, name));
        write_file(
            &path,
            &fill(template_file.text, lang, world, name),
            template_file.executable,
        )?;
    }
    write_file(&dir.join("wit").join(PLUGIN_WIT_FILE), PLUGIN_WIT, false)?;

    let cd = format!("cd {}", shell_quote(&dir.display().to_string()));
    Ok(Scaffolded {
        build: format!("{cd} && ./build.sh"),
        test: format!(
            "{cd} && wasmrelay plugin test {name}.wasm --world {world} --input input.jsonl",
            world = world.as_str()
        ),
        dir,
    })
}

fn write_file(path: &Path, text: &str, executable: bool) -> Result<(), String> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("creating directory {}: {e}", parent.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    if executable {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("making {} executable: {e}", path.display()))?;
    }
    Ok(())
}

/// Quotes a path for a POSIX shell when it needs it.
fn shell_quote(s: &str) -> String {
    let plain = s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/._-+=:,@".contains(&b));
    if plain && !s.is_empty() {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

pub(super) fn run(args: PluginNewArgs) -> ExitCode {
    let world = args.world.unwrap_or(World::Processor);
    match scaffold(&args.dir, &args.name, args.lang, world) {
        Ok(made) => {
            let text = format!(
                "created a {lang} {world} plugin in {dir}\n\nbuild it:\n  {build}\ntest it:\n  {test}\n",
                lang = args.lang.title(),
                world = world.as_str(),
                dir = made.dir.display(),
                build = made.build,
                test = made.test,
            );
            if std::io::stdout().write_all(text.as_bytes()).is_err() {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_must_be_lowercase_words_joined_by_hyphens() {
        for good in ["a", "my-plugin", "enrich2", "a-b-c9"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in [
            "", "My", "9lives", "a--b", "-a", "a-", "a_b", "a/b", "..", "x y",
        ] {
            let error = check_name(bad).unwrap_err();
            assert!(error.contains(&format!("`{bad}`")), "{error}");
        }
    }

    #[test]
    fn every_template_is_filled_in_completely() {
        let tmp = tempfile::tempdir().unwrap();
        for lang in [
            PluginLang::Rust,
            PluginLang::Js,
            PluginLang::Python,
            PluginLang::C,
        ] {
            for world in [World::Processor, World::Router] {
                let name = format!("p-{}-{}", lang.as_str(), world.as_str());
                let made = scaffold(tmp.path(), &name, lang, world).unwrap();
                assert!(made.build.ends_with("&& ./build.sh"), "{}", made.build);
                assert!(made.test.contains(&format!("{name}.wasm --world {world}")));
                let mut pending = vec![made.dir.clone()];
                let mut files = 0;
                while let Some(dir) = pending.pop() {
                    for entry in std::fs::read_dir(dir).unwrap() {
                        let path = entry.unwrap().path();
                        if path.is_dir() {
                            pending.push(path);
                            continue;
                        }
                        files += 1;
                        let text = std::fs::read_to_string(&path).unwrap();
                        assert!(
                            !text.contains("{{"),
                            "{} keeps a placeholder",
                            path.display()
                        );
                        assert!(
                            !path.display().to_string().contains("{{"),
                            "{}",
                            path.display()
                        );
                    }
                }
                assert!(files >= 5, "{name}: only {files} files");
                assert_eq!(
                    std::fs::read_to_string(made.dir.join("wit/plugin.wit")).unwrap(),
                    PLUGIN_WIT
                );
                let build = made.dir.join("build.sh");
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(&build).unwrap().permissions().mode();
                assert_eq!(mode & 0o111, 0o111, "{} not executable", build.display());
            }
        }
    }

    #[test]
    fn an_existing_project_is_not_overwritten() {
        let tmp = tempfile::tempdir().unwrap();
        scaffold(tmp.path(), "mine", PluginLang::Js, World::Processor).unwrap();
        let error = scaffold(tmp.path(), "mine", PluginLang::C, World::Router).unwrap_err();
        assert!(error.contains("already exists"), "{error}");
        assert!(tmp.path().join("mine/mine.js").is_file());
        assert!(!tmp.path().join("mine/mine.c").exists());
    }

    #[test]
    fn paths_are_quoted_for_the_shell_when_needed() {
        assert_eq!(shell_quote("/tmp/a-b/c_d.1"), "/tmp/a-b/c_d.1");
        assert_eq!(shell_quote("/tmp/a b"), "'/tmp/a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
