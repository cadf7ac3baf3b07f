//! Cost per frame of sealing and opening mesh frames (the MAC and framing
//! of every frame on a mesh link), frame by frame against in batches.
//!
//! A link's writer hands the codec what is queued together (up to 64
//! frames); to a peer that takes sealed batches they go under one seq and
//! one MAC (`MeshSealed.frames`), otherwise one `MeshSealed` each. Measured
//! in one run: 64 `Forward`s of a 256 B message, and 64 `ForwardAck`s (the
//! answers), each way sealed and opened frame by frame and as one batch.
//!
//! After criterion's report a table prints ns per frame and the ratio of
//! batched to frame by frame. Run with
//! `cargo bench -p wasmrelay --bench mesh_seal`.

#![allow(clippy::unwrap_used, clippy::print_stdout, missing_docs)]

#[path = "../tests/support/mod.rs"]
mod support;

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group};
use prost::Message as _;
use tokio_util::codec::{Decoder as _, Encoder as _};
use wasmrelay_protocol::mesh_auth::{FrameBatch, MeshCodec, SessionKeys};
use wasmrelay_protocol::v1::{self, ForwardResult};
use wasmrelay_protocol::{Frame, Kind, Outgoing};

const FRAMES: usize = 64;
const KINDS: [&str; 2] = ["forward-256B", "forward-ack"];

fn forward(seq: u64) -> Frame {
    Frame::of(Kind::Forward(v1::Forward {
        seq,
        process_id: "proc-routed-256-throughput".to_string(),
        delivery_id: format!("bench-topic/3/{}", 100_000 + seq),
        message: Some(
            v1::Message {
                key: Some(Bytes::from_static(b"key-1234")),
                value: Bytes::from(vec![b'x'; 256]),
                headers: Vec::new(),
                topic: "bench-topic".to_string(),
                partition: 3,
                offset: 100_000 + seq as i64,
                timestamp_ms: 1_700_000_000_000,
            }
            .encode_to_vec()
            .into(),
        ),
    }))
}

fn forward_ack(seq: u64) -> Frame {
    Frame::of(Kind::ForwardAck(v1::ForwardAck {
        seq,
        result: ForwardResult::Delivered as i32,
        reason: String::new(),
    }))
}

/// A sending and a receiving codec of one link direction.
fn linked(batches: bool) -> (MeshCodec, MeshCodec) {
    let keys = SessionKeys::derive(b"bench secret", "a", "b", &[1; 16], &[2; 16]);
    let mut sender = MeshCodec::new(1024 * 1024);
    sender.seal_with(keys.clone().for_dialer());
    sender.send_batches(batches);
    let mut receiver = MeshCodec::new(1024 * 1024);
    receiver.seal_with(keys.for_acceptor());
    (sender, receiver)
}

/// Seals `frames` as the writer hands them over, then opens them all.
fn round_trip(sender: &mut MeshCodec, receiver: &mut MeshCodec, frames: Vec<Frame>) -> usize {
    let mut wire = BytesMut::new();
    let frames = frames.into_iter().map(Outgoing::Frame).collect();
    sender.encode(FrameBatch(frames), &mut wire).unwrap();
    let mut opened = 0;
    while let Some(frame) = receiver.decode(&mut wire).unwrap() {
        std::hint::black_box(frame);
        opened += 1;
    }
    opened
}

fn bench_mesh_seal(c: &mut Criterion) {
    for kind in KINDS {
        let make = if kind == "forward-ack" {
            forward_ack
        } else {
            forward
        };
        let frames: Vec<Frame> = (1..=FRAMES as u64).map(make).collect();
        let mut group = c.benchmark_group(format!("mesh_seal/{kind}"));
        group.throughput(Throughput::Elements(FRAMES as u64));
        for (mode, batches) in [("frame-by-frame", false), ("batched", true)] {
            let (mut sender, mut receiver) = linked(batches);
            group.bench_function(mode, |b| {
                b.iter(|| {
                    let opened = round_trip(&mut sender, &mut receiver, frames.clone());
                    assert_eq!(opened, FRAMES);
                })
            });
        }
        // What cloning the frames costs, in both modes alike.
        group.bench_function("clone-only", |b| b.iter(|| frames.clone()));
        group.finish();
    }
}

criterion_group!(benches, bench_mesh_seal);

fn print_summary() {
    println!();
    println!("mesh frames sealed and opened, ns per frame (clone of the frames taken out)");
    println!(
        "{:<14} {:>16} {:>12} {:>10}",
        "frames", "frame by frame", "batched", "ratio"
    );
    for kind in KINDS {
        let group = format!("mesh_seal/{kind}");
        let (Some(single), Some(batched), Some(clone)) = (
            support::criterion_mean_ns(&group, "frame-by-frame"),
            support::criterion_mean_ns(&group, "batched"),
            support::criterion_mean_ns(&group, "clone-only"),
        ) else {
            println!("{kind}: no results (was the benchmark filtered out?)");
            continue;
        };
        let per_frame = |ns: f64| (ns - clone) / FRAMES as f64;
        println!(
            "{kind:<14} {:>16.1} {:>12.1} {:>9.2}x",
            per_frame(single),
            per_frame(batched),
            per_frame(batched) / per_frame(single)
        );
    }
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    print_summary();
}
