//! Why the fuzz targets re-encode with a wide maximum: a frame read within
//! the maximum can re-encode a few bytes longer.

use prost::Message as _;
use wasmrelay_protocol::{Frame, Kind};

#[test]
fn a_negative_enum_sent_in_5_bytes_is_written_back_in_10() {
    // Frame.error (field 13, length-delimited) = Error { code (field 1,
    // varint) = -1 as a 5-byte varint, which prost accepts and truncates }.
    let body = [0x6a, 0x06, 0x08, 0xff, 0xff, 0xff, 0xff, 0x0f];
    let frame = Frame::decode(&body[..]).expect("prost reads it");
    let Some(Kind::Error(error)) = &frame.kind else {
        panic!("not an error frame: {frame:?}");
    };
    assert_eq!(error.code, -1);
    assert_eq!(frame.encoded_len(), body.len() + 5);
}
