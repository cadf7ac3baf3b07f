//! Cluster authentication with the cluster secret: the mesh handshake, the
//! per-link session that authenticates every later mesh frame, and the MACs
//! of the records nodes exchange through Kafka (heartbeats, routes).
//!
//! Every key is derived from the secret, one per purpose ([`purpose_key`]),
//! so a MAC made for one purpose never passes for another. A node dialing
//! another proves it knows the secret with an HMAC-SHA256 over both node
//! ids, a fresh nonce and its clock; the acceptor answers with an HMAC over
//! both nonces. Both then derive a session key per direction from the two
//! nonces and node ids ([`SessionKeys`]); [`MeshCodec`] seals every frame
//! after the handshake in a `MeshSealed` with a MAC and a sequence number
//! (the frames a writer hands over together, a [`FrameBatch`], under one
//! MAC and number when the peer said it takes that), so a man in the
//! middle that relays the handshake gets a link it can neither read into
//! nor write on. The exact texts are in
//! `proto/wasmrelay.proto` (`MeshHello`, `MeshWelcome`, `MeshSealed`) so
//! that other implementations can interoperate; the record MAC is
//! [`record_mac`].
//!
//! Owns the cryptography and the sealed framing; does not own the link's
//! life (the host's mesh) nor what a record means (membership, routes).

use std::collections::VecDeque;

use bytes::{BufMut as _, Bytes, BytesMut};
use hmac::{Hmac, Mac as _};
use prost::Message as _;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use sha2::Sha256;
use tokio_util::codec::{Decoder, Encoder};

use crate::codec::LENGTH_PREFIX_BYTES;
use crate::v1::{ErrorCode, MeshSealed};
use crate::{CodecError, Frame, FrameCodec, Kind, Outgoing};

/// How far apart the two nodes' clocks may be, in milliseconds.
pub const MAX_CLOCK_SKEW_MS: i64 = 60_000;

/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// What a key derived from the cluster secret is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// The MACs of `MeshHello` and `MeshWelcome`.
    MeshHandshake,
    /// The root of the per-link session keys.
    MeshSession,
    /// The MACs of heartbeat records.
    HeartbeatRecord,
    /// The MACs of route records and route tombstones.
    RouteRecord,
}

impl Purpose {
    /// The purpose's name in the derivation text.
    pub fn name(self) -> &'static str {
        match self {
            Purpose::MeshHandshake => "mesh-handshake",
            Purpose::MeshSession => "mesh-session",
            Purpose::HeartbeatRecord => "heartbeat-record",
            Purpose::RouteRecord => "route-record",
        }
    }
}

/// A 32-byte key, with its HMAC key schedule made once (every MAC made
/// with it starts from a copy, not from the key: two SHA-256 blocks fewer a
/// record or a frame). Its `Debug` does not show it.
#[derive(Clone)]
pub struct Key {
    bytes: [u8; MAC_BYTES],
    keyed: HmacSha256,
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Key {}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

impl Key {
    fn new(bytes: [u8; MAC_BYTES]) -> Key {
        Key {
            bytes,
            keyed: HmacSha256::new_from_slice(&bytes).expect("HMAC takes keys of any length"),
        }
    }

    fn mac(&self) -> HmacSha256 {
        self.keyed.clone()
    }
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; MAC_BYTES] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// `HMAC-SHA256(secret, "wasmrelay-key\n" + purpose)`: the key of one
/// purpose.
pub fn purpose_key(secret: &[u8], purpose: Purpose) -> Key {
    Key::new(hmac(
        secret,
        &[b"wasmrelay-key\n", purpose.name().as_bytes()],
    ))
}

fn hello_text(node_id: &str, to_node_id: &str, nonce: &[u8], time_ms: i64) -> String {
    format!(
        "wasmrelay-mesh-hello\n{node_id}\n{to_node_id}\n{}\n{time_ms}",
        hex::encode(nonce)
    )
}

fn welcome_text(node_id: &str, dialer_id: &str, dialer_nonce: &[u8], nonce: &[u8]) -> String {
    format!(
        "wasmrelay-mesh-welcome\n{node_id}\n{dialer_id}\n{}\n{}",
        hex::encode(dialer_nonce),
        hex::encode(nonce)
    )
}

fn handshake_mac(secret: &[u8], text: &str) -> HmacSha256 {
    let mut mac = purpose_key(secret, Purpose::MeshHandshake).mac();
    mac.update(text.as_bytes());
    mac
}

/// The `mac` of a `MeshHello`.
pub fn hello_mac(
    secret: &[u8],
    node_id: &str,
    to_node_id: &str,
    nonce: &[u8],
    time_ms: i64,
) -> Vec<u8> {
    handshake_mac(secret, &hello_text(node_id, to_node_id, nonce, time_ms))
        .finalize()
        .into_bytes()
        .to_vec()
}

/// Checks a `MeshHello`'s `mac` (in constant time) and clock.
pub fn verify_hello(
    secret: &[u8],
    hello: &crate::v1::MeshHello,
    now_ms: i64,
) -> Result<(), String> {
    if (hello.time_ms - now_ms).abs() > MAX_CLOCK_SKEW_MS {
        return Err(format!(
            "the clocks of {} and this node are {} ms apart (at most {MAX_CLOCK_SKEW_MS} allowed)",
            hello.node_id,
            (hello.time_ms - now_ms).abs()
        ));
    }
    handshake_mac(
        secret,
        &hello_text(
            &hello.node_id,
            &hello.to_node_id,
            &hello.nonce,
            hello.time_ms,
        ),
    )
    .verify_slice(&hello.mac)
    .map_err(|_| format!("node {} does not know the cluster secret", hello.node_id))
}

/// The `mac` of a `MeshWelcome` from `node_id` with its `nonce`, answering
/// `dialer_id`'s hello with `dialer_nonce`.
pub fn welcome_mac(
    secret: &[u8],
    node_id: &str,
    dialer_id: &str,
    dialer_nonce: &[u8],
    nonce: &[u8],
) -> Vec<u8> {
    handshake_mac(
        secret,
        &welcome_text(node_id, dialer_id, dialer_nonce, nonce),
    )
    .finalize()
    .into_bytes()
    .to_vec()
}

/// Checks a `MeshWelcome`'s `mac` against the hello `dialer_id` sent with
/// `dialer_nonce`.
pub fn verify_welcome(
    secret: &[u8],
    welcome: &crate::v1::MeshWelcome,
    dialer_id: &str,
    dialer_nonce: &[u8],
) -> Result<(), String> {
    handshake_mac(
        secret,
        &welcome_text(&welcome.node_id, dialer_id, dialer_nonce, &welcome.nonce),
    )
    .verify_slice(&welcome.mac)
    .map_err(|_| format!("node {} does not know the cluster secret", welcome.node_id))
}

/// The two keys of one mesh link, one per direction.
#[derive(Clone, Debug)]
pub struct SessionKeys {
    /// Seals what the dialer sends.
    pub dialer_to_acceptor: Key,
    /// Seals what the acceptor sends.
    pub acceptor_to_dialer: Key,
}

impl SessionKeys {
    /// The keys of the link `dialer_id` opened to `acceptor_id` with these
    /// nonces (see `proto/wasmrelay.proto`, "Session").
    pub fn derive(
        secret: &[u8],
        dialer_id: &str,
        acceptor_id: &str,
        dialer_nonce: &[u8],
        acceptor_nonce: &[u8],
    ) -> SessionKeys {
        let root = purpose_key(secret, Purpose::MeshSession);
        let text = format!(
            "wasmrelay-mesh-session\n{dialer_id}\n{acceptor_id}\n{}\n{}",
            hex::encode(dialer_nonce),
            hex::encode(acceptor_nonce)
        );
        let master = hmac(&root.bytes, &[text.as_bytes()]);
        SessionKeys {
            dialer_to_acceptor: Key::new(hmac(&master, &[b"dialer-to-acceptor"])),
            acceptor_to_dialer: Key::new(hmac(&master, &[b"acceptor-to-dialer"])),
        }
    }

    /// `(sending, receiving)` keys for the dialer's end.
    pub fn for_dialer(self) -> (Key, Key) {
        (self.dialer_to_acceptor, self.acceptor_to_dialer)
    }

    /// `(sending, receiving)` keys for the acceptor's end.
    pub fn for_acceptor(self) -> (Key, Key) {
        (self.acceptor_to_dialer, self.dialer_to_acceptor)
    }
}

fn sealed_mac(key: &Key, seq: u64, frame: &[u8]) -> HmacSha256 {
    let mut mac = key.mac();
    mac.update(&seq.to_be_bytes());
    mac.update(frame);
    mac
}

/// The `MeshSealed` frame carrying `frame` as the `seq`th of its direction.
pub fn seal(key: &Key, seq: u64, frame: &Frame) -> Frame {
    let inner = frame.encode_to_vec();
    let mac = sealed_mac(key, seq, &inner)
        .finalize()
        .into_bytes()
        .to_vec();
    Frame::of(Kind::MeshSealed(MeshSealed {
        seq,
        frame: inner.into(),
        mac: mac.into(),
        frames: Vec::new(),
    }))
}

/// The size of the `MeshSealed` frame carrying a frame of `inner_len`
/// bytes, at most (the sequence number taken at its longest).
pub fn sealed_len(inner_len: usize) -> usize {
    sealed_batch_len(inner_len as u64 + 1 + encoded_len_varint(inner_len as u64) as u64) as usize
}

/// The size of a `MeshSealed` frame whose frame fields (`frame` or each of
/// `frames`, with their tags and lengths) take `fields` bytes, at most.
fn sealed_batch_len(fields: u64) -> u64 {
    let sealed = (1 + encoded_len_varint(u64::MAX) as u64)
        + fields
        + (1 + encoded_len_varint(MAC_BYTES as u64) + MAC_BYTES) as u64;
    key_len(SEALED_TAG) as u64 + encoded_len_varint(sealed) as u64 + sealed
}

/// The tag of `Frame.mesh_sealed`.
const SEALED_TAG: u32 = 24;

/// The MAC of a `MeshSealed` carrying `frames` (see the proto).
fn sealed_batch_mac(key: &Key, seq: u64, frames: &[Bytes]) -> HmacSha256 {
    let mut mac = key.mac();
    mac.update(&seq.to_be_bytes());
    mac.update(&[0]);
    for frame in frames {
        mac.update(&(frame.len() as u32).to_be_bytes());
        mac.update(frame);
    }
    mac
}

/// Frames to send together: to a peer that takes them
/// ([`MeshCodec::send_batches`]), sealed in as few `MeshSealed` frames as
/// the size limit allows, one MAC each; otherwise one by one.
#[derive(Debug, Default)]
pub struct FrameBatch(pub Vec<Outgoing>);

/// What was wrong with what arrived on (or was to be sent on) a mesh link.
#[derive(Debug, thiserror::Error)]
pub enum MeshWireError {
    /// The framing itself: size, protobuf, socket.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// A frame that is not a `MeshSealed` after the handshake.
    #[error("a {0} frame arrived unsealed after the mesh handshake")]
    Unsealed(&'static str),
    /// A `MeshSealed` out of sequence: replayed, reordered or one dropped.
    #[error(
        "sealed frame {got} arrived where frame {expected} was due (replayed, reordered or dropped)"
    )]
    OutOfOrder {
        /// The next seq due.
        expected: u64,
        /// The seq received.
        got: u64,
    },
    /// A `MeshSealed` whose MAC does not verify: altered, or made without
    /// the key.
    #[error(
        "sealed frame {seq} does not authenticate (altered, or made without the cluster secret)"
    )]
    BadMac {
        /// Its seq.
        seq: u64,
    },
    /// The frame inside a `MeshSealed` is not a frame that may be sealed.
    #[error("sealed frame {seq} does not carry a valid frame: {reason}")]
    BadInner {
        /// Its seq.
        seq: u64,
        /// What was wrong.
        reason: String,
    },
}

impl From<std::io::Error> for MeshWireError {
    fn from(error: std::io::Error) -> Self {
        MeshWireError::Codec(CodecError::Io(error))
    }
}

impl MeshWireError {
    /// The error code to send to the peer before closing, if any.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            MeshWireError::Codec(error) => error.code(),
            MeshWireError::Unsealed(_)
            | MeshWireError::OutOfOrder { .. }
            | MeshWireError::BadMac { .. } => Some(ErrorCode::Unauthorized),
            MeshWireError::BadInner { .. } => Some(ErrorCode::BadFrame),
        }
    }

    /// Whether the peer's frames failed authentication (rather than being
    /// malformed or the socket failing).
    pub fn is_unauthorized(&self) -> bool {
        self.code() == Some(ErrorCode::Unauthorized)
    }
}

/// One direction's key and next sequence number.
#[derive(Clone, Debug)]
struct Direction {
    key: Key,
    next: u64,
}

/// The framing of a mesh link: plain frames during the handshake, then
/// (after [`MeshCodec::seal_with`]) every frame sealed in a `MeshSealed`
/// both ways. `max_frame_bytes` limits the frames on the wire, the sealed
/// ones included.
#[derive(Clone, Debug)]
pub struct MeshCodec {
    frames: FrameCodec,
    send: Option<Direction>,
    receive: Option<Direction>,
    /// Whether the peer takes batches ([`FrameBatch`]).
    batches_out: bool,
    /// Frames of a batch opened and not returned yet.
    opened: VecDeque<Frame>,
}

impl MeshCodec {
    /// A codec for the handshake, refusing frames over `max_frame_bytes`.
    pub fn new(max_frame_bytes: usize) -> MeshCodec {
        MeshCodec {
            frames: FrameCodec::new(max_frame_bytes),
            send: None,
            receive: None,
            batches_out: false,
            opened: VecDeque::new(),
        }
    }

    /// Whether a [`FrameBatch`] may go out sealed as one frame: set after
    /// the handshake when the peer said it takes them.
    pub fn send_batches(&mut self, peer_takes_them: bool) {
        self.batches_out = peer_takes_them;
    }

    /// From now on seals what is sent with `send` and accepts only frames
    /// sealed with `receive`, both numbered from 1.
    pub fn seal_with(&mut self, (send, receive): (Key, Key)) {
        self.send = Some(Direction { key: send, next: 1 });
        self.receive = Some(Direction {
            key: receive,
            next: 1,
        });
    }

    /// Whether frames are sealed now.
    pub fn is_sealed(&self) -> bool {
        self.send.is_some()
    }

    /// The largest frame on the wire.
    pub fn max_frame_bytes(&self) -> usize {
        self.frames.max_frame_bytes()
    }

    fn open(&mut self, frame: Frame) -> Result<Frame, MeshWireError> {
        let Some(receive) = &mut self.receive else {
            return Ok(frame);
        };
        let sealed = match frame.kind {
            Some(Kind::MeshSealed(sealed)) => sealed,
            _ => return Err(MeshWireError::Unsealed(frame.kind_name())),
        };
        if sealed.seq != receive.next {
            return Err(MeshWireError::OutOfOrder {
                expected: receive.next,
                got: sealed.seq,
            });
        }
        let seq = sealed.seq;
        if sealed.frames.is_empty() {
            sealed_mac(&receive.key, seq, &sealed.frame)
                .verify_slice(&sealed.mac)
                .map_err(|_| MeshWireError::BadMac { seq })?;
            receive.next += 1;
            return open_inner(seq, sealed.frame);
        }
        sealed_batch_mac(&receive.key, seq, &sealed.frames)
            .verify_slice(&sealed.mac)
            .map_err(|_| MeshWireError::BadMac { seq })?;
        receive.next += 1;
        if !sealed.frame.is_empty() {
            return Err(MeshWireError::BadInner {
                seq,
                reason: "both `frame` and `frames` are set".to_string(),
            });
        }
        let mut frames = sealed.frames.into_iter();
        let first = open_inner(seq, frames.next().expect("not empty"))?;
        for frame in frames {
            let frame = open_inner(seq, frame)?;
            self.opened.push_back(frame);
        }
        Ok(first)
    }
}

/// The frame carried in sealed frame `seq`, if it is one that may be.
fn open_inner(seq: u64, bytes: Bytes) -> Result<Frame, MeshWireError> {
    let inner = Frame::decode(bytes).map_err(|e| MeshWireError::BadInner {
        seq,
        reason: e.to_string(),
    })?;
    match &inner.kind {
        None => Err(MeshWireError::BadInner {
            seq,
            reason: "a frame with no kind this version knows".to_string(),
        }),
        Some(Kind::MeshSealed(_) | Kind::MeshHello(_) | Kind::MeshWelcome(_)) => {
            Err(MeshWireError::BadInner {
                seq,
                reason: format!("a {} frame may not be sealed", inner.kind_name()),
            })
        }
        // Forward, ForwardAck, MeshLookup, MeshLookupAnswer,
        // MeshRecordsMissed, Ping, Pong, Error: which way each may go is
        // for the link to judge.
        Some(_) => Ok(inner),
    }
}

impl Decoder for MeshCodec {
    type Item = Frame;
    type Error = MeshWireError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, MeshWireError> {
        if let Some(frame) = self.opened.pop_front() {
            return Ok(Some(frame));
        }
        match self.frames.decode(src)? {
            Some(frame) => self.open(frame).map(Some),
            None => Ok(None),
        }
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, MeshWireError> {
        if let Some(frame) = self.opened.pop_front() {
            return Ok(Some(frame));
        }
        match self.frames.decode_eof(src)? {
            Some(frame) => self.open(frame).map(Some),
            None => Ok(None),
        }
    }
}

impl Encoder<Frame> for MeshCodec {
    type Error = MeshWireError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), MeshWireError> {
        if self.send.is_none() {
            return Ok(self.frames.encode_frame(&frame, dst)?);
        }
        let frame = Outgoing::Frame(frame);
        let len = frame.encoded_len();
        self.seal_into(std::slice::from_ref(&frame), &[len], dst)
    }
}

impl Encoder<FrameBatch> for MeshCodec {
    type Error = MeshWireError;

    fn encode(&mut self, batch: FrameBatch, dst: &mut BytesMut) -> Result<(), MeshWireError> {
        if self.send.is_none() {
            for frame in &batch.0 {
                self.frames.encode_frame(frame, dst)?;
            }
            return Ok(());
        }
        let lens: Vec<usize> = batch.0.iter().map(|frame| frame.encoded_len()).collect();
        if !self.batches_out {
            for (frame, len) in batch.0.iter().zip(&lens) {
                self.seal_into(std::slice::from_ref(frame), std::slice::from_ref(len), dst)?;
            }
            return Ok(());
        }
        // As many frames under one seal as the size limit allows.
        let max = self.frames.max_frame_bytes() as u64;
        let mut start = 0;
        let mut fields = 0u64;
        for (at, &len) in lens.iter().enumerate() {
            let field = (1 + encoded_len_varint(len as u64) + len) as u64;
            if at > start && sealed_batch_len(fields + field) > max {
                self.seal_into(&batch.0[start..at], &lens[start..at], dst)?;
                start = at;
                fields = 0;
            }
            fields += field;
        }
        self.seal_into(&batch.0[start..], &lens[start..], dst)
    }
}

impl MeshCodec {
    /// Writes `frames` (of encoded lengths `lens`) as the next sealed
    /// frame, each encoded straight into `dst` and MACed there: in `frame`
    /// when it is one, in `frames` when several (see the proto).
    fn seal_into(
        &mut self,
        frames: &[Outgoing],
        lens: &[usize],
        dst: &mut BytesMut,
    ) -> Result<(), MeshWireError> {
        let send = self.send.as_mut().expect("sealing");
        let seq = send.next;
        let single = frames.len() == 1;
        let (frame_tag, frame_fields) = if single {
            // proto3 leaves an empty `frame` out.
            let len = lens[0];
            let field = if len == 0 {
                0
            } else {
                1 + encoded_len_varint(len as u64) + len
            };
            (2, field)
        } else {
            let fields = lens
                .iter()
                .map(|&len| 1 + encoded_len_varint(len as u64) + len)
                .sum();
            (4, fields)
        };
        let sealed = 1
            + encoded_len_varint(seq)
            + frame_fields
            + 1
            + encoded_len_varint(MAC_BYTES as u64)
            + MAC_BYTES;
        let length = key_len(SEALED_TAG) + encoded_len_varint(sealed as u64) + sealed;
        let max = self.frames.max_frame_bytes();
        if length > max {
            return Err(CodecError::TooLarge { length, max }.into());
        }
        dst.reserve(LENGTH_PREFIX_BYTES + length);
        let start = dst.len();
        dst.put_u32(length as u32);
        encode_key(SEALED_TAG, WireType::LengthDelimited, dst);
        encode_varint(sealed as u64, dst);
        prost::encoding::uint64::encode(1, &seq, dst);
        let mut mac = send.key.mac();
        mac.update(&seq.to_be_bytes());
        if !single {
            mac.update(&[0]);
        }
        for (frame, &len) in frames.iter().zip(lens) {
            if len == 0 && single {
                break;
            }
            encode_key(frame_tag, WireType::LengthDelimited, dst);
            encode_varint(len as u64, dst);
            let at = dst.len();
            frame.encode_raw(dst);
            debug_assert_eq!(dst.len() - at, len, "a frame's encoded length");
            if !single {
                mac.update(&(len as u32).to_be_bytes());
            }
            mac.update(&dst[at..]);
        }
        encode_key(3, WireType::LengthDelimited, dst);
        encode_varint(MAC_BYTES as u64, dst);
        dst.put_slice(&mac.finalize().into_bytes());
        debug_assert_eq!(dst.len() - start, LENGTH_PREFIX_BYTES + length);
        send.next += 1;
        Ok(())
    }
}

/// The MAC of a cluster record: HMAC-SHA256 with `key` (the purpose key of
/// the record's topic) over the label `wasmrelay-record`, the record's
/// `kind` and its `parts` (key, value, and whatever else the kind names),
/// each as a 4-byte big-endian length then its bytes, so no two different
/// records have the same input.
pub fn record_mac(key: &Key, kind: &str, parts: &[&[u8]]) -> [u8; MAC_BYTES] {
    record_hmac(key, kind, parts).finalize().into_bytes().into()
}

/// Checks a record MAC (in constant time).
pub fn verify_record_mac(key: &Key, kind: &str, parts: &[&[u8]], mac: &[u8]) -> bool {
    record_hmac(key, kind, parts).verify_slice(mac).is_ok()
}

fn record_hmac(key: &Key, kind: &str, parts: &[&[u8]]) -> HmacSha256 {
    let mut mac = key.mac();
    let label: &[u8] = b"wasmrelay-record";
    for part in [label, kind.as_bytes()].iter().chain(parts) {
        mac.update(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
        mac.update(part);
    }
    mac
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{MeshHello, MeshSealed, MeshWelcome, Ping};

    fn hello(secret: &[u8], time_ms: i64) -> MeshHello {
        let nonce = vec![7; 16];
        MeshHello {
            protocol_version: 1,
            node_id: "a".to_string(),
            to_node_id: "b".to_string(),
            mac: hello_mac(secret, "a", "b", &nonce, time_ms).into(),
            nonce: nonce.into(),
            time_ms,
            takes_sealed_batches: true,
        }
    }

    #[test]
    fn the_right_secret_passes_and_a_wrong_one_does_not() {
        assert!(verify_hello(b"s3cret", &hello(b"s3cret", 1000), 1000).is_ok());
        let error = verify_hello(b"s3cret", &hello(b"other", 1000), 1000).unwrap_err();
        assert!(
            error.contains("does not know the cluster secret"),
            "{error}"
        );
        let mut tampered = hello(b"s3cret", 1000);
        tampered.to_node_id = "c".to_string();
        assert!(verify_hello(b"s3cret", &tampered, 1000).is_err());
    }

    #[test]
    fn an_old_hello_is_refused() {
        let error = verify_hello(b"s", &hello(b"s", 0), MAX_CLOCK_SKEW_MS + 1).unwrap_err();
        assert!(error.contains("clocks"), "{error}");
    }

    #[test]
    fn the_welcome_proves_the_acceptor_knows_the_secret_and_binds_both_nonces() {
        let dialer_nonce = [1u8; 16];
        let nonce = [3u8; 16];
        let welcome = MeshWelcome {
            node_id: "b".to_string(),
            mac: welcome_mac(b"s", "b", "a", &dialer_nonce, &nonce).into(),
            nonce: nonce.to_vec().into(),
            takes_sealed_batches: true,
        };
        assert!(verify_welcome(b"s", &welcome, "a", &dialer_nonce).is_ok());
        assert!(verify_welcome(b"x", &welcome, "a", &dialer_nonce).is_err());
        assert!(verify_welcome(b"s", &welcome, "a", &[2u8; 16]).is_err());
        assert!(verify_welcome(b"s", &welcome, "c", &dialer_nonce).is_err());
        let swapped = MeshWelcome {
            nonce: vec![4u8; 16].into(),
            ..welcome
        };
        assert!(verify_welcome(b"s", &swapped, "a", &dialer_nonce).is_err());
    }

    #[test]
    fn purposes_have_different_keys() {
        let keys = [
            Purpose::MeshHandshake,
            Purpose::MeshSession,
            Purpose::HeartbeatRecord,
            Purpose::RouteRecord,
        ]
        .map(|p| purpose_key(b"secret", p));
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(format!("{:?}", keys[0]), "Key(<redacted>)");
    }

    fn linked_codecs(secret: &[u8]) -> (MeshCodec, MeshCodec) {
        let keys = SessionKeys::derive(secret, "a", "b", &[1; 16], &[2; 16]);
        let mut dialer = MeshCodec::new(1024);
        dialer.seal_with(keys.clone().for_dialer());
        let mut acceptor = MeshCodec::new(1024);
        acceptor.seal_with(keys.for_acceptor());
        (dialer, acceptor)
    }

    fn ping(nonce: u64) -> Frame {
        Frame::of(Kind::Ping(Ping { nonce }))
    }

    fn encode(codec: &mut MeshCodec, frame: Frame) -> BytesMut {
        let mut bytes = BytesMut::new();
        codec.encode(frame, &mut bytes).unwrap();
        bytes
    }

    #[test]
    fn sealed_frames_pass_in_order_both_ways() {
        let (mut dialer, mut acceptor) = linked_codecs(b"s");
        for n in 1..4 {
            let mut bytes = encode(&mut dialer, ping(n));
            assert_eq!(acceptor.decode(&mut bytes).unwrap(), Some(ping(n)));
            let mut bytes = encode(&mut acceptor, ping(n + 10));
            assert_eq!(dialer.decode(&mut bytes).unwrap(), Some(ping(n + 10)));
        }
    }

    #[test]
    fn lookups_and_their_answers_travel_sealed_and_are_refused_unsealed() {
        let lookup = Frame::of(Kind::MeshLookup(crate::v1::MeshLookup {
            lookup_id: 7,
            process_id: "p".to_string(),
        }));
        let answer = Frame::of(Kind::MeshLookupAnswer(crate::v1::MeshLookupAnswer {
            lookup_id: 7,
            process_id: "p".to_string(),
            connected: true,
            generation: 42,
        }));
        let (mut dialer, mut acceptor) = linked_codecs(b"s");
        let mut bytes = encode(&mut dialer, lookup.clone());
        assert_eq!(acceptor.decode(&mut bytes).unwrap(), Some(lookup.clone()));
        let mut bytes = encode(&mut acceptor, answer.clone());
        assert_eq!(dialer.decode(&mut bytes).unwrap(), Some(answer.clone()));
        for (frame, name) in [(lookup, "mesh_lookup"), (answer, "mesh_lookup_answer")] {
            let (_, mut acceptor) = linked_codecs(b"s");
            let mut bytes = BytesMut::new();
            FrameCodec::new(1024)
                .encode_frame(&frame, &mut bytes)
                .unwrap();
            let error = acceptor.decode(&mut bytes).unwrap_err();
            assert!(
                matches!(error, MeshWireError::Unsealed(n) if n == name),
                "{error}"
            );
            assert!(error.is_unauthorized());
        }
    }

    #[test]
    fn an_altered_replayed_reflected_or_unsealed_frame_is_refused() {
        let (mut dialer, mut acceptor) = linked_codecs(b"s");
        let first = encode(&mut dialer, ping(1));
        // Altered: flip the last byte of the MAC, then of the carried frame.
        for at in [first.len() - 1, first.len() - MAC_BYTES - 3] {
            let (_, mut fresh) = linked_codecs(b"s");
            let mut bytes = first.clone();
            bytes[at] ^= 1;
            let error = fresh.decode(&mut bytes).unwrap_err();
            assert!(matches!(error, MeshWireError::BadMac { seq: 1 }), "{error}");
        }
        // Replayed.
        assert!(acceptor.decode(&mut first.clone()).unwrap().is_some());
        let error = acceptor.decode(&mut first.clone()).unwrap_err();
        assert!(
            matches!(
                error,
                MeshWireError::OutOfOrder {
                    expected: 2,
                    got: 1
                }
            ),
            "{error}"
        );
        // Reflected back to its sender.
        let (mut dialer, _) = linked_codecs(b"s");
        let (mut other_dialer, _) = linked_codecs(b"s");
        let mut bytes = encode(&mut other_dialer, ping(1));
        assert!(matches!(
            dialer.decode(&mut bytes).unwrap_err(),
            MeshWireError::BadMac { .. }
        ));
        // Made with another secret.
        let (mut forger, _) = linked_codecs(b"not the secret");
        let (_, mut acceptor) = linked_codecs(b"s");
        let mut bytes = encode(&mut forger, ping(1));
        assert!(acceptor.decode(&mut bytes).unwrap_err().is_unauthorized());
        // Unsealed.
        let (_, mut acceptor) = linked_codecs(b"s");
        let mut bytes = BytesMut::new();
        FrameCodec::new(1024)
            .encode_frame(&ping(1), &mut bytes)
            .unwrap();
        let error = acceptor.decode(&mut bytes).unwrap_err();
        assert!(matches!(error, MeshWireError::Unsealed("ping")), "{error}");
        assert_eq!(error.code(), Some(ErrorCode::Unauthorized));
    }

    #[test]
    fn the_sealed_size_bound_holds_and_the_maximum_applies_to_sealed_frames() {
        for n in [0u64, 1, 1000] {
            let frame = ping(n);
            let sealed = seal(&purpose_key(b"s", Purpose::MeshSession), u64::MAX, &frame);
            assert!(sealed.encoded_len() <= sealed_len(frame.encoded_len()));
        }
        let (mut dialer, _) = linked_codecs(b"s");
        let big = Frame::error(ErrorCode::BadFrame, "x".repeat(1000));
        let error = dialer.encode(big, &mut BytesMut::new()).unwrap_err();
        assert!(
            matches!(error, MeshWireError::Codec(CodecError::TooLarge { .. })),
            "{error}"
        );
    }

    fn encode_batch(codec: &mut MeshCodec, frames: Vec<Frame>) -> BytesMut {
        let mut bytes = BytesMut::new();
        let frames = frames.into_iter().map(Outgoing::Frame).collect();
        codec.encode(FrameBatch(frames), &mut bytes).unwrap();
        bytes
    }

    /// The `MeshSealed` frames in `bytes`, unopened.
    fn sealed_frames(bytes: &BytesMut) -> Vec<MeshSealed> {
        let mut bytes = bytes.clone();
        let mut sealed = Vec::new();
        while let Some(frame) = FrameCodec::new(1024).decode(&mut bytes).unwrap() {
            match frame.kind {
                Some(Kind::MeshSealed(one)) => sealed.push(one),
                other => panic!("expected a MeshSealed, got {other:?}"),
            }
        }
        sealed
    }

    #[test]
    fn a_batch_goes_under_one_seal_to_a_peer_that_takes_them_and_frame_by_frame_otherwise() {
        let pings: Vec<Frame> = (0..5).map(ping).collect();
        for takes in [false, true] {
            let (mut dialer, mut acceptor) = linked_codecs(b"s");
            dialer.send_batches(takes);
            let mut bytes = encode_batch(&mut dialer, pings.clone());
            let sealed = sealed_frames(&bytes);
            if takes {
                assert_eq!(sealed.len(), 1);
                assert_eq!(sealed[0].seq, 1);
                assert_eq!(sealed[0].frames.len(), 5);
                assert!(sealed[0].frame.is_empty());
            } else {
                assert_eq!(sealed.len(), 5);
                assert!(sealed.iter().all(|one| one.frames.is_empty()));
                assert_eq!(
                    sealed.iter().map(|one| one.seq).collect::<Vec<_>>(),
                    [1, 2, 3, 4, 5]
                );
            }
            // Opened frame by frame, in order; the next seal follows on.
            let mut opened = Vec::new();
            while let Some(frame) = acceptor.decode(&mut bytes).unwrap() {
                opened.push(frame);
            }
            assert_eq!(opened, pings);
            let mut bytes = encode(&mut dialer, ping(9));
            assert_eq!(acceptor.decode(&mut bytes).unwrap(), Some(ping(9)));
        }
    }

    #[test]
    fn a_batch_larger_than_a_frame_may_be_is_sealed_in_several_that_fit() {
        let (mut dialer, mut acceptor) = linked_codecs(b"s");
        dialer.send_batches(true);
        // Each about 300 bytes sealed: three fit in 1,024, not four.
        let errors: Vec<Frame> = (0..10)
            .map(|n| Frame::error(ErrorCode::BadFrame, format!("{n}{}", "x".repeat(250))))
            .collect();
        let mut bytes = encode_batch(&mut dialer, errors.clone());
        let sealed = sealed_frames(&bytes);
        assert!(
            sealed.len() > 1 && sealed.len() < 10,
            "{} sealed",
            sealed.len()
        );
        assert_eq!(
            sealed
                .iter()
                .map(|one| one.frames.len().max(1))
                .sum::<usize>(),
            10
        );
        let mut opened = Vec::new();
        while let Some(frame) = acceptor.decode(&mut bytes).unwrap() {
            opened.push(frame);
        }
        assert_eq!(opened, errors);
    }

    #[test]
    fn sealed_frames_are_the_mesh_sealed_frames_the_proto_describes() {
        let key = SessionKeys::derive(b"s", "a", "b", &[1; 16], &[2; 16])
            .for_dialer()
            .0;
        let parcel = std::sync::Arc::new(crate::Parcel {
            process_id: "p-1".to_string(),
            delivery_id: "t/0/7".to_string(),
            message: crate::WireMessage::new(crate::v1::Message {
                value: vec![9u8; 300].into(),
                topic: "t".to_string(),
                offset: 7,
                ..Default::default()
            }),
        });
        let frames = vec![
            Outgoing::Frame(ping(1)),
            Outgoing::Parcel(crate::ParcelFrame::forward(5, parcel.clone())),
            Outgoing::Frame(ping(0)),
        ];
        let inner: Vec<Bytes> = frames.iter().map(|f| f.encode_to_vec().into()).collect();
        // One by one: byte for byte the `MeshSealed` that `seal` makes.
        let (mut dialer, _) = linked_codecs(b"s");
        let mut bytes = BytesMut::new();
        dialer
            .encode(FrameBatch(frames.clone()), &mut bytes)
            .unwrap();
        let mut expected = BytesMut::new();
        for (n, frame) in inner.iter().enumerate() {
            let frame = Frame::decode(frame.clone()).unwrap();
            FrameCodec::new(1024)
                .encode_frame(&seal(&key, n as u64 + 1, &frame), &mut expected)
                .unwrap();
        }
        assert_eq!(bytes, expected);
        // Batched: the `MeshSealed` with `frames` and the batch MAC.
        let (mut dialer, _) = linked_codecs(b"s");
        dialer.send_batches(true);
        let mut bytes = BytesMut::new();
        dialer.encode(FrameBatch(frames), &mut bytes).unwrap();
        let mac = sealed_batch_mac(&key, 1, &inner).finalize().into_bytes();
        assert_eq!(
            sealed_frames(&bytes),
            [MeshSealed {
                seq: 1,
                frame: Bytes::new(),
                mac: Bytes::copy_from_slice(&mac),
                frames: inner,
            }]
        );
    }

    #[test]
    fn an_altered_reordered_or_mixed_batch_is_refused() {
        let (mut dialer, _) = linked_codecs(b"s");
        dialer.send_batches(true);
        let bytes = encode_batch(&mut dialer, vec![ping(1), ping(2), ping(3)]);
        let sealed = sealed_frames(&bytes).remove(0);
        let reseal = |sealed: MeshSealed| {
            let mut bytes = BytesMut::new();
            FrameCodec::new(1024)
                .encode_frame(&Frame::of(Kind::MeshSealed(sealed)), &mut bytes)
                .unwrap();
            bytes
        };
        let mut swapped = sealed.clone();
        swapped.frames.swap(0, 1);
        let mut dropped = sealed.clone();
        dropped.frames.pop();
        let mut moved = sealed.clone();
        moved.frame = moved.frames.remove(0);
        let mut joined = sealed.clone();
        joined.frames = vec![joined.frames.concat().into()];
        for altered in [swapped, dropped, moved, joined] {
            let (_, mut acceptor) = linked_codecs(b"s");
            let error = acceptor.decode(&mut reseal(altered)).unwrap_err();
            assert!(matches!(error, MeshWireError::BadMac { seq: 1 }), "{error}");
        }
        // The MAC passes, but a sealed frame carries `frame` or `frames`.
        let (mut dialer, mut acceptor) = linked_codecs(b"s");
        let both = {
            let frames: Vec<Bytes> = [ping(1), ping(2)]
                .iter()
                .map(|f| f.encode_to_vec().into())
                .collect();
            let mac = sealed_batch_mac(&dialer.send.as_ref().unwrap().key, 1, &frames)
                .finalize()
                .into_bytes();
            MeshSealed {
                seq: 1,
                frame: ping(3).encode_to_vec().into(),
                mac: Bytes::copy_from_slice(&mac),
                frames,
            }
        };
        let _ = &mut dialer;
        let error = acceptor.decode(&mut reseal(both)).unwrap_err();
        assert!(
            matches!(error, MeshWireError::BadInner { seq: 1, .. }),
            "{error}"
        );
    }

    #[test]
    fn record_macs_cover_kind_and_every_part() {
        let key = purpose_key(b"s", Purpose::RouteRecord);
        let mac = record_mac(&key, "route", &[b"p", b"v"]);
        assert!(verify_record_mac(&key, "route", &[b"p", b"v"], &mac));
        assert!(!verify_record_mac(
            &key,
            "route-removal",
            &[b"p", b"v"],
            &mac
        ));
        assert!(!verify_record_mac(&key, "route", &[b"pv", b""], &mac));
        assert!(!verify_record_mac(&key, "route", &[b"p", b"w"], &mac));
        assert!(!verify_record_mac(&key, "route", &[b"p", b"v"], &mac[..31]));
        let other = purpose_key(b"s", Purpose::HeartbeatRecord);
        assert!(!verify_record_mac(&other, "route", &[b"p", b"v"], &mac));
    }
}
