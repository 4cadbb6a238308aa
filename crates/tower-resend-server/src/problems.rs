//! The error bodies of the server half: one [RFC 9457] problem document,
//! `application/problem+json`, for every answer the layers give on their own
//! account and for every tower-resend client error a handler passes on with
//! [`ClientErrorResponse`](crate::ClientErrorResponse).
//!
//! # The shape
//!
//! RFC 9457's members:
//!
//! - `type`: [`TYPE_BASE`] followed by the `error` code: a link to the
//!   code's section below (`about:blank` is never used);
//! - `title`: the type's summary, the same for every occurrence;
//! - `status`: the HTTP status code;
//! - `detail`: what happened this time, in tower-resend's own words. It never
//!   carries the text of an internal error (a transport error's message,
//!   with the addresses and names it may hold), unless the server asks for
//!   it with
//!   [`ClientErrorResponse::with_internal_detail`](crate::ClientErrorResponse::with_internal_detail),
//!   and then in a member of its own, `internal_detail`.
//!
//! Extension members, each present when it applies (and left out
//! otherwise):
//!
//! - `error`: the code, stable: match on it (`deadline_exceeded`,
//!   `outcome_unknown`, `idempotency_key_reused`, …);
//! - `upstream`: the name of the upstream concerned (a tower-resend stack's
//!   [`name`](tower_resend::StackBuilder::name));
//! - `attempts`: how many attempts of the upstream call were made;
//! - on `deadline_exceeded`: `error_source` (`upstream`, `internal` or
//!   `deadline`: where the time ran out), `upstream` or `internal` (the
//!   name of the work that was running), `budget_ms` (the caller's budget,
//!   when known) and `spent_ms`: `total`, `upstream` and `internal` (the
//!   milliseconds of each upstream and of each piece of marked work) and
//!   `unattributed`;
//! - `idempotency_key`: when the upstream may have acted on a call that
//!   resend sent under an `Idempotency-Key` it chose, that key: what the
//!   upstream knows the call by, to look it up (or to send it again under);
//! - `internal_detail`: only when configured, see above.
//!
//! ```json
//! {"type": "https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#deadline_exceeded",
//!  "title": "Deadline exceeded", "status": 504,
//!  "detail": "the request's deadline ran out during a call to the upstream shipping",
//!  "error": "deadline_exceeded", "error_source": "upstream", "upstream": "shipping",
//!  "budget_ms": 2000,
//!  "spent_ms": {"total": 2000, "upstream": {"shipping": 1750}, "internal": {"db": 250}, "unattributed": 0}}
//! ```
//!
//! A gRPC request (`content-type: application/grpc…`) whose deadline runs
//! out is answered the gRPC way instead: `grpc-status: 4`
//! (DEADLINE_EXCEEDED) in a trailers-only response, with the same
//! attribution in one line of `grpc-message`.
//!
//! # Statuses and codes
//!
//! | status | `error` | from |
//! |---|---|---|
//! | 504 | [`deadline_exceeded`](#deadline_exceeded) | [`InboundDeadlineLayer`](crate::InboundDeadlineLayer); a keyed handler cut by the deadline; `ClientErrorResponse` |
//! | 502 | [`outcome_unknown`](#outcome_unknown) | `ClientErrorResponse` |
//! | 503 | [`upstream_overloaded`](#upstream_overloaded) | `ClientErrorResponse` |
//! | 503 | [`circuit_open`](#circuit_open) | `ClientErrorResponse` |
//! | 504 | [`upstream_timeout`](#upstream_timeout) | `ClientErrorResponse` |
//! | 502 | [`upstream_failed`](#upstream_failed) | `ClientErrorResponse` |
//! | 400 | [`idempotency_key_invalid`](#idempotency_key_invalid) | [`IdempotencyLayer`](crate::IdempotencyLayer) |
//! | 400 | [`idempotency_key_required`](#idempotency_key_required) | `IdempotencyLayer` |
//! | 400 | [`idempotency_key_needs_credentials`](#idempotency_key_needs_credentials) | `IdempotencyLayer` |
//! | 400 | [`request_body_failed`](#request_body_failed) | `IdempotencyLayer` |
//! | 413 | [`request_too_large`](#request_too_large) | `IdempotencyLayer` |
//! | 409 | [`idempotency_key_in_progress`](#idempotency_key_in_progress) | `IdempotencyLayer` |
//! | 422 | [`idempotency_key_reused`](#idempotency_key_reused) | `IdempotencyLayer` |
//! | 503 | [`idempotency_store_unavailable`](#idempotency_store_unavailable) | `IdempotencyLayer` |
//! | 503 | [`commit_outcome_unknown`](#commit_outcome_unknown) | `IdempotencyLayer` over `PostgresTransactional` |
//! | 500 | [`handler_failed`](#handler_failed) | `IdempotencyLayer` |
//! | 500 | [`handler_panicked`](#handler_panicked) | `IdempotencyLayer` |
//! | 500 | [`response_lost`](#response_lost) | `IdempotencyLayer` |
//! | 500 | [`transaction_in_use`](#transaction_in_use) | `IdempotencyLayer` over `PostgresTransactional` |
//!
//! The 409 and the 503s carry `Retry-After` (whole seconds, at least 1).
//!
//! # Types
//!
//! ### deadline_exceeded
//!
//! 504: the request's deadline ran out. `error_source` says where:
//! `upstream` (inside a call to the upstream named in `upstream`),
//! `internal` (inside the handler's own work, named in `internal` when the
//! handler marked it with [`tower_resend::deadline::internal`]) or `deadline`
//! (the caller's budget was spent before the handler ran; nothing ran).
//! A tower-resend client error whose deadline ran out, or an outcome-unknown one
//! that the deadline caused (the call was cut by it, or no time was left to
//! try again), is this 504 naming its upstream; the upstream may have
//! acted on the call.
//!
//! ### outcome_unknown
//!
//! 502: the upstream may have acted on a request that is not safe to send
//! again; verify (look the resource up) before sending it again.
//!
//! ### upstream_overloaded
//!
//! 503: the upstream is failing for many calls at once (tower-resend's retry
//! budget is spent); try again later.
//!
//! ### circuit_open
//!
//! 503: the upstream's circuit breaker is open: the call failed at once and
//! nothing was sent. `Retry-After` is the time it stays open, rounded up to
//! whole seconds.
//!
//! ### upstream_timeout
//!
//! 504: an attempt, or the connection to the upstream, took longer than its
//! own timeout.
//!
//! ### upstream_failed
//!
//! 502: the upstream call failed otherwise (a transport error, retries
//! exhausted, a body too large to send again).
//!
//! ### idempotency_key_invalid
//!
//! 400: the `Idempotency-Key` is not 1 to 255 visible ASCII characters, or
//! appears more than once; nothing ran.
//!
//! ### idempotency_key_required
//!
//! 400: the route requires an `Idempotency-Key`, and the request has none;
//! nothing ran.
//!
//! ### idempotency_key_needs_credentials
//!
//! 400: a keyed request without credentials, which the layer is configured
//! to refuse; nothing ran.
//!
//! ### request_body_failed
//!
//! 400: the keyed request's body could not be read; nothing ran.
//!
//! ### request_too_large
//!
//! 413: the keyed request's body is larger than the layer keeps; nothing
//! ran.
//!
//! ### idempotency_key_in_progress
//!
//! 409: a request with this key is still running; retry after
//! `Retry-After`, with the same key.
//!
//! ### idempotency_key_reused
//!
//! 422: this key was used with another request (method, path or body
//! differ).
//!
//! ### idempotency_store_unavailable
//!
//! 503: the idempotency store could not be reached; nothing ran (the layer
//! fails closed).
//!
//! ### commit_outcome_unknown
//!
//! 503: the operation's transaction may or may not have committed; send it
//! again with the same key: it is replayed if it did.
//!
//! ### handler_failed
//!
//! 500: the handler failed. Over a [`Store`](crate::Store), the work may
//! have run in part, and it will not run again under this key; over
//! `PostgresTransactional`, its transaction was rolled back, and it may be
//! sent again.
//!
//! ### handler_panicked
//!
//! 500: the handler panicked; as `handler_failed`.
//!
//! ### response_lost
//!
//! 500: the handler answered, but its response's body failed after the
//! head; as `handler_failed`.
//!
//! ### transaction_in_use
//!
//! 500: the handler kept its transaction after it ended; it was rolled
//! back, and the operation may be sent again.
//!
//! [RFC 9457]: https://www.rfc-editor.org/rfc/rfc9457

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE as CONTENT_TYPE_HEADER, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use serde_json::{Map, Value};

use crate::body::MaybeBuffered;
use crate::store::StoredResponse;

/// The media type of every problem document: `application/problem+json`.
pub const CONTENT_TYPE: &str = "application/problem+json";

/// What every `type` begins with; the `error` code follows, naming its
/// section of these docs.
pub const TYPE_BASE: &str =
    "https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#";

/// Every code, with its title: the types documented above.
const TITLES: &[(&str, &str)] = &[
    ("deadline_exceeded", "Deadline exceeded"),
    ("outcome_unknown", "Outcome of an upstream call unknown"),
    ("upstream_overloaded", "Upstream overloaded"),
    ("circuit_open", "Upstream circuit open"),
    ("upstream_timeout", "Upstream timed out"),
    ("upstream_failed", "Upstream call failed"),
    ("idempotency_key_invalid", "Malformed Idempotency-Key"),
    ("idempotency_key_required", "Idempotency-Key required"),
    (
        "idempotency_key_needs_credentials",
        "Idempotency-Key without credentials",
    ),
    ("request_body_failed", "Request body unreadable"),
    ("request_too_large", "Keyed request too large"),
    (
        "idempotency_key_in_progress",
        "Request with this Idempotency-Key in progress",
    ),
    (
        "idempotency_key_reused",
        "Idempotency-Key reused for another request",
    ),
    (
        "idempotency_store_unavailable",
        "Idempotency store unavailable",
    ),
    ("commit_outcome_unknown", "Commit outcome unknown"),
    ("handler_failed", "Operation failed"),
    ("handler_panicked", "Operation panicked"),
    ("response_lost", "Response lost"),
    ("transaction_in_use", "Transaction kept by the handler"),
];

fn title(code: &str) -> &'static str {
    match TITLES.iter().find(|(c, _)| *c == code) {
        Some((_, title)) => title,
        None => {
            debug_assert!(false, "problem type {code} is not documented");
            "Error"
        }
    }
}

/// Milliseconds, as a JSON number.
pub(crate) fn ms(d: Duration) -> Value {
    Value::from(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `Retry-After` for a wait: whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    after.as_secs().max(1) + u64::from(after.subsec_nanos() > 0 && after.as_secs() >= 1)
}

/// One problem document, and the response that carries it.
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    status: StatusCode,
    code: &'static str,
    detail: String,
    /// The extension members after `error`, in order.
    members: Vec<(&'static str, Value)>,
    retry_after: Option<Duration>,
}

impl Problem {
    /// A problem of type `code` (documented above), answered with `status`.
    pub(crate) fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
            members: Vec::new(),
            retry_after: None,
        }
    }

    /// The extension member `name` (replacing one already set).
    pub(crate) fn with(mut self, name: &'static str, value: impl Into<Value>) -> Self {
        let value = value.into();
        match self.members.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => *v = value,
            None => self.members.push((name, value)),
        }
        self
    }

    /// Answered with `Retry-After` (see [`retry_after_secs`]).
    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// Another `detail`.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn set_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = detail.into();
        self
    }

    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn detail(&self) -> &str {
        &self.detail
    }

    /// The members in their order: RFC 9457's, then the extensions.
    fn members(&self) -> impl Iterator<Item = (&str, Value)> + '_ {
        [
            ("type", Value::from(format!("{TYPE_BASE}{}", self.code))),
            ("title", Value::from(title(self.code))),
            ("status", Value::from(self.status.as_u16())),
            ("detail", Value::from(self.detail.as_str())),
            ("error", Value::from(self.code)),
        ]
        .into_iter()
        .chain(self.members.iter().map(|(n, v)| (*n, v.clone())))
    }

    /// The document as JSON.
    #[cfg_attr(not(any(feature = "axum", test)), allow(dead_code))]
    pub(crate) fn to_json(&self) -> Value {
        let map: Map<String, Value> = self.members().map(|(n, v)| (n.to_owned(), v)).collect();
        Value::Object(map)
    }

    /// The document as the body carries it, its members in order.
    pub(crate) fn body(&self) -> Bytes {
        let mut out = Vec::with_capacity(256);
        out.push(b'{');
        for (i, (name, value)) in self.members().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            // (A string and a JSON value always serialize.)
            let _ = serde_json::to_writer(&mut out, name);
            out.push(b':');
            let _ = serde_json::to_writer(&mut out, &value);
        }
        out.push(b'}');
        Bytes::from(out)
    }

    /// `Content-Type`, and `Retry-After` when set.
    pub(crate) fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(CONTENT_TYPE));
        if let Some(after) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        headers
    }

    /// The response, as a record keeps it.
    pub(crate) fn stored(&self) -> StoredResponse {
        StoredResponse {
            status: self.status,
            headers: self.headers(),
            body: self.body(),
            body_omitted: false,
        }
    }

    /// The response.
    pub(crate) fn response<B>(&self) -> Response<MaybeBuffered<B>> {
        let mut resp = Response::new(MaybeBuffered::full(self.body()));
        *resp.status_mut() = self.status;
        *resp.headers_mut() = self.headers();
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_has_the_rfc_members_first_then_its_own() {
        let p = Problem::new(StatusCode::CONFLICT, "idempotency_key_in_progress", "busy")
            .with("upstream", "shipping")
            .with("attempts", 2)
            .with("attempts", 3)
            .retry_after(Duration::from_millis(1500));
        let body = String::from_utf8(p.body().to_vec()).unwrap();
        assert_eq!(
            body,
            "{\"type\":\"https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#idempotency_key_in_progress\",\
             \"title\":\"Request with this Idempotency-Key in progress\",\"status\":409,\"detail\":\"busy\",\
             \"error\":\"idempotency_key_in_progress\",\"upstream\":\"shipping\",\"attempts\":3}"
        );
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), p.to_json());
        let h = p.headers();
        assert_eq!(h["content-type"], "application/problem+json");
        assert_eq!(h["retry-after"], "2");
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_and_at_least_one() {
        for (ms, secs) in [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (2500, 3)] {
            assert_eq!(retry_after_secs(Duration::from_millis(ms)), secs, "{ms} ms");
        }
    }

    /// Every type has its section in the module docs, whose heading is
    /// the anchor its `type` links to.
    #[test]
    fn every_type_is_documented() {
        let docs = include_str!("problems.rs");
        for (code, _) in TITLES {
            assert!(docs.contains(&format!("//! ### {code}\n")), "{code}");
            assert!(docs.contains(&format!("(#{code})")), "{code} in the table");
        }
    }
}
