//! `fault-panic` (test plugin): `process` panics with the message
//! `fault-panic: deliberate panic`, which traps the instance; a message
//! whose value is exactly `spare me` passes unchanged instead (so a batch
//! can mix messages that trap and messages that do not).
//!
//! Config keys: none.

use wasmrelay_plugin_sdk::prelude::*;

struct FaultPanic;

impl Processor for FaultPanic {
    fn process(msg: Message) -> Result<Outcome, String> {
        if msg.value.as_deref() == Some(b"spare me".as_slice()) {
            return Ok(Outcome::Emit(vec![msg.into()]));
        }
        std::hint::black_box(&msg);
        panic!("fault-panic: deliberate panic");
    }
}

export_processor!(FaultPanic);
