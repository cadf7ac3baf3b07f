//! The errors of the client: [`ClientError`] from connecting,
//! [`SendError`] from sending upstream, [`AckError`] from settling a
//! delivery.

use std::fmt;
use std::time::Duration;

use wasmrelay_protocol::v1::ErrorCode;

/// Why [`Client::connect`](crate::Client::connect) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The configuration cannot work (no address, bad process id, ...).
    #[error("invalid client configuration: {0}")]
    InvalidConfig(String),
    /// A node refused the process for a reason that retrying cannot fix
    /// (`UNSUPPORTED_VERSION`, `BAD_PROCESS_ID`, or `UNAUTHORIZED`: the
    /// token is missing, expired, not signed by a trusted key or for another
    /// process id). No other address is tried.
    #[error("{address} refused the connection ({}): {message}", code.as_str_name())]
    Refused {
        /// The node address that answered.
        address: String,
        /// The error code it sent.
        code: ErrorCode,
        /// Its explanation.
        message: String,
    },
    /// The configured token could not be had (its file is missing or
    /// empty, its function failed); no node was contacted.
    #[error("no token to send: {0}")]
    Token(String),
    /// No address accepted the process: each was unreachable, timed out,
    /// answered with a retryable error or redirected too often.
    #[error("no relay node accepted the connection: {}", Failures(.failures))]
    Unreachable {
        /// Every address tried (redirect targets included) and what
        /// happened there, in order.
        failures: Vec<(String, String)>,
    },
}

struct Failures<'a>(&'a [(String, String)]);

impl fmt::Display for Failures<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (address, reason)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{address}: {reason}")?;
        }
        Ok(())
    }
}

/// Why [`Client::send`](crate::Client::send) did not get a positive `SendAck`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The node answered `SendAck{ok: false}` with this error; the message
    /// is not in Kafka.
    #[error("the relay node refused the message: {0}")]
    Rejected(String),
    /// The connection ended after the message was handed to it and before
    /// its `SendAck` arrived. The message may or may not have reached Kafka:
    /// retrying is safe for delivery but can produce a duplicate.
    #[error("the connection ended before the relay node acknowledged the message")]
    ConnectionLost,
    /// The client was not connected at any time during the send timeout;
    /// nothing was sent.
    #[error("not connected to a relay node within {0:?}; the message was not sent")]
    NotConnected(Duration),
    /// The message was sent but its `SendAck` did not arrive within the send
    /// timeout. As with [`SendError::ConnectionLost`], it may still reach
    /// Kafka.
    #[error("no acknowledgement from the relay node within {0:?}")]
    AckTimeout(Duration),
    /// The encoded message is larger than the node (or this client)
    /// accepts; nothing was sent.
    #[error("the message is {length} bytes encoded; the connection accepts at most {max}")]
    TooLarge {
        /// The encoded frame length.
        length: usize,
        /// The maximum frame size.
        max: usize,
    },
    /// The client was closed, replaced by another connection with the same
    /// process id, or permanently refused; it does not connect any more.
    #[error("the client has stopped: {0}")]
    Stopped(String),
}

/// Why [`Delivery::ack`](crate::Delivery::ack) or
/// [`Delivery::nack`](crate::Delivery::nack) could not be sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AckError {
    /// The connection the delivery came on has ended. The node delivers the
    /// message again (with the same delivery id) on a later connection.
    #[error("the connection of this delivery has ended; the node will deliver it again")]
    ConnectionGone,
}
