//! A registered connection as the rest of the client sees it: a queue of
//! frames to write (drained by one writer task, so acks from many tasks are
//! cheap), the sends waiting for their `SendAck`, and whether the
//! connection is still alive.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use prost::Message as _;
use tokio::io::AsyncWrite;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::io::FrameWriter;
use wasmrelay_protocol::v1::{self, ErrorCode};
use wasmrelay_protocol::{Frame, Kind};

/// One registered connection to a node.
#[derive(Debug)]
pub(crate) struct Connection {
    node_id: String,
    address: String,
    /// Boxed: the queue's first block holds 32 frames from the start.
    outbox: mpsc::UnboundedSender<Box<Frame>>,
    alive: CancellationToken,
    sends: Mutex<PendingSends>,
    max_send_bytes: usize,
}

/// The sends waiting for their `SendAck`.
#[derive(Debug, Default)]
struct PendingSends {
    /// Set when the connection ends; no send is registered after it.
    closed: bool,
    last_seq: u64,
    waiting: HashMap<u64, oneshot::Sender<v1::SendAck>>,
}

/// Why [`Connection::start_send`] did not send.
#[derive(Debug)]
pub(crate) enum StartSendError {
    /// The connection has ended; the body is handed back for the next one.
    Gone(v1::Send),
    /// The frame is longer than the node accepts.
    TooLarge { length: usize, max: usize },
}

impl Connection {
    /// A live connection to `node_id` at `address` and the receiving end of
    /// its frame queue (for [`write_frames`]). Frames longer than
    /// `max_send_bytes` are refused by [`Connection::start_send`].
    pub(crate) fn new(
        node_id: String,
        address: String,
        max_send_bytes: usize,
    ) -> (Arc<Connection>, mpsc::UnboundedReceiver<Box<Frame>>) {
        let (outbox, queue) = mpsc::unbounded_channel();
        let connection = Connection {
            node_id,
            address,
            outbox,
            alive: CancellationToken::new(),
            sends: Mutex::new(PendingSends::default()),
            max_send_bytes,
        };
        (Arc::new(connection), queue)
    }

    /// The node holding the connection.
    pub(crate) fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The address connected to.
    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// False once the connection has ended.
    pub(crate) fn is_alive(&self) -> bool {
        !self.alive.is_cancelled()
    }

    /// Cancelled when the connection ends.
    pub(crate) fn alive_token(&self) -> CancellationToken {
        self.alive.clone()
    }

    /// Queues a frame for the writer; false when the connection has ended.
    pub(crate) fn queue(&self, kind: Kind) -> bool {
        self.is_alive() && self.outbox.send(Box::new(Frame::of(kind))).is_ok()
    }

    /// Registers `body` as the next send, queues it, and returns its
    /// sequence number and the receiver of its `SendAck` (which fails when
    /// the connection ends first).
    pub(crate) fn start_send(
        &self,
        mut body: v1::Send,
    ) -> Result<(u64, oneshot::Receiver<v1::SendAck>), StartSendError> {
        let mut sends = self.lock_sends();
        if sends.closed || !self.is_alive() {
            return Err(StartSendError::Gone(body));
        }
        let seq = sends.last_seq + 1;
        body.seq = seq;
        let frame = Frame::of(Kind::Send(body));
        let length = frame.encoded_len();
        if length > self.max_send_bytes {
            return Err(StartSendError::TooLarge {
                length,
                max: self.max_send_bytes,
            });
        }
        if let Err(mpsc::error::SendError(frame)) = self.outbox.send(Box::new(frame)) {
            match frame.kind {
                Some(Kind::Send(body)) => return Err(StartSendError::Gone(body)),
                _ => unreachable!("the frame handed back is the Send frame"),
            }
        }
        sends.last_seq = seq;
        let (resolve, acked) = oneshot::channel();
        sends.waiting.insert(seq, resolve);
        Ok((seq, acked))
    }

    /// Hands a `SendAck` to its waiting send; false for an unknown seq.
    pub(crate) fn complete_send(&self, ack: v1::SendAck) -> bool {
        let waiting = self.lock_sends().waiting.remove(&ack.seq);
        match waiting {
            // The sender may have given up (timeout); that is fine.
            Some(resolve) => {
                let _ = resolve.send(ack);
                true
            }
            None => false,
        }
    }

    /// Forgets a send whose caller stopped waiting.
    pub(crate) fn forget_send(&self, seq: u64) {
        self.lock_sends().waiting.remove(&seq);
    }

    /// Marks the connection as ended: acks and sends are refused from now
    /// on, and every send still waiting fails (its `SendAck` will not come).
    /// The writer writes what was queued before and then closes the socket.
    pub(crate) fn end(&self) {
        let waiting = {
            let mut sends = self.lock_sends();
            sends.closed = true;
            self.alive.cancel();
            std::mem::take(&mut sends.waiting)
        };
        drop(waiting);
    }

    fn lock_sends(&self) -> MutexGuard<'_, PendingSends> {
        // The map stays consistent even if a holder panicked.
        self.sends
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The writer task of a connection: writes queued frames (batching what is
/// queued before flushing) until the connection ends, then writes what is
/// still queued and closes the sink. An error is the reason the connection
/// broke.
pub(crate) async fn write_frames<W>(
    mut sink: FrameWriter<W>,
    mut queue: mpsc::UnboundedReceiver<Box<Frame>>,
    alive: CancellationToken,
) -> Result<(), String>
where
    W: AsyncWrite + Unpin,
{
    loop {
        let frame = tokio::select! {
            biased;
            frame = queue.recv() => match frame {
                Some(frame) => frame,
                None => break,
            },
            () = alive.cancelled() => break,
        };
        feed(&mut sink, &frame);
        while let Ok(frame) = queue.try_recv() {
            feed(&mut sink, &frame);
        }
        sink.flush()
            .await
            .map_err(|e| format!("cannot write to the node: {e}"))?;
    }
    sink.close()
        .await
        .map_err(|e| format!("cannot close the connection: {e}"))
}

fn feed<W>(sink: &mut FrameWriter<W>, frame: &Frame)
where
    W: AsyncWrite + Unpin,
{
    // Nothing is queued of a frame too large: the codec checks the length
    // first. Sends are checked before they are queued, so this is a huge
    // nack reason or error text; dropping it is better than breaking the
    // connection.
    if let Err(error) = sink.queue(frame) {
        tracing::error!(%error, kind = frame.kind_name(), "a frame was too large to send; dropped");
    }
}

/// An `Error` frame body, for frames queued with [`Connection::queue`].
pub(crate) fn error_kind(code: ErrorCode, message: impl Into<String>) -> Kind {
    Kind::Error(v1::Error {
        code: code as i32,
        message: message.into(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn body() -> v1::Send {
        v1::Send {
            value: bytes::Bytes::from_static(b"v"),
            ..v1::Send::default()
        }
    }

    #[test]
    fn sends_are_numbered_and_completed() {
        let (connection, mut queue) = Connection::new("n".into(), "a:1".into(), 1024);
        let (seq1, mut ack1) = connection.start_send(body()).unwrap();
        let (seq2, _ack2) = connection.start_send(body()).unwrap();
        assert_eq!((seq1, seq2), (1, 2));
        assert!(matches!(queue.try_recv().unwrap().kind, Some(Kind::Send(s)) if s.seq == 1));
        assert!(connection.complete_send(v1::SendAck {
            seq: 1,
            ok: true,
            error: String::new()
        }));
        assert!(ack1.try_recv().unwrap().ok);
        assert!(!connection.complete_send(v1::SendAck::default()));
    }

    #[test]
    fn ending_fails_waiting_sends_and_refuses_new_ones() {
        let (connection, _queue) = Connection::new("n".into(), "a:1".into(), 1024);
        let (_, mut ack) = connection.start_send(body()).unwrap();
        connection.end();
        assert!(ack.try_recv().is_err());
        assert!(matches!(
            connection.start_send(body()),
            Err(StartSendError::Gone(_))
        ));
        assert!(!connection.queue(Kind::Ack(v1::Ack { seq: 1 })));
    }

    #[test]
    fn oversized_sends_are_refused() {
        let (connection, _queue) = Connection::new("n".into(), "a:1".into(), 16);
        let large = v1::Send {
            value: bytes::Bytes::from(vec![0; 64]),
            ..v1::Send::default()
        };
        assert!(matches!(
            connection.start_send(large),
            Err(StartSendError::TooLarge { max: 16, .. })
        ));
    }
}
