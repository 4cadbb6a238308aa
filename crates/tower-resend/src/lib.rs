//! Tower middleware for outbound HTTP and gRPC calls: how long to wait, and
//! whether a failure may be sent again.
//!
//! [`tower_resend::stack()`](stack()) wraps any [`tower::Service`](tower_service::Service)
//! that speaks [`http::Request`] (tower-resend's [`hyper_client`], a reqwest client,
//! a tonic channel) in every layer below, in the right order, with one error
//! type. It retries what is safe to send again, and says what happened:
//!
//! ```
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use tower_resend::{retry::Attempts, ErrorKind};
//! use tower::{service_fn, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), tower_resend::BoxError> {
//! // Stands in for your HTTP client: an upstream that answers 503 once.
//! let calls = Arc::new(AtomicU32::new(0));
//! let upstream = service_fn(move |_req: Request<_>| {
//!     let status = match calls.fetch_add(1, Ordering::SeqCst) {
//!         0 => StatusCode::SERVICE_UNAVAILABLE,
//!         _ => StatusCode::OK,
//!     };
//!     async move { Response::builder().status(status).body(String::from("rates")) }
//! });
//!
//! let shipping = tower_resend::stack()
//!     .name("shipping")                        // in errors, traces and 504s
//!     .total(Duration::from_secs(10))          // the whole call, waits included
//!     .attempt_timeout(Duration::from_secs(2)) // each attempt
//!     .max_attempts(3)
//!     .service(upstream);
//!
//! let req = Request::get("http://shipping/rates").body(String::new())?;
//! match shipping.oneshot(req).await {
//!     Ok(resp) => {
//!         // What it took: the 503, then the 200.
//!         let attempts = resp.extensions().get::<Attempts>().map_or(0, Attempts::len);
//!         assert_eq!(attempts, 2);
//!     }
//!     Err(e) => {
//!         let what = match e.kind() {
//!             // The server may have acted: look it up before sending again.
//!             ErrorKind::OutcomeUnknown => "may have happened",
//!             ErrorKind::DeadlineExceeded => "out of time", // e.phase(): in what
//!             ErrorKind::CircuitOpen => "unwell, not called",
//!             _ => "failed", // e.retry_advice(), e.history(), e.is_not_sent()
//!         };
//!         return Err(format!("shipping {what}: {e}").into());
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # The layers
//!
//! Outside in, as [`stack()`] composes them. The stack is itself a tower
//! [`Layer`](tower_layer::Layer): `ServiceBuilder::new().layer(stack()..)`
//! composes with tower-http's layers. Each layer also stands alone, at its
//! module's path, named as tower names them (`FooLayer` makes `Foo<S>`,
//! whose future is `foo::ResponseFuture`):
//!
//! - [`deadline::CallDeadlineLayer`]: one deadline budget for the whole
//!   call, the earliest of the ambient one ([`deadline::scope`]), the
//!   request's own [`Deadline`], a `grpc-timeout` the caller set, and now +
//!   total. It shrinks as it is spent and is handed down through request
//!   extensions.
//! - [`idempotency::SetIdempotencyKeyLayer`]: sends the caller's
//!   [`IdempotencyKey`] on every attempt; with
//!   [`StackBuilder::idempotency_keys`](stack::StackBuilder::idempotency_keys)
//!   it also gives an unsafe request without one a key before any retry, so
//!   every attempt carries the same key and the upstream can deduplicate.
//! - [`retry::RetryLayer`]: classifies each attempt by what the server may
//!   have done ([`classify`]), resends only what is safe (idempotent
//!   methods, or a request with a key), waits with full-jitter backoff and
//!   `Retry-After`, and draws on a shared [`RetryBudget`](retry::RetryBudget).
//!   A POST without a key that may have run comes back as
//!   [`ErrorKind::OutcomeUnknown`]: verify first. Only one layer retries,
//!   however many are nested.
//! - [`breaker::CircuitBreakerLayer`] (opt-in): while an upstream looks
//!   unwell (too many of its attempts fail or time out), calls fail at once
//!   with [`ErrorKind::CircuitOpen`], not sent, until probes find it well
//!   again.
//! - [`hedge::HedgeLayer`] (opt-in, [`StackBuilder::hedge`](stack::StackBuilder::hedge)):
//!   a backup copy of a slow replay-safe attempt; the first good answer wins.
//! - [`deadline::DeadlineHeaderLayer`]: the time left goes on the wire, as
//!   `grpc-timeout` or an HTTP header in milliseconds.
//! - [`fleet::FleetLayer`] (opt-in, [`StackBuilder::fleet`](stack::StackBuilder::fleet)):
//!   the upstream is several instances (a list, a DNS name, your
//!   discovery); each attempt and each hedged copy goes to one the call has
//!   not used (power of two choices), and instances that keep failing are
//!   set aside. Below the retry and hedge layers, as gRPC's retry design
//!   puts retries above the load balancer.
//! - [`timeout::AttemptTimeoutLayer`]: each attempt waits `min(per attempt,
//!   time left)`.
//! - [`read_ahead::ReadAheadLayer`]: reads a small response body before
//!   the response is returned, so a connection that breaks inside it is a
//!   failed attempt (retried if safe), not an error in the caller's hands;
//!   and limits how long a body may send nothing.
//! - [`connect::ConnectTimeoutLayer`]: a connect timeout apart from the
//!   attempt timeout; [`hyper_client`] builds a hyper-util client with it
//!   (and `https://` with the `https` feature).
//!
//! Request bodies are sent as they are when they are in memory (`Full`,
//! `String`, `Empty`), and kept up to a cap for replays when they stream
//! (see [`body::Replay`]).
//!
//! A stack's type is one line for a struct field with
//! [`Stack::boxed`](stack::Stack::boxed) ([`stack::BoxStack`]; for tonic's
//! generated clients, `tonic::BoxChannel`).
//!
//! Every failure is a [`tower_resend::Error`](Error) that says what fired
//! ([`ErrorKind`]), where ([`Error::upstream`], [`Error::phase`]), after how
//! long ([`Error::elapsed`]), whether the request can have reached the
//! server ([`Error::is_not_sent`]), and what to do ([`Error::retry_advice`]).
//!
//! # One layer on its own
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower_resend::{timeout::AttemptTimeoutLayer, deadline::DeadlineHeaderLayer, deadline::CallDeadlineLayer, Error, ErrorKind};
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
//!     .layer(CallDeadlineLayer::new(Duration::from_secs(10)).upstream("shipping"))
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
//! # Time
//!
//! All time is [`tokio::time::Instant`], so tests on tokio's paused clock
//! (`start_paused = true`, `tokio::time::advance`) control every limit.
//!
//! # Feature flags
//!
//! - `hyper-client` (default): [`hyper_client`], a hyper-util legacy client
//!   with a connect timeout, taking any request body.
//! - `https`: `https://` for [`hyper_client`] (hyper-rustls on `ring`, the
//!   webpki roots; [`connect::hyper_client_with_tls`] for your own).
//! - `reqwest`: [`reqwest::ReqwestService`], a reqwest client as the
//!   transport, its errors mapped to what they say about the request; and
//!   [`reqwest::ResendMiddleware`], the stack around reqwest's own calls,
//!   with [`reqwest::RequestBuilderExt::send_with`] to send a reqwest request
//!   through it.
//! - `reqwest-middleware` (with `reqwest`): `ResendMiddleware` is a
//!   `reqwest_middleware::Middleware`, for a `ClientWithMiddleware`.
//! - `otel`: metrics on the OpenTelemetry API, from the meter you pass
//!   (`StackBuilder::meter`; see [`telemetry`], whose spans need no feature).
//! - `tonic`: [`tonic::TonicTransport`], a tonic channel as the transport;
//!   the stack's errors as `tonic::Status` ([`tonic::into_status`], and
//!   `From<tower_resend::Error>`). The gRPC rules need no feature: the default
//!   classifier applies them to gRPC requests, and
//!   [`classify::GrpcClassifier`] adds an
//!   allowlist of idempotent methods.
//! - `service-config`: [`service_config`], gRPC's service config JSON
//!   (`methodConfig` timeouts, retry and hedging policies, `retryThrottling`)
//!   applied per method; and route tables ([`routes::Routes`], which need no
//!   feature) read from JSON or any serde format.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod body;
pub mod breaker;
pub mod classify;
pub mod connect;
pub mod deadline;
mod error;
pub mod fleet;
pub mod hedge;
pub mod idempotency;
mod name;
#[cfg(feature = "quota")]
#[cfg_attr(docsrs, doc(cfg(feature = "quota")))]
pub mod quota;
/// The pacing layer's place in a [`Stack`](stack::Stack), empty: the
/// rest of the module needs feature `quota`.
#[cfg(not(feature = "quota"))]
pub mod quota {
    mod slot;
    pub(crate) use slot::sealed::WrapsPace;
    pub use slot::{NoPace, PaceSlot};
}
pub mod read_ahead;
mod renamed;
#[cfg(feature = "reqwest")]
pub mod reqwest;
pub mod retry;
pub mod routes;
#[cfg(feature = "service-config")]
#[cfg_attr(docsrs, doc(cfg(feature = "service-config")))]
pub mod service_config;
pub mod stack;
pub mod telemetry;
#[cfg(test)]
mod test_events;
pub mod timeout;
#[cfg(feature = "tonic")]
pub mod tonic;
mod vocab;

#[cfg(feature = "hyper-client")]
pub use connect::hyper_client;
pub use deadline::value::Deadline;
pub use error::{BoxError, Error, ErrorKind, Phase, RetryAdvice};
pub use idempotency::key::IdempotencyKey;
pub use name::Name;
#[doc(hidden)]
#[allow(deprecated)]
pub use renamed::{
    Attempts, CallOptions, DeadlineLayer, DeadlineService, HedgeFuture, IdempotencyKeyLayer,
    ReplayBody, Stack, StackBuilder, StackFuture,
};

/// Starts a [`StackBuilder`](stack::StackBuilder): the whole of tower-resend, composed in the right
/// order, with the defaults (10 s per call, 5 s per attempt, 3 attempts in
/// all, the default backoff and retry budget).
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::Request;
/// use http_body_util::Full;
/// use tower_resend::IdempotencyKey;
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// // One stack per upstream, built once, cloned into every task.
/// let shipping = tower_resend::stack()
///     .name("shipping")
///     .total(Duration::from_secs(10))
///     .attempt_timeout(Duration::from_secs(5))
///     .max_attempts(3)
///     .idempotency_keys()
///     .service(tower_resend::hyper_client(Duration::from_secs(2)));
///
/// let mut req = Request::post("http://127.0.0.1:9/shipments").body(Full::new(Bytes::from("{}"))).unwrap();
/// req.extensions_mut().insert(IdempotencyKey::new("shipment-request:42").unwrap());
/// match shipping.clone().oneshot(req).await {
///     Ok(resp) => { /* resp.extensions().get::<tower_resend::retry::Attempts>() says what happened */ }
///     Err(e) if e.is_outcome_unknown() => { /* may have happened: look it up first */ }
///     Err(e) => assert!(e.is_not_sent()), // nothing listens on port 9
/// }
/// # }
/// ```
pub fn stack() -> stack::StackBuilder {
    stack::StackBuilder::new()
}
