//! A limit on each attempt that never outlasts the call's deadline.
//!
//! [`AttemptTimeoutLayer`] gives each attempt `min(per_attempt, time left)`,
//! where the time left comes from the request's [`Deadline`](crate::Deadline)
//! (or the ambient one). The two limits fail differently, so the caller can
//! always tell which fired: the per-attempt limit with
//! [`ErrorKind::AttemptTimeout`](crate::ErrorKind::AttemptTimeout), the
//! deadline with [`ErrorKind::DeadlineExceeded`](crate::ErrorKind::DeadlineExceeded).
//! A request whose deadline has already passed is not sent at all. Under a
//! retry layer, that layer checks the deadline as it sends each attempt,
//! and the attempt's timer starts when the attempt first waits (one clock
//! reading fewer on a call answered at once).
//!
//! Unlike tower-http's timeout, it never makes up a response (a 408 would
//! read as "not processed" to a classifier): a timeout is an error, and what
//! the server did is unknown.
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower_resend::{timeout::AttemptTimeoutLayer, deadline::CallDeadlineLayer, Error, ErrorKind};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! let silent = service_fn(|_req: Request<()>| std::future::pending::<Result<Response<String>, Error>>());
//! let svc = ServiceBuilder::new()
//!     .layer(CallDeadlineLayer::new(Duration::from_secs(1)))
//!     .layer(AttemptTimeoutLayer::new(Duration::from_millis(400)))
//!     .service(silent);
//!
//! let start = tokio::time::Instant::now();
//! let err = Error::from_box(svc.oneshot(Request::new(())).await.unwrap_err());
//! assert_eq!(err.kind(), ErrorKind::AttemptTimeout);
//! assert_eq!(start.elapsed(), Duration::from_millis(400));
//! # }
//! ```

mod future;
mod layer;
mod service;

pub use future::ResponseFuture;
pub use layer::AttemptTimeoutLayer;
pub use service::AttemptTimeout;
