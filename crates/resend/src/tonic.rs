//! gRPC: a classifier that reads `grpc-status`, and a tonic channel as the
//! transport (feature `tonic`).
//!
//! # Classification
//!
//! [`GrpcClassifier`] reads the `grpc-status` of an attempt: from the
//! response headers of a *trailers-only* response (a call that failed before
//! any message, the usual shape of UNAVAILABLE and RESOURCE_EXHAUSTED), and,
//! for reporting, from the trailers ([`GrpcClassifier::classify_trailers`]).
//! The retry layer acts on the first kind only: a status in the trailers
//! arrives after the layer has handed the response on.
//!
//! | `grpc-status` | class | retried |
//! |---|---|---|
//! | OK | [`Success`](Class::Success) | no |
//! | UNAVAILABLE | [`Overloaded`](Class::Overloaded), may have been processed (like HTTP 503) | when replay-safe, after `grpc-retry-pushback-ms` (or the overload floor) plus backoff |
//! | RESOURCE_EXHAUSTED | [`Overloaded`](Class::Overloaded), not processed (like HTTP 429) | yes, after `grpc-retry-pushback-ms` (or the overload floor) plus backoff |
//! | DEADLINE_EXCEEDED | [`Unknown`](Class::Unknown), never retried | no: the deadline is the call's, shared by every attempt |
//! | CANCELLED, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION, ABORTED, OUT_OF_RANGE, UNIMPLEMENTED, UNAUTHENTICATED | [`Rejected`](Class::Rejected) | no |
//! | UNKNOWN, INTERNAL, DATA_LOSS, a malformed status | [`Unknown`](Class::Unknown) (like HTTP 500) | when replay-safe |
//! | no `grpc-status` in the headers (it comes in the trailers) | [`Success`](Class::Success) for the retry layer | no |
//! | an HTTP status other than 200 (a proxy answered) | as [`HttpClassifier`] says | as for HTTP |
//!
//! A `grpc-retry-pushback-ms` that is negative or malformed means "do not
//! retry", as gRPC's retry design says; a valid one replaces the overload
//! floor, like `Retry-After`.
//!
//! gRPC methods are all POST, so **replay-safety** comes from an allowlist of
//! idempotent full method names (`/pkg.Service/Method`,
//! [`GrpcClassifier::idempotent`]) or an `idempotency-key` metadata entry on
//! the call ([`Classify::is_replay_safe`]). Everything else that may have
//! been processed (UNAVAILABLE, a timeout after the request was written)
//! ends the call with [`OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown).
//!
//! # Transport
//!
//! [`TonicTransport`] wraps a `tonic::transport::Channel` (or any service of
//! `http::Request<tonic::body::Body>`) so that [`resend::stack()`](crate::stack)
//! can wrap it: it takes resend's replayable body, and it reports a failure to
//! connect (tonic's [`ConnectError`](::tonic::ConnectError)) as
//! [not sent](crate::Error::is_not_sent). The stack is itself a service that
//! generated tonic clients accept (`FooClient::new(stack)`). Every attempt
//! carries `grpc-timeout` with the time left before the deadline, less a
//! small margin ([`DeadlineHeaderLayer`](crate::DeadlineHeaderLayer)).
//!
//! Give generated clients `MapErr::new(stack, `[`into_status`]`)`: the stack's
//! [`resend::Error`](crate::Error) then reaches them as the gRPC status that
//! says the same (DEADLINE_EXCEEDED for a deadline), and [`resend_error`]
//! finds the whole error behind it.
//!
//! Leave `Endpoint::timeout` unset: the deadline and the attempt timeout
//! bound each call, and the channel also enforces the `grpc-timeout` the
//! stack writes. Set `Endpoint::connect_timeout` (the connect timeout) and
//! `Endpoint::tcp_nodelay(true)`.
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use resend::tonic::{GrpcClassifier, TonicTransport};
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
//! let ledger = resend::stack()
//!     .name("ledger")
//!     .total(Duration::from_secs(10))
//!     .retry(|r| r.classifier(GrpcClassifier::new().idempotent("/ledger.Ledger/GetBalance")))
//!     .service(TonicTransport::new(channel));
//!
//! let req = Request::post("http://ledger/ledger.Ledger/GetBalance")
//!     .header("content-type", "application/grpc")
//!     .body(tonic::body::Body::empty())
//!     .unwrap();
//! let resp = ledger.oneshot(req).await.unwrap();
//! assert_eq!(resend::tonic::grpc_status(resp.headers()), Some(tonic::Code::Ok));
//! assert_eq!(resp.extensions().get::<resend::Attempts>().unwrap().len(), 2);
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ::tonic::Code;
use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderMap, Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use crate::classify::{Class, Classification, Classify, HttpClassifier, RequestFacts};
use crate::deadline::{parse_grpc_timeout, GRPC_TIMEOUT};
use crate::error::{BoxError, Error, ErrorKind, Phase};
use crate::retry::{parse_grpc_pushback, Pushback};

/// The `grpc-status` header (or trailer).
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// The `grpc-retry-pushback-ms` header (or trailer).
pub const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The gRPC status in `headers` (response headers of a trailers-only
/// response, or trailers), if there is one; a malformed value reads as
/// [`Code::Unknown`].
///
/// ```
/// let mut trailers = http::HeaderMap::new();
/// trailers.insert("grpc-status", http::HeaderValue::from_static("14"));
/// assert_eq!(resend::tonic::grpc_status(&trailers), Some(tonic::Code::Unavailable));
/// assert_eq!(resend::tonic::grpc_status(&http::HeaderMap::new()), None);
/// ```
pub fn grpc_status(headers: &HeaderMap) -> Option<Code> {
    headers
        .get(GRPC_STATUS)
        .map(|v| Code::from_bytes(v.as_bytes()))
}

/// The gRPC status that says what `err` says, with `err` as its source, for
/// tonic clients: map the stack's errors with it
/// (`tower::util::MapErr::new(stack, resend::tonic::into_status)`) so that a
/// generated client sees DEADLINE_EXCEEDED for a deadline, not UNKNOWN, and
/// [`resend_error`] still finds the whole error.
///
/// | [`ErrorKind`] | code |
/// |---|---|
/// | `DeadlineExceeded`, `AttemptTimeout` | DEADLINE_EXCEEDED |
/// | `ConnectTimeout`, `CircuitOpen`, anything [not sent](Error::is_not_sent) | UNAVAILABLE |
/// | `RetriesExhausted`, `BudgetExhausted` | UNAVAILABLE |
/// | `OutcomeUnknown`, `BodyNotReplayable`, `Transport` after sending | UNKNOWN |
///
/// ```
/// use std::time::Duration;
/// use http::{Request, Response};
/// use resend::tonic::{into_status, resend_error, GrpcClassifier, TonicTransport};
/// use tower::{service_fn, util::MapErr, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// // Stands in for a channel to a server that never answers.
/// let silent = service_fn(|_req: Request<tonic::body::Body>| async {
///     std::future::pending::<Result<Response<tonic::body::Body>, std::convert::Infallible>>().await
/// });
/// let ledger = resend::stack()
///     .total(Duration::from_secs(1))
///     .retry(|r| r.classifier(GrpcClassifier::new().idempotent("/ledger.Ledger/GetBalance")))
///     .service(TonicTransport::new(silent));
/// let ledger = MapErr::new(ledger, into_status); // what a generated client should be given
///
/// let req = Request::post("/ledger.Ledger/GetBalance").body(tonic::body::Body::empty()).unwrap();
/// let status = ledger.oneshot(req).await.unwrap_err();
/// assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
/// assert!(resend_error(&status).is_some_and(|e| e.is_deadline_exceeded()));
/// # }
/// ```
pub fn into_status(err: Error) -> ::tonic::Status {
    let code = match err.kind() {
        ErrorKind::DeadlineExceeded | ErrorKind::AttemptTimeout => Code::DeadlineExceeded,
        _ if err.is_not_sent() => Code::Unavailable,
        ErrorKind::ConnectTimeout
        | ErrorKind::RetriesExhausted
        | ErrorKind::BudgetExhausted
        | ErrorKind::CircuitOpen => Code::Unavailable,
        ErrorKind::OutcomeUnknown | ErrorKind::BodyNotReplayable | ErrorKind::Transport => {
            Code::Unknown
        }
    };
    let mut status = ::tonic::Status::new(code, err.to_string());
    status.set_source(Arc::new(err));
    status
}

/// The [`resend::Error`](crate::Error) behind a `tonic::Status` that a tonic
/// client made of the stack's error, if that is where it came from.
///
/// A generated client turns the stack's error into a status with
/// `Status::from_error`: a code from what tonic recognises in it (UNAVAILABLE
/// for a failure to connect), else UNKNOWN with the error's message. The
/// resend error, with its kind and attempt history, stays reachable here.
///
/// ```
/// use resend::tonic::resend_error;
///
/// let status = tonic::Status::not_found("no such account");
/// assert!(resend_error(&status).is_none());
/// ```
pub fn resend_error(status: &::tonic::Status) -> Option<&Error> {
    let mut next = std::error::Error::source(status);
    while let Some(e) = next {
        if let Some(ours) = e.downcast_ref::<Error>() {
            return Some(ours);
        }
        next = e.source();
    }
    None
}

/// The gRPC classifier of the [module table](self), with an allowlist of
/// idempotent methods.
///
/// ```
/// use http::{Request, Response};
/// use resend::classify::{Class, Classify, RequestFacts};
/// use resend::tonic::GrpcClassifier;
///
/// let c = GrpcClassifier::new().idempotent("/shop.Catalog/GetItem");
/// let get = Request::post("http://shop/shop.Catalog/GetItem").body(()).unwrap();
/// let buy = Request::post("http://shop/shop.Orders/Buy").body(()).unwrap();
/// assert!(Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&get)));
/// assert!(!Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&buy)));
///
/// let unavailable = Response::builder().header("grpc-status", "14").body(()).unwrap();
/// let got = c.classify_response(&RequestFacts::of(&buy), &unavailable);
/// assert_eq!(got.class(), Class::Overloaded);
/// assert!(got.maybe_processed()); // so Buy is not retried
/// ```
#[derive(Clone, Debug, Default)]
pub struct GrpcClassifier {
    http: HttpClassifier,
    // Few entries, shared, so clones are cheap.
    idempotent: Option<Arc<[Box<str>]>>,
}

impl GrpcClassifier {
    /// The classifier of the module table; no method is on the allowlist.
    pub const fn new() -> Self {
        Self {
            http: HttpClassifier::new(),
            idempotent: None,
        }
    }

    /// Declares the method `full_name` (`/pkg.Service/Method`, the request
    /// path) idempotent: it may be sent again after an answer that leaves
    /// its outcome unknown.
    #[must_use]
    pub fn idempotent(self, full_name: &str) -> Self {
        self.idempotent_methods([full_name])
    }

    /// Declares each of `full_names` idempotent; see [`idempotent`](Self::idempotent).
    ///
    /// ```
    /// let c = resend::tonic::GrpcClassifier::new()
    ///     .idempotent_methods(["/shop.Catalog/GetItem", "/shop.Catalog/ListItems"]);
    /// assert!(c.is_idempotent("/shop.Catalog/ListItems"));
    /// ```
    #[must_use]
    pub fn idempotent_methods<I, S>(self, full_names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut list: Vec<Box<str>> = self.idempotent.as_deref().unwrap_or_default().to_vec();
        for name in full_names {
            let name = name.as_ref();
            if !list.iter().any(|m| &**m == name) {
                list.push(name.into());
            }
        }
        Self {
            http: self.http,
            idempotent: Some(list.into()),
        }
    }

    /// True when `path` (`/pkg.Service/Method`) is on the allowlist.
    pub fn is_idempotent(&self, path: &str) -> bool {
        self.idempotent
            .as_deref()
            .is_some_and(|list| list.iter().any(|m| &**m == path))
    }

    /// Classifies a gRPC status and what came with it (`headers`: the
    /// response headers of a trailers-only response, or the trailers).
    fn classify_code(code: Code, headers: &HeaderMap) -> Classification {
        let c = match code {
            Code::Ok => return Classification::new(Class::Success),
            Code::Unavailable => Classification::new(Class::Overloaded).with_maybe_processed(true),
            Code::ResourceExhausted => Classification::new(Class::Overloaded),
            // The deadline is the call's: another attempt would have less of
            // it. Never retried, whatever the method.
            Code::DeadlineExceeded => {
                return Classification::new(Class::Unknown)
                    .with_pushback(Some(Pushback::DoNotRetry));
            }
            Code::Cancelled
            | Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::FailedPrecondition
            | Code::Aborted
            | Code::OutOfRange
            | Code::Unimplemented
            | Code::Unauthenticated => return Classification::new(Class::Rejected),
            Code::Unknown | Code::Internal | Code::DataLoss => Classification::new(Class::Unknown),
        };
        c.with_pushback(pushback(headers))
    }

    /// Classifies a call by its trailers, for reporting: the status of a
    /// call whose response began with messages comes in the trailers, after
    /// the retry layer has returned the response, so no retry acts on it.
    /// Trailers without `grpc-status` are [`Unknown`](Class::Unknown): the
    /// call ended without saying how.
    ///
    /// ```
    /// use resend::classify::Class;
    /// use resend::tonic::GrpcClassifier;
    ///
    /// let mut trailers = http::HeaderMap::new();
    /// trailers.insert("grpc-status", http::HeaderValue::from_static("4"));
    /// let c = GrpcClassifier::new().classify_trailers(&trailers);
    /// assert_eq!(c.class(), Class::Unknown); // DEADLINE_EXCEEDED: may have been processed
    /// ```
    pub fn classify_trailers(&self, trailers: &HeaderMap) -> Classification {
        match grpc_status(trailers) {
            Some(code) => Self::classify_code(code, trailers),
            None => Classification::new(Class::Unknown),
        }
    }
}

/// Reads `grpc-retry-pushback-ms`: absent is `None`; negative or malformed
/// is [`Pushback::DoNotRetry`].
fn pushback(headers: &HeaderMap) -> Option<Pushback> {
    headers
        .get(GRPC_RETRY_PUSHBACK_MS)
        .map(|v| parse_grpc_pushback(v.as_bytes()))
}

impl<B> Classify<B> for GrpcClassifier {
    fn classify_response(&self, req: &RequestFacts<'_>, resp: &Response<B>) -> Classification {
        if resp.status() != StatusCode::OK {
            // Not a gRPC answer: a proxy or load balancer spoke HTTP.
            return self.http.classify_response(req, resp);
        }
        match grpc_status(resp.headers()) {
            Some(code) => Self::classify_code(code, resp.headers()),
            // The status will come in the trailers: the call is under way.
            None => Classification::new(Class::Success),
        }
    }

    fn classify_error(
        &self,
        req: &RequestFacts<'_>,
        err: &(dyn std::error::Error + 'static),
    ) -> Classification {
        if proves_not_sent(err) {
            return Classification::new(Class::NotSent);
        }
        Classify::<B>::classify_error(&self.http, req, err)
    }

    fn is_replay_safe(&self, req: &RequestFacts<'_>) -> bool {
        self.is_idempotent(req.uri().path()) || req.has_idempotency_key()
    }
}

/// True when `err`'s source chain holds tonic's [`ConnectError`](::tonic::ConnectError)
/// (the channel could not connect) or a refused connection: nothing was
/// written.
fn proves_not_sent(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if e.is::<::tonic::ConnectError>() {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            // Only connect(2) is refused.
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        next = e.source();
    }
    false
}

/// True when `err`'s source chain holds tonic's
/// [`TimeoutExpired`](::tonic::TimeoutExpired).
fn timed_out(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if e.is::<::tonic::TimeoutExpired>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// A tonic channel as the transport of a resend stack; see the
/// [module docs](self).
///
/// It turns the stack's request body into a `tonic::body::Body`, and a
/// failure to connect into a [`resend::Error`](crate::Error) that says
/// [not sent](crate::Error::is_not_sent).
///
/// ```
/// use std::time::Duration;
/// use http::{Request, Response};
/// use resend::tonic::{GrpcClassifier, TonicTransport};
/// use tower::service_fn;
///
/// // In production: `Endpoint::from_static("http://ledger:50051")
/// //     .connect_timeout(Duration::from_secs(2)).tcp_nodelay(true).connect_lazy()`.
/// let channel = service_fn(|_req: Request<tonic::body::Body>| async {
///     Ok::<_, std::convert::Infallible>(Response::new(tonic::body::Body::empty()))
/// });
/// let ledger = resend::stack()
///     .name("ledger")
///     .retry(|r| r.classifier(GrpcClassifier::new().idempotent("/ledger.Ledger/GetBalance")))
///     .service(TonicTransport::new(channel));
/// # let _ = ledger;
/// ```
#[derive(Clone, Debug)]
pub struct TonicTransport<S> {
    inner: S,
}

impl<S> TonicTransport<S> {
    /// Wraps `channel`.
    pub const fn new(channel: S) -> Self {
        Self { inner: channel }
    }

    /// The channel.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The channel, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the channel.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResB> Service<Request<B>> for TonicTransport<S>
where
    S: Service<Request<::tonic::body::Body>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(|e| map_error(e.into()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The channel enforces the grpc-timeout the stack wrote (the time
        // left, less a margin): remember it, to tell that expiry from others.
        let budget = req
            .headers()
            .get(GRPC_TIMEOUT)
            .and_then(|v| parse_grpc_timeout(v.as_bytes()).ok())
            .map(|t| (t, Instant::now()));
        ResponseFuture {
            inner: self.inner.call(req.map(::tonic::body::Body::new)),
            budget,
        }
    }
}

/// A failure to connect becomes a not-sent resend error; anything else is
/// passed on as it is.
fn map_error(e: BoxError) -> BoxError {
    if proves_not_sent(&*e) {
        Error::connect(e).into()
    } else {
        e
    }
}

pin_project! {
    /// Response future of [`TonicTransport`].
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        // The request's grpc-timeout and when it was sent.
        budget: Option<(Duration, Instant)>,
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let budget = *this.budget;
        this.inner.poll(cx).map_err(|e| {
            let e = e.into();
            match budget {
                // The channel cut the call at the grpc-timeout, i.e. at the
                // deadline less its margin: the deadline ran out, not "some
                // timeout" (an `Endpoint::timeout` stays tonic's error).
                Some((limit, sent)) if timed_out(&*e) => {
                    let elapsed = sent.elapsed();
                    if elapsed >= limit {
                        // tonic's own error is not kept as the source: tonic
                        // clients would read it as CANCELLED.
                        Error::deadline_exceeded(Phase::Attempt, elapsed).into()
                    } else {
                        e
                    }
                }
                _ => map_error(e),
            }
        })
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(method: &str, headers: &[(&str, &str)]) -> (Classification, bool) {
        let c = GrpcClassifier::new().idempotent("/svc.S/Get");
        let req = Request::post(format!("http://up{method}"))
            .body(())
            .unwrap();
        let mut resp = Response::builder();
        for (k, v) in headers {
            resp = resp.header(*k, *v);
        }
        let resp = resp.body(()).unwrap();
        let facts = RequestFacts::of(&req);
        (
            c.classify_response(&facts, &resp),
            Classify::<()>::is_replay_safe(&c, &facts),
        )
    }

    #[test]
    fn the_status_table_row_by_row() {
        let rows: &[(&str, Class, bool)] = &[
            ("0", Class::Success, false),
            ("14", Class::Overloaded, true),
            ("8", Class::Overloaded, false),
            ("4", Class::Unknown, true),
            ("1", Class::Rejected, false),
            ("3", Class::Rejected, false),
            ("5", Class::Rejected, false),
            ("6", Class::Rejected, false),
            ("7", Class::Rejected, false),
            ("9", Class::Rejected, false),
            ("10", Class::Rejected, false),
            ("11", Class::Rejected, false),
            ("12", Class::Rejected, false),
            ("16", Class::Rejected, false),
            ("2", Class::Unknown, true),
            ("13", Class::Unknown, true),
            ("15", Class::Unknown, true),
            ("99", Class::Unknown, true),
            ("fourteen", Class::Unknown, true),
        ];
        for &(status, class, maybe) in rows {
            let (c, _) = classify("/svc.S/Get", &[("grpc-status", status)]);
            assert_eq!(c.class(), class, "grpc-status {status}");
            assert_eq!(c.maybe_processed(), maybe, "grpc-status {status}");
        }
        // DEADLINE_EXCEEDED is never retried, even for an idempotent method.
        let (c, safe) = classify("/svc.S/Get", &[("grpc-status", "4")]);
        assert!(safe);
        assert_eq!(c.pushback(), Some(Pushback::DoNotRetry));
        // No status in the headers: it comes in the trailers.
        let (c, _) = classify("/svc.S/Get", &[]);
        assert_eq!(c.class(), Class::Success);
    }

    #[test]
    fn pushback_is_read_like_retry_after() {
        let (c, _) = classify(
            "/svc.S/Put",
            &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")],
        );
        assert_eq!(c.retry_after(), Some(Duration::from_millis(1500)));
        for bad in ["-1", "soon", "1.5", ""] {
            let (c, _) = classify(
                "/svc.S/Get",
                &[("grpc-status", "14"), ("grpc-retry-pushback-ms", bad)],
            );
            assert_eq!(c.pushback(), Some(Pushback::DoNotRetry), "{bad:?}");
        }
        // On a final status, pushback is not read.
        let (c, _) = classify(
            "/svc.S/Get",
            &[("grpc-status", "5"), ("grpc-retry-pushback-ms", "10")],
        );
        assert_eq!(c.pushback(), None);
    }

    #[test]
    fn replay_safety_is_the_allowlist_or_a_key() {
        let c = GrpcClassifier::new()
            .idempotent("/svc.S/Get")
            .idempotent_methods(["/svc.S/List", "/svc.S/Get"]);
        let facts = |path: &str, key: bool| {
            let mut b = Request::post(format!("http://up{path}"));
            if key {
                b = b.header("idempotency-key", "k-1");
            }
            let req = b.body(()).unwrap();
            Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&req))
        };
        assert!(facts("/svc.S/Get", false));
        assert!(facts("/svc.S/List", false));
        assert!(!facts("/svc.S/Charge", false));
        assert!(facts("/svc.S/Charge", true));
        // The HTTP rule does not apply: a GET is not safe by its method.
        let get = Request::get("http://up/svc.S/Charge").body(()).unwrap();
        assert!(!Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&get)));
    }

    #[test]
    fn non_200_answers_are_classified_as_http() {
        let (c, _) = classify("/svc.S/Get", &[]);
        assert_eq!(c.class(), Class::Success);
        let c = GrpcClassifier::new();
        let req = Request::post("http://up/svc.S/Get").body(()).unwrap();
        let resp = Response::builder().status(502).body(()).unwrap();
        assert_eq!(
            c.classify_response(&RequestFacts::of(&req), &resp).class(),
            Class::Unknown
        );
    }

    #[test]
    fn trailers_are_classified_for_reporting() {
        let c = GrpcClassifier::new();
        let mut t = HeaderMap::new();
        assert_eq!(c.classify_trailers(&t).class(), Class::Unknown);
        t.insert(GRPC_STATUS, "0".parse().unwrap());
        assert_eq!(c.classify_trailers(&t).class(), Class::Success);
        t.insert(GRPC_STATUS, "7".parse().unwrap());
        assert_eq!(c.classify_trailers(&t).class(), Class::Rejected);
    }

    #[test]
    fn connect_errors_are_not_sent() {
        let c = GrpcClassifier::new();
        let req = Request::post("http://up/svc.S/Get").body(()).unwrap();
        let facts = RequestFacts::of(&req);
        let connect = ::tonic::ConnectError(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert_eq!(
            Classify::<()>::classify_error(&c, &facts, &connect).class(),
            Class::NotSent
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(
            Classify::<()>::classify_error(&c, &facts, &reset).class(),
            Class::Unknown
        );
        let timeout = ::tonic::TimeoutExpired(());
        assert_eq!(
            Classify::<()>::classify_error(&c, &facts, &timeout).class(),
            Class::Unknown
        );
        let mapped = map_error(Box::new(connect));
        assert!(Error::from_box(mapped).is_not_sent());
    }
}
