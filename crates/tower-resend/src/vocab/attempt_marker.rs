//! What a retry layer tells the layers below it about the attempt it sends.

use std::time::Duration;

/// In the extensions of every attempt a retry layer sends. A retry layer
/// further in finds it and passes the request through, so retries never
/// multiply (3 layers of 3 attempts send 3 times, not 27); the layers below
/// read what it says of this attempt. An extension rather than a
/// thread-local, so that it survives whatever lies between the layers (an
/// `async` adapter, a buffer's worker task).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RetryInCharge {
    /// This attempt's own limit (the request's `CallOptions`): an attempt
    /// timeout below applies it instead of its own.
    pub(crate) attempt_timeout: Option<Duration>,
    /// A break in its response body is retried (a replay-safe request with
    /// retries allowed): a read-ahead layer below reads small bodies ahead.
    pub(crate) read_ahead: bool,
}
