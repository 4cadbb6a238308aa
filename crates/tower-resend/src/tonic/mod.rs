//! gRPC over tonic (feature `tonic`): a tonic channel as the transport, the
//! stack's errors as `tonic::Status`, and tonic's own view of the call's
//! deadline.
//!
//! # Classification
//!
//! The stack recognises a gRPC request by its `content-type`
//! (`application/grpc…`, which tonic writes) and classifies its attempts by
//! the [gRPC table](crate::classify#grpc) without being told: the
//! `grpc-status` of a trailers-only answer, `grpc-retry-pushback-ms`, a
//! refused connection. Name a [`GrpcClassifier`](crate::classify::GrpcClassifier) only to declare methods
//! idempotent ([`GrpcClassifier::idempotent`](crate::classify::GrpcClassifier::idempotent)): that allowlist is opt-in,
//! so that a call that may have been processed (UNAVAILABLE, a timeout
//! after the request was written) is never sent again unless its method is
//! on it or it carries an `idempotency-key` metadata entry; it then ends
//! with [`OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown). What the
//! server did not process (RESOURCE_EXHAUSTED, a refused connection) is
//! retried for every method. Each attempt's status is in its record
//! ([`Attempt::grpc_code`](crate::vocab::Attempt::grpc_code)):
//! `#1 grpc UNAVAILABLE (overloaded)`, not `200`.
//!
//! # Deadline
//!
//! A timeout the caller set with tonic (`tonic::Request::set_timeout`, which
//! tonic sends as `grpc-timeout`) is the call's deadline when it is sooner
//! than the stack's budget ([`CallDeadlineLayer`](crate::deadline::CallDeadlineLayer)): the
//! call ends by then, and every attempt carries `grpc-timeout` with what is
//! left of it, less a small margin
//! ([`DeadlineHeaderLayer`](crate::deadline::DeadlineHeaderLayer)), never the
//! caller's first value again.
//!
//! # Transport
//!
//! [`TonicTransport`] wraps a `tonic::transport::Channel` (or any service of
//! `http::Request<tonic::body::Body>`) so that [`tower_resend::stack()`](crate::stack())
//! can wrap it: it takes tower-resend's replayable body, and it reports a failure to
//! connect (tonic's [`ConnectError`](::tonic::ConnectError)) as
//! [not sent](crate::Error::is_not_sent). The stack is itself a service that
//! generated tonic clients accept (`FooClient::new(stack)`).
//!
//! Give generated clients `MapErr::new(stack, `[`into_status`]`)`: the stack's
//! [`tower_resend::Error`](crate::Error) then reaches them as the gRPC status that
//! says the same (DEADLINE_EXCEEDED for a deadline), and [`resend_error`]
//! finds the whole error behind it. In a tonic handler, `?` does the same
//! (`From<tower_resend::Error> for tonic::Status`).
//!
//! Leave `Endpoint::timeout` unset: the deadline and the attempt timeout
//! bound each call, and the channel also enforces the `grpc-timeout` the
//! stack writes. Set `Endpoint::connect_timeout` (the connect timeout) and
//! `Endpoint::tcp_nodelay(true)`.
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower_resend::tonic::TonicTransport;
//! use tower::{service_fn, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // Stands in for a `tonic::transport::Channel`: answers UNAVAILABLE once.
//! let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
//! let channel = service_fn(move |_req: Request<tonic::body::Body>| {
//!     let first = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
//!     async move {
//!         let status = if first { tonic::Status::unavailable("draining") } else { tonic::Status::ok("") };
//!         Ok::<_, std::convert::Infallible>(status.into_http::<tonic::body::Body>())
//!     }
//! });
//!
//! // No classifier named: the gRPC table applies to gRPC requests.
//! let ledger = tower_resend::stack()
//!     .name("ledger")
//!     .total(Duration::from_secs(10))
//!     .service(TonicTransport::new(channel));
//!
//! // A Charge with an idempotency key may be sent again after UNAVAILABLE.
//! let req = Request::post("http://ledger/ledger.Ledger/Charge")
//!     .header("content-type", "application/grpc")
//!     .header("idempotency-key", "charge-order-42")
//!     .body(tonic::body::Body::empty())
//!     .unwrap();
//! let resp = ledger.oneshot(req).await.unwrap();
//! assert_eq!(tower_resend::tonic::grpc_status(resp.headers()), Some(tonic::Code::Ok));
//! let attempts = resp.extensions().get::<tower_resend::retry::Attempts>().unwrap();
//! assert!(attempts.to_string().starts_with("#1 grpc UNAVAILABLE (overloaded)"));
//! assert_eq!(attempts.len(), 2);
//! # }
//! ```

mod status;
mod transport;

use ::tonic::Code;
use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use tower::util::BoxCloneSyncService;
use tower::ServiceExt;
use tower_service::Service;

use crate::classify::GrpcCode;
use crate::error::{BoxError, Error};
use crate::stack::{box_body, BoxBody};
pub use status::{into_status, resend_error};
pub use transport::{ResponseFuture, TonicTransport};

/// A stack over a tonic channel (or a service config's
/// [`PerRoute`](crate::routes::PerRoute) of them) as generated clients take
/// it, with its type erased: its errors already gRPC statuses
/// ([`into_status`]), its responses of [`BoxBody`]. A client of it fits in
/// a struct field: `LedgerClient<BoxChannel>`. Made by [`boxed_channel`].
pub type BoxChannel =
    BoxCloneSyncService<Request<::tonic::body::Body>, Response<BoxBody>, ::tonic::Status>;

/// `service` (a stack over a [`TonicTransport`], or a service config's
/// [`PerRoute`](crate::routes::PerRoute)) as a [`BoxChannel`].
///
/// ```
/// use std::time::Duration;
/// use http::{Request, Response};
/// use tower::service_fn;
/// use tower_resend::tonic::{boxed_channel, BoxChannel, TonicTransport};
///
/// // A generated client's field: `LedgerClient<BoxChannel>`. Underneath:
/// struct Ledger {
///     grpc: tonic::client::Grpc<BoxChannel>,
/// }
///
/// // Stands in for `Channel::from_static("http://ledger:50051").connect_lazy()`.
/// let channel = service_fn(|_req: Request<tonic::body::Body>| async {
///     Ok::<_, std::convert::Infallible>(Response::new(tonic::body::Body::empty()))
/// });
/// let stack = tower_resend::stack()
///     .name("ledger")
///     .total(Duration::from_secs(3))
///     .service(TonicTransport::new(channel));
/// let ledger = Ledger { grpc: tonic::client::Grpc::new(boxed_channel(stack)) };
/// # let _ = ledger.grpc;
/// ```
pub fn boxed_channel<S, ResB>(service: S) -> BoxChannel
where
    S: Service<Request<::tonic::body::Body>, Response = Response<ResB>, Error = Error>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    BoxCloneSyncService::new(service.map_response(box_body).map_err(into_status))
}

/// The gRPC status in `headers` (response headers of a trailers-only
/// response, or trailers), if there is one; a malformed value reads as
/// [`Code::Unknown`].
///
/// ```
/// let mut trailers = http::HeaderMap::new();
/// trailers.insert("grpc-status", http::HeaderValue::from_static("14"));
/// assert_eq!(tower_resend::tonic::grpc_status(&trailers), Some(tonic::Code::Unavailable));
/// assert_eq!(tower_resend::tonic::grpc_status(&http::HeaderMap::new()), None);
/// ```
pub fn grpc_status(headers: &HeaderMap) -> Option<Code> {
    GrpcCode::in_headers(headers).map(Code::from)
}

impl From<GrpcCode> for Code {
    fn from(code: GrpcCode) -> Self {
        Self::from(code.as_i32())
    }
}

impl From<Code> for GrpcCode {
    fn from(code: Code) -> Self {
        Self::from_i32(code as i32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::GRPC_STATUS;

    #[test]
    fn grpc_codes_convert_both_ways() {
        for n in 0..=16 {
            let code = GrpcCode::from_i32(n);
            let tonic = Code::from(code);
            assert_eq!(tonic as i32, n);
            assert_eq!(GrpcCode::from(tonic), code);
        }
        let mut h = HeaderMap::new();
        h.insert(GRPC_STATUS, "fourteen".parse().unwrap());
        assert_eq!(grpc_status(&h), Some(Code::Unknown));
    }
}
