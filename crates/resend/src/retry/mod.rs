//! Retrying: how long to back off before the next attempt ([`Backoff`],
//! exponential with full jitter), how long the server asked us to wait
//! ([`parse_retry_after`] for HTTP's `Retry-After` in both its forms,
//! [`parse_grpc_pushback`] for gRPC's `grpc-retry-pushback-ms`), and a request
//! body that can be sent again ([`ReplayBody`]).
//!
//! The parsers and the backoff neither sleep nor read a clock: callers pass
//! in the random source and the current time, so every result can be
//! reproduced in tests.

mod backoff;
mod body;
mod retry_after;

pub use backoff::{Backoff, InvalidBackoff};
pub use body::{ReplayBody, ReplayError, DEFAULT_REPLAY_CAP};
pub use retry_after::{parse_grpc_pushback, parse_retry_after, InvalidRetryAfter, Pushback};
