//! One input line of `wasmrelay plugin test`.
//! What is checked: `wasmrelay::fuzzing::message_line`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    wasmrelay::fuzzing::message_line(data);
});
