//! One deadline budget for the whole call, handed down.
//!
//! A [`Deadline`] is an absolute instant. [`CallDeadlineLayer`] fixes it for each
//! call (the earliest of the ambient deadline, the request's own and now +
//! total), writes it into the request's extensions and enforces it over
//! everything inside: attempts, waits between them, and the response body.
//! Inner layers read it from the extensions: the
//! [`AttemptTimeoutLayer`](crate::timeout::AttemptTimeoutLayer) gives each attempt no
//! more than what is left, and [`DeadlineHeaderLayer`] writes what is left on
//! the wire (`grpc-timeout`, or a header in milliseconds) with the parsers for
//! both beside the writers.
//!
//! A server or a job runner opens an ambient [`scope`] once; every stack
//! called inside inherits its deadline. A future spawned onto another task
//! takes the scope along when wrapped in [`carry`].
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower_resend::{Deadline, deadline::CallDeadlineLayer, Error, ErrorKind, Phase};
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // An upstream that never answers.
//! let silent = service_fn(|_req: Request<()>| std::future::pending::<Result<Response<String>, Error>>());
//! let svc = CallDeadlineLayer::new(Duration::from_secs(1)).upstream("shipping").layer(silent);
//!
//! let err = Error::from_box(svc.oneshot(Request::new(())).await.unwrap_err());
//! assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
//! assert_eq!(err.phase(), Some(Phase::Attempt));
//! assert_eq!(err.elapsed(), Some(Duration::from_secs(1)));
//! assert_eq!(err.to_string(), "shipping: deadline exceeded while an attempt was in flight after 1 s");
//! # }
//! ```

mod body;
mod carry;
mod future;
mod header;
mod layer;
mod ledger;
mod service;
pub(crate) mod value;
mod wire;

pub use body::DeadlineBody;
pub use carry::carry;
pub use future::ResponseFuture;
pub use header::{DeadlineHeader, DeadlineHeaderLayer, DEFAULT_MARGIN, GRPC_TIMEOUT};
pub use layer::CallDeadlineLayer;
pub use ledger::internal;
pub(crate) use ledger::{LedgerGuard, Source};
pub use service::CallDeadline;
pub(crate) use value::current_ledger;
pub use value::scope;
pub(crate) use value::Deadline;
pub(crate) use value::{ambient, clamp};
pub use wire::{
    encode_grpc_timeout, encode_millis, parse_grpc_timeout, parse_millis, InvalidTimeout,
    GRPC_TIMEOUT_MAX_DIGITS, MILLIS_MAX_DIGITS,
};

/// What a server layer needs of the ambient deadline: a scope that also
/// keeps a [`TimeLedger`](server::TimeLedger) of where the time went (which
/// `tower-resend-server`'s inbound deadline layer opens, and reads to say
/// where a spent deadline went), and that ledger's records. An application
/// needs none of it: [`scope`], [`carry`], [`internal`] and
/// [`Deadline::current`](crate::Deadline::current) are its ways in.
pub mod server {
    pub use super::ledger::{Entry, LedgerGuard, Snapshot, Source, TimeLedger};
    pub use super::value::{current_ledger, scope_with_ledger, Ambient};
}

#[cfg(test)]
mod tests;
