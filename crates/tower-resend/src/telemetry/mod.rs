//! What resend tells a tracing backend and a metrics pipeline: spans by
//! OpenTelemetry's HTTP client conventions, and (feature `otel`) metrics on
//! the OpenTelemetry API, named as the semantic conventions and gRPC's
//! retry metrics (gRFC A96) name them.
//!
//! # Spans
//!
//! Spans go through [`tracing`], with OpenTelemetry's attribute names as
//! their field names, so that [tracing-opentelemetry] exports them as they
//! are (it reads `otel.name`, `otel.kind` and `otel.status_code` too). Both
//! are at `INFO`: an application with the usual `info` filter and
//! tracing-opentelemetry gets a client span per request it sends, as
//! OpenTelemetry users expect of an HTTP client; `tower_resend=warn` turns them
//! off. With no subscriber, or one that filters them out, nothing is
//! computed for them (no URL is built, no name formatted).
//!
//! | span | when | fields |
//! |---|---|---|
//! | `resend.call` | one per logical call, around all its attempts and waits | `resend.upstream` (the stack's name), `http.request.method`, `resend.replay_safe`; at the end `resend.attempts`, `resend.outcome`, `resend.stop`, `resend.elapsed_ms`, and on a failure `error.type` and `otel.status_code = "ERROR"` |
//! | `resend.attempt` | one per physical attempt, a child of the call; `otel.kind = "client"`, `otel.name` = the method (`GET`), or `package.Service/Method` for gRPC | `http.request.method`, `server.address`, `server.port`, `url.full` (scheme, host, port and path: no query, no userinfo, no fragment), `http.request.resend_count` (1 on the second attempt, 2 on the third; absent on the first), `http.response.status_code`, `resend.class`, and on a failed attempt `error.type` and `otel.status_code = "ERROR"`; gRPC: `rpc.system = "grpc"`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code`; a hedged attempt: `resend.hedge.sent` (copies sent) and `resend.hedge.won` (the copy that answered, from 1) |
//!
//! The call span is the logical operation and the attempt span is the HTTP
//! client span of the conventions (one per physical request, named by its
//! method, its resends counted by `http.request.resend_count`): naming the
//! call `{method}` too would put two client spans of the same name one
//! inside the other, which service maps count twice. The call keeps the
//! name `resend.call`, and says the upstream in `resend.upstream`.
//!
//! `error.type` is what went wrong, in few values: on an attempt, the
//! status code of an HTTP error answer (`"503"`), the gRPC status name of a
//! gRPC one (`"UNAVAILABLE"`), tower-resend's error kind for its own errors
//! (`attempt_timeout`, `connect_timeout`, `circuit_open`,
//! `deadline_exceeded`), and the [class](crate::classify::Class) of other
//! errors (`not_sent` for a refused connection, `unknown` for a reset). On
//! the call, the same for the answer it returned, or the kind of its error
//! (`outcome_unknown`, `retries_exhausted`, `budget_exhausted`…).
//!
//! `resend.outcome` is the class of the answer returned (`success`,
//! `rejected`, `overloaded`…) or the kind of the error (as `error.type`),
//! and `cancelled` for a call dropped before it ended (its caller went
//! away), or `deadline_exceeded` when it was dropped with its deadline
//! passed (the deadline layer outside it fired). `resend.stop` is why
//! retrying stopped: `final`, `disabled`, `max_attempts`, `budget`,
//! `deadline`, `server_said_no`, `outcome_unknown`, `not_replayable`,
//! `replayed`, `circuit_open`, `throttled`, `at_capacity`, `quota_spent`.
//!
//! Each wait before a retry is an event `waiting to retry` in the call
//! span, at `INFO`, with `resend.wait.reason` — `backoff` (the jittered
//! backoff), `retry_after` (the server's `Retry-After` or gRPC pushback,
//! spread, plus backoff), `overloaded` (the floor after a 429 or 503 that
//! named no wait) or `budget` (no retry budget token: waiting for one) —
//! `resend.wait_ms` (the wait the policy planned), the
//! `http.request.resend_count` of the attempt it waits for, and for
//! `budget` the longest it may wait for a token, `resend.wait.longest_ms`.
//! A circuit breaker that refuses an attempt ends the call at once (no
//! wait): the attempt says `error.type = "circuit_open"` and the call
//! `resend.stop = "circuit_open"`; so does a fleet whose instances are all
//! at their limit (`at_capacity`), and a pacing layer (feature `quota`)
//! whose upstream's stated quota has no room before the deadline
//! (`quota_spent`). A pacing layer's wait for the quota is an event
//! `waiting for the upstream's quota` in the attempt's span, at `DEBUG`,
//! with `resend.quota.wait_ms` and `resend.quota.reason` (`pace`: the
//! call's place in the pace; `spent`: the reset); its refusal an event
//! `not sent: ...`, at `INFO`, with `error.type = "quota_spent"` and
//! `resend.quota.reset_ms`; a value off the wire not taken as it was, at
//! `DEBUG`, with `http.response.header` and `resend.quota.doubt`.
//!
//! # Metrics (feature `otel`)
//!
//! Instruments are made, once, from the `opentelemetry::metrics::Meter`
//! you pass — `StackBuilder::meter`, `RetryLayer::meter`,
//! `CircuitBreakerLayer::meter` — from your own meter provider; or from the
//! global one with `global_meter()`. Without a meter nothing is recorded,
//! and a call pays one check of an `Option` for it.
//!
//! ```
//! # #[cfg(feature = "otel")] {
//! // `provider.meter("tower-resend")` from your `SdkMeterProvider`; the global
//! // provider here, a no-op until one is set.
//! let meter = opentelemetry::global::meter("tower-resend");
//! let shipping = tower_resend::stack()
//!     .name("shipping")
//!     .circuit_breaker()
//!     .meter(&meter);
//! # let _ = shipping;
//! # }
//! ```
//!
//! | instrument | kind, unit | recorded | attributes |
//! |---|---|---|---|
//! | `http.client.request.duration` | histogram, `s` | every HTTP attempt (each is a request of its own, as it has its own span; gRPC attempts aside): from sending it to its response head, or to its error (a body read ahead is included), with the conventions' buckets | `http.request.method`, `server.address`, `server.port`, `url.scheme`, `http.response.status_code`, `error.type` (the status code of an answer of 400 or more, else the error's kind), `resend.upstream` |
//! | `resend.client.call.attempts` | histogram, `{attempt}` | at the end of every call: attempts made | `resend.upstream`, `http.request.method`, `resend.outcome` |
//! | `resend.client.call.retries` | histogram, `{retry}` | at the end of an HTTP call that retried: its retries, transparent ones aside (as gRPC's, 0 is not recorded) | `resend.upstream`, `http.request.method` |
//! | `resend.client.call.transparent_retries` | histogram, `{retry}` | at the end of an HTTP call with retries of attempts that were not sent | `resend.upstream`, `http.request.method` |
//! | `grpc.client.call.retries` | histogram, `{retry}` | gRFC A96, for gRPC calls: as `resend.client.call.retries` | `grpc.method`, `grpc.target` (the upstream's name, else the authority) |
//! | `grpc.client.call.transparent_retries` | histogram, `{retry}` | gRFC A96: as `resend.client.call.transparent_retries` | `grpc.method`, `grpc.target` |
//! | `grpc.client.call.retry_delay` | histogram, `s` | gRFC A96: at the end of a gRPC call that retried, the total time it spent without an attempt in flight | `grpc.method`, `grpc.target` |
//! | `resend.client.retry.delay` | histogram, `s` | every wait before a retry (HTTP and gRPC), as long as it lasted | `resend.upstream`, `resend.wait.reason` |
//! | `resend.client.hedge.copies` | histogram, `{copy}` | at the end of every hedged attempt (a replay-safe request of a stack with [`hedge`](crate::stack::StackBuilder::hedge)): the copies it sent, the first included (1: no backup was needed) | `resend.upstream`, `resend.hedge.winner` (`first` or `backup`: the copy whose answer, or error, was returned) |
//! | `resend.client.retry_budget.exhausted` | counter, `{call}` | a call that ended because no retry budget token came in time | `resend.upstream` |
//! | `resend.client.outcome_unknown` | counter, `{call}` | a call that ended outcome-unknown (it may have been processed, and is not safe to resend) | `resend.upstream`, `http.request.method` |
//! | `resend.client.breaker.state_changes` | counter, `{change}` | every change of a circuit breaker's state | `resend.upstream`, `resend.breaker.state` (`open`, `half_open`, `closed`: the new state) |
//! | `resend.client.quota.wait` | histogram, `s` | a pacing layer's (feature `quota`, its own `PaceLayer::meter`) every wait of a call for its place in the upstream's stated quota | `resend.quota.reason` (`pace`: its place in the pace; `spent`: the reset) |
//! | `resend.client.quota.refused` | counter, `{call}` | a pacing layer's every call refused, not sent: no room in the quota before its deadline | none |
//! | `resend.client.quota.remaining` | gauge, `{call}` | after each answer that states a quota: what is left of it, less the calls out | `resend.quota.policy` (at most 16 per layer) |
//! | `resend.client.quota.set_aside` | counter, `{value}` | a pacing layer's every value of a quota field not taken as it was | `resend.quota.set_aside` (`malformed`, `negative`, `past_cap`: clamped to the cap; `stale`: of the window before; `not_followed`: a quota past the 16 followed) |
//! | `resend.client.quota.fallbacks` | counter, `{call}` | a pacing layer sharing its quotas (feature `quota-redis`): every call placed by this process's own view because the store failed | none |
//!
//! Attributes are bounded: the upstream's name, the method (an extension
//! method is `_OTHER`), classes, kinds and states; never a URL, a key or a
//! header. `grpc.method` is the call's path, bounded by the services a
//! client calls.
//!
//! A96 records a call's retry delay as one total; resend also records each
//! wait, with its reason, in `resend.client.retry.delay`. A transport
//! instrumented of its own (reqwest's, hyper's) would record
//! `http.client.request.duration` a second time: give resend the meter, or
//! the transport, not both.
//!
//! [tracing-opentelemetry]: https://docs.rs/tracing-opentelemetry

#[cfg(feature = "otel")]
mod metrics;
#[cfg(not(feature = "otel"))]
mod noop;
mod spans;

#[cfg(feature = "otel")]
pub(crate) use metrics::{BreakerMetrics, CallMetrics, ClientMetrics};
#[cfg(not(feature = "otel"))]
pub(crate) use noop::{BreakerMetrics, CallMetrics, ClientMetrics};
pub(crate) use spans::{attempt_cut, attempt_ended, attempt_span, call_ended, spans, wait_event};

use http::Method;

use crate::classify::{Class, GrpcCode};
use crate::error::ErrorKind;
use crate::vocab::Stop;

/// The meter of the global meter provider, scoped `tower-resend` with this
/// crate's version: for [`StackBuilder::meter`](crate::stack::StackBuilder::meter)
/// and the layers' `meter`, when the application set a global provider
/// (`opentelemetry::global::set_meter_provider`) rather than hand its own.
///
/// ```
/// let shipping = tower_resend::stack()
///     .name("shipping")
///     .meter(&tower_resend::telemetry::global_meter());
/// # let _ = shipping;
/// ```
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub fn global_meter() -> opentelemetry::metrics::Meter {
    opentelemetry::global::meter_with_scope(
        opentelemetry::InstrumentationScope::builder(env!("CARGO_PKG_NAME"))
            .with_version(env!("CARGO_PKG_VERSION"))
            .build(),
    )
}

/// Why a retry waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WaitReason {
    /// The jittered backoff alone.
    Backoff,
    /// The server said how long (`Retry-After`, gRPC pushback).
    RetryAfter,
    /// An overloaded answer named no wait: the overload floor.
    Overloaded,
    /// No retry budget token: waiting for one.
    Budget,
}

impl WaitReason {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Backoff => "backoff",
            Self::RetryAfter => "retry_after",
            Self::Overloaded => "overloaded",
            Self::Budget => "budget",
        }
    }
}

/// How a call ended, for its span and its metrics.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Outcome {
    /// It returned a response, whose attempt was of `class`.
    Response {
        class: Class,
        status: http::StatusCode,
        grpc: Option<GrpcCode>,
    },
    /// It failed with an error of this kind.
    Error(ErrorKind),
    /// It was dropped before it ended: its caller went away.
    Cancelled,
}

impl Outcome {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Response { class, .. } => class.as_str(),
            Self::Error(kind) => kind_str(kind),
            Self::Cancelled => "cancelled",
        }
    }

    /// What went wrong, when something did: `error.type`.
    pub(crate) fn error_type(&self) -> Option<&'static str> {
        match *self {
            Self::Response { status, grpc, .. } => answer_error(status, grpc),
            Self::Error(kind) => Some(kind_str(kind)),
            Self::Cancelled => Some("cancelled"),
        }
    }
}

/// `error.type` of an answer: the gRPC status name of a gRPC answer that is
/// not OK, the status code of an HTTP answer of 400 or more.
pub(crate) fn answer_error(
    status: http::StatusCode,
    grpc: Option<GrpcCode>,
) -> Option<&'static str> {
    match grpc {
        Some(GrpcCode::Ok) => None,
        Some(code) => Some(code.as_str()),
        None if status.as_u16() >= 400 => Some(status_str(status)),
        None => None,
    }
}

/// A status code as text, without allocating: the standard ones and the
/// others of their class.
fn status_str(status: http::StatusCode) -> &'static str {
    macro_rules! codes {
        ($($n:literal)*) => {
            match status.as_u16() {
                $($n => stringify!($n),)*
                400..=499 => "4xx",
                _ => "5xx",
            }
        };
    }
    codes!(400 401 402 403 404 405 406 407 408 409 410 411 412 413 414 415
        416 417 418 421 422 423 424 425 426 428 429 431 451
        500 501 502 503 504 505 506 507 508 510 511)
}

/// tower-resend's error kinds, as `error.type` and `resend.outcome` say them.
pub(crate) const fn kind_str(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::DeadlineExceeded => "deadline_exceeded",
        ErrorKind::AttemptTimeout => "attempt_timeout",
        ErrorKind::ConnectTimeout => "connect_timeout",
        ErrorKind::Transport => "transport",
        ErrorKind::OutcomeUnknown => "outcome_unknown",
        ErrorKind::RetriesExhausted => "retries_exhausted",
        ErrorKind::BudgetExhausted => "budget_exhausted",
        ErrorKind::BodyNotReplayable => "body_not_replayable",
        ErrorKind::CircuitOpen => "circuit_open",
        ErrorKind::Throttled => "throttled",
        ErrorKind::AtCapacity => "at_capacity",
        ErrorKind::QuotaSpent => "quota_spent",
    }
}

/// Why retrying stopped, as `resend.stop` says it.
pub(crate) const fn stop_str(stop: Stop) -> &'static str {
    match stop {
        Stop::Final => "final",
        Stop::Disabled => "disabled",
        Stop::MaxAttempts => "max_attempts",
        Stop::Budget => "budget",
        Stop::Deadline => "deadline",
        Stop::ServerSaidNo => "server_said_no",
        Stop::OutcomeUnknown => "outcome_unknown",
        Stop::Replayed => "replayed",
        Stop::NotReplayable => "not_replayable",
        Stop::CircuitOpen => "circuit_open",
        Stop::Throttled => "throttled",
        Stop::AtCapacity => "at_capacity",
        Stop::QuotaSpent => "quota_spent",
    }
}

/// The method as the conventions bound it: the standard ones, `_OTHER`
/// for an extension method.
#[cfg_attr(not(feature = "otel"), allow(dead_code))]
pub(crate) fn method_str(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => "_OTHER",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn error_types_are_bounded_and_say_what_failed() {
        assert_eq!(answer_error(StatusCode::OK, None), None);
        assert_eq!(answer_error(StatusCode::FOUND, None), None);
        assert_eq!(
            answer_error(StatusCode::SERVICE_UNAVAILABLE, None),
            Some("503")
        );
        assert_eq!(answer_error(StatusCode::NOT_FOUND, None), Some("404"));
        let odd = StatusCode::from_u16(499).unwrap();
        assert_eq!(answer_error(odd, None), Some("4xx"));
        let odd = StatusCode::from_u16(599).unwrap();
        assert_eq!(answer_error(odd, None), Some("5xx"));
        assert_eq!(answer_error(StatusCode::OK, Some(GrpcCode::Ok)), None);
        assert_eq!(
            answer_error(StatusCode::OK, Some(GrpcCode::Unavailable)),
            Some("UNAVAILABLE")
        );
        assert_eq!(
            Outcome::Error(ErrorKind::OutcomeUnknown).error_type(),
            Some("outcome_unknown")
        );
        let ok = Outcome::Response {
            class: Class::Success,
            status: StatusCode::OK,
            grpc: None,
        };
        assert_eq!((ok.as_str(), ok.error_type()), ("success", None));
        assert_eq!(method_str(&Method::from_bytes(b"PURGE").unwrap()), "_OTHER");
        assert_eq!(method_str(&Method::PATCH), "PATCH");
    }
}
