//! The server half of tower-resend, for axum and tonic services: the
//! caller's deadline handed down to every outbound call, a 504 (or
//! DEADLINE_EXCEEDED) that says where the time went, and `Idempotency-Key`
//! deduplication: a keyed operation's work is done once.
//!
//! # Overview
//!
//! - [`InboundDeadlineLayer`]: reads the caller's budget (`grpc-timeout`, or
//!   a header in milliseconds), bounds it by the server's maximum, and runs
//!   the handler inside tower-resend's task-local deadline scope, so every tower-resend
//!   client stack the handler calls inherits it. When it runs out, the answer
//!   is a 504 whose body names where the time went: an upstream, the
//!   handler's own work, or a budget spent before the handler ran.
//! - [`IdempotencyLayer`]: a keyed operation's work runs once, whatever the
//!   caller, the clock, the store or the process does; a repeated
//!   `Idempotency-Key` gets the first result, with the records in a [`Store`]:
//!   [`MemoryStore`], `RedisStore` (feature `redis`) or `PostgresStore`
//!   (feature `postgres`).
//! - [`ShedLayer`]: at capacity, refuses retries before first attempts
//!   (503 with `Retry-After`, or UNAVAILABLE with pushback), so goodput
//!   holds when callers retry. Its capacity is fixed, or found from latency
//!   ([`ShedLayer::adaptive`], between the floor and ceiling of an
//!   [`AdaptiveLimit`]).
//! - [`ClientErrorResponse`] (feature `axum`): a tower-resend client error as an axum
//!   response (504 with attribution, 502 "verify before resending", …).
//!
//! Every error body, the 504, the idempotency layer's own answers (400,
//! 409, 413, 422, 503, 500) and the client errors, is one RFC 9457 problem
//! document (`application/problem+json`) with a stable `error` code; the
//! types are documented in [`problems`].
//!
//! # Layer order
//!
//! Outside in: [`InboundDeadlineLayer`], then [`ShedLayer`] if you shed
//! load (it reads the deadline, and a shed request claims no key; given the
//! idempotency layer, [`ShedLayer::replays_from`], it answers a keyed retry
//! it would shed from the key's record first), then
//! [`IdempotencyLayer`], then the handler. A keyed handler cut by the deadline ends with the deadline's
//! 504, which is kept as its operation's end (the work may have run in
//! part); a keyed handler whose caller went away runs on to its end.
//!
//! On an axum router (`.layer` calls wrap what is above them, so the last
//! is the outermost):
//!
//! ```
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_resend_server::{IdempotencyLayer, InboundDeadlineLayer, MemoryStore, ShedLayer};
//!
//! async fn create_order(body: String) -> String {
//!     // Every tower-resend stack called here inherits the caller's deadline,
//!     // and derives its Idempotency-Keys from the inbound one.
//!     assert!(tower_resend::Deadline::current().is_some());
//!     format!("created {body}")
//! }
//!
//! let idempotency = IdempotencyLayer::new(MemoryStore::new());
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order))
//!     .layer(idempotency.clone())
//!     .layer(ShedLayer::new(64).replays_from(&idempotency))
//!     .layer(InboundDeadlineLayer::new(Duration::from_secs(10)));
//! # let _ = app;
//! ```
//!
//! On a tonic server (`Server::builder().layer(..)`; with a
//! `ServiceBuilder` the first layer is the outermost), around every
//! service it serves:
//!
//! ```no_run
//! use std::time::Duration;
//! use tower::ServiceBuilder;
//! use tower_resend_server::{IdempotencyLayer, InboundDeadlineLayer, MemoryStore};
//!
//! # async fn serve<S>(ledger: S) -> Result<(), tonic::transport::Error>
//! # where
//! #     S: tower::Service<http::Request<tonic::body::Body>, Error = std::convert::Infallible>
//! #         + tonic::server::NamedService + Clone + Send + Sync + 'static,
//! #     S::Response: axum::response::IntoResponse,
//! #     S::Future: Send + 'static,
//! # {
//! // `ledger`: your generated server, e.g. `LedgerServer::new(MyLedger)`.
//! tonic::transport::Server::builder()
//!     .layer(
//!         ServiceBuilder::new()
//!             .layer(InboundDeadlineLayer::new(Duration::from_secs(10)))
//!             .layer(IdempotencyLayer::new(MemoryStore::new())),
//!     )
//!     .add_service(ledger)
//!     .serve("127.0.0.1:50051".parse().unwrap())
//!     .await
//! # }
//! ```
//!
//! As a plain tower stack:
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower_resend_server::{IdempotencyLayer, InboundDeadlineLayer, MemoryStore};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let svc = ServiceBuilder::new()
//!     .layer(InboundDeadlineLayer::new(Duration::from_secs(10)))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()))
//!     .service(service_fn(|_req: Request<_>| async {
//!         assert!(tower_resend::Deadline::current().is_some());
//!         Ok::<_, tower_resend::BoxError>(Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
//!     }));
//! let req = Request::post("/orders").header("grpc-timeout", "2S").body(http_body_util::Empty::<bytes::Bytes>::new()).unwrap();
//! assert_eq!(svc.oneshot(req).await.unwrap().status(), 200);
//! # }
//! ```
//!
//! # gRPC
//!
//! A request with `content-type: application/grpc…` gets the same rules in
//! gRPC form. Its stored answer keeps its trailers (`grpc-status`,
//! `grpc-message`) and replays them. The layers' own answers are
//! trailers-only statuses (see the table in [`problems`]): a key in
//! progress or a store that is down is UNAVAILABLE with
//! `grpc-retry-pushback-ms` (retried by a stock gRPC retry policy and by
//! tower-resend's client after the wait); a malformed key or a key reused
//! with another payload is INVALID_ARGUMENT; a body over the cap
//! RESOURCE_EXHAUSTED (not to be retried); the deadline DEADLINE_EXCEEDED.
//! A handler's UNAVAILABLE says nothing was done and frees the key; any
//! other status says so with the metadata `idempotent-nothing-done: true`
//! ([`NothingDone`]), and a server error that must be kept in the
//! transactional mode with `idempotent-keep: true` ([`KeepResponse`]).
//!
//! # Feature flags
//!
//! - `axum`: `ClientErrorResponse`, a tower-resend client error as an axum response.
//! - `redis`: `RedisStore`.
//! - `postgres`: `PostgresStore`, and `PostgresTransactional` (the record
//!   commits with the handler's own transaction).
//! - `otel`: metrics on the OpenTelemetry API from the meter you pass
//!   (`IdempotencyLayer::meter`): replays, conflicts, lease take-overs,
//!   store latency and errors; `ShedLayer::meter`: the shedding limit and
//!   counts. The spans (`resend.idempotency`) need no
//!   feature.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

#[cfg(feature = "axum")]
mod axum;
mod body;
pub mod deadline;
pub mod idempotency;
pub mod problems;
pub mod shed;
pub mod store;

#[cfg(feature = "axum")]
pub use axum::ClientErrorResponse;
pub use body::MaybeBuffered;
pub use deadline::{InboundDeadline, InboundDeadlineLayer};
pub use idempotency::{
    Idempotency, IdempotencyLayer, IdempotencyStats, KeepResponse, NothingDone, EXCHANGE_HEADERS,
};
#[cfg(feature = "postgres")]
pub use idempotency::{IdempotentTx, PostgresTransactional, TxConnection};
pub use shed::{AdaptiveLimit, Shed, ShedLayer, ShedStats};
#[cfg(feature = "postgres")]
pub use store::PostgresStore;
#[cfg(feature = "redis")]
pub use store::RedisStore;
pub use store::{MemoryStore, Store, StoreError};
