//! A resend client error as an axum response.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, StatusCode};
use resend::{Error, ErrorKind};

use crate::deadline::{Attribution, ErrorSource};

/// A resend client error, answered the way a server should pass it on.
///
/// | kind | status | body `error` |
/// |---|---|---|
/// | `DeadlineExceeded` | 504 | `deadline_exceeded`, with the same attribution as [`InboundDeadlineLayer`](crate::InboundDeadlineLayer)'s 504 |
/// | `OutcomeUnknown` | 502 | `outcome_unknown`: the upstream may have acted; verify before sending again |
/// | `BudgetExhausted` | 503 with `Retry-After: 1` | `upstream_overloaded` |
/// | `AttemptTimeout`, `ConnectTimeout` | 504 | `upstream_timeout` |
/// | anything else | 502 | `upstream_failed` |
///
/// Every body names the upstream and says what happened in `message`.
///
/// Under [`IdempotencyLayer`](crate::IdempotencyLayer), an error that says
/// the upstream did nothing with the call
/// ([`nothing_processed`](resend::Error::nothing_processed): it was never
/// sent, or was refused unprocessed) becomes a response marked
/// [`NothingDone`](crate::NothingDone): the lease is dropped, and the
/// caller's retry runs the handler again. Any other error is the
/// operation's end, kept and replayed. A handler that did work of its own
/// before the failed call should not pass such an error on with `?`: its
/// retry would do that work again.
///
/// ```
/// use axum::{routing::post, Router};
/// use resend_server::ClientErrorResponse;
///
/// async fn create_order() -> Result<String, ClientErrorResponse> {
///     // let resp = shipping.clone().oneshot(req).await.map_err(resend::Error::from_box)?;
///     Ok("created".to_owned())
/// }
///
/// let app: Router = Router::new().route("/orders", post(create_order));
/// # let _ = app;
/// ```
#[derive(Debug)]
pub struct ClientErrorResponse(pub Error);

impl From<Error> for ClientErrorResponse {
    fn from(e: Error) -> Self {
        Self(e)
    }
}

impl ClientErrorResponse {
    /// The status and the JSON body of the response.
    pub fn parts(&self) -> (StatusCode, serde_json::Value) {
        let e = &self.0;
        let upstream = e.upstream().map(str::to_owned);
        match e.kind() {
            ErrorKind::DeadlineExceeded => {
                let snapshot = resend::deadline::current_ledger()
                    .map(|l| l.snapshot())
                    .unwrap_or_default();
                let attributed: Duration = snapshot.totals().iter().map(|e| e.spent).sum();
                let a = Attribution {
                    source: ErrorSource::Upstream,
                    name: upstream,
                    budget: None,
                    elapsed: e.elapsed().unwrap_or_default().max(attributed),
                    snapshot,
                };
                (StatusCode::GATEWAY_TIMEOUT, a.to_json())
            }
            kind => {
                let (status, code, message) = match kind {
                    ErrorKind::OutcomeUnknown => (
                        StatusCode::BAD_GATEWAY,
                        "outcome_unknown",
                        "the upstream may have acted on the request; verify before sending it again",
                    ),
                    ErrorKind::BudgetExhausted => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "upstream_overloaded",
                        "the upstream is failing for many calls; try again later",
                    ),
                    ErrorKind::AttemptTimeout | ErrorKind::ConnectTimeout => (
                        StatusCode::GATEWAY_TIMEOUT,
                        "upstream_timeout",
                        "the upstream did not answer in time",
                    ),
                    _ => (
                        StatusCode::BAD_GATEWAY,
                        "upstream_failed",
                        "the upstream call failed",
                    ),
                };
                let body = serde_json::json!({
                    "error": code,
                    "upstream": upstream,
                    "message": message,
                    "detail": e.to_string(),
                    "attempts": e.attempts(),
                });
                (status, body)
            }
        }
    }
}

impl IntoResponse for ClientErrorResponse {
    fn into_response(self) -> Response {
        let (status, body) = self.parts();
        tracing::warn!(status = status.as_u16(), error = %self.0, "upstream call failed");
        let mut resp = Response::new(axum::body::Body::from(Bytes::from(body.to_string())));
        *resp.status_mut() = status;
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.0.nothing_processed() {
            resp.extensions_mut().insert(crate::NothingDone);
        }
        resp
    }
}
