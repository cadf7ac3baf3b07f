//! A config file's text (TOML with ${VAR} interpolation), parsed and validated.
//! What is checked: `wasmrelay::fuzzing::config_text`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    wasmrelay::fuzzing::config_text(data);
});
