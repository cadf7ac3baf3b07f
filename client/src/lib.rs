//! The Rust SDK for business processes connected to a wasmrelay cluster.
//!
//! A process connects to a relay node with [`Client::connect`], registers
//! its process id, and then receives the messages meant for it as
//! [`Event::Delivery`] on the [`Events`] stream; it settles each with
//! [`Delivery::ack`] or [`Delivery::nack`], and sends messages upstream with
//! [`Client::send`]. The client keeps the connection alive, follows the
//! node's redirects and rebalancing, and reconnects on its own.
//!
//! Nodes authenticate the process: its `Hello` carries a [`Token`] (a JWT
//! for its process id) given in the [`ClientConfig`] as a string, a file or
//! a function, read again for every connection attempt. A node that refuses
//! the token (`UNAUTHORIZED`) stops the client with a clear error rather
//! than retrying.
//!
//! ```no_run
//! use wasmrelay_client::{Client, ClientConfig, Event, OutgoingMessage};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let config = ClientConfig::new(["relay-1:7400", "relay-2:7400"], "billing-worker-1")
//!     .with_token_file("/var/run/secrets/wasmrelay/token");
//! let (client, mut events) = Client::connect(config).await?;
//! while let Some(event) = events.next().await {
//!     match event {
//!         Event::Delivery(delivery) => {
//!             let answer = OutgoingMessage::reply_to(&delivery, delivery.message.value.clone());
//!             match client.send(answer).await {
//!                 Ok(()) => delivery.ack()?,
//!                 Err(error) => delivery.nack(error.to_string())?,
//!             }
//!         }
//!         Event::Replaced { reason } => eprintln!("replaced: {reason}"),
//!         other => eprintln!("{other:?}"),
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Delivery is at least once: a delivery not acked before its connection
//! ends comes again (same [`Delivery::delivery_id`]) on the next one. The
//! wire protocol is described in `protocol/proto/wasmrelay.proto`.

mod client;
mod config;
mod connection;
mod delivery;
mod dial;
mod error;
mod events;
mod message;
mod supervisor;
mod token;

pub use client::Client;
pub use config::ClientConfig;
pub use delivery::{Delivery, MAX_NACK_REASON_BYTES};
pub use error::{AckError, ClientError, SendError};
pub use events::{Event, Events};
pub use message::{IncomingMessage, OutgoingMessage};
pub use token::Token;
pub use wasmrelay_protocol::v1::ErrorCode;
