//! The caller's deadline, handed down to every outbound call, and a 504 that
//! says where the time went.
//!
//! [`InboundDeadlineLayer`] reads the caller's budget from `grpc-timeout`
//! (or a configured header in milliseconds), bounds it by the server's own
//! maximum, puts the [`Deadline`](tower_resend::Deadline) in the request's
//! extensions and runs the handler inside tower-resend's task-local deadline scope
//! with a fresh [`TimeLedger`](tower_resend::deadline::server::TimeLedger): every tower-resend
//! client stack the handler calls inherits the deadline, with no plumbing,
//! and records its time. A malformed header is ignored (the server default
//! applies) with a `warn` event; it never fails the request.
//!
//! When the deadline runs out, the handler is cancelled and the answer is a
//! 504 with a [problem document](crate::problems) (`application/problem+json`,
//! RFC 9457) of type [`deadline_exceeded`](crate::problems#deadline_exceeded):
//!
//! ```json
//! {"type": "https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#deadline_exceeded",
//!  "title": "Deadline exceeded", "status": 504,
//!  "detail": "the request's deadline ran out during a call to the upstream shipping",
//!  "error": "deadline_exceeded", "error_source": "upstream", "upstream": "shipping",
//!  "budget_ms": 2000,
//!  "spent_ms": {"total": 2000, "upstream": {"shipping": 1700}, "internal": {"db": 250}, "unattributed": 50}}
//! ```
//!
//! `error_source` is `upstream` when the time ran out inside an outbound
//! resend call (named in `upstream`), `internal` inside the handler's own work
//! (named in `internal` when the handler marked it with
//! [`tower_resend::deadline::internal`]), or `deadline` when the budget was spent
//! before the handler ran. A handler that passes on the error of an
//! outbound call the deadline ended, with
//! [`ClientErrorResponse`](crate::ClientErrorResponse) (feature `axum`),
//! answers the same 504 naming that upstream. A gRPC request
//! (`content-type: application/grpc…`) gets `grpc-status: 4`
//! (DEADLINE_EXCEEDED) in a trailers-only response instead.
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Empty};
//! use bytes::Bytes;
//! use tower_resend::Deadline;
//! use tower_resend_server::InboundDeadlineLayer;
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(|_req: Request<()>| async {
//!     // The caller's budget is the ambient deadline.
//!     assert_eq!(Deadline::current().unwrap().remaining(), Duration::from_secs(2));
//!     tower_resend::deadline::internal("db", tokio::time::sleep(Duration::from_secs(5))).await;
//!     Ok::<_, std::convert::Infallible>(Response::new(Empty::<Bytes>::new()))
//! }));
//!
//! let req = Request::post("/orders").header("grpc-timeout", "2S").body(()).unwrap();
//! let resp = svc.oneshot(req).await.unwrap();
//! assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
//! assert_eq!(resp.headers()["content-type"], "application/problem+json");
//! let body: serde_json::Value = serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
//! assert_eq!(body["error"], "deadline_exceeded");
//! assert_eq!(body["error_source"], "internal");
//! assert_eq!(body["internal"], "db");
//! assert_eq!(body["spent_ms"]["internal"]["db"], 2000);
//! # }
//! ```
//!
//! Configured: a default budget below the maximum, and the budget also read
//! from an HTTP header in milliseconds.
//!
//! ```
//! use std::time::Duration;
//! use http::HeaderName;
//! use tower_resend_server::InboundDeadlineLayer;
//!
//! let layer = InboundDeadlineLayer::new(Duration::from_secs(30))
//!     .default_budget(Duration::from_secs(5))
//!     .http_header(HeaderName::from_static("x-request-timeout-ms"));
//! # let _ = layer;
//! ```

mod attribution;
mod future;
mod layer;
mod service;

pub(crate) use attribution::Attribution;
pub use attribution::ErrorSource;
pub use future::{Lazy, ResponseFuture};
pub use layer::InboundDeadlineLayer;
pub use service::InboundDeadline;

#[cfg(test)]
mod tests;
