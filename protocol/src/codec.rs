//! The frame codec: a big-endian `u32` length, then that many bytes of a
//! protobuf [`Frame`]. Used with `tokio_util::codec::Framed` on both sides.
//!
//! Decoding never allocates more than the maximum frame size for one frame,
//! so a peer cannot make the receiver reserve memory by announcing a huge
//! length; every way a byte stream can fail to be frames is a distinct
//! [`CodecError`] that maps to the [`ErrorCode`] sent back.

use bytes::{Buf, BufMut, BytesMut};
use prost::Message as _;
use tokio_util::codec::{Decoder, Encoder};

use crate::v1::ErrorCode;
use crate::{DEFAULT_MAX_FRAME_BYTES, Frame};

/// Bytes of the length prefix.
pub const LENGTH_PREFIX_BYTES: usize = 4;

/// What was wrong with the bytes received or the frame to send.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// A length prefix above the maximum.
    #[error("frame of {length} bytes is larger than the maximum of {max} bytes")]
    TooLarge {
        /// The announced (or, when sending, the encoded) length.
        length: usize,
        /// The maximum frame size.
        max: usize,
    },
    /// The bytes are not a protobuf `Frame`.
    #[error("frame of {length} bytes is not a valid Frame: {reason}")]
    Malformed {
        /// The frame's length.
        length: usize,
        /// What protobuf decoding said.
        reason: String,
    },
    /// A valid `Frame` without a kind (or of a kind this version does not
    /// know).
    #[error("frame has no kind this protocol version knows")]
    NoKind,
    /// The stream ended inside a frame.
    #[error("connection closed inside a frame ({received} of {expected} bytes received)")]
    Truncated {
        /// Bytes of the frame (prefix included) received.
        received: usize,
        /// Bytes the frame needed (prefix included), when the prefix was read.
        expected: usize,
    },
    /// Reading or writing the socket failed.
    #[error("connection error: {0}")]
    Io(#[from] std::io::Error),
}

impl CodecError {
    /// The error code to send to the peer before closing, if any (an I/O
    /// error or a stream that ended leaves nobody to tell).
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            CodecError::TooLarge { .. } => Some(ErrorCode::FrameTooLarge),
            CodecError::Malformed { .. } | CodecError::NoKind => Some(ErrorCode::BadFrame),
            CodecError::Truncated { .. } | CodecError::Io(_) => None,
        }
    }
}

/// Encodes and decodes [`Frame`]s with a `u32` big-endian length prefix.
#[derive(Clone, Debug)]
pub struct FrameCodec {
    max_frame_bytes: usize,
}

impl Default for FrameCodec {
    fn default() -> FrameCodec {
        FrameCodec::new(DEFAULT_MAX_FRAME_BYTES)
    }
}

impl FrameCodec {
    /// A codec that refuses frames longer than `max_frame_bytes` (length
    /// prefix excluded), both ways.
    pub fn new(max_frame_bytes: usize) -> FrameCodec {
        FrameCodec { max_frame_bytes }
    }

    /// The maximum frame size.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// Encodes one frame into a new buffer (prefix included).
    pub fn encode_to_vec(&self, frame: &Frame) -> Result<Vec<u8>, CodecError> {
        let mut buffer = BytesMut::new();
        self.encode_frame(frame, &mut buffer)?;
        Ok(buffer.to_vec())
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = CodecError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, CodecError> {
        if src.len() < LENGTH_PREFIX_BYTES {
            return Ok(None);
        }
        let length = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
        if length > self.max_frame_bytes {
            return Err(CodecError::TooLarge {
                length,
                max: self.max_frame_bytes,
            });
        }
        let needed = LENGTH_PREFIX_BYTES + length;
        if src.len() < needed {
            src.reserve(needed - src.len());
            return Ok(None);
        }
        src.advance(LENGTH_PREFIX_BYTES);
        let body = src.split_to(length).freeze();
        let frame = Frame::decode(body).map_err(|e| CodecError::Malformed {
            length,
            reason: e.to_string(),
        })?;
        if frame.kind.is_none() {
            return Err(CodecError::NoKind);
        }
        Ok(Some(frame))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, CodecError> {
        if let Some(frame) = self.decode(src)? {
            return Ok(Some(frame));
        }
        if src.is_empty() {
            return Ok(None);
        }
        let expected = if src.len() >= LENGTH_PREFIX_BYTES {
            LENGTH_PREFIX_BYTES + u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize
        } else {
            LENGTH_PREFIX_BYTES
        };
        let received = src.len();
        src.clear();
        Err(CodecError::Truncated { received, expected })
    }
}

impl Encoder<Frame> for FrameCodec {
    type Error = CodecError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), CodecError> {
        self.encode_frame(&frame, dst)
    }
}

impl FrameCodec {
    /// Appends one frame (prefix included) to `dst`: a [`Frame`], or what
    /// encodes as one ([`crate::ParcelFrame`], [`crate::Outgoing`]).
    pub fn encode_frame(
        &self,
        frame: &impl prost::Message,
        dst: &mut BytesMut,
    ) -> Result<(), CodecError> {
        let length = frame.encoded_len();
        if length > self.max_frame_bytes {
            return Err(CodecError::TooLarge {
                length,
                max: self.max_frame_bytes,
            });
        }
        dst.reserve(LENGTH_PREFIX_BYTES + length);
        dst.put_u32(length as u32);
        frame
            .encode(dst)
            .map_err(|e| CodecError::Io(std::io::Error::other(e)))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Kind;
    use crate::v1::{Hello, Ping};

    fn hello() -> Frame {
        Frame::of(Kind::Hello(Hello {
            protocol_version: 1,
            process_id: "p-1".to_string(),
            client_name: "test".to_string(),
            accepts_redirect: true,
            token: "header.claims.signature".to_string(),
            redirects: 0,
        }))
    }

    #[test]
    fn round_trips_frames_split_anywhere() {
        let mut codec = FrameCodec::default();
        let mut bytes = codec.encode_to_vec(&hello()).unwrap();
        bytes.extend(
            codec
                .encode_to_vec(&Frame::of(Kind::Ping(Ping { nonce: 7 })))
                .unwrap(),
        );
        for split in 0..bytes.len() {
            let mut buffer = BytesMut::from(&bytes[..split]);
            let mut frames = Vec::new();
            while let Some(frame) = codec.decode(&mut buffer).unwrap() {
                frames.push(frame);
            }
            buffer.extend_from_slice(&bytes[split..]);
            while let Some(frame) = codec.decode_eof(&mut buffer).unwrap() {
                frames.push(frame);
            }
            assert_eq!(frames.len(), 2, "split at {split}");
            assert_eq!(frames[0], hello());
        }
    }

    #[test]
    fn an_oversized_length_is_refused_before_reading_the_body() {
        let mut codec = FrameCodec::new(1024);
        let mut buffer = BytesMut::from(&[0x00, 0x01, 0x00, 0x00][..]);
        let error = codec.decode(&mut buffer).unwrap_err();
        assert!(matches!(
            error,
            CodecError::TooLarge {
                length: 65536,
                max: 1024
            }
        ));
        assert_eq!(error.code(), Some(ErrorCode::FrameTooLarge));
        assert!(buffer.capacity() < 65536);
    }

    #[test]
    fn garbage_is_a_bad_frame() {
        let mut codec = FrameCodec::default();
        let mut buffer = BytesMut::from(&[0, 0, 0, 3, 0xff, 0xff, 0xff][..]);
        let error = codec.decode(&mut buffer).unwrap_err();
        assert!(
            matches!(error, CodecError::Malformed { length: 3, .. }),
            "{error}"
        );
        assert_eq!(error.code(), Some(ErrorCode::BadFrame));
    }

    #[test]
    fn an_empty_frame_has_no_kind() {
        let mut codec = FrameCodec::default();
        let mut buffer = BytesMut::from(&[0, 0, 0, 0][..]);
        let error = codec.decode(&mut buffer).unwrap_err();
        assert!(matches!(error, CodecError::NoKind));
    }

    #[test]
    fn a_stream_ending_inside_a_frame_is_truncated() {
        let mut codec = FrameCodec::default();
        let bytes = codec.encode_to_vec(&hello()).unwrap();
        let mut buffer = BytesMut::from(&bytes[..bytes.len() - 2]);
        assert!(codec.decode(&mut buffer).unwrap().is_none());
        let error = codec.decode_eof(&mut buffer).unwrap_err();
        assert!(
            matches!(error, CodecError::Truncated { received, expected } if expected == bytes.len() && received == bytes.len() - 2),
            "{error}"
        );
        assert_eq!(error.code(), None);
    }

    #[test]
    fn frames_over_the_maximum_are_not_sent() {
        let codec = FrameCodec::new(8);
        let error = codec.encode_to_vec(&hello()).unwrap_err();
        assert!(matches!(error, CodecError::TooLarge { max: 8, .. }));
    }
}
