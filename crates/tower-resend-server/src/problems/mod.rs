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
//!   [`name`](tower_resend::stack::StackBuilder::name));
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
//! | 503 | UNAVAILABLE, pushback | [`request_shed`](#request_shed) | [`ShedLayer`](crate::ShedLayer) |
//! | 500 | INTERNAL | [`handler_failed`](#handler_failed) | `IdempotencyLayer` |
//! | 500 | INTERNAL | [`handler_panicked`](#handler_panicked) | `IdempotencyLayer` |
//! | 500 | INTERNAL | [`response_lost`](#response_lost) | `IdempotencyLayer` |
//! | 500 | INTERNAL | [`transaction_in_use`](#transaction_in_use) | `IdempotencyLayer` over `PostgresTransactional` |
//! | 500 | INTERNAL | [`transaction_aborted`](#transaction_aborted) | `IdempotencyLayer` over `PostgresTransactional` |
//! | 422 | FAILED_PRECONDITION | [`constraint_violation`](#constraint_violation) | `IdempotencyLayer` over `PostgresTransactional` |
//! | 503 | UNAVAILABLE, pushback | [`transaction_conflict`](#transaction_conflict) | `IdempotencyLayer` over `PostgresTransactional` |
//!
//! The 409 and the 503s carry `Retry-After` (whole seconds, at least 1).
//! Each code is a [`ProblemType`].
//!
//! An answer that says nothing was done carries `Idempotent-Nothing-Done:
//! true` ([`IDEMPOTENT_NOTHING_DONE`](tower_resend::classify::IDEMPOTENT_NOTHING_DONE);
//! a header, and over gRPC in the trailers-only metadata): `request_shed`,
//! `idempotency_store_unavailable`, `idempotency_store_not_set_up`,
//! `transaction_in_use`, `transaction_aborted`, `transaction_conflict`
//! ([`ProblemType::nothing_done`]); `handler_failed`, `handler_panicked`
//! and `response_lost` when their transaction was rolled back; a
//! `deadline_exceeded` whose `error_source` is `deadline`; and a handler's
//! own answer that released its key (marked `NothingDone`, a 429, a gRPC
//! UNAVAILABLE) or was rolled back. tower-resend's client reads it: such an
//! attempt was not processed, so the call may be sent again, and a call all
//! of whose attempts were so answered ends as overload, never as outcome
//! unknown.
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
//! budget is spent, or its adaptive throttle turned the call away), or
//! every instance of it has as many calls in flight as it serves (a fleet
//! at capacity: nothing was sent); try again later.
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
//! ### request_shed
//!
//! 503: the server is at capacity and refused the request before it ran
//! (retries are refused before first attempts), or the request's deadline
//! would pass before its turn; nothing was done. `Retry-After` is the time
//! the queue takes to drain at the pace work has been finishing.
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
//! answer was not kept, and the operation may be sent again. (A failed
//! statement whose SQLSTATE says more is answered by it instead:
//! [`constraint_violation`](#constraint_violation),
//! [`transaction_conflict`](#transaction_conflict).)
//!
//! ### constraint_violation
//!
//! 422: a statement in the handler's transaction violated an integrity
//! constraint (SQLSTATE class 23: a unique, foreign key, check or not-null
//! violation), or the COMMIT did (a deferred one), yet the handler answered
//! as if it had succeeded. Nothing was committed, and the key is free; but
//! the same request fails the same way on every try, so this answer is
//! final: a client does not send it again as it is. (Not 409: to a client
//! that sends an `Idempotency-Key`, a 409 means "a request with this key is
//! in progress, try again", and tower-resend's own client resends it.)
//!
//! ### transaction_conflict
//!
//! 503: the handler's transaction failed to serialize with another
//! (SQLSTATE 40001) or was chosen to end a deadlock (40P01), in a
//! statement or at the COMMIT, and the handler did not answer it. Nothing
//! was committed, and the key is free: send it again after `Retry-After`,
//! with the same key; the next try may pass.
//!
//! [RFC 9457]: https://www.rfc-editor.org/rfc/rfc9457

use http::header::CONTENT_TYPE as CONTENT_TYPE_HEADER;
use http::HeaderMap;

mod answer;
mod document;
mod problem_type;

pub(crate) use answer::{Answer, Failure};
pub(crate) use document::{ms, say_nothing_done, Problem};
pub use problem_type::ProblemType;

/// The media type of every problem document: `application/problem+json`.
pub const CONTENT_TYPE: &str = "application/problem+json";

/// What every `type` begins with; the `error` code follows, naming its
/// section of these docs.
pub const TYPE_BASE: &str =
    "https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#";

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type has its section in the module docs, whose heading is the
    /// anchor its `type` links to, and its row in the table, with its
    /// status and gRPC status as the enum says.
    #[test]
    fn every_type_is_documented() {
        let docs = include_str!("mod.rs");
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

    /// The types that say nothing was done are the ones the docs list, and
    /// their answers carry the marker in both forms; the others do not.
    #[test]
    fn the_nothing_done_marker_is_where_the_docs_say() {
        let docs = include_str!("mod.rs");
        let para = docs
            .split("An answer that says nothing was done")
            .nth(1)
            .and_then(|p| p.split("([`ProblemType::nothing_done`])").next())
            .expect("the paragraph");
        for t in ProblemType::ALL {
            assert_eq!(
                para.contains(&format!("`{}`", t.code())),
                t.nothing_done(),
                "{}",
                t.code()
            );
            let p = Problem::new(t, "detail");
            for protocol in [Protocol::Http, Protocol::Grpc] {
                let said = p
                    .stored(protocol)
                    .headers
                    .get(tower_resend::classify::IDEMPOTENT_NOTHING_DONE)
                    .is_some_and(|v| v == "true");
                assert_eq!(said, t.nothing_done(), "{} {protocol:?}", t.code());
            }
        }
    }
}
