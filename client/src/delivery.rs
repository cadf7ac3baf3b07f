//! [`Delivery`]: a message delivered to the process, which it must ack or
//! nack on the connection it came on.

use std::fmt;
use std::sync::Arc;

use wasmrelay_protocol::Kind;
use wasmrelay_protocol::v1;

use crate::connection::Connection;
use crate::error::AckError;
use crate::message::IncomingMessage;

/// The longest nack reason sent, in bytes; longer reasons are cut (at a
/// character boundary).
pub const MAX_NACK_REASON_BYTES: usize = 4096;

/// A message delivered to this process (a `Deliver` frame).
///
/// Settle every delivery with [`Delivery::ack`] or [`Delivery::nack`]: the
/// node limits how many deliveries are unacked at once. A delivery dropped
/// unsettled logs a warning and is not acked; the node delivers it again
/// once the connection ends.
///
/// Delivery is at least once: after a reconnection the same message can
/// arrive again with the same [`delivery_id`](Delivery::delivery_id).
///
/// Because `Delivery` settles on drop, its fields cannot be moved out;
/// clone what must outlive it (the byte buffers are reference counted).
pub struct Delivery {
    /// Stable across redeliveries: `topic/partition/offset` of the input.
    pub delivery_id: String,
    /// The message.
    pub message: IncomingMessage,
    seq: u64,
    connection: Arc<Connection>,
    settled: bool,
}

impl Delivery {
    pub(crate) fn new(connection: Arc<Connection>, deliver: v1::Deliver) -> Delivery {
        Delivery {
            delivery_id: deliver.delivery_id,
            message: deliver
                .message
                .map(IncomingMessage::from)
                .unwrap_or_default(),
            seq: deliver.seq,
            connection,
            settled: false,
        }
    }

    /// The sequence number of the delivery on its connection.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The node whose connection delivered it.
    pub fn node_id(&self) -> &str {
        self.connection.node_id()
    }

    /// False once the connection it came on has ended: it can no longer be
    /// acked, and the node will deliver it again.
    pub fn is_settleable(&self) -> bool {
        self.connection.is_alive()
    }

    /// Tells the node the message is done (`Ack`). Returns once the ack is
    /// queued for writing; [`AckError::ConnectionGone`] when the connection
    /// it came on has ended (the node delivers the message again).
    pub fn ack(mut self) -> Result<(), AckError> {
        self.settled = true;
        self.settle(Kind::Ack(v1::Ack { seq: self.seq }))
    }

    /// Refuses the message (`Nack`): the node retries it (elsewhere or
    /// later) until its time to live, then dead-letters it with `reason`
    /// (cut to [`MAX_NACK_REASON_BYTES`]). Errors as [`Delivery::ack`].
    pub fn nack(mut self, reason: impl Into<String>) -> Result<(), AckError> {
        self.settled = true;
        let mut reason = reason.into();
        truncate_at_char_boundary(&mut reason, MAX_NACK_REASON_BYTES);
        self.settle(Kind::Nack(v1::Nack {
            seq: self.seq,
            reason,
        }))
    }

    fn settle(&self, kind: Kind) -> Result<(), AckError> {
        if self.connection.queue(kind) {
            Ok(())
        } else {
            Err(AckError::ConnectionGone)
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if !self.settled {
            tracing::warn!(
                delivery_id = %self.delivery_id,
                seq = self.seq,
                node_id = %self.connection.node_id(),
                "a delivery was dropped without ack or nack; the node delivers it again after this connection ends"
            );
        }
    }
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("delivery_id", &self.delivery_id)
            .field("seq", &self.seq)
            .field("node_id", &self.connection.node_id())
            .field("message", &self.message)
            .finish()
    }
}

fn truncate_at_char_boundary(text: &mut String, max: usize) {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn reasons_are_cut_at_a_character_boundary() {
        let mut text = "é".repeat(10);
        truncate_at_char_boundary(&mut text, 5);
        assert_eq!(text, "éé");
        let mut short = "ok".to_string();
        truncate_at_char_boundary(&mut short, 5);
        assert_eq!(short, "ok");
    }

    #[test]
    fn acks_go_to_the_connection_until_it_ends() {
        let (connection, mut queue) = Connection::new("n".into(), "a:1".into(), 1024);
        let deliver = |seq| v1::Deliver {
            seq,
            delivery_id: format!("t/0/{seq}"),
            message: None,
        };
        let first = Delivery::new(connection.clone(), deliver(4));
        let second = Delivery::new(connection.clone(), deliver(5));
        assert_eq!(first.node_id(), "n");
        first.ack().unwrap();
        let frame = queue.try_recv().unwrap();
        assert!(matches!(frame.kind, Some(Kind::Ack(v1::Ack { seq: 4 }))));
        connection.end();
        assert!(!second.is_settleable());
        assert_eq!(second.nack("no"), Err(AckError::ConnectionGone));
    }
}
