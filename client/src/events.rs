//! [`Events`]: what happens to the client ([`Event`]), deliveries included,
//! as a stream.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use tokio::sync::mpsc;

use crate::delivery::Delivery;

/// Something that happened to the client.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event {
    /// Registered with a node (on the first connection and after every
    /// reconnection).
    Connected {
        /// The node holding the connection.
        node_id: String,
    },
    /// A message for this process; ack or nack it.
    Delivery(Delivery),
    /// The connection ended; the client is reconnecting. Deliveries of the
    /// ended connection can no longer be acked: the node delivers them
    /// again.
    Disconnected {
        /// Why the connection ended.
        reason: String,
    },
    /// Another connection registered the same process id; this client
    /// stops (no reconnection) and the stream ends after this event.
    Replaced {
        /// The node's explanation.
        reason: String,
    },
    /// While reconnecting, a node refused the process for a reason retrying
    /// cannot fix (`UNSUPPORTED_VERSION`, `BAD_PROCESS_ID`, `UNAUTHORIZED`);
    /// the client stops and the stream ends after this event.
    Refused {
        /// The node address, error code and message.
        reason: String,
    },
}

/// The events of a [`Client`](crate::Client), in order.
///
/// A [`Stream`] of [`Event`]s; [`Events::next`] saves importing
/// `StreamExt`. The stream ends after [`Event::Replaced`] or
/// [`Event::Refused`], or once the client is closed.
///
/// Deliveries are buffered until read (the node bounds how many are unacked
/// at once), so read the events promptly.
#[derive(Debug)]
pub struct Events {
    /// Boxed: the queue's first block holds 32 events from the start.
    receiver: mpsc::UnboundedReceiver<Box<Event>>,
}

impl Events {
    pub(crate) fn new(receiver: mpsc::UnboundedReceiver<Box<Event>>) -> Events {
        Events { receiver }
    }

    /// The next event; `None` once the client has stopped.
    pub async fn next(&mut self) -> Option<Event> {
        self.receiver.recv().await.map(|event| *event)
    }
}

impl Stream for Events {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.receiver
            .poll_recv(cx)
            .map(|event| event.map(|event| *event))
    }
}
