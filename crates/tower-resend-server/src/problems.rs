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
//! # gRPC
//!
//! A gRPC request (`content-type: application/grpc…`) gets every answer of
//! the layers the gRPC way instead: a *trailers-only* response (HTTP 200,
//! `content-type: application/grpc`, no message) whose `grpc-status` is the
//! code's gRPC status (the table below) and whose `grpc-message` is the
//! `detail` (percent-encoded, as gRPC says). An answer that may be retried
//! carries `grpc-retry-pushback-ms` (the `Retry-After`, in milliseconds), so
//! that a stock gRPC retry policy and tower-resend's client wait as asked; a
//! RESOURCE_EXHAUSTED that must not be retried as it is carries
//! `grpc-retry-pushback-ms: -1`, which means "do not retry". A plain tonic
//! client sees the status with its message, never an HTTP error.
//!
//! # Statuses and codes
//!
//! | status | gRPC | `error` | from |
//! |---|---|---|---|
//! | 504 | DEADLINE_EXCEEDED | [`deadline_exceeded`](#deadline_exceeded) | [`InboundDeadlineLayer`](crate::InboundDeadlineLayer); a keyed handler cut by the deadline; `ClientErrorResponse` |
//! | 502 | UNKNOWN | [`outcome_unknown`](#outcome_unknown) | `ClientErrorResponse` |
//! | 503 | UNAVAILABLE | [`upstream_overloaded`](#upstream_overloaded) | `ClientErrorResponse` |
//! | 503 | UNAVAILABLE | [`circuit_open`](#circuit_open) | `ClientErrorResponse` |
//! | 504 | DEADLINE_EXCEEDED | [`upstream_timeout`](#upstream_timeout) | `ClientErrorResponse` |
//! | 502 | UNAVAILABLE | [`upstream_failed`](#upstream_failed) | `ClientErrorResponse` |
//! | 400 | INVALID_ARGUMENT | [`idempotency_key_invalid`](#idempotency_key_invalid) | [`IdempotencyLayer`](crate::IdempotencyLayer) |
//! | 400 | INVALID_ARGUMENT | [`idempotency_key_required`](#idempotency_key_required) | `IdempotencyLayer` |
//! | 400 | UNAUTHENTICATED | [`idempotency_key_needs_credentials`](#idempotency_key_needs_credentials) | `IdempotencyLayer` |
//! | 400 | CANCELLED | [`request_body_failed`](#request_body_failed) | `IdempotencyLayer` |
//! | 413 | RESOURCE_EXHAUSTED, pushback -1 | [`request_too_large`](#request_too_large) | `IdempotencyLayer` |
//! | 409 | UNAVAILABLE, pushback | [`idempotency_key_in_progress`](#idempotency_key_in_progress) | `IdempotencyLayer` |
//! | 422 | INVALID_ARGUMENT | [`idempotency_key_reused`](#idempotency_key_reused) | `IdempotencyLayer` |
//! | 503 | UNAVAILABLE, pushback | [`idempotency_store_unavailable`](#idempotency_store_unavailable) | `IdempotencyLayer` |
//! | 503 | UNAVAILABLE, pushback | [`idempotency_store_not_set_up`](#idempotency_store_not_set_up) | `IdempotencyLayer` |
//! | 503 | UNAVAILABLE, pushback | [`commit_outcome_unknown`](#commit_outcome_unknown) | `IdempotencyLayer` over `PostgresTransactional` |
//! | 500 | INTERNAL | [`handler_failed`](#handler_failed) | `IdempotencyLayer` |
//! | 500 | INTERNAL | [`handler_panicked`](#handler_panicked) | `IdempotencyLayer` |
//! | 500 | INTERNAL | [`response_lost`](#response_lost) | `IdempotencyLayer` |
//! | 500 | INTERNAL | [`transaction_in_use`](#transaction_in_use) | `IdempotencyLayer` over `PostgresTransactional` |
//! | 500 | INTERNAL | [`transaction_aborted`](#transaction_aborted) | `IdempotencyLayer` over `PostgresTransactional` |
//!
//! The 409 and the 503s carry `Retry-After` (whole seconds, at least 1).
//! Each code is a [`ProblemType`].
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
//! ### idempotency_store_not_set_up
//!
//! 503: the idempotency store answers, but is not set up: its table (or
//! its function) is missing, `migrate()` was not run; nothing ran.
//!
//! ### commit_outcome_unknown
//!
//! 503: the operation's transaction may or may not have committed; send it
//! again with the same key: it is replayed if it did.
//!
//! ### handler_failed
//!
//! 500: the handler failed (it returned an error, not a response). Over a
//! [`Store`](crate::Store), the work may have run in part, and it will not
//! run again under this key; over `PostgresTransactional`, its transaction
//! was rolled back, and it may be sent again.
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
//! ### transaction_aborted
//!
//! 500: a statement in the handler's transaction failed, so nothing of it
//! could be committed, yet the handler answered as if it had succeeded; its
//! answer was not kept, and the operation may be sent again.
//!
//! [RFC 9457]: https://www.rfc-editor.org/rfc/rfc9457

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE as CONTENT_TYPE_HEADER, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use serde_json::{Map, Value};
use tower_resend::classify::{GrpcCode, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS};

use crate::body::MaybeBuffered;
use crate::store::StoredResponse;

/// The media type of every problem document: `application/problem+json`.
pub const CONTENT_TYPE: &str = "application/problem+json";

/// What every `type` begins with; the `error` code follows, naming its
/// section of these docs.
pub const TYPE_BASE: &str =
    "https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#";

/// `grpc-message`.
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

/// Every problem type of the server half: its `error` code, HTTP status,
/// title and gRPC status, once. The codes are stable: match on the enum in
/// Rust, on [`code`](Self::code) anywhere else.
///
/// ```
/// use http::StatusCode;
/// use tower_resend::classify::GrpcCode;
/// use tower_resend_server::problems::ProblemType;
///
/// let t = ProblemType::IdempotencyKeyInProgress;
/// assert_eq!(t.code(), "idempotency_key_in_progress");
/// assert_eq!(t.status(), StatusCode::CONFLICT);
/// assert_eq!(t.grpc_code(), GrpcCode::Unavailable);
/// assert_eq!(ProblemType::from_code("idempotency_key_reused"), Some(ProblemType::IdempotencyKeyReused));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemType {
    /// [`deadline_exceeded`](self#deadline_exceeded).
    DeadlineExceeded,
    /// [`outcome_unknown`](self#outcome_unknown).
    OutcomeUnknown,
    /// [`upstream_overloaded`](self#upstream_overloaded).
    UpstreamOverloaded,
    /// [`circuit_open`](self#circuit_open).
    CircuitOpen,
    /// [`upstream_timeout`](self#upstream_timeout).
    UpstreamTimeout,
    /// [`upstream_failed`](self#upstream_failed).
    UpstreamFailed,
    /// [`idempotency_key_invalid`](self#idempotency_key_invalid).
    IdempotencyKeyInvalid,
    /// [`idempotency_key_required`](self#idempotency_key_required).
    IdempotencyKeyRequired,
    /// [`idempotency_key_needs_credentials`](self#idempotency_key_needs_credentials).
    IdempotencyKeyNeedsCredentials,
    /// [`request_body_failed`](self#request_body_failed).
    RequestBodyFailed,
    /// [`request_too_large`](self#request_too_large).
    RequestTooLarge,
    /// [`idempotency_key_in_progress`](self#idempotency_key_in_progress).
    IdempotencyKeyInProgress,
    /// [`idempotency_key_reused`](self#idempotency_key_reused).
    IdempotencyKeyReused,
    /// [`idempotency_store_unavailable`](self#idempotency_store_unavailable).
    IdempotencyStoreUnavailable,
    /// [`idempotency_store_not_set_up`](self#idempotency_store_not_set_up).
    IdempotencyStoreNotSetUp,
    /// [`commit_outcome_unknown`](self#commit_outcome_unknown).
    CommitOutcomeUnknown,
    /// [`handler_failed`](self#handler_failed).
    HandlerFailed,
    /// [`handler_panicked`](self#handler_panicked).
    HandlerPanicked,
    /// [`response_lost`](self#response_lost).
    ResponseLost,
    /// [`transaction_in_use`](self#transaction_in_use).
    TransactionInUse,
    /// [`transaction_aborted`](self#transaction_aborted).
    TransactionAborted,
}

impl ProblemType {
    /// Every type, in the order of the table above.
    pub const ALL: [Self; 21] = [
        Self::DeadlineExceeded,
        Self::OutcomeUnknown,
        Self::UpstreamOverloaded,
        Self::CircuitOpen,
        Self::UpstreamTimeout,
        Self::UpstreamFailed,
        Self::IdempotencyKeyInvalid,
        Self::IdempotencyKeyRequired,
        Self::IdempotencyKeyNeedsCredentials,
        Self::RequestBodyFailed,
        Self::RequestTooLarge,
        Self::IdempotencyKeyInProgress,
        Self::IdempotencyKeyReused,
        Self::IdempotencyStoreUnavailable,
        Self::IdempotencyStoreNotSetUp,
        Self::CommitOutcomeUnknown,
        Self::HandlerFailed,
        Self::HandlerPanicked,
        Self::ResponseLost,
        Self::TransactionInUse,
        Self::TransactionAborted,
    ];

    /// The `error` code, and the anchor of its section above.
    pub const fn code(self) -> &'static str {
        self.row().0
    }

    /// The HTTP status it is answered with.
    pub const fn status(self) -> StatusCode {
        self.row().1
    }

    /// Its summary, the document's `title`.
    pub const fn title(self) -> &'static str {
        self.row().2
    }

    /// The gRPC status it is answered with, for a gRPC request.
    pub const fn grpc_code(self) -> GrpcCode {
        self.row().3
    }

    /// The type whose code is `code`.
    pub fn from_code(code: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.code() == code)
    }

    /// The table's row: code, status, title, gRPC status.
    const fn row(self) -> (&'static str, StatusCode, &'static str, GrpcCode) {
        use GrpcCode as G;
        use StatusCode as S;
        match self {
            Self::DeadlineExceeded => (
                "deadline_exceeded",
                S::GATEWAY_TIMEOUT,
                "Deadline exceeded",
                G::DeadlineExceeded,
            ),
            Self::OutcomeUnknown => (
                "outcome_unknown",
                S::BAD_GATEWAY,
                "Outcome of an upstream call unknown",
                G::Unknown,
            ),
            Self::UpstreamOverloaded => (
                "upstream_overloaded",
                S::SERVICE_UNAVAILABLE,
                "Upstream overloaded",
                G::Unavailable,
            ),
            Self::CircuitOpen => (
                "circuit_open",
                S::SERVICE_UNAVAILABLE,
                "Upstream circuit open",
                G::Unavailable,
            ),
            Self::UpstreamTimeout => (
                "upstream_timeout",
                S::GATEWAY_TIMEOUT,
                "Upstream timed out",
                G::DeadlineExceeded,
            ),
            Self::UpstreamFailed => (
                "upstream_failed",
                S::BAD_GATEWAY,
                "Upstream call failed",
                G::Unavailable,
            ),
            Self::IdempotencyKeyInvalid => (
                "idempotency_key_invalid",
                S::BAD_REQUEST,
                "Malformed Idempotency-Key",
                G::InvalidArgument,
            ),
            Self::IdempotencyKeyRequired => (
                "idempotency_key_required",
                S::BAD_REQUEST,
                "Idempotency-Key required",
                G::InvalidArgument,
            ),
            Self::IdempotencyKeyNeedsCredentials => (
                "idempotency_key_needs_credentials",
                S::BAD_REQUEST,
                "Idempotency-Key without credentials",
                G::Unauthenticated,
            ),
            Self::RequestBodyFailed => (
                "request_body_failed",
                S::BAD_REQUEST,
                "Request body unreadable",
                G::Cancelled,
            ),
            Self::RequestTooLarge => (
                "request_too_large",
                S::PAYLOAD_TOO_LARGE,
                "Keyed request too large",
                G::ResourceExhausted,
            ),
            Self::IdempotencyKeyInProgress => (
                "idempotency_key_in_progress",
                S::CONFLICT,
                "Request with this Idempotency-Key in progress",
                G::Unavailable,
            ),
            Self::IdempotencyKeyReused => (
                "idempotency_key_reused",
                S::UNPROCESSABLE_ENTITY,
                "Idempotency-Key reused for another request",
                G::InvalidArgument,
            ),
            Self::IdempotencyStoreUnavailable => (
                "idempotency_store_unavailable",
                S::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
                G::Unavailable,
            ),
            Self::IdempotencyStoreNotSetUp => (
                "idempotency_store_not_set_up",
                S::SERVICE_UNAVAILABLE,
                "Idempotency store not set up",
                G::Unavailable,
            ),
            Self::CommitOutcomeUnknown => (
                "commit_outcome_unknown",
                S::SERVICE_UNAVAILABLE,
                "Commit outcome unknown",
                G::Unavailable,
            ),
            Self::HandlerFailed => (
                "handler_failed",
                S::INTERNAL_SERVER_ERROR,
                "Operation failed",
                G::Internal,
            ),
            Self::HandlerPanicked => (
                "handler_panicked",
                S::INTERNAL_SERVER_ERROR,
                "Operation panicked",
                G::Internal,
            ),
            Self::ResponseLost => (
                "response_lost",
                S::INTERNAL_SERVER_ERROR,
                "Response lost",
                G::Internal,
            ),
            Self::TransactionInUse => (
                "transaction_in_use",
                S::INTERNAL_SERVER_ERROR,
                "Transaction kept by the handler",
                G::Internal,
            ),
            Self::TransactionAborted => (
                "transaction_aborted",
                S::INTERNAL_SERVER_ERROR,
                "Transaction aborted",
                G::Internal,
            ),
        }
    }
}

/// How a request speaks, and so how it is answered: HTTP (problem
/// documents) or gRPC (trailers-only statuses).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Protocol {
    #[default]
    Http,
    Grpc,
}

impl Protocol {
    /// gRPC for a request whose `content-type` is `application/grpc…`.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let grpc = headers
            .get(CONTENT_TYPE_HEADER)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        if grpc {
            Self::Grpc
        } else {
            Self::Http
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

/// One problem document, and the response that carries it (a problem
/// document over HTTP, a trailers-only status over gRPC).
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    kind: ProblemType,
    detail: String,
    /// The extension members after `error`, in order.
    members: Vec<(&'static str, Value)>,
    retry_after: Option<Duration>,
    /// `grpc-message` when it is not the `detail`.
    grpc_message: Option<String>,
}

impl Problem {
    /// A problem of type `kind`, saying `detail`.
    pub(crate) fn new(kind: ProblemType, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            members: Vec::new(),
            retry_after: None,
            grpc_message: None,
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

    /// Answered with `Retry-After` (see [`retry_after_secs`]), and over
    /// gRPC with `grpc-retry-pushback-ms`.
    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// Over gRPC, `message` in `grpc-message` rather than the `detail`.
    pub(crate) fn grpc_message(mut self, message: impl Into<String>) -> Self {
        self.grpc_message = Some(message.into());
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
        self.kind.status()
    }

    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn detail(&self) -> &str {
        &self.detail
    }

    /// The members in their order: RFC 9457's, then the extensions.
    fn members(&self) -> impl Iterator<Item = (&str, Value)> + '_ {
        let code = self.kind.code();
        [
            ("type", Value::from(format!("{TYPE_BASE}{code}"))),
            ("title", Value::from(self.kind.title())),
            ("status", Value::from(self.kind.status().as_u16())),
            ("detail", Value::from(self.detail.as_str())),
            ("error", Value::from(code)),
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
    fn body(&self) -> Bytes {
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
    fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(CONTENT_TYPE));
        if let Some(after) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        headers
    }

    /// The answer, as a record keeps it: the problem document over HTTP, a
    /// trailers-only status over gRPC (see the [module docs](self#grpc)).
    pub(crate) fn stored(&self, protocol: Protocol) -> StoredResponse {
        match protocol {
            Protocol::Http => StoredResponse::new(self.kind.status(), self.headers(), self.body()),
            Protocol::Grpc => {
                let mut headers = HeaderMap::new();
                headers.insert(
                    CONTENT_TYPE_HEADER,
                    HeaderValue::from_static("application/grpc"),
                );
                let code = self.kind.grpc_code();
                headers.insert(GRPC_STATUS, HeaderValue::from(code.as_i32()));
                let message = self.grpc_message.as_deref().unwrap_or(&self.detail);
                headers.insert(GRPC_MESSAGE, grpc_message(message));
                let pushback = match (self.retry_after, code) {
                    (Some(after), _) => Some(i64::try_from(after.as_millis()).unwrap_or(i64::MAX)),
                    // Not to be retried as it is (tower-resend's client
                    // would retry a plain RESOURCE_EXHAUSTED).
                    (None, GrpcCode::ResourceExhausted) => Some(-1),
                    (None, _) => None,
                };
                if let Some(ms) = pushback {
                    headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(ms));
                }
                StoredResponse::new(StatusCode::OK, headers, Bytes::new())
            }
        }
    }

    /// The answer.
    pub(crate) fn response<B>(&self, protocol: Protocol) -> Response<MaybeBuffered<B>> {
        let stored = self.stored(protocol);
        let mut resp = Response::new(MaybeBuffered::full(stored.body));
        *resp.status_mut() = stored.status;
        *resp.headers_mut() = stored.headers;
        resp
    }
}

/// `message` as a `grpc-message` value: percent-encoded, every byte outside
/// printable ASCII and every `%` (gRPC's rule). Written here: it is the one
/// encoding of the crate, six lines against a dependency.
fn grpc_message(message: &str) -> HeaderValue {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    HeaderValue::from_str(&out).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The answers the idempotency layer gives on its own account, each in its
/// HTTP and gRPC form (through [`Problem`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// 400: the key is malformed, for this reason.
    KeyInvalid(&'static str),
    /// 400: the route requires a key.
    KeyRequired,
    /// 400: a keyed request without credentials, refused.
    KeyNeedsCredentials,
    /// 400: the request's body could not be read.
    RequestBodyFailed,
    /// 413: the request's body is over the cap.
    RequestTooLarge { cap: usize },
    /// 409: the same key is running.
    InProgress { retry_after: Duration },
    /// 422: the key was used with another request.
    KeyReused,
    /// 503: the store cannot be reached.
    StoreUnavailable,
    /// 503: the store answers, but its table is missing.
    StoreNotSetUp,
    /// 503: the commit's outcome is unknown (transactional).
    CommitOutcomeUnknown,
    /// 500: the operation failed (`failure`); `undone`: rolled back, so it
    /// may be sent again, rather than kept as the key's end.
    Failed { failure: Failure, undone: bool },
    /// 500: the handler kept its transaction (rolled back).
    TransactionInUse,
    /// 500: the handler's transaction was aborted, and its success answer
    /// not kept.
    TransactionAborted,
}

/// How an operation failed, for [`Answer::Failed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The handler returned an error.
    Handler,
    /// The handler panicked.
    Panic,
    /// The response's body failed after its head.
    ResponseLost,
}

/// `Retry-After` of the layer's own 503s.
const RETRY_SOON: Duration = Duration::from_secs(1);

impl Answer {
    /// Its problem type.
    pub(crate) const fn kind(&self) -> ProblemType {
        match self {
            Self::KeyInvalid(_) => ProblemType::IdempotencyKeyInvalid,
            Self::KeyRequired => ProblemType::IdempotencyKeyRequired,
            Self::KeyNeedsCredentials => ProblemType::IdempotencyKeyNeedsCredentials,
            Self::RequestBodyFailed => ProblemType::RequestBodyFailed,
            Self::RequestTooLarge { .. } => ProblemType::RequestTooLarge,
            Self::InProgress { .. } => ProblemType::IdempotencyKeyInProgress,
            Self::KeyReused => ProblemType::IdempotencyKeyReused,
            Self::StoreUnavailable => ProblemType::IdempotencyStoreUnavailable,
            Self::StoreNotSetUp => ProblemType::IdempotencyStoreNotSetUp,
            Self::CommitOutcomeUnknown => ProblemType::CommitOutcomeUnknown,
            Self::Failed { failure, .. } => match failure {
                Failure::Handler => ProblemType::HandlerFailed,
                Failure::Panic => ProblemType::HandlerPanicked,
                Failure::ResponseLost => ProblemType::ResponseLost,
            },
            Self::TransactionInUse => ProblemType::TransactionInUse,
            Self::TransactionAborted => ProblemType::TransactionAborted,
        }
    }

    /// What happened this time: the document's `detail`, and
    /// `grpc-message`.
    fn detail(&self) -> Cow<'static, str> {
        const KEPT: &str = "it will not run again under this key";
        const UNDONE: &str = "its transaction was rolled back: nothing of it was committed, so it may be sent again (with the same key)";
        Cow::Borrowed(match self {
            Self::KeyInvalid(reason) => reason,
            Self::KeyRequired => "this request must carry an Idempotency-Key header",
            Self::KeyNeedsCredentials => {
                "a request with an Idempotency-Key must identify its caller (credentials)"
            }
            Self::RequestBodyFailed => "the request body could not be read",
            Self::RequestTooLarge { cap } => {
                return Cow::Owned(format!(
                    "a request with an idempotency key may have at most {cap} bytes of body"
                ))
            }
            Self::InProgress { .. } => {
                "a request with this idempotency key is in progress; retry later"
            }
            Self::KeyReused => "this idempotency key was used with another request (method, path or body differ)",
            Self::StoreUnavailable => "the idempotency store cannot be reached; nothing was done",
            Self::StoreNotSetUp => "the idempotency store is not set up: its table is missing (run migrate); nothing was done",
            Self::CommitOutcomeUnknown => "the operation's transaction may or may not have committed; send it again with the same key: it is replayed if it did",
            Self::Failed { failure, undone } => {
                let what = match failure {
                    Failure::Handler => "the operation failed and may have run in part",
                    Failure::Panic => "the operation failed unexpectedly and may have run in part",
                    Failure::ResponseLost => "the operation ran, but its response was lost",
                };
                let then = if *undone { UNDONE } else { KEPT };
                return Cow::Owned(format!("{what}; {then}"));
            }
            Self::TransactionInUse => "the operation kept its transaction after it ended; it was rolled back, so it may be sent again (with the same key)",
            Self::TransactionAborted => "a statement of the operation's transaction failed, so nothing of it was committed; it may be sent again (with the same key)",
        })
    }

    /// The `Retry-After` it carries, if any.
    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InProgress { retry_after } => Some(*retry_after),
            Self::StoreUnavailable | Self::StoreNotSetUp | Self::CommitOutcomeUnknown => {
                Some(RETRY_SOON)
            }
            _ => None,
        }
    }

    /// The problem it is.
    pub(crate) fn problem(&self) -> Problem {
        let p = Problem::new(self.kind(), self.detail());
        match self.retry_after() {
            Some(after) => p.retry_after(after),
            None => p,
        }
    }

    /// The answer, as a record keeps it.
    pub(crate) fn stored(&self, protocol: Protocol) -> StoredResponse {
        self.problem().stored(protocol)
    }

    /// The answer.
    pub(crate) fn response<B>(&self, protocol: Protocol) -> Response<MaybeBuffered<B>> {
        self.problem().response(protocol)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_has_the_rfc_members_first_then_its_own() {
        let p = Problem::new(ProblemType::IdempotencyKeyInProgress, "busy")
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

    /// Every type has its section in the module docs, whose heading is the
    /// anchor its `type` links to, and its row in the table, with its
    /// status and gRPC status as the enum says.
    #[test]
    fn every_type_is_documented() {
        let docs = include_str!("problems.rs");
        for t in ProblemType::ALL {
            let code = t.code();
            assert!(docs.contains(&format!("//! ### {code}\n")), "{code}");
            let row = docs
                .lines()
                .find(|l| l.contains(&format!("(#{code})")))
                .unwrap_or_else(|| panic!("{code} in the table"));
            assert!(
                row.starts_with(&format!(
                    "//! | {} | {}",
                    t.status().as_u16(),
                    t.grpc_code()
                )),
                "{row}"
            );
            assert_eq!(ProblemType::from_code(code), Some(t));
        }
        assert_eq!(ProblemType::from_code("nonsense"), None);
    }

    /// The layer's answers in both forms: over gRPC, trailers-only with the
    /// status a stock retry policy and tower-resend's classifier treat
    /// right, and the detail as `grpc-message`.
    #[test]
    fn answers_in_their_grpc_form() {
        let rows = [
            (
                Answer::InProgress {
                    retry_after: Duration::from_secs(2),
                },
                409,
                GrpcCode::Unavailable,
                Some("2000"),
            ),
            (Answer::KeyReused, 422, GrpcCode::InvalidArgument, None),
            (
                Answer::KeyInvalid("bad key"),
                400,
                GrpcCode::InvalidArgument,
                None,
            ),
            (
                Answer::StoreUnavailable,
                503,
                GrpcCode::Unavailable,
                Some("1000"),
            ),
            (
                Answer::RequestTooLarge { cap: 10 },
                413,
                GrpcCode::ResourceExhausted,
                Some("-1"),
            ),
            (
                Answer::Failed {
                    failure: Failure::Panic,
                    undone: false,
                },
                500,
                GrpcCode::Internal,
                None,
            ),
        ];
        for (answer, status, code, pushback) in rows {
            let http = answer.stored(Protocol::Http);
            assert_eq!(http.status.as_u16(), status, "{answer:?}");
            assert_eq!(http.headers["content-type"], CONTENT_TYPE);
            let grpc = answer.stored(Protocol::Grpc);
            assert_eq!(grpc.status, StatusCode::OK, "{answer:?}");
            assert!(grpc.body.is_empty(), "trailers-only");
            assert_eq!(grpc.headers["content-type"], "application/grpc");
            assert_eq!(
                GrpcCode::in_headers(&grpc.headers),
                Some(code),
                "{answer:?}"
            );
            assert_eq!(
                grpc.headers
                    .get(GRPC_RETRY_PUSHBACK_MS)
                    .map(|v| v.to_str().unwrap()),
                pushback,
                "{answer:?}"
            );
            assert_eq!(grpc.headers[GRPC_MESSAGE], *answer.detail(), "{answer:?}");
        }
    }

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(grpc_message("plain text"), "plain text");
        assert_eq!(grpc_message("100% – done\n"), "100%25 %E2%80%93 done%0A");
    }
}
