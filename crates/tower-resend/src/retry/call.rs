//! One retrying call: what it keeps between its attempts, what it makes of
//! each attempt's end (classified, recorded, decided by [`Policy::decide`]),
//! and how it ends.
//!
//! [`Policy::decide`]: super::policy::Policy::decide

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use tokio::time::Instant;

use super::budget::Want;
use super::head::Head;
use super::layer::Shared;
use super::policy::{Attempted, Decision};
use super::{CallOptions, RetryBudget, Token};
use crate::body::Replay;
use crate::classify::{is_replayed, Class, Classification, Classify, RequestFacts};
use crate::deadline::Deadline;
use crate::error::{BoxError, Error, ErrorKind};
use crate::telemetry::{self, Outcome, WaitReason};
use crate::vocab::{Attempt, Attempts, GrpcCode, Hedged, RetryInCharge, Stop, Tried};

/// What comes after an attempt.
pub(crate) enum Next<R> {
    /// The call's answer: its history written on the response, or the
    /// error made the call's.
    Done(Result<Response<R>, BoxError>),
    /// Another attempt after `wait`, with a budget token if it needed one.
    Retry { wait: Duration },
    /// Another attempt after `wait`, once the budget has a token for it;
    /// `last` is the answer to end with if none comes in time.
    Throttled {
        wait: Duration,
        last: Result<Response<R>, BoxError>,
    },
}

/// Why an attempt was not sent.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Unsent {
    /// The deadline had passed.
    Deadline,
    /// The adaptive throttle turned it away.
    Throttled,
}

/// Everything a call needs to try again.
pub(crate) struct Call<S, B, C> {
    /// The service for later attempts: made from the template on the first
    /// retry. Boxed, so that on the success path this state does not carry
    /// (and copy) an empty slot the size of the whole inner service.
    pub(super) service: Option<Box<S>>,
    pub(super) head: Head,
    /// The body kept for later attempts; `None` when it cannot be sent again.
    pub(super) body: Option<B>,
    /// The next attempt's copy of it, made when a retry is decided.
    pub(super) next_body: Option<B>,
    pub(super) shared: Arc<Shared<S, C>>,
    pub(super) replay_safe: bool,
    /// Retries are allowed for this request (no `NoRetry`).
    pub(super) allowed: bool,
    pub(super) deadline: Option<Deadline>,
    pub(super) start: Instant,
    pub(super) attempt_start: Instant,
    /// The adaptive throttle's bin of the attempt under way (its accept
    /// counts there), if there is a throttle.
    pub(super) throttle_bin: u64,
    pub(super) waited: Duration,
    /// When the last attempt ended (its wait is counted from then).
    pub(super) decided_at: Instant,
    /// This request's own attempt cap and attempt limit, if it set them.
    pub(super) options: CallOptions,
    /// The next attempt holds a budget token: one it gives back if it
    /// succeeds (and, if the floor paid for it, pauses the floor if it
    /// fails).
    pub(super) token: Option<Token>,
    pub(super) history: Attempts,
    rng: Option<fastrand::Rng>,
    /// The call's span, and the span of the attempt in flight (none
    /// between attempts).
    pub(super) span: tracing::Span,
    pub(super) attempt: tracing::Span,
    /// Why the wait before the next attempt waits.
    pub(super) wait_reason: WaitReason,
    /// What the next attempt wants a budget token for.
    pub(super) wants: Want,
    /// The call's end has been reported (its span and metrics).
    ended: bool,
}

impl<S, B, C> Call<S, B, C> {
    /// The state of a call whose first attempt is `req`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn new(
        req: &Request<B>,
        marker: RetryInCharge,
        own_deadline: Option<Deadline>,
        key: Option<HeaderValue>,
        body: Option<B>,
        shared: Arc<Shared<S, C>>,
        replay_safe: bool,
        allowed: bool,
        deadline: Option<Deadline>,
        options: CallOptions,
        now: Instant,
    ) -> Box<Self> {
        let facts = RequestFacts::of(req);
        let (span, attempt) = telemetry::spans(
            shared.upstream.as_deref(),
            &facts,
            replay_safe,
            shared.fleet,
        );
        // Boxed where it is made: the state is a few hundred bytes, and
        // boxing it in the caller moved it once more.
        Box::new(Self {
            service: None,
            // Made here, in its place, rather than moved in.
            head: Head::keep(req, marker, own_deadline, key),
            body,
            next_body: None,
            shared,
            replay_safe,
            allowed,
            deadline,
            start: now,
            attempt_start: now,
            throttle_bin: 0,
            waited: Duration::ZERO,
            decided_at: now,
            options,
            token: None,
            history: Attempts::new(),
            rng: None,
            span,
            attempt,
            wait_reason: WaitReason::Backoff,
            wants: Want::Retry,
            ended: false,
        })
    }

    fn rng(&mut self) -> &mut fastrand::Rng {
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

    /// What the attempt that just ended with `result` leads to: it is
    /// classified and recorded, its budget token settled, and the decision
    /// table consulted; a retry takes its token (or waits for one), a stop
    /// ends the call.
    pub(super) fn ended<R>(&mut self, result: Result<Response<R>, BoxError>) -> Next<R>
    where
        B: Replay,
        C: Classify<R>,
    {
        // One clock read for the attempt's end, the time left and the
        // call's total.
        let now = Instant::now();
        let took = now.saturating_duration_since(self.attempt_start);
        let c = self.classify(&result);
        let status = result.as_ref().ok().map(Response::status);
        if let Some(throttle) = &self.shared.throttle {
            // Overloaded and refused are the upstream's rejects (a circuit
            // breaker's refusal never reached it).
            let rejected = match c.class() {
                Class::Overloaded => true,
                Class::NotSent => !is_circuit_open(&result),
                _ => false,
            };
            throttle.answered(self.throttle_bin, !rejected);
        }
        // The instance that answered, when the upstream is a fleet.
        let server = self.head.tried().and_then(Tried::take_answered);
        self.shared
            .metrics
            .attempt_ended(&self.head.facts(), server.as_deref(), &result, &c, took);
        if !self.attempt.is_disabled() {
            // The attempt's span ends here.
            telemetry::attempt_ended(&self.attempt, &result, &c);
            self.attempt = tracing::Span::none();
        }
        let made = self.history.len() + 1;
        let mut attempt = Attempt::new(c.class(), status, self.waited, took, c.retry_after())
            .with_grpc_code(c.grpc_code())
            .with_replayed(c.replayed())
            .with_server(server);
        if let Some(h) = result
            .as_ref()
            .ok()
            .and_then(|r| r.extensions().get::<Hedged>())
        {
            attempt = attempt.with_copies(h.sent, h.won);
        }
        self.history.push(attempt);
        self.settle_token(c.class());

        // The inputs of the decision table; the body's copy is made only
        // for an answer that is not final.
        let final_answer = matches!(c.class(), Class::Success | Class::Rejected);
        let next_body = if final_answer {
            None
        } else {
            self.body.as_ref().and_then(Replay::try_copy)
        };
        let remaining = self.deadline.map(|d| d.remaining_at(now));
        // Another instance of a fleet can take the next attempt, and the
        // answer spoke for its own instance only (a 429, or gRPC's
        // RESOURCE_EXHAUSTED, speaks for the whole service: a rate limit
        // or a quota is the caller's wherever it goes).
        let for_service = status == Some(http::StatusCode::TOO_MANY_REQUESTS)
            || c.grpc_code() == Some(GrpcCode::ResourceExhausted);
        let elsewhere =
            !final_answer && !for_service && self.head.tried().is_some_and(Tried::elsewhere);
        let decided = Attempted {
            elsewhere,
            class: &c,
            made,
            replay_safe: self.replay_safe,
            allowed: self.allowed,
            circuit_open: c.class() == Class::NotSent && is_circuit_open(&result),
            replayable: next_body.is_some(),
            remaining,
            max_attempts: self.options.max_attempts,
        };
        let policy = self.shared.policy;
        let decision = policy.decide(decided, self.rng());
        tracing::debug!(
            parent: &self.span,
            attempt = made,
            class = c.class().as_str(),
            status = status.map(|s| s.as_u16()),
            wait_ms = match decision {
                Decision::Retry { wait, .. } => Some(wait.as_millis() as u64),
                Decision::Stop(_) => None,
            },
            stop = match decision {
                Decision::Stop(s) => Some(tracing::field::display(s)),
                Decision::Retry { .. } => None,
            },
            time_left_ms = remaining.map(|d| d.as_millis() as u64),
            "attempt"
        );
        self.decided_at = now;
        let (wait, token) = match decision {
            Decision::Stop(stop) => {
                // The first attempt began with the call.
                let elapsed = if self.attempt_start == self.start {
                    took
                } else {
                    now.saturating_duration_since(self.start)
                };
                let mut result = result;
                self.finish(elapsed, &mut result, stop);
                return Next::Done(result);
            }
            Decision::Retry { wait, token } => (wait, token),
        };
        self.next_body = next_body;
        self.waited = wait;
        self.wait_reason = if c.retry_after().is_some() {
            WaitReason::RetryAfter
        } else if c.class() == Class::Overloaded {
            WaitReason::Overloaded
        } else {
            WaitReason::Backoff
        };
        if let Some(budget) = self.shared.budget.as_ref().filter(|_| token) {
            // A keyed call whose attempt may have run (its answer lost, or
            // its key still running) retries to learn its outcome: first
            // in line for a token.
            let outcome = matches!(c.class(), Class::Unknown | Class::InProgress)
                && self.head.facts().has_idempotency_key();
            self.wants = if outcome { Want::Outcome } else { Want::Retry };
            match budget.withdraw_for(self.wants) {
                Some(token) => self.token = Some(token),
                // No token: wait for one, holding this answer to end with
                // if none comes.
                None => return Next::Throttled { wait, last: result },
            }
        }
        telemetry::wait_event(&self.span, self.wait_reason, wait, None, made);
        Next::Retry { wait }
    }

    /// What the server may have done, by the classifier; a failure the
    /// server replayed from its idempotency store is marked so.
    fn classify<R>(&self, result: &Result<Response<R>, BoxError>) -> Classification
    where
        C: Classify<R>,
    {
        let facts = self.head.facts();
        match result {
            Ok(resp) => {
                let c = self.shared.classifier.classify_response(&facts, resp);
                // Only a failure's replay changes the decision: a success
                // pays no header lookup.
                let replayed = !matches!(c.class(), Class::Success | Class::Rejected)
                    && is_replayed(resp.headers());
                c.with_replayed(replayed)
            }
            Err(e) => self.shared.classifier.classify_error(&facts, &**e),
        }
    }

    /// A retry that succeeded gives its budget token back: as the upstream
    /// recovers, tokens return as fast as it answers.
    fn settle_token(&mut self, class: Class) {
        let (Some(token), Some(budget)) = (self.token.take(), &self.shared.budget) else {
            return;
        };
        match class {
            // The upstream answered as a well one does: a success, a final
            // refusal, or "another attempt holds this key" (409): not a
            // failed probe.
            Class::Success | Class::Rejected | Class::InProgress => budget.give_back(),
            // A probe of a failing upstream failed.
            _ if token == Token::Floor => budget.floor_failed(),
            _ => budget.failed(),
        }
    }

    /// The budget of the call's retries, if it has one.
    pub(super) fn budget(&self) -> Option<&RetryBudget> {
        self.shared.budget.as_ref()
    }

    /// Reports the call's end, `result`, on its span and metrics.
    fn report<R>(&mut self, result: &Result<Response<R>, BoxError>, stop: Stop) {
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
        // A keyed call whose last answer leaves it unsettled (an outer
        // retry layer, when there is one, is in charge of that).
        let unsettled = stop != Stop::Disabled
            && unsettled(&history)
            && self.head.facts().has_idempotency_key();
        match result {
            Ok(resp) if !matches!(stop, Stop::OutcomeUnknown | Stop::Replayed) && !unsettled => {
                resp.extensions_mut().insert(history);
            }
            Ok(_) => {
                let mut e = Error::retry(ErrorKind::OutcomeUnknown, history, None);
                e.set_upstream_if_none(upstream);
                if let Some(key) = self.head.key() {
                    e = e.with_key(key);
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
                // Sent under a key (resend's or the caller's): a call that
                // may have been processed is outcome-unknown, and says the
                // key a retry must carry.
                if let Some(key) = self.head.key() {
                    e = e.with_key(key);
                }
                *result = Err(e.into());
            }
        }
        self.report(result, stop);
    }
}

/// True when a keyed call's last answer leaves its operation unsettled:
/// another attempt under the key still runs (409 "in progress"), or the
/// server turned the last attempt away (overloaded, a shed) after an
/// earlier one that may have run. The caller must send it again with the
/// same key, whose record then answers (a plain 409 or 503 would not say
/// so). Only keyed calls answer 409 "in progress".
fn unsettled(history: &Attempts) -> bool {
    let Some(last) = history.last() else {
        return false;
    };
    match last.class() {
        Class::InProgress => true,
        Class::Overloaded if last.may_have_run() => {
            let earlier = history.len().saturating_sub(1) as usize;
            history.iter().take(earlier).any(Attempt::may_have_run)
        }
        _ => false,
    }
}

/// True when `result` is a circuit breaker's refusal, anywhere in the
/// error's chain.
fn is_circuit_open<R>(result: &Result<R, BoxError>) -> bool {
    result.as_ref().err().is_some_and(|e| {
        std::iter::successors(Some(&**e as &(dyn std::error::Error + 'static)), |e| {
            e.source()
        })
        .any(|e| {
            e.downcast_ref::<Error>()
                .is_some_and(|e| e.kind() == ErrorKind::CircuitOpen)
        })
    })
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

impl<S, B, C> Drop for Call<S, B, C> {
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
