//! `Idempotency-Key` done right: a repeated key gets the first result, and
//! the work is done once.
//!
//! [`IdempotencyLayer`] applies to requests with an unsafe method (POST,
//! PATCH, …) that carry `Idempotency-Key` (or `X-Idempotency-Key`); other
//! requests go straight through. For such a request:
//!
//! - the key must be 1 to 255 visible ASCII characters, else 400; on routes
//!   configured to require one ([`IdempotencyLayer::require_key_when`]), a
//!   request without a key gets 400;
//! - the body is read, up to a cap (a larger one: 413, nothing runs), and
//!   handed on to the handler; the *fingerprint* is the method, path and
//!   query and a hash of the body;
//! - the first request with the key takes a lease in the [`Store`](crate::Store),
//!   runs the handler and stores its final response (status, headers, body up
//!   to a cap) in place of the lease;
//! - the same key while the first runs: 409 with `Retry-After`;
//! - the same key after: the stored response, marked
//!   `Idempotent-Replayed: true`, and the handler does not run;
//! - the same key with another fingerprint: 422;
//! - a handler error, a 5xx or 429, or a cancelled request drops the lease, so
//!   a retry runs; a lease whose holder died expires and is taken over;
//! - keys are scoped by the caller's identity ([`IdempotencyLayer::scope_with`]),
//!   so nobody can replay another caller's response; records expire (24 h by
//!   default);
//! - a store that cannot answer fails closed: 503, nothing runs.
//!
//! ```
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use bytes::Bytes;
//! use resend_server::{IdempotencyLayer, MaybeBuffered, MemoryStore};
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let svc = IdempotencyLayer::new(MemoryStore::new()).layer(service_fn(|req: Request<MaybeBuffered<Full<Bytes>>>| async move {
//!     let body = req.into_body().collect().await?.to_bytes();
//!     Ok::<_, resend::BoxError>(Response::new(Full::new(Bytes::from(format!("charged {}", body.len())))))
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
//! the authentication in front, shorter leases and records.
//!
//! ```
//! use std::time::Duration;
//! use resend_server::{IdempotencyLayer, MemoryStore};
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .require_key_when(|req| req.uri.path() == "/payments")
//!     .scope_with(|req| {
//!         req.headers.get("x-tenant-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
//!     })
//!     .lease(Duration::from_secs(30))
//!     .record_ttl(Duration::from_secs(3600))
//!     .request_cap(64 * 1024);
//! # let _ = layer;
//! ```

mod future;
mod layer;
mod request;
mod response;
mod service;

pub use future::ResponseFuture;
pub use layer::{
    IdempotencyLayer, DEFAULT_LEASE, DEFAULT_RECORD_TTL, DEFAULT_REQUEST_CAP, DEFAULT_RESPONSE_CAP,
    DEFAULT_RETRY_AFTER, DEFAULT_STORE_TIMEOUT,
};
pub use request::{
    authorization_scope, IDEMPOTENCY_KEY, IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED,
    X_IDEMPOTENCY_KEY,
};
pub use service::Idempotency;

#[cfg(test)]
mod tests;
