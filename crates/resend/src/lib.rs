//! Tower middleware for outbound HTTP and gRPC calls: how long to wait, and
//! whether a failure may be sent again.
//!
//! # Overview
//!
//! `resend` stacks around any [`tower::Service`](tower_service::Service) that
//! speaks [`http::Request`] — hyper-util's client, a reqwest client through an
//! adapter, a tonic channel — and bounds every call in time:
//!
//! - [`DeadlineLayer`]: one deadline budget for the whole call, the earliest
//!   of the ambient one ([`deadline::scope`]), the request's own
//!   [`Deadline`] and now + total. It shrinks as it is spent and is handed
//!   down through request extensions.
//! - [`AttemptTimeoutLayer`]: each attempt waits `min(per attempt, time left)`.
//! - [`DeadlineHeaderLayer`]: the time left goes on the wire, as
//!   `grpc-timeout` or an HTTP header in milliseconds.
//! - [`CircuitBreakerLayer`] (opt-in): while an upstream looks unwell
//!   (too many of its attempts fail or time out), calls fail at once with
//!   [`ErrorKind::CircuitOpen`], not sent, until probes find it well again.
//! - [`ConnectTimeoutLayer`](connect::ConnectTimeoutLayer): a connect timeout
//!   apart from the attempt timeout; [`hyper_client`] builds a hyper-util
//!   client with it.
//!
//! Every failure is a [`resend::Error`](Error) that says what fired
//! ([`ErrorKind`]), where ([`Error::upstream`], [`Error::phase`]), after how
//! long ([`Error::elapsed`]), and whether the request can have reached the
//! server ([`Error::is_not_sent`]).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use resend::{AttemptTimeoutLayer, DeadlineHeaderLayer, DeadlineLayer, Error, ErrorKind};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // An upstream that takes 2 s to answer.
//! let slow = service_fn(|_req: Request<()>| async {
//!     tokio::time::sleep(Duration::from_secs(2)).await;
//!     Ok::<_, Error>(Response::new(()))
//! });
//!
//! let client = ServiceBuilder::new()
//!     .layer(DeadlineLayer::new(Duration::from_secs(10)).upstream("shipping"))
//!     .layer(DeadlineHeaderLayer::new())
//!     .layer(AttemptTimeoutLayer::new(Duration::from_secs(1)))
//!     .service(slow);
//!
//! let err = Error::from_box(client.oneshot(Request::new(())).await.unwrap_err());
//! assert_eq!(err.kind(), ErrorKind::AttemptTimeout);
//! assert_eq!(err.upstream(), Some("shipping"));
//! # }
//! ```
//!
//! # Layer order
//!
//! Outside in: [`DeadlineLayer`] (fixes the budget), then the retrying layer,
//! then, when used, [`CircuitBreakerLayer`] (sees every attempt), then
//! [`DeadlineHeaderLayer`] (writes what is left on each attempt), then
//! [`AttemptTimeoutLayer`], then the transport with its connect timeout.
//!
//! # Time
//!
//! All time is [`tokio::time::Instant`], so tests on tokio's paused clock
//! (`start_paused = true`, `tokio::time::advance`) control every limit.
//!
//! # Feature flags
//!
//! - `hyper-client` (default): [`hyper_client`], a hyper-util legacy client
//!   with a connect timeout.
//! - `reqwest`: [`reqwest::ReqwestService`], a reqwest client as the
//!   transport, its errors mapped to what they say about the request.
//! - `tonic`: [`tonic::GrpcClassifier`] (gRPC statuses, pushback, an
//!   allowlist of idempotent methods) and [`tonic::TonicTransport`], a tonic
//!   channel as the transport.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod breaker;
mod builder;
pub mod classify;
pub mod connect;
pub mod deadline;
mod error;
pub mod idempotency;
mod name;
#[cfg(feature = "reqwest")]
pub mod reqwest;
pub mod retry;
mod stack;
pub mod timeout;
#[cfg(feature = "tonic")]
pub mod tonic;

pub use breaker::CircuitBreakerLayer;
pub use builder::ServiceBuilderExt;
#[cfg(feature = "hyper-client")]
pub use connect::{hyper_client, HyperClient};
pub use deadline::{Deadline, DeadlineHeaderLayer, DeadlineLayer};
pub use error::{BoxError, Error, ErrorKind, Phase, RetryAdvice};
pub use idempotency::{IdempotencyKey, IdempotencyKeyLayer};
pub use name::Name;
pub use retry::{Attempts, CallOptions, RetryLayer};
pub use stack::{stack, Stack, StackBuilder, StackFuture, DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_TOTAL};
pub use timeout::AttemptTimeoutLayer;
