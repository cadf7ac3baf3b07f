//! `fault-panic` (test plugin): `process` panics with the message
//! `fault-panic: deliberate panic`, which traps the instance.
//!
//! Config keys: none.

use wasmrelay_plugin_sdk::prelude::*;

struct FaultPanic;

impl Processor for FaultPanic {
    fn process(msg: Message) -> Result<Outcome, String> {
        std::hint::black_box(&msg);
        panic!("fault-panic: deliberate panic");
    }
}

export_processor!(FaultPanic);
