//! `fault-loop` (test plugin): `process` never returns. It spins in a loop
//! the optimiser cannot remove, so the host must interrupt it (fuel or epoch
//! deadline).
//!
//! Config keys: none.

use std::hint::black_box;

use wasmrelay_plugin_sdk::prelude::*;

struct FaultLoop;

impl Processor for FaultLoop {
    fn process(msg: Message) -> Result<Outcome, String> {
        black_box(&msg);
        let mut spins: u64 = 0;
        loop {
            spins = black_box(spins.wrapping_add(1));
        }
    }
}

export_processor!(FaultLoop);
