//! The committed seed inputs under `seeds/`, made from real frames.
//!
//! `cargo test` (in protocol/fuzz) checks that the files match what this
//! file makes; `UPDATE_SEEDS=1 cargo test` rewrites them.

use std::path::Path;

use bytes::{Bytes, BytesMut};
use tokio_util::codec::Encoder;
use wasmrelay_protocol::v1::{
    Ack, Deliver, ErrorCode, Forward, Header, Hello, MeshHello, Message, Nack, Ping, Send,
};
use wasmrelay_protocol::{Frame, FrameCodec, Kind};

fn hello() -> Frame {
    Frame::of(Kind::Hello(Hello {
        protocol_version: 1,
        process_id: "billing-7".to_string(),
        client_name: "billing-worker/2.3.1".to_string(),
        accepts_redirect: true,
        redirects: 0,
        token: "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJiaWxsaW5nLTciLCJleHAiOjB9.c2ln".to_string(),
    }))
}

fn message() -> Message {
    Message {
        key: Some(Bytes::from_static(b"order-42")),
        value: Bytes::from_static(b"{\"amount\":1250,\"currency\":\"EUR\"}"),
        headers: vec![
            Header {
                name: "content-type".to_string(),
                value: Bytes::from_static(b"application/json"),
            },
            Header {
                name: "trace-id".to_string(),
                value: Bytes::from_static(b"4bf92f3577b34da6a3ce929d0e0e4736"),
            },
            Header {
                name: "empty".to_string(),
                value: Bytes::new(),
            },
        ],
        topic: "orders".to_string(),
        partition: 3,
        offset: 1_234_567,
        timestamp_ms: 1_767_225_600_000,
    }
}

fn deliver() -> Frame {
    Frame::of(Kind::Deliver(Deliver {
        seq: 17,
        delivery_id: "orders/3/1234567".to_string(),
        message: Some(message()),
    }))
}

fn send() -> Frame {
    Frame::of(Kind::Send(Send {
        seq: 5,
        key: None,
        value: Bytes::from_static(b"done"),
        headers: vec![Header {
            name: "status".to_string(),
            value: Bytes::from_static(b"ok"),
        }],
        in_reply_to: "orders/3/1234567".to_string(),
    }))
}

fn mesh_hello() -> Frame {
    Frame::of(Kind::MeshHello(MeshHello {
        protocol_version: 1,
        node_id: "node-a".to_string(),
        to_node_id: "node-b".to_string(),
        nonce: Bytes::from_static(&[7; 16]),
        time_ms: 1_767_225_600_000,
        mac: Bytes::from_static(&[0xab; 32]),
        takes_sealed_batches: true,
    }))
}

fn forward() -> Frame {
    Frame::of(Kind::Forward(Forward {
        seq: 9,
        process_id: "billing-7".to_string(),
        delivery_id: "orders/3/1234567".to_string(),
        message: Some(prost::Message::encode_to_vec(&message()).into()),
    }))
}

fn encode(frames: &[Frame]) -> Vec<u8> {
    let mut codec = FrameCodec::new(64 * 1024);
    let mut bytes = BytesMut::new();
    for frame in frames {
        // `Encoder<Frame>`, as `Framed` sends.
        codec
            .encode(frame.clone(), &mut bytes)
            .expect("encode a seed frame");
    }
    bytes.to_vec()
}

fn body(frame: &Frame) -> Vec<u8> {
    prost::Message::encode_to_vec(frame)
}

/// `decode_frames` inputs: a chunk-size byte, then a byte stream.
fn decode_frames_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let with = |chunk: u8, stream: Vec<u8>| [vec![chunk], stream].concat();
    let hello_bytes = encode(&[hello()]);
    vec![
        ("hello", with(0, hello_bytes.clone())),
        ("deliver_with_headers", with(7, encode(&[deliver()]))),
        (
            "session",
            with(
                3,
                encode(&[
                    hello(),
                    deliver(),
                    Frame::of(Kind::Ack(Ack { seq: 17 })),
                    Frame::of(Kind::Nack(Nack {
                        seq: 18,
                        reason: "busy".to_string(),
                    })),
                    send(),
                    Frame::of(Kind::Ping(Ping { nonce: 99 })),
                    Frame::error(ErrorCode::SlowConsumer, "too slow"),
                ]),
            ),
        ),
        ("mesh", with(1, encode(&[mesh_hello(), forward()]))),
        ("garbage", with(0, vec![0, 0, 0, 3, 0xff, 0xff, 0xff])),
        ("no_kind", with(0, vec![0, 0, 0, 0])),
        ("too_large", with(2, vec![0x00, 0x01, 0x00, 0x01, 1, 2, 3])),
        (
            "truncated",
            with(5, hello_bytes[..hello_bytes.len() - 2].to_vec()),
        ),
    ]
}

/// `check_message` inputs: the encoding of a message.
fn check_message_seeds() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("message_with_headers", prost::Message::encode_to_vec(&message())),
        ("empty", Vec::new()),
        ("not_utf8_topic", vec![0x22, 0x02, 0xff, 0xfe]),
    ]
}

/// `decode_then_encode` inputs: the body of one frame.
fn decode_then_encode_seeds() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("hello", body(&hello())),
        ("deliver_with_headers", body(&deliver())),
        ("send", body(&send())),
        ("forward", body(&forward())),
        ("garbage", vec![0xff, 0xff, 0xff]),
    ]
}

#[test]
fn seeds_are_up_to_date() {
    let update = std::env::var_os("UPDATE_SEEDS").is_some();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    let sets = [
        ("decode_frames", decode_frames_seeds()),
        ("decode_then_encode", decode_then_encode_seeds()),
        ("check_message", check_message_seeds()),
    ];
    for (target, seeds) in sets {
        let dir = root.join(target);
        if update {
            std::fs::create_dir_all(&dir).expect("create the seed directory");
        }
        for (name, bytes) in seeds {
            let path = dir.join(format!("{name}.bin"));
            if update {
                std::fs::write(&path, &bytes).expect("write a seed");
            } else {
                let committed = std::fs::read(&path).unwrap_or_else(|e| {
                    panic!("{}: {e} (UPDATE_SEEDS=1 writes it)", path.display())
                });
                assert_eq!(
                    committed,
                    bytes,
                    "{} is stale (UPDATE_SEEDS=1 rewrites it)",
                    path.display()
                );
            }
        }
    }
}
