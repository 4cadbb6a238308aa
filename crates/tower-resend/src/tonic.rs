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

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ::tonic::Code;
use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use crate::classify::{grpc_proves_not_sent as proves_not_sent, GrpcCode};
use crate::deadline::{parse_grpc_timeout, GRPC_TIMEOUT};
use crate::error::{BoxError, Error, ErrorKind, Phase};
use crate::retry::{Attempt, Attempts};

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

/// The gRPC status that says what `err` says, with `err` as its source, for
/// tonic clients: map the stack's errors with it
/// (`tower::util::MapErr::new(stack, tower_resend::tonic::into_status)`) so that a
/// generated client sees DEADLINE_EXCEEDED for a deadline, not UNKNOWN, and
/// [`resend_error`] still finds the whole error. `tonic::Status::from(err)`
/// (and `?` in a tonic handler) is the same.
///
/// | [`ErrorKind`] | code | why |
/// |---|---|---|
/// | `DeadlineExceeded` | DEADLINE_EXCEEDED | the call's deadline ran out |
/// | `AttemptTimeout` | DEADLINE_EXCEEDED | a client-side time limit fired while the request was out: gRPC's code for that, which also says the operation may have completed (UNAVAILABLE would invite a blind resend) |
/// | anything [not sent](Error::is_not_sent): `ConnectTimeout`, `CircuitOpen`, a refused connection | UNAVAILABLE | nothing reached the server: safe to send again, later |
/// | `RetriesExhausted`, `BudgetExhausted` | the last attempt's gRPC status, if it had one; else UNAVAILABLE | the call was retried and every attempt failed: what gRPC's own retries return |
/// | `OutcomeUnknown` | UNKNOWN | the server may have acted: verify before resending (the message says so, and names the last attempt's status) |
/// | `BodyNotReplayable`, `Transport` after sending | UNKNOWN | the request went out and no answer says what became of it |
///
/// The message is tower-resend's own sentence (the upstream's name, what fired,
/// the time spent, the attempts), without the text of a transport error
/// underneath, which stays reachable through [`resend_error`]: a handler
/// that returns the status to its own caller hands on no internal detail.
///
/// ```
/// use std::time::Duration;
/// use http::{Request, Response};
/// use tower_resend::classify::GrpcClassifier;
/// use tower_resend::tonic::{into_status, resend_error, TonicTransport};
/// use tower::{service_fn, util::MapErr, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// // Stands in for a channel to a server that never answers.
/// let silent = service_fn(|_req: Request<tonic::body::Body>| async {
///     std::future::pending::<Result<Response<tonic::body::Body>, std::convert::Infallible>>().await
/// });
/// let ledger = tower_resend::stack()
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
    let mut status = ::tonic::Status::new(code(&err), message(&err));
    status.set_source(Arc::new(err));
    status
}

/// The stack's error as the gRPC status that says the same; see
/// [`into_status`].
impl From<Error> for ::tonic::Status {
    fn from(err: Error) -> Self {
        into_status(err)
    }
}

/// The code of [`into_status`]'s table.
fn code(err: &Error) -> Code {
    match err.kind() {
        ErrorKind::DeadlineExceeded | ErrorKind::AttemptTimeout => Code::DeadlineExceeded,
        _ if err.is_not_sent() => Code::Unavailable,
        ErrorKind::ConnectTimeout | ErrorKind::CircuitOpen | ErrorKind::Throttled => {
            Code::Unavailable
        }
        ErrorKind::RetriesExhausted | ErrorKind::BudgetExhausted => last_grpc_code(err)
            .filter(|c| *c != GrpcCode::Ok)
            .map_or(Code::Unavailable, Code::from),
        ErrorKind::OutcomeUnknown | ErrorKind::BodyNotReplayable | ErrorKind::Transport => {
            Code::Unknown
        }
    }
}

/// The gRPC status of the call's last attempt, if it had one.
fn last_grpc_code(err: &Error) -> Option<GrpcCode> {
    err.history()
        .and_then(Attempts::last)
        .and_then(Attempt::grpc_code)
}

/// `err`'s sentence, and those of the tower-resend errors it wraps, without the
/// text of any other error in its source chain; then the last attempt's
/// gRPC status, if it had one.
fn message(err: &Error) -> String {
    let mut msg = err.summary().to_string();
    if let Some(code) = last_grpc_code(err) {
        use std::fmt::Write;
        let _ = write!(msg, " (the last attempt got {code})");
    }
    msg
}

/// The [`tower_resend::Error`](crate::Error) behind a `tonic::Status` that a tonic
/// client made of the stack's error, if that is where it came from.
///
/// A generated client turns the stack's error into a status with
/// `Status::from_error`: a code from what tonic recognises in it (UNAVAILABLE
/// for a failure to connect), else UNKNOWN with the error's message. The
/// resend error, with its kind and attempt history, stays reachable here.
///
/// ```
/// use tower_resend::tonic::resend_error;
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

/// A tonic channel as the transport of a tower-resend stack; see the
/// [module docs](self).
///
/// It turns the stack's request body into a `tonic::body::Body`, and a
/// failure to connect into a [`tower_resend::Error`](crate::Error) that says
/// [not sent](crate::Error::is_not_sent).
///
/// ```
/// use std::time::Duration;
/// use http::{Request, Response};
/// use tower_resend::classify::GrpcClassifier;
/// use tower_resend::tonic::{TonicTransport};
/// use tower::service_fn;
///
/// // In production: `Endpoint::from_static("http://ledger:50051")
/// //     .connect_timeout(Duration::from_secs(2)).tcp_nodelay(true).connect_lazy()`.
/// let channel = service_fn(|_req: Request<tonic::body::Body>| async {
///     Ok::<_, std::convert::Infallible>(Response::new(tonic::body::Body::empty()))
/// });
/// let ledger = tower_resend::stack()
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
    use crate::classify::{Class, GrpcClassifier, GRPC_STATUS};
    use crate::vocab::Stop;
    use crate::vocab::{Refusal, Why};
    use http::StatusCode;

    fn history(attempts: &[(Class, Option<GrpcCode>)], stop: Stop) -> Attempts {
        let mut a = Attempts::new();
        for &(class, code) in attempts {
            let status = code.map(|_| StatusCode::OK);
            a.push(
                Attempt::new(
                    class,
                    status,
                    Duration::ZERO,
                    Duration::from_millis(2),
                    None,
                )
                .with_grpc_code(code),
            );
        }
        a.finish(Duration::from_millis(700), stop);
        a
    }

    fn named(mut e: Error) -> Error {
        e.set_upstream_if_none(Some(&crate::name::Name::from("ledger")));
        e
    }

    #[test]
    fn each_kind_becomes_the_code_that_says_what_happened() {
        let secret = || -> BoxError { "tcp 10.1.2.3:50051: connection reset by peer".into() };
        let unavailable = Some(GrpcCode::Unavailable);
        let cases: Vec<(Error, Code, &str)> = vec![
            (
                named(Error::deadline_exceeded(
                    Phase::Attempt,
                    Duration::from_millis(500),
                )),
                Code::DeadlineExceeded,
                "ledger: deadline exceeded while an attempt was in flight after 500 ms",
            ),
            (
                Error::deadline_exceeded(Phase::Start, Duration::ZERO),
                Code::DeadlineExceeded,
                "deadline exceeded before the request was sent after 0 ms",
            ),
            (
                Error::attempt_timeout(Duration::from_millis(400)),
                Code::DeadlineExceeded,
                "attempt timed out after 400 ms",
            ),
            (
                Error::connect_timeout(Duration::from_secs(2)),
                Code::Unavailable,
                "connect timed out (nothing was sent) after 2 s",
            ),
            (
                Error::connect(Box::new(std::io::Error::from(
                    std::io::ErrorKind::ConnectionRefused,
                ))),
                Code::Unavailable,
                "could not connect (nothing was sent)",
            ),
            (
                Error::circuit_open(
                    Refusal::Open {
                        left: Duration::from_secs(2),
                        why: Why::Probe,
                    },
                    None,
                ),
                Code::Unavailable,
                "circuit open for another 2 s after a probe failed",
            ),
            (Error::transport(secret()), Code::Unknown, "transport error"),
            // Retried for a replay-safe call, every attempt UNAVAILABLE
            // but the last, which timed out.
            (
                Error::retry(
                    ErrorKind::RetriesExhausted,
                    history(
                        &[(Class::Overloaded, unavailable), (Class::Unknown, None)],
                        Stop::MaxAttempts,
                    ),
                    Some(Box::new(Error::attempt_timeout(Duration::from_millis(300)))),
                ),
                Code::Unavailable,
                "retries exhausted after 700 ms (2 attempts): attempt timed out after 300 ms",
            ),
            // The last attempt's own status, when it had one.
            (
                Error::retry(
                    ErrorKind::BudgetExhausted,
                    history(
                        &[
                            (Class::Unknown, Some(GrpcCode::Internal)),
                            (Class::Overloaded, Some(GrpcCode::ResourceExhausted)),
                        ],
                        Stop::Budget,
                    ),
                    Some(secret()),
                ),
                Code::ResourceExhausted,
                "retry budget exhausted after 700 ms (2 attempts): the upstream is failing for \
                 many calls, so this one was not retried (the last attempt got RESOURCE_EXHAUSTED)",
            ),
            // A Charge answered UNAVAILABLE: not resent, and not UNAVAILABLE
            // either, which would invite a blind resend.
            (
                named(Error::retry(
                    ErrorKind::OutcomeUnknown,
                    history(&[(Class::Overloaded, unavailable)], Stop::OutcomeUnknown),
                    None,
                )),
                Code::Unknown,
                "ledger: outcome unknown after 700 ms; the server may have processed the \
                 request, which is not safe to send again: verify (look the resource up) before \
                 resending (the last attempt got UNAVAILABLE)",
            ),
            (
                Error::retry(
                    ErrorKind::BodyNotReplayable,
                    history(&[(Class::Unknown, None)], Stop::NotReplayable),
                    Some(secret()),
                ),
                Code::Unknown,
                "body not replayable after 700 ms: a retry was needed but the request body was \
                 too large to keep, so it was not resent",
            ),
            // Every attempt refused before it was sent.
            (
                Error::retry(
                    ErrorKind::RetriesExhausted,
                    history(
                        &[(Class::NotSent, None), (Class::NotSent, None)],
                        Stop::MaxAttempts,
                    ),
                    Some(Box::new(Error::connect(secret()))),
                ),
                Code::Unavailable,
                "retries exhausted after 700 ms (2 attempts): could not connect (nothing was sent)",
            ),
        ];
        for (err, want, message) in cases {
            let kind = err.kind();
            let status = ::tonic::Status::from(err);
            assert_eq!(status.code(), want, "{kind:?}: {status:?}");
            assert_eq!(status.message(), message, "{kind:?}");
            assert!(!status.message().contains("10.1.2.3"), "{kind:?}");
            // The whole error stays behind it.
            assert_eq!(resend_error(&status).map(Error::kind), Some(kind));
        }
    }

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

    #[test]
    fn connect_errors_are_not_sent() {
        use crate::classify::{Classify, HttpClassifier, RequestFacts};

        let grpc = Request::post("http://up/svc.S/Get")
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
        let facts = RequestFacts::of(&grpc);
        let connect = ::tonic::ConnectError(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        for c in [
            &GrpcClassifier::new() as &dyn Classify<()>,
            &HttpClassifier::new(),
        ] {
            assert_eq!(c.classify_error(&facts, &connect).class(), Class::NotSent);
            let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
            assert_eq!(c.classify_error(&facts, &reset).class(), Class::Unknown);
            let timeout = ::tonic::TimeoutExpired(());
            assert_eq!(c.classify_error(&facts, &timeout).class(), Class::Unknown);
        }
        let mapped = map_error(Box::new(connect));
        assert!(Error::from_box(mapped).is_not_sent());
    }
}
