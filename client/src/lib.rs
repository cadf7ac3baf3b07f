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
//! Over TLS, give the configuration a [`ClientTls`] with
//! [`ClientConfig::with_tls`]: it trusts the CA in a PEM file
//! ([`ClientTls::with_ca_file`]) and/or the system roots
//! ([`ClientTls::with_system_roots`]), and can present a client certificate
//! to nodes that require one ([`ClientTls::with_client_cert_files`], mutual
//! TLS). Each node's certificate is verified for the host part of the
//! address dialed (configured or a redirect target, DNS name or IP
//! address), or for one name given with [`ClientTls::with_server_name`].
//! Files are read when the `ClientTls` is built, so a bad one fails there
//! with a [`TlsError`] naming it; a handshake that fails is a failed attempt
//! on that address, with the reason (e.g. `invalid peer certificate:
//! UnknownIssuer`) among [`ClientError::Unreachable`]'s failures.
//!
//! ```no_run
//! use wasmrelay_client::{Client, ClientConfig, ClientTls, Event, OutgoingMessage};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let tls = ClientTls::with_ca_file("/etc/wasmrelay/ca.pem")?;
//! let config = ClientConfig::new(["relay-1:7400", "relay-2:7400"], "billing-worker-1")
//!     .with_token_file("/var/run/secrets/wasmrelay/token")
//!     .with_tls(tls);
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
mod stream;
mod supervisor;
mod tls;
mod token;

pub use client::Client;
pub use config::ClientConfig;
pub use delivery::{Delivery, MAX_NACK_REASON_BYTES};
pub use error::{AckError, ClientError, SendError};
pub use events::{Event, Events};
pub use message::{IncomingMessage, OutgoingMessage};
pub use tls::{ClientTls, TlsError};
pub use token::Token;
pub use wasmrelay_protocol::v1::ErrorCode;
