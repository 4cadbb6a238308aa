//! A tower-resend client error as an axum response.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use tower_resend::retry::Stop;
use tower_resend::{Deadline, Error, ErrorKind, Phase};

use crate::deadline::{Attribution, ErrorSource};
use crate::problems::{Problem, ProblemType};

/// A tower-resend client error, answered the way a server should pass it on: a
/// [problem document](crate::problems) (`application/problem+json`), the
/// same shape as the server's other answers.
///
/// | kind | status | `error` |
/// |---|---|---|
/// | `DeadlineExceeded`, and `OutcomeUnknown` caused by the deadline | 504 | [`deadline_exceeded`](crate::problems#deadline_exceeded): `error_source: upstream`, naming the upstream, with the time spent as [`InboundDeadlineLayer`](crate::InboundDeadlineLayer)'s 504 says it |
/// | `OutcomeUnknown` | 502 | [`outcome_unknown`](crate::problems#outcome_unknown): the upstream may have acted; verify before sending again |
/// | `BudgetExhausted`, `Throttled`, `AtCapacity` | 503 with `Retry-After: 1` | [`upstream_overloaded`](crate::problems#upstream_overloaded) |
/// | `CircuitOpen` | 503 with `Retry-After`: the time the circuit stays open, rounded up to whole seconds | [`circuit_open`](crate::problems#circuit_open) |
/// | `QuotaSpent` | 503 with `Retry-After`: the time until the upstream's stated quota is whole again, rounded up to whole seconds | [`upstream_overloaded`](crate::problems#upstream_overloaded) |
/// | `AttemptTimeout`, `ConnectTimeout` | 504 | [`upstream_timeout`](crate::problems#upstream_timeout) |
/// | anything else | 502 | [`upstream_failed`](crate::problems#upstream_failed) |
///
/// An outcome-unknown error was caused by the deadline when its cause (down
/// its source chain) is a `DeadlineExceeded`, when its call stopped
/// retrying for want of time ([`Stop::Deadline`]), or when the inbound
/// deadline ([`Deadline::current`]) has run out: the handler's call ran out
/// of the caller's time, and the answer is the documented 504 naming that
/// upstream, not a 502.
///
/// Every body names the upstream (`upstream`), counts the `attempts`, and
/// says what happened in `detail`, in tower-resend's own words; an outcome-unknown
/// call sent under a key resend chose carries that `idempotency_key`. The
/// error's own text, with its causes (a transport error's message may name
/// hosts and addresses), is logged, and is put in the body, as
/// `internal_detail`, only when [`with_internal_detail`](Self::with_internal_detail)
/// asks for it.
///
/// Under [`IdempotencyLayer`](crate::IdempotencyLayer), an error that says
/// the upstream did nothing with the call
/// ([`nothing_processed`](tower_resend::Error::nothing_processed): it was never
/// sent, or was refused unprocessed) becomes a response marked
/// [`NothingDone`](crate::NothingDone): the lease is dropped, and the
/// caller's retry runs the handler again. Any other error is the
/// operation's end, kept and replayed. A handler that did work of its own
/// before the failed call should not pass such an error on with `?`: its
/// retry would do that work again.
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_resend_server::ClientErrorResponse;
///
/// async fn create_order() -> Result<String, ClientErrorResponse> {
///     // let resp = shipping.clone().oneshot(req).await.map_err(tower_resend::Error::from_box)?;
///     Ok("created".to_owned())
/// }
///
/// let app: Router = Router::new().route("/orders", post(create_order));
/// # let _ = app;
/// ```
///
/// The error's text in the body, for a server whose callers may see it (in
/// development, say):
///
/// ```
/// use tower_resend_server::ClientErrorResponse;
///
/// let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by 10.0.0.7");
/// let e = tower_resend::Error::from_box(io.into());
///
/// let (status, body) = ClientErrorResponse::new(e).parts();
/// assert_eq!(status, 502);
/// assert_eq!(body["error"], "upstream_failed");
/// assert!(!body.to_string().contains("10.0.0.7"));
///
/// # let e = tower_resend::Error::from_box(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by 10.0.0.7").into());
/// let (_, body) = ClientErrorResponse::new(e).with_internal_detail(true).parts();
/// assert!(body["internal_detail"].as_str().unwrap().contains("reset by 10.0.0.7"));
/// ```
#[derive(Debug)]
pub struct ClientErrorResponse {
    error: Error,
    internal_detail: bool,
}

impl From<Error> for ClientErrorResponse {
    fn from(error: Error) -> Self {
        Self::new(error)
    }
}

impl ClientErrorResponse {
    /// The response to `error`, without its internal text.
    pub const fn new(error: Error) -> Self {
        Self {
            error,
            internal_detail: false,
        }
    }

    /// Puts the error's own text, with its causes, in the body as
    /// `internal_detail`. Default: off (the text is logged, not sent).
    ///
    /// ```
    /// use tower_resend_server::ClientErrorResponse;
    ///
    /// let e = tower_resend::Error::from_box("connection reset by 10.0.0.7".into());
    /// let (_, hidden) = ClientErrorResponse::new(e).parts();
    /// assert!(hidden.get("internal_detail").is_none());
    /// # let e = tower_resend::Error::from_box("connection reset by 10.0.0.7".into());
    /// let (_, shown) = ClientErrorResponse::new(e).with_internal_detail(true).parts();
    /// assert!(shown["internal_detail"].as_str().unwrap().contains("10.0.0.7"));
    /// ```
    #[must_use]
    pub const fn with_internal_detail(mut self, on: bool) -> Self {
        self.internal_detail = on;
        self
    }

    /// The client error.
    pub const fn error(&self) -> &Error {
        &self.error
    }

    /// Unwraps the client error.
    pub fn into_error(self) -> Error {
        self.error
    }

    /// The status and the problem document of the response.
    pub fn parts(&self) -> (StatusCode, serde_json::Value) {
        let p = self.problem();
        (p.status(), p.to_json())
    }

    /// The problem document: the kind's row of the table above.
    fn problem(&self) -> Problem {
        let e = &self.error;
        let upstream = e.upstream();
        let the =
            upstream.map_or_else(|| "an upstream".to_owned(), |n| format!("the upstream {n}"));
        let mut p = match e.kind() {
            _ if caused_by_deadline(e) => deadline_exceeded(e),
            ErrorKind::OutcomeUnknown => Problem::new(
                ProblemType::OutcomeUnknown,
                format!("{the} may have acted on the request; verify (look the resource up) before sending it again"),
            ),
            ErrorKind::BudgetExhausted => Problem::new(
                ProblemType::UpstreamOverloaded,
                format!("{the} is failing for many calls; try again later"),
            )
            .retry_after(Duration::from_secs(1)),
            ErrorKind::CircuitOpen => Problem::new(
                ProblemType::CircuitOpen,
                format!("{the} looks unwell and is not called for now (its circuit is open); nothing was sent; try again later"),
            )
            .retry_after(e.limit().unwrap_or(Duration::from_secs(1))),
            ErrorKind::Throttled => Problem::new(
                ProblemType::UpstreamOverloaded,
                format!("{the} has been rejecting most calls; this one was not sent; try again later"),
            )
            .retry_after(Duration::from_secs(1)),
            ErrorKind::AtCapacity => Problem::new(
                ProblemType::UpstreamOverloaded,
                format!("{the} has as many calls in flight as it serves; this one was not sent; try again later"),
            )
            .retry_after(Duration::from_secs(1)),
            ErrorKind::QuotaSpent => Problem::new(
                ProblemType::UpstreamOverloaded,
                format!("{the}'s stated quota has no room for this call before its deadline; nothing was sent; try again after its reset"),
            )
            .retry_after(e.limit().unwrap_or(Duration::from_secs(1))),
            ErrorKind::AttemptTimeout => Problem::new(
                ProblemType::UpstreamTimeout,
                format!("{the} did not answer in time"),
            ),
            ErrorKind::ConnectTimeout => Problem::new(
                ProblemType::UpstreamTimeout,
                format!("{the} could not be reached in time; nothing was sent"),
            ),
            _ if e.is_not_sent() => Problem::new(
                ProblemType::UpstreamFailed,
                format!("the call to {the} failed; nothing was sent"),
            ),
            _ => Problem::new(
                ProblemType::UpstreamFailed,
                format!("the call to {the} failed"),
            ),
        };
        if let Some(name) = upstream {
            p = p.with("upstream", name);
        }
        if e.attempts() > 0 {
            p = p.with("attempts", e.attempts());
        }
        if let Some(key) = e.idempotency_key().filter(|_| e.is_outcome_unknown()) {
            p = p.with("idempotency_key", key);
        }
        if self.internal_detail {
            p = p.with("internal_detail", internal_text(e));
        }
        p
    }
}

/// True when the deadline ended the call: it ran out, or it made the call's
/// outcome unknown (it cut the call, left no time to try again, or the
/// inbound deadline has run out).
fn caused_by_deadline(e: &Error) -> bool {
    match e.kind() {
        ErrorKind::DeadlineExceeded => true,
        ErrorKind::OutcomeUnknown => {
            e.phase().is_some()
                || e.history().is_some_and(|h| h.stop() == Stop::Deadline)
                || cause_is_deadline(e)
                || Deadline::current().is_some_and(Deadline::is_expired)
        }
        _ => false,
    }
}

/// A `DeadlineExceeded` down `e`'s source chain.
fn cause_is_deadline(e: &Error) -> bool {
    let mut next = std::error::Error::source(e);
    while let Some(cause) = next {
        if cause
            .downcast_ref::<Error>()
            .is_some_and(Error::is_deadline_exceeded)
        {
            return true;
        }
        next = cause.source();
    }
    false
}

/// The 504 of a call the deadline ended: the upstream it was calling, and
/// where the request's time went (the ambient ledger).
fn deadline_exceeded(e: &Error) -> Problem {
    let snapshot = tower_resend::deadline::server::current_ledger()
        .map(|l| l.snapshot())
        .unwrap_or_default();
    let attributed: Duration = snapshot.totals().iter().map(|e| e.spent).sum();
    let a = Attribution {
        source: ErrorSource::Upstream,
        name: e.upstream().map(str::to_owned),
        budget: None,
        elapsed: e.elapsed().unwrap_or_default().max(attributed),
        snapshot,
    };
    let p = a.problem();
    let the = e.upstream().map_or_else(
        || "the upstream".to_owned(),
        |n| format!("the upstream {n}"),
    );
    let detail = if e.phase() == Some(Phase::Start) {
        format!("the request's deadline ran out before the call to {the} could be sent; nothing was sent")
    } else if e.is_outcome_unknown() {
        format!("{}, which may have acted on the request", p.detail())
    } else {
        return p;
    };
    p.set_detail(detail)
}

/// The error's text and its causes', each once.
fn internal_text(e: &Error) -> String {
    let mut out = e.to_string();
    let mut next = std::error::Error::source(e);
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

impl IntoResponse for ClientErrorResponse {
    fn into_response(self) -> Response {
        let stored = self.problem().stored(crate::problems::Protocol::Http);
        tracing::warn!(status = stored.status.as_u16(), error = %internal_text(&self.error), "upstream call failed");
        let mut resp = Response::new(axum::body::Body::from(stored.body));
        *resp.status_mut() = stored.status;
        *resp.headers_mut() = stored.headers;
        if self.error.nothing_processed() {
            resp.extensions_mut()
                .insert(crate::idempotency::NothingDone);
        }
        resp
    }
}
