//! Arbitrary bytes as the `message` of a `Forward` from a peer node, which
//! the receiving node passes on to its process without decoding it
//! (`EncodedMessage::check`, `protocol/src/wire_message.rs`). Checked:
//!
//! - the check never panics;
//! - whatever it accepts, prost decodes as a `Message`, and that message
//!   re-encodes to something the check accepts too.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use wasmrelay_protocol::{EncodedMessage, v1};

fuzz_target!(|data: &[u8]| {
    if EncodedMessage::check(Bytes::copy_from_slice(data)).is_ok() {
        let message = v1::Message::decode(data).expect("an accepted message decodes");
        let again = message.encode_to_vec();
        assert!(
            EncodedMessage::check(Bytes::from(again)).is_ok(),
            "a decoded message re-encodes to an accepted one"
        );
    }
});
