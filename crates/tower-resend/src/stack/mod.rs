//! The composed stack: every layer in the right order, one error type.
//!
//! [`stack()`](crate::stack()) starts a [`StackBuilder`]; the builder is a
//! [`Layer`](tower_layer::Layer) that makes a [`Stack`], whose future is
//! [`ResponseFuture`]: `.service(transport)` or
//! `ServiceBuilder::new().layer(stack()…).service(transport)` give the same
//! service.

use std::time::Duration;

mod boxed;
mod builder;
mod compose;
mod future;
mod service;
mod slots;
#[cfg(test)]
mod tests;

#[cfg(feature = "tonic")]
pub(crate) use boxed::box_body;
pub use boxed::{boxed, BoxBody, BoxStack};
pub use builder::StackBuilder;
pub use future::ResponseFuture;
pub use service::Stack;

/// Default deadline budget of a call: 10 s.
pub const DEFAULT_TOTAL: Duration = Duration::from_secs(10);
/// Default limit of one attempt: 5 s.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
