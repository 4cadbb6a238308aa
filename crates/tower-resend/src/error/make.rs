//! How the layers make an [`Error`]: one of each kind with what it
//! knows (a phase, a limit, a refusal, a cause), and what a layer above
//! adds on its way up (the attempts, the upstream's name, the time spent,
//! the call's key). What an error says to its caller is in `mod.rs`.

use std::time::Duration;

use super::{BoxError, Error, ErrorKind, Inner, Phase};
use crate::name::Name;
use crate::vocab::{Attempts, Refusal};

impl Error {
    pub(super) fn new(kind: ErrorKind) -> Self {
        Self {
            inner: Box::new(Inner {
                kind,
                not_sent: matches!(
                    kind,
                    ErrorKind::ConnectTimeout
                        | ErrorKind::CircuitOpen
                        | ErrorKind::Throttled
                        | ErrorKind::AtCapacity
                        | ErrorKind::QuotaSpent
                ),
                phase: None,
                limit: None,
                upstream: None,
                attempts: 0,
                elapsed: None,
                history: None,
                circuit: None,
                key: None,
                source: None,
            }),
        }
    }

    pub(crate) fn deadline_exceeded(phase: Phase, elapsed: Duration) -> Self {
        let mut e = Self::new(ErrorKind::DeadlineExceeded);
        e.inner.not_sent = phase == Phase::Start;
        e.inner.phase = Some(phase);
        e.inner.elapsed = Some(elapsed);
        e
    }

    /// The adaptive throttle turned an attempt away: not sent.
    pub(crate) fn throttled() -> Self {
        Self::new(ErrorKind::Throttled)
    }

    /// Every instance of a fleet that the call could use is at its limit:
    /// not sent.
    pub(crate) fn at_capacity() -> Self {
        Self::new(ErrorKind::AtCapacity)
    }

    /// The upstream's stated quota has no room for the call before its
    /// deadline: not sent, to come back after `wait` (the reset, or the
    /// call's place in the pace), the [`limit`](Self::limit).
    #[cfg_attr(not(feature = "quota"), allow(dead_code))]
    pub(crate) fn quota_spent(wait: Duration) -> Self {
        let mut e = Self::new(ErrorKind::QuotaSpent);
        e.inner.limit = Some(wait);
        e
    }

    pub(crate) fn attempt_timeout(limit: Duration) -> Self {
        let mut e = Self::new(ErrorKind::AttemptTimeout);
        e.inner.limit = Some(limit);
        e.inner.elapsed = Some(limit);
        e.inner.attempts = 1;
        e
    }

    pub(crate) fn connect_timeout(limit: Duration) -> Self {
        let mut e = Self::new(ErrorKind::ConnectTimeout);
        e.inner.limit = Some(limit);
        e.inner.elapsed = Some(limit);
        e
    }

    /// A circuit breaker refused the call: nothing was sent. The time it
    /// stays open is the [`limit`](Self::limit).
    pub(crate) fn circuit_open(refusal: Refusal, upstream: Option<&Name>) -> Self {
        let mut e = Self::new(ErrorKind::CircuitOpen);
        e.inner.limit = Some(match refusal {
            Refusal::Open { left, .. } => left,
            Refusal::Probing { wait, .. } => wait,
        });
        e.inner.upstream = upstream.cloned();
        e.inner.circuit = Some(refusal);
        e
    }

    /// A connector failed: nothing can have been written to the server.
    pub(crate) fn connect(source: BoxError) -> Self {
        let mut e = Self::new(ErrorKind::Transport);
        e.inner.not_sent = true;
        e.inner.source = Some(source);
        e
    }

    pub(crate) fn transport(source: BoxError) -> Self {
        let mut e = Self::new(ErrorKind::Transport);
        e.inner.source = Some(source);
        e
    }

    /// The retry layer's verdict on a call that failed: `kind`, with the
    /// attempt history and the last failure as its source.
    pub(crate) fn retry(kind: ErrorKind, history: Attempts, source: Option<BoxError>) -> Self {
        let mut e = Self::new(kind);
        e.inner.not_sent = !history.any_sent();
        e.inner.attempts = history.len();
        e.inner.elapsed = Some(history.elapsed());
        if kind == ErrorKind::DeadlineExceeded {
            e.inner.phase = Some(Phase::Waiting);
        }
        // Keep what the last failure established (its name; its limit stays
        // with it, in the source: the call's own time is `elapsed`).
        if let Some(last) = source.as_deref().and_then(|s| s.downcast_ref::<Self>()) {
            e.inner.upstream.clone_from(&last.inner.upstream);
            if kind == ErrorKind::DeadlineExceeded && last.is_deadline_exceeded() {
                e.inner.phase = last.inner.phase;
            }
        }
        e.inner.history = Some(history);
        e.inner.source = source;
        e
    }

    /// Attaches the attempt history to an error passed on as it was.
    pub(crate) fn with_history(mut self, history: Attempts) -> Self {
        self.inner.attempts = history.len();
        if !history.any_sent() {
            self.inner.not_sent = true;
        } else if matches!(
            self.inner.kind,
            ErrorKind::CircuitOpen | ErrorKind::AtCapacity | ErrorKind::QuotaSpent
        ) {
            // The last attempt was refused, but an earlier one went out.
            self.inner.not_sent = false;
        }
        self.inner.history = Some(history);
        self
    }

    pub(crate) fn with_phase(mut self, phase: Phase) -> Self {
        self.inner.phase = Some(phase);
        self
    }

    /// Fills in the upstream's name if no inner layer did.
    pub(crate) fn set_upstream_if_none(&mut self, name: Option<&Name>) {
        if self.inner.upstream.is_none() {
            self.inner.upstream = name.cloned();
        }
    }

    pub(crate) fn set_elapsed(&mut self, elapsed: Duration) {
        self.inner.elapsed = Some(elapsed);
    }

    /// The error of a call sent under `key` (resend's or the caller's),
    /// carrying it. A key already set stays.
    pub(crate) fn with_key(mut self, key: http::HeaderValue) -> Self {
        if self.inner.key.is_none() {
            self.inner.key = Some(key);
        }
        self
    }

    /// The error of a keyed call that may have been processed, as the
    /// retry rules decide (`retry::policy::ends`): outcome unknown,
    /// with this error as its cause, `key` readable and the advice to send
    /// it again with that key. An error that already carries a key stays
    /// as it is.
    pub(crate) fn outcome_unknown_over(self, key: http::HeaderValue) -> Self {
        if self.inner.key.is_some() || self.inner.kind == ErrorKind::OutcomeUnknown {
            return self.with_key(key);
        }
        let mut e = Self::new(ErrorKind::OutcomeUnknown);
        e.inner.upstream = self.inner.upstream.clone();
        e.inner.attempts = self.inner.attempts;
        e.inner.elapsed = self.inner.elapsed;
        e.inner.phase = self.inner.phase;
        e.inner.history = self.inner.history.clone();
        e.inner.key = Some(key);
        e.inner.source = Some(Box::new(self));
        e
    }
}
