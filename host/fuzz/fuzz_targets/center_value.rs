//! A config-center value (`kafka.<id>`): a JSON object of librdkafka properties.
//! What is checked: `wasmrelay::fuzzing::center_value`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    wasmrelay::fuzzing::center_value(data);
});
