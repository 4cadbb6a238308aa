//! `Idempotency-Key` done right: a repeated key gets the first result, and
//! the work is done once.
//!
//! The promise is about work, not requests: **a keyed operation's work runs
//! once**, whatever the caller, the clock, the store or the process does.
//!
//! [`IdempotencyLayer`] applies to requests with an unsafe method (POST,
//! PATCH, …) that carry `Idempotency-Key` (or `X-Idempotency-Key`); other
//! requests go straight through. For such a request:
//!
//! - the key must be 1 to 255 visible ASCII characters, else 400; on routes
//!   configured to require one ([`IdempotencyLayer::require_key_when`]), a
//!   request without a key gets 400;
//! - keys are scoped by every credential the caller presents
//!   (`Authorization`, `Proxy-Authorization`, `Cookie`, `X-Api-Key` and the
//!   [API-key headers](IdempotencyLayer::api_key_headers) you name), or by
//!   your own [`scope_with`](IdempotencyLayer::scope_with): no caller is
//!   ever replayed another's response. Callers without credentials share one
//!   scope, or are refused ([`Anonymous`]). `Set-Cookie` (and the
//!   [per-caller headers](IdempotencyLayer::per_caller_header) you name) is
//!   never stored for replay, nor by default are the headers of one
//!   exchange ([`EXCHANGE_HEADERS`]: `Date`, request and trace ids,
//!   rate limits, `Server-Timing`): a replay gets its own;
//! - the body is read, up to a cap (a larger one: 413, nothing runs), and
//!   handed on to the handler; the *fingerprint* is the method, path and
//!   query and a hash of the body;
//! - the first request with the key takes a short lease in the
//!   [`Store`](crate::Store) and runs the handler **to completion**: a
//!   caller that goes away (a dropped connection, an attempt timeout) does
//!   not cancel it — it goes on in a task of its own, still bounded by the
//!   inbound deadline. The lease is renewed every third of its life while
//!   the handler runs (counted from the request's start, before its claim
//!   was sent, so a claim slow to answer does not push the renewals later),
//!   so no second run starts however long the first takes, and a holder
//!   that died (a crash) is replaced once it expires. A duplicate that
//!   reaches the process where the work runs is told so by that process
//!   (409), whatever the store's lease says.
//!   That leaves a lease one limit: a holder whose store calls land past
//!   its lease (a store that answers, or a process that stalls, for longer
//!   than two thirds of it: over 6 s at the default 10 s) can be taken over
//!   by a duplicate that reaches *another* process while its handler still
//!   works, and the work may run twice; the layer logs it as an error and
//!   counts it
//!   ([`IdempotencyStats::leases_lost`](crate::IdempotencyStats::leases_lost)).
//!   PostgreSQL's transactional mode (`PostgresStore::transactional`)
//!   holds even then: the key is a row of the handler's own transaction,
//!   on which a second claim waits;
//! - the same key while the first runs: 409 with `Retry-After`;
//! - the same key after: the stored response, marked
//!   `Idempotent-Replayed: true`, and the handler does not run;
//! - the same key with another fingerprint: 422;
//! - what is kept: once the handler has started, its final response, **5xx
//!   included**, unless it says nothing was done — it carries the
//!   [`NothingDone`] extension, or is a 429 — in which case the lease is
//!   dropped and a retry runs. A handler error, a panic, or a body that fails
//!   after the head are kept as a 500 saying so; a handler cut by the
//!   deadline, as the deadline's 504. None of them runs again;
//! - a store that cannot be reached before the work fails closed: 503,
//!   nothing runs. One that fails after it does not lose the response: it is
//!   held in memory (this process answers the key from it) and stored in the
//!   background, with the lease kept, until it lands
//!   ([`IdempotencyStats`] counts what could not be);
//! - outbound calls made by the handler through a tower-resend stack with
//!   [`idempotency_keys`](tower_resend::stack::StackBuilder::idempotency_keys) derive
//!   their keys from the inbound one ([`tower_resend::idempotency::derive_keys`]),
//!   so a re-run after a crash sends the same keys downstream;
//! - records expire (24 h by default); every store call is bounded by a
//!   timeout.
//!
//! The layer's own answers (the 400s, 409, 413, 422, 503 and the 500s it
//! keeps) are [problem documents](crate::problems)
//! (`application/problem+json`) with a stable `error` code, such as
//! `idempotency_key_in_progress` or `idempotency_key_reused`.
//!
//! ```
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use bytes::Bytes;
//! use tower_resend_server::{IdempotencyLayer, MaybeBuffered, MemoryStore};
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let svc = IdempotencyLayer::new(MemoryStore::new()).layer(service_fn(|req: Request<MaybeBuffered<Full<Bytes>>>| async move {
//!     let body = req.into_body().collect().await?.to_bytes();
//!     Ok::<_, tower_resend::BoxError>(Response::new(Full::new(Bytes::from(format!("charged {}", body.len())))))
//! }));
//!
//! let charge = || Request::post("/charges").header("idempotency-key", "order-42").body(Full::new(Bytes::from("€10"))).unwrap();
//! let first = svc.clone().oneshot(charge()).await.unwrap();
//! let again = svc.clone().oneshot(charge()).await.unwrap();
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! assert_eq!(again.into_body().collect().await.unwrap().to_bytes(), "charged 5");
//!
//! // Same key, another body: 422.
//! let other = Request::post("/charges").header("idempotency-key", "order-42").body(Full::new(Bytes::from("€99"))).unwrap();
//! assert_eq!(svc.oneshot(other).await.unwrap().status(), StatusCode::UNPROCESSABLE_ENTITY);
//! # let _ = first;
//! # }
//! ```
//!
//! Configured: keys required on one route, scoped by a tenant header set by
//! the authentication in front, a shorter lease and records.
//!
//! ```
//! use std::time::Duration;
//! use tower_resend_server::{IdempotencyLayer, MemoryStore};
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .require_key_when(|req| req.uri.path() == "/payments")
//!     .scope_with(|req| {
//!         req.headers.get("x-tenant-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
//!     })
//!     .lease(Duration::from_secs(5))
//!     .record_ttl(Duration::from_secs(3600))
//!     .request_cap(64 * 1024);
//! # let _ = layer;
//! ```

mod backend;
mod config;
mod future;
mod held;
mod keyed;
mod layer;
mod lease;
mod request;
mod response;
mod rules;
mod running;
mod service;
mod stats;
mod store_call;
mod supervise;
mod telemetry;
#[cfg(feature = "postgres")]
mod transactional;
mod work;

pub use backend::Backend;
pub use config::{
    Anonymous, DEFAULT_LEASE, DEFAULT_RECORD_TTL, DEFAULT_REQUEST_CAP, DEFAULT_RESPONSE_CAP,
    DEFAULT_RETRY_AFTER, DEFAULT_STORE_RETRY_FOR, DEFAULT_STORE_TIMEOUT, EXCHANGE_HEADERS,
    LEASE_RANGE, RECORD_TTL_RANGE, RETRY_AFTER_RANGE, STORE_TIMEOUT_RANGE, X_API_KEY,
};
pub use future::ResponseFuture;
pub use layer::IdempotencyLayer;
pub use request::{
    credential_scope, CREDENTIAL_HEADERS, IDEMPOTENCY_KEY, IDEMPOTENT_BODY_OMITTED,
    IDEMPOTENT_REPLAYED, X_IDEMPOTENCY_KEY,
};
pub use response::{IDEMPOTENT_KEEP, IDEMPOTENT_NOTHING_DONE};
pub use service::Idempotency;
pub use stats::IdempotencyStats;
#[cfg(feature = "postgres")]
pub use transactional::{
    HandlerTransaction, IdempotentTx, NoTransaction, PostgresTransactional, TxConnection,
};

/// A response extension by which a handler says that it did nothing: the
/// layer then drops the lease (or rolls the transaction back) instead of
/// keeping the response, so the caller's retry runs the handler again.
///
/// Set it only when nothing at all was done — validation failed before any
/// write, an upstream said the request was never sent or processed.
/// [`ClientErrorResponse`](crate::ClientErrorResponse) sets it for tower-resend
/// client errors that say so
/// ([`nothing_processed`](tower_resend::Error::nothing_processed)).
///
/// A handler that cannot set a response extension says the same with the
/// header (or gRPC trailer) [`IDEMPOTENT_NOTHING_DONE`]`: true`: a tonic
/// handler, in its `Status`'s metadata. A gRPC UNAVAILABLE, or
/// RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms`, says it without a
/// mark. Whichever way it was said, the answer that lets the key go carries
/// the header to the caller (in its headers), so that tower-resend's client
/// knows this attempt did nothing.
///
/// ```
/// use http::{Response, StatusCode};
/// use tower_resend_server::idempotency::NothingDone;
///
/// let mut resp = Response::new(String::from("try again later"));
/// *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
/// resp.extensions_mut().insert(NothingDone);
/// ```
///
/// From a tonic handler:
///
/// ```
/// use tower_resend_server::idempotency::IDEMPOTENT_NOTHING_DONE;
///
/// let mut status = tonic::Status::failed_precondition("the account is frozen; nothing was charged");
/// status.metadata_mut().insert("idempotent-nothing-done", "true".parse().unwrap());
/// assert_eq!(IDEMPOTENT_NOTHING_DONE, "idempotent-nothing-done");
/// # let _ = status;
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NothingDone;

/// A response extension by which a handler says that its response is the
/// operation's end even though it is a server error: under
/// [`PostgresTransactional`], where a 5xx (or
/// a gRPC server error) rolls back and frees the key, the transaction
/// commits with the response instead, and a retry gets it replayed. (Over a
/// lease store every end is kept already; this changes nothing there.)
///
/// Set it when the 5xx reports work that was done and must not be done
/// again: a downstream call that may have charged a card, say. The header
/// (or gRPC trailer) [`IDEMPOTENT_KEEP`]`: true` says the same.
///
/// ```
/// use http::{Response, StatusCode};
/// use tower_resend_server::idempotency::KeepResponse;
///
/// let mut resp = Response::new(String::from("charged, but the receipt failed"));
/// *resp.status_mut() = StatusCode::BAD_GATEWAY;
/// resp.extensions_mut().insert(KeepResponse);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeepResponse;
