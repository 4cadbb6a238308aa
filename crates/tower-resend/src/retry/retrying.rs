//! What a retrying call keeps between its attempts, and how it ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Response};
use tokio::time::Instant;

use super::head::Head;
use super::layer::Shared;
use super::{Attempts, ReplayBody, Stop, Token};
use crate::classify::{Class, RequestFacts};
use crate::deadline::Deadline;
use crate::error::{BoxError, Error, ErrorKind};
use crate::telemetry::{self, Outcome, WaitReason};

/// Everything a call needs to try again.
pub(crate) struct Retrying<S, B, C> {
    /// The service for later attempts: made from the template on the first
    /// retry. Boxed, so that on the success path this state does not carry
    /// (and copy) an empty slot the size of the whole inner service.
    pub(super) service: Option<Box<S>>,
    pub(super) head: Head,
    pub(super) body: Option<ReplayBody<B>>,
    pub(super) next_body: Option<ReplayBody<B>>,
    pub(super) shared: Arc<Shared<S, C>>,
    pub(super) replay_safe: bool,
    pub(super) allowed: bool,
    pub(super) deadline: Option<Deadline>,
    pub(super) start: Instant,
    pub(super) attempt_start: Instant,
    pub(super) waited: Duration,
    /// When the last attempt ended (its wait is counted from then).
    pub(super) decided_at: Instant,
    /// This request's own attempt cap and attempt limit, if it set them.
    pub(super) options: super::CallOptions,
    /// The next attempt holds a budget token: one it gives back if it
    /// succeeds (and, if the floor paid for it, pauses the floor if it
    /// fails).
    pub(super) token: Option<Token>,
    pub(super) history: Attempts,
    pub(super) rng: Option<fastrand::Rng>,
    /// The call's span, and the span of the attempt in flight (none
    /// between attempts).
    pub(super) span: tracing::Span,
    pub(super) attempt: tracing::Span,
    /// Why the wait before the next attempt waits.
    pub(super) wait_reason: WaitReason,
    /// The call's end has been reported (its span and metrics).
    pub(super) ended: bool,
}

impl<S, B, C> Retrying<S, B, C> {
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(crate) fn new(
        req: &http::Request<ReplayBody<B>>,
        own_deadline: Option<Deadline>,
        key: Option<HeaderValue>,
        body: Option<ReplayBody<B>>,
        shared: Arc<Shared<S, C>>,
        replay_safe: bool,
        allowed: bool,
        deadline: Option<Deadline>,
        now: Instant,
    ) -> Box<Self> {
        let facts = RequestFacts::of(req);
        let (span, attempt) = telemetry::spans(shared.upstream.as_deref(), &facts, replay_safe);
        // Boxed where it is made: the state is a few hundred bytes, and
        // boxing it in the caller moved it once more (-64 instructions per
        // call by callgrind).
        Box::new(Self {
            service: None,
            // Made here, in its place, rather than moved in.
            head: Head::keep(req, own_deadline, key),
            body,
            next_body: None,
            shared,
            replay_safe,
            allowed,
            deadline,
            start: now,
            attempt_start: now,
            waited: Duration::ZERO,
            decided_at: now,
            options: super::CallOptions::new(),
            token: None,
            history: Attempts::new(),
            rng: None,
            span,
            attempt,
            wait_reason: WaitReason::Backoff,
            ended: false,
        })
    }

    /// The span of the attempt in flight: the first one's, until it is sent.
    pub(crate) fn attempt_span(&self) -> &tracing::Span {
        &self.attempt
    }

    /// Reports the call's end, `result`, on its span and metrics.
    pub(super) fn report<R>(&mut self, result: &Result<Response<R>, BoxError>, stop: Stop) {
        self.ended = true;
        if self.span.is_disabled() && !self.shared.metrics.is_on() {
            return;
        }
        let (outcome, history) = match result {
            Ok(resp) => {
                let history = resp.extensions().get::<Attempts>();
                let last = history.and_then(Attempts::last);
                let outcome = Outcome::Response {
                    class: last.map_or(Class::Success, |a| a.class()),
                    status: resp.status(),
                    grpc: last.and_then(|a| a.grpc_code()),
                };
                (outcome, history)
            }
            Err(e) => match e.downcast_ref::<Error>() {
                Some(e) => (Outcome::Error(e.kind()), e.history()),
                None => (Outcome::Error(ErrorKind::Transport), None),
            },
        };
        let none = Attempts::new();
        let history = history.unwrap_or(&none);
        telemetry::call_ended(
            &self.span,
            outcome,
            Some(stop),
            history.len(),
            history.elapsed(),
        );
        self.shared
            .metrics
            .call_ended(&self.head.facts(), outcome, Some(stop), history);
    }

    /// This request's own settings (a `CallOptions` extension).
    pub(crate) fn set_options(&mut self, options: super::CallOptions) {
        self.options = options;
    }

    pub(super) fn rng(&mut self) -> &mut fastrand::Rng {
        let shared = &self.shared;
        self.rng.get_or_insert_with(|| match shared.seed {
            // Each call draws its own sequence, reproducibly.
            Some(seed) => {
                let n = shared.calls.fetch_add(1, Ordering::Relaxed);
                fastrand::Rng::with_seed(seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            }
            None => fastrand::Rng::new(),
        })
    }

    /// Ends the call, `elapsed` after it began, with `result` and the reason
    /// retrying stopped: the history written on the response, or the error
    /// made the call's. In place: the response is moved by value through
    /// every layer already, and this saves it two more moves.
    pub(super) fn finish<R>(
        &mut self,
        elapsed: Duration,
        result: &mut Result<Response<R>, BoxError>,
        stop: Stop,
    ) {
        let mut history = std::mem::replace(&mut self.history, Attempts::new());
        history.finish(elapsed, stop);
        let upstream = self.shared.upstream.as_ref();
        match result {
            Ok(resp) if !matches!(stop, Stop::OutcomeUnknown | Stop::Replayed) => {
                resp.extensions_mut().insert(history);
            }
            Ok(_) => {
                let mut e = Error::retry(ErrorKind::OutcomeUnknown, history, None);
                e.set_upstream_if_none(upstream);
                if let Some(key) = self.head.generated_key() {
                    e = e.with_generated_key(key);
                }
                *result = Err(e.into());
            }
            Err(source) => {
                // (A zero-sized placeholder: no allocation.)
                let source = std::mem::replace(source, Box::new(Taken));
                // A deadline that ran out stays the reason, whatever else
                // also stopped the call: the caller can tell which limit fired.
                let deadline = source
                    .downcast_ref::<Error>()
                    .is_some_and(Error::is_deadline_exceeded);
                let kind = match stop {
                    Stop::OutcomeUnknown => Some(ErrorKind::OutcomeUnknown),
                    _ if deadline => Some(ErrorKind::DeadlineExceeded),
                    Stop::MaxAttempts if history.len() > 1 => Some(ErrorKind::RetriesExhausted),
                    Stop::Budget => Some(ErrorKind::BudgetExhausted),
                    Stop::NotReplayable => Some(ErrorKind::BodyNotReplayable),
                    Stop::Deadline => Some(ErrorKind::DeadlineExceeded),
                    _ => None,
                };
                let mut e = match kind {
                    Some(kind) => Error::retry(kind, history, Some(source)),
                    None => Error::from_box(source).with_history(history),
                };
                e.set_upstream_if_none(upstream);
                // Sent under a key resend chose: a call that may have been
                // processed is outcome-unknown, and says the key a retry
                // must carry.
                if let Some(key) = self.head.generated_key() {
                    e = e.with_generated_key(key);
                }
                *result = Err(e.into());
            }
        }
        self.report(result, stop);
    }
}

/// What an error taken out of a result for a moment is replaced with.
#[derive(Debug)]
struct Taken;

impl std::fmt::Display for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("(taken)")
    }
}

impl std::error::Error for Taken {}

impl<S, B, C> Drop for Retrying<S, B, C> {
    /// A call dropped before it ended (its caller went away, or the
    /// deadline layer outside it fired) still ends its span and counts.
    fn drop(&mut self) {
        if self.ended || (self.span.is_disabled() && !self.shared.metrics.is_on()) {
            return;
        }
        let now = Instant::now();
        let outcome = match self.deadline {
            Some(d) if d.remaining_at(now).is_zero() => Outcome::Error(ErrorKind::DeadlineExceeded),
            _ => Outcome::Cancelled,
        };
        telemetry::attempt_cut(&self.attempt, outcome);
        let elapsed = now.saturating_duration_since(self.start);
        telemetry::call_ended(&self.span, outcome, None, self.history.len(), elapsed);
        self.shared
            .metrics
            .call_ended(&self.head.facts(), outcome, None, &self.history);
    }
}
