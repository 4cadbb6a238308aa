//! The stack's errors as gRPC statuses: the code grpc-go and grpc-java
//! give the same failure, and the whole error behind it.

use std::sync::Arc;

use ::tonic::Code;

use crate::classify::GrpcCode;
use crate::error::{Error, ErrorKind};
use crate::retry::{Attempt, Attempts};

/// The gRPC status that says what `err` says, with `err` as its source, for
/// tonic clients: map the stack's errors with it
/// (`tower::util::MapErr::new(stack, tower_resend::tonic::into_status)`) so that a
/// generated client sees DEADLINE_EXCEEDED for a deadline, not UNKNOWN, and
/// [`resend_error`] still finds the whole error. `tonic::Status::from(err)`
/// (and `?` in a tonic handler) is the same.
///
/// The code is the one grpc-go and grpc-java give the same failure; the
/// first row that applies wins:
///
/// | the failure | code | why |
/// |---|---|---|
/// | the call's deadline ran out (`DeadlineExceeded`, or under `OutcomeUnknown`: a keyed call cut by its deadline, a service config's `timeout`) | DEADLINE_EXCEEDED | gRPC's code for a deadline, which already says the operation may have completed |
/// | the last attempt was answered with a gRPC status (`RetriesExhausted`, `BudgetExhausted`, `OutcomeUnknown`, a replayed answer) | that status | what gRPC's own retries return: the last attempt's status |
/// | the last attempt was answered with an HTTP status other than 200 (a proxy spoke) | as gRPC maps HTTP: 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 UNIMPLEMENTED, 400 INTERNAL, 429, 502, 503, 504 UNAVAILABLE, others UNKNOWN | gRPC's HTTP-to-gRPC status mapping |
/// | an attempt's own time limit fired (`AttemptTimeout`, alone or as the last attempt's failure) | DEADLINE_EXCEEDED | a client-side time limit fired while the request was out |
/// | nothing reached the server ([not sent](Error::is_not_sent): `ConnectTimeout`, a refused connection), or a local refusal (`CircuitOpen`, `Throttled`, `AtCapacity`, `QuotaSpent`) | UNAVAILABLE | safe to send again, later |
/// | the connection broke after the request went out (`Transport`, or a last attempt that got no answer) | UNAVAILABLE | gRPC's code for a transport that failed mid-call; it does not promise that nothing ran |
/// | anything else | UNKNOWN | nothing above describes it |
///
/// UNKNOWN is never the code of an outcome that is merely unknown: the
/// outcome (unknown, not sent), the Idempotency-Key and the advice stay in
/// the message and in the [`tower_resend::Error`](crate::Error) behind the
/// status ([`resend_error`]).
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

/// The code of [`into_status`]'s table, row by row.
fn code(err: &Error) -> Code {
    let chain = || ours(err);
    if chain().any(Error::is_deadline_exceeded) {
        return Code::DeadlineExceeded;
    }
    let last = err.history().and_then(Attempts::last);
    if let Some(code) = last
        .and_then(Attempt::grpc_code)
        .filter(|c| *c != GrpcCode::Ok)
    {
        return Code::from(code);
    }
    if let Some(status) = last.and_then(Attempt::status).filter(|s| s.as_u16() != 200) {
        return from_http(status);
    }
    if chain().any(|e| e.kind() == ErrorKind::AttemptTimeout) {
        return Code::DeadlineExceeded;
    }
    let refused_here = |e: &Error| {
        e.is_not_sent()
            || matches!(
                e.kind(),
                ErrorKind::CircuitOpen
                    | ErrorKind::Throttled
                    | ErrorKind::AtCapacity
                    | ErrorKind::QuotaSpent
            )
    };
    let broke = |e: &Error| e.kind() == ErrorKind::Transport;
    if chain().any(|e| refused_here(e) || broke(e)) || last.is_some_and(|a| a.status().is_none()) {
        return Code::Unavailable;
    }
    Code::Unknown
}

/// `err` and the tower-resend errors down its source chain.
fn ours(err: &Error) -> impl Iterator<Item = &Error> {
    std::iter::successors(Some(err), |e| {
        let mut next = std::error::Error::source(*e);
        while let Some(s) = next {
            if let Some(ours) = s.downcast_ref::<Error>() {
                return Some(ours);
            }
            next = s.source();
        }
        None
    })
}

/// gRPC's mapping of an HTTP status that is not a gRPC answer
/// (`doc/http-grpc-status-mapping.md`).
fn from_http(status: http::StatusCode) -> Code {
    match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::classify::Class;
    use crate::error::{BoxError, Phase};
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

    /// Two attempts, both answered with the HTTP `status` (a proxy).
    fn http_history(status: u16) -> Attempts {
        let mut a = Attempts::new();
        for _ in 0..2 {
            let status = StatusCode::from_u16(status).unwrap();
            a.push(Attempt::new(
                Class::Unknown,
                Some(status),
                Duration::ZERO,
                Duration::from_millis(2),
                None,
            ));
        }
        a.finish(Duration::from_millis(700), Stop::MaxAttempts);
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
            // The connection broke after the request went out.
            (
                Error::transport(secret()),
                Code::Unavailable,
                "transport error",
            ),
            (
                Error::throttled(),
                Code::Unavailable,
                "throttled: the upstream has been rejecting most calls, this one was not sent",
            ),
            (
                Error::at_capacity(),
                Code::Unavailable,
                "at capacity: the fleet has as many attempts in flight as its limits \
                 allow (at every instance the call could use, or in all), this one was \
                 not sent",
            ),
            (
                Error::quota_spent(Duration::from_secs(30)),
                Code::Unavailable,
                "quota spent: the upstream's stated quota has no room for this call for \
                 another 30 s, past its deadline; it was not sent",
            ),
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
                Code::DeadlineExceeded,
                "retries exhausted after 700 ms (2 attempts): attempt timed out after 300 ms",
            ),
            // A keyed call cut by its deadline: outcome unknown, and
            // DEADLINE_EXCEEDED as gRPC says a deadline; the key and the
            // advice stay in the message.
            (
                named(
                    Error::retry(
                        ErrorKind::DeadlineExceeded,
                        history(&[(Class::Unknown, None)], Stop::Deadline),
                        Some(Box::new(Error::deadline_exceeded(
                            Phase::Attempt,
                            Duration::from_millis(700),
                        ))),
                    )
                    .outcome_unknown_over(http::HeaderValue::from_static("charge-7")),
                ),
                Code::DeadlineExceeded,
                "ledger: outcome unknown after 700 ms: deadline exceeded after 700 ms: no time left \
                 for another attempt; the server may have processed the request: send it again \
                 only with the same Idempotency-Key, charge-7, after 1 s",
            ),
            // A proxy answered in HTTP: gRPC's mapping of its status.
            (
                Error::retry(ErrorKind::RetriesExhausted, http_history(503), None),
                Code::Unavailable,
                "retries exhausted after 700 ms (2 attempts)",
            ),
            (
                Error::retry(ErrorKind::RetriesExhausted, http_history(404), None),
                Code::Unimplemented,
                "retries exhausted after 700 ms (2 attempts)",
            ),
            (
                Error::retry(ErrorKind::RetriesExhausted, http_history(500), None),
                Code::Unknown,
                "retries exhausted after 700 ms (2 attempts)",
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
            // A Charge answered UNAVAILABLE: not resent. UNAVAILABLE, as
            // grpc-go returns the server's status (gRPC's own docs say it is
            // not always safe to retry); the message says what is unknown.
            (
                named(Error::retry(
                    ErrorKind::OutcomeUnknown,
                    history(&[(Class::Overloaded, unavailable)], Stop::OutcomeUnknown),
                    None,
                )),
                Code::Unavailable,
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
                Code::Unavailable,
                "body not replayable after 700 ms: a retry was needed but the request body was \
                 too large to keep, so it was not resent; the server may have processed the \
                 request, which is not safe to send again: verify (look the resource up) before \
                 resending",
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
}
