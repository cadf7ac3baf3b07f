//! Arbitrary bytes as a received byte stream: fed to `FrameCodec::decode` in
//! chunks, then `decode_eof`, the way `FramedRead` drives the codec.
//!
//! The first input byte picks the chunk size (0: the whole stream at once,
//! n: n bytes at a time), so where the stream is split is fuzzed too. The
//! rest is the stream. Checked:
//!
//! - nothing panics, and decoding stops at the first error;
//! - `Ok(None)` from `decode` means the buffer really holds an incomplete
//!   frame, and `Ok(None)` from `decode_eof` leaves the buffer empty;
//! - each error is one the situation allows (`TooLarge` only for a length
//!   above the maximum, `Truncated` only at the end of the stream, never
//!   `Io`), with the right error code;
//! - the frames and the error do not depend on where the stream was split;
//! - every decoded frame re-encodes and decodes back equal, and its
//!   re-encoding is stable (encoding the decoded copy gives the same bytes).
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tokio_util::codec::Decoder;
use wasmrelay_protocol::codec::LENGTH_PREFIX_BYTES;
use wasmrelay_protocol::v1::ErrorCode;
use wasmrelay_protocol::{CodecError, Frame, FrameCodec};

const MAX_FRAME_BYTES: usize = 64 * 1024;

/// What decoding a stream gave: its frames, then the error that stopped it.
#[derive(Debug, PartialEq)]
struct Outcome {
    frames: Vec<Frame>,
    /// The error's `Debug` text (`CodecError` has no `PartialEq`).
    error: Option<String>,
}

fn decode_stream(stream: &[u8], chunk: usize) -> Outcome {
    let mut codec = FrameCodec::new(MAX_FRAME_BYTES);
    let mut buffer = BytesMut::new();
    let mut frames = Vec::new();
    for piece in stream.chunks(chunk) {
        buffer.extend_from_slice(piece);
        loop {
            match codec.decode(&mut buffer) {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => {
                    check_incomplete(&buffer);
                    break;
                }
                Err(error) => return stopped(frames, &error, false),
            }
        }
    }
    loop {
        match codec.decode_eof(&mut buffer) {
            Ok(Some(frame)) => frames.push(frame),
            Ok(None) => {
                assert!(
                    buffer.is_empty(),
                    "decode_eof said done with {} bytes left",
                    buffer.len()
                );
                return Outcome {
                    frames,
                    error: None,
                };
            }
            Err(error) => {
                assert!(buffer.is_empty() || !matches!(error, CodecError::Truncated { .. }));
                return stopped(frames, &error, true);
            }
        }
    }
}

/// `decode` said "need more bytes": the buffer must hold less than a frame.
fn check_incomplete(buffer: &BytesMut) {
    if buffer.len() < LENGTH_PREFIX_BYTES {
        return;
    }
    let length = u32::from_be_bytes([buffer[0], buffer[1], buffer[2], buffer[3]]) as usize;
    assert!(
        length <= MAX_FRAME_BYTES,
        "an oversized length {length} was not refused"
    );
    assert!(
        buffer.len() < LENGTH_PREFIX_BYTES + length,
        "a whole frame of {length} bytes was left in a buffer of {}",
        buffer.len()
    );
}

fn stopped(frames: Vec<Frame>, error: &CodecError, at_eof: bool) -> Outcome {
    let _ = error.to_string();
    match *error {
        CodecError::TooLarge { length, max } => {
            assert_eq!(max, MAX_FRAME_BYTES);
            assert!(length > MAX_FRAME_BYTES, "TooLarge for {length} bytes");
            assert_eq!(error.code(), Some(ErrorCode::FrameTooLarge));
        }
        CodecError::Malformed { length, .. } => {
            assert!(length <= MAX_FRAME_BYTES);
            assert_eq!(error.code(), Some(ErrorCode::BadFrame));
        }
        CodecError::NoKind => assert_eq!(error.code(), Some(ErrorCode::BadFrame)),
        CodecError::Truncated { received, expected } => {
            assert!(at_eof, "Truncated before the end of the stream");
            assert!(
                0 < received && received < expected,
                "Truncated {received} of {expected}"
            );
            assert_eq!(error.code(), None);
        }
        CodecError::Io(_) => panic!("decoding bytes in memory gave an I/O error: {error}"),
    }
    Outcome {
        frames,
        error: Some(format!("{error:?}")),
    }
}

/// Encodes `frame`, decodes it back and encodes the copy again.
fn check_round_trip(frame: &Frame) {
    let mut codec = FrameCodec::new(MAX_FRAME_BYTES);
    let bytes = match codec.encode_to_vec(frame) {
        Ok(bytes) => bytes,
        // A frame read within the maximum can re-encode a few bytes longer:
        // protobuf lets an `int32` / enum be sent as a 5-byte varint, and a
        // negative one is always written back as 10 bytes.
        Err(CodecError::TooLarge { length, .. }) => {
            assert_eq!(length, prost::Message::encoded_len(frame));
            assert!(length > MAX_FRAME_BYTES);
            codec = FrameCodec::new(u32::MAX as usize);
            codec
                .encode_to_vec(frame)
                .expect("encode with a wide maximum")
        }
        Err(other) => panic!("re-encoding a decoded frame failed: {other}"),
    };
    let mut encoded = BytesMut::from(&bytes[..]);
    let copy = codec
        .decode_eof(&mut encoded)
        .expect("a re-encoded frame decodes")
        .expect("a re-encoded frame is a whole frame");
    assert!(
        encoded.is_empty(),
        "{} bytes left after a re-encoded frame",
        encoded.len()
    );
    assert_eq!(&copy, frame, "the frame changed in a round trip");
    let again = codec.encode_to_vec(&copy).expect("encode the copy");
    assert_eq!(again, bytes, "re-encoding is not stable");
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, stream)) = data.split_first() else {
        return;
    };
    let whole = stream.len().max(1);
    let chunk = if selector == 0 {
        whole
    } else {
        usize::from(selector)
    };
    let outcome = decode_stream(stream, chunk);
    if chunk < stream.len() {
        assert_eq!(
            outcome,
            decode_stream(stream, whole),
            "the split changed the result"
        );
    }
    for frame in &outcome.frames {
        check_round_trip(frame);
    }
});
