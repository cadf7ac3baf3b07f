//! `passthrough`: emits every input message unchanged (key, value and
//! headers), without looking at it.
//!
//! It is the cheapest possible processor and the baseline of the relay's
//! per-message overhead benchmark: no parsing, no copying beyond what the
//! component ABI itself does.
//!
//! Config keys: none.

use wasmrelay_plugin_sdk::prelude::*;

struct Passthrough;

impl Processor for Passthrough {
    #[inline]
    fn process(msg: Message) -> Result<Outcome, String> {
        Ok(Outcome::one(msg.into_output()))
    }
}

export_processor!(Passthrough);
