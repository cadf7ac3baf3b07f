//! `version-tag` (test plugin): emits the input with one extra header,
//! `x-version`, whose value is the 16-byte marker stored in [`MARKER`]:
//! `wasmrelay-v-0000` as built.
//!
//! Tests make "new versions" of this plugin without rebuilding it by
//! replacing those 16 bytes in the `.wasm` file (e.g. with
//! `wasmrelay-v-0001`). So the marker is a static in the data segment that
//! occurs exactly once in the binary, and the code reads it from memory at run
//! time (through `black_box`), never as a folded constant.
//!
//! Config keys: none.

use std::hint::black_box;

use wasmrelay_plugin_sdk::prelude::*;

/// The version marker; patched in the `.wasm` by tests. Must stay 16 bytes.
#[used]
static MARKER: [u8; 16] = *b"wasmrelay-v-0000";

struct VersionTag;

impl Processor for VersionTag {
    fn process(msg: Message) -> Result<Outcome, String> {
        // `black_box` hides where the reference points, so the bytes are
        // loaded from linear memory rather than known at compile time.
        let marker: &[u8; 16] = black_box(&MARKER);
        let mut out = msg.into_output();
        out.add_header("x-version", marker.to_vec());
        Ok(Outcome::one(out))
    }
}

export_processor!(VersionTag);
