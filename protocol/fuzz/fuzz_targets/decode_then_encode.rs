//! Arbitrary bytes as the body of one frame: the length prefix is written
//! for them, so the fuzzer spends its time on the protobuf rather than on
//! finding a valid prefix. Checked: nothing panics; the codec accepts a body
//! exactly when prost decodes it to a `Frame` with a kind, and gives the same
//! frame; an accepted frame re-encodes, decodes back equal, and re-encodes
//! to the same bytes.
#![no_main]

use bytes::{BufMut, BytesMut};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use tokio_util::codec::Decoder;
use wasmrelay_protocol::{CodecError, Frame, FrameCodec};

const MAX_FRAME_BYTES: usize = 64 * 1024;

fuzz_target!(|body: &[u8]| {
    let mut codec = FrameCodec::new(MAX_FRAME_BYTES);
    let mut buffer = BytesMut::with_capacity(4 + body.len());
    buffer.put_u32(body.len() as u32);
    buffer.extend_from_slice(body);
    let direct = Frame::decode(body);
    match codec.decode_eof(&mut buffer) {
        Ok(Some(frame)) => {
            assert!(buffer.is_empty());
            assert_eq!(
                direct.as_ref().ok(),
                Some(&frame),
                "the codec and prost disagree"
            );
            // A wide maximum: a frame can re-encode a few bytes longer (a
            // negative int32 sent as 5 bytes is written back as 10).
            let mut wide = FrameCodec::new(u32::MAX as usize);
            let once = wide.encode_to_vec(&frame).expect("re-encode");
            let mut again = BytesMut::from(&once[..]);
            let copy = wide
                .decode_eof(&mut again)
                .expect("decode")
                .expect("a frame");
            assert_eq!(copy, frame, "the frame changed in a round trip");
            assert_eq!(
                wide.encode_to_vec(&copy).expect("encode"),
                once,
                "re-encoding is not stable"
            );
        }
        Ok(None) => panic!("a whole frame decoded to nothing"),
        Err(CodecError::TooLarge { length, .. }) => {
            assert_eq!(length, body.len());
            assert!(length > MAX_FRAME_BYTES);
        }
        Err(CodecError::Malformed { .. }) => {
            assert!(direct.is_err(), "the codec refused what prost reads")
        }
        Err(CodecError::NoKind) => assert!(direct.is_ok_and(|f| f.kind.is_none())),
        Err(error) => panic!("unexpected error for a whole frame: {error}"),
    }
});
