//! `fault-alloc` (test plugin): `process` allocates without bound, 1 MiB at
//! a time, every page touched, until the host's memory limit stops it (the
//! allocation fails and the instance traps).
//!
//! Config keys: none.

use std::hint::black_box;

use wasmrelay_plugin_sdk::prelude::*;

const CHUNK: usize = 1 << 20;

struct FaultAlloc;

impl Processor for FaultAlloc {
    fn process(msg: Message) -> Result<Outcome, String> {
        black_box(&msg);
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            // Non-zero fill: the memory is really written, not just reserved.
            let chunk = black_box(vec![0xa5u8; CHUNK]);
            hoard.push(chunk);
            black_box(&mut hoard);
        }
    }
}

export_processor!(FaultAlloc);
