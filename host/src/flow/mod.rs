//! Message flows: what happens to a consumed record between the input topic
//! and the output (or dead-letter) topic.
//!
//! - [`handler`]: the per-record pipeline of a flow.
//! - [`chain`]: a chain of processor plugins.
//! - [`target`]: the [`DeliveryTarget`] seam: where service calls go.
//! - [`app`]: HTTP delivery to the application beside the relay.
//! - [`retry`]: backoff within a budget.
//! - [`dead_letter`]: dead-letter records and their headers.
//! - [`headers`]: every header name the relay uses.
//! - [`origin`]: the origin headers of a flow's outputs, rendered when enqueued.

pub mod app;
pub mod chain;
pub mod dead_letter;
pub mod handler;
pub mod headers;
pub mod origin;
pub mod retry;
pub mod target;

pub use handler::{FlowHandler, FlowMessageHandler};
pub use target::{Delivery, DeliveryEnd, DeliveryTarget};
