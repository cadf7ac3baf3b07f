//! What both ends of a mesh link do with the socket: a writer task that
//! drains the link's bounded queue of frames (sealed by the connection's
//! codec once the handshake is done), and the last word (an `Error` frame)
//! before closing.

use std::time::Duration;

use futures::SinkExt as _;
use futures::stream::SplitSink;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::mesh_auth::{FrameBatch, MeshCodec, MeshWireError};
use wasmrelay_protocol::{Frame, Outgoing};

/// How long the last frame to a closing peer may take to go out.
const FAREWELL_TIMEOUT: Duration = Duration::from_secs(1);
/// Frames written before the socket is flushed, when more are queued.
const WRITE_BATCH: usize = 64;

/// A mesh connection: plain frames during the handshake, sealed ones after
/// it (see [`MeshCodec`]).
pub(super) type Conn = Framed<crate::net::Stream, MeshCodec>;
/// The writing half of a mesh connection.
pub(super) type Sink = SplitSink<Conn, FrameBatch>;

/// Writes the queued frames, flushing when the queue runs dry, until
/// `closed` is cancelled or the queue's senders are gone: those queued
/// together (up to [`WRITE_BATCH`]) go as one batch, sealed as one frame
/// when the peer takes that. A failed write cancels `closed` (so the reader
/// stops too) and is returned with the sink.
pub(super) async fn write_frames(
    mut sink: Sink,
    mut queue: mpsc::Receiver<Outgoing>,
    closed: CancellationToken,
) -> (Sink, Option<MeshWireError>) {
    let error = loop {
        let frame = tokio::select! {
            biased;
            _ = closed.cancelled() => break None,
            frame = queue.recv() => match frame {
                Some(frame) => frame,
                None => break None,
            },
        };
        // Room for what is queued now, so the batch does not grow step by step.
        let mut batch = Vec::with_capacity((queue.len() + 1).min(WRITE_BATCH));
        batch.push(frame);
        while batch.len() < WRITE_BATCH {
            let Ok(frame) = queue.try_recv() else {
                break;
            };
            batch.push(frame);
        }
        if let Err(error) = sink.send(FrameBatch(batch)).await {
            break Some(error);
        }
    };
    if error.is_some() {
        closed.cancel();
    }
    (sink, error)
}

/// Sends `last_word` (if any) and closes the sink, each within a second.
pub(super) async fn farewell(mut sink: Sink, last_word: Option<Frame>) {
    if let Some(frame) = last_word {
        let _ = tokio::time::timeout(
            FAREWELL_TIMEOUT,
            sink.send(FrameBatch(vec![Outgoing::Frame(frame)])),
        )
        .await;
    }
    let _ = tokio::time::timeout(FAREWELL_TIMEOUT, sink.close()).await;
}

/// Sends `last_word` (if any) on a connection not split yet, and closes it.
pub(super) async fn refuse(conn: &mut Conn, last_word: Option<Frame>) {
    if let Some(frame) = last_word {
        let _ = tokio::time::timeout(FAREWELL_TIMEOUT, conn.send(frame)).await;
    }
    let _ = tokio::time::timeout(FAREWELL_TIMEOUT, futures::SinkExt::<Frame>::close(conn)).await;
}
