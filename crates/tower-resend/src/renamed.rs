//! The crate root's names of earlier versions, each an alias of its new
//! name that says where it went: code written for them still compiles,
//! with a deprecation warning naming the new path, rather than failing with
//! a bare "unresolved import". Hidden from the docs; the CHANGELOG lists
//! each. (A module's own earlier names are aliases in that module.)
#![allow(missing_docs)]

use crate::classify::HttpClassifier;

#[deprecated(note = "renamed: tower_resend::deadline::CallDeadlineLayer")]
pub type DeadlineLayer = crate::deadline::CallDeadlineLayer;

#[deprecated(note = "renamed: tower_resend::deadline::CallDeadline")]
pub type DeadlineService<S> = crate::deadline::CallDeadline<S>;

#[deprecated(note = "renamed: tower_resend::idempotency::SetIdempotencyKeyLayer")]
pub type IdempotencyKeyLayer = crate::idempotency::SetIdempotencyKeyLayer;

#[deprecated(note = "moved: tower_resend::stack::ResponseFuture")]
pub type StackFuture<F> = crate::stack::ResponseFuture<F>;

#[deprecated(note = "moved: tower_resend::hedge::ResponseFuture")]
pub type HedgeFuture<F, S, B, C, R> = crate::hedge::ResponseFuture<F, S, B, C, R>;

#[deprecated(
    note = "moved: tower_resend::stack::Stack (or name it in one line: tower_resend::stack::BoxStack)"
)]
pub type Stack<
    S,
    C = HttpClassifier,
    B = crate::breaker::NoBreaker,
    F = crate::fleet::NoFleet,
    H = crate::hedge::NoHedge,
> = crate::stack::Stack<S, C, B, F, H>;

#[deprecated(note = "moved: tower_resend::stack::StackBuilder")]
pub type StackBuilder<
    C = HttpClassifier,
    B = crate::breaker::NoBreaker,
    F = crate::fleet::NoFleet,
    H = crate::hedge::NoHedge,
> = crate::stack::StackBuilder<C, B, F, H>;

#[deprecated(note = "moved: tower_resend::retry::Attempts")]
pub type Attempts = crate::retry::Attempts;

#[deprecated(note = "moved: tower_resend::retry::CallOptions")]
pub type CallOptions = crate::retry::CallOptions;

#[deprecated(note = "moved: tower_resend::body::ReplayBody")]
pub type ReplayBody<B> = crate::body::ReplayBody<B>;
