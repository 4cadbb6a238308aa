//! The names of earlier versions, each an alias of its new name that says
//! where it went: code written for them still compiles, with a
//! deprecation warning naming the new path, rather than failing with a
//! bare "unresolved import". Hidden from the docs; the CHANGELOG lists each.
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

/// The names that were under `retry::`.
pub(crate) mod retry {
    #![allow(missing_docs)]
    use crate::classify::HttpClassifier;

    #[deprecated(note = "moved: tower_resend::hedge::HedgeLayer")]
    pub type HedgeLayer<C = HttpClassifier> = crate::hedge::HedgeLayer<C>;

    #[deprecated(note = "moved: tower_resend::hedge::Hedge")]
    pub type Hedge<S, C = HttpClassifier> = crate::hedge::Hedge<S, C>;

    #[deprecated(note = "moved: tower_resend::hedge::Hedged")]
    pub type Hedged = crate::hedge::Hedged;

    #[deprecated(note = "moved: tower_resend::read_ahead::ReadAhead")]
    pub type ReadAheadService<S> = crate::read_ahead::ReadAhead<S>;
}

/// The names that were under `routes::`.
pub(crate) mod routes {
    #[deprecated(
        note = "renamed: tower_resend::routes::PerRoute (no clash with axum::Router), or tower_resend::stack::BoxStack to name it in one line"
    )]
    pub type Router<S> = crate::routes::PerRoute<S>;
}

/// The names that were under `fleet::`.
pub(crate) mod fleet {
    #[deprecated(note = "renamed: tower_resend::fleet::InvalidFleet")]
    pub type InvalidInstance = crate::fleet::InvalidFleet;
}
