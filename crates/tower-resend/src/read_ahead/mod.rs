//! Small response bodies read before the response is returned, so that a
//! connection that breaks inside one is an attempt that failed — and, for a
//! replay-safe request, retried — rather than an error in the caller's hands;
//! and a limit on how long a body may send nothing.
//!
//! [`ReadAheadLayer`] makes [`ReadAhead`], whose future is
//! [`ResponseFuture`] and whose body is [`ReadAheadBody`].

mod body;
mod future;
mod idle;
mod layer;
mod service;
#[cfg(test)]
mod tests;

pub use body::ReadAheadBody;
pub use future::ResponseFuture;
pub use layer::ReadAheadLayer;
pub use service::ReadAhead;

/// The default cap of [`ReadAheadLayer`]: 64 KiB.
pub const DEFAULT_READ_AHEAD: usize = 64 * 1024;
