//! A run of route records as read from the routes topic, applied to one table.
//! What is checked: `wasmrelay::fuzzing::route_records`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = wasmrelay::fuzzing::route_records(data);
});
