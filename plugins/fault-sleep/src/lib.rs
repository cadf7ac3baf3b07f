//! `fault-sleep` (test plugin): `process` sleeps for an hour through WASI's
//! clocks (a host call: the epoch deadline cannot interrupt it while it
//! blocks), so the host must bound how long a guest can sleep.
//!
//! Config keys: none.

use std::time::Duration;

use wasmrelay_plugin_sdk::prelude::*;

struct FaultSleep;

impl Processor for FaultSleep {
    fn process(msg: Message) -> Result<Outcome, String> {
        std::thread::sleep(Duration::from_secs(3600));
        Ok(Outcome::one(msg.into_output()))
    }
}

export_processor!(FaultSleep);
