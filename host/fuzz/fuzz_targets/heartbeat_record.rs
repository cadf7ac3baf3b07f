//! A heartbeat record as read from the heartbeat topic, signed or not.
//! What is checked: `wasmrelay::fuzzing::heartbeat_record`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = wasmrelay::fuzzing::heartbeat_record(data);
});
