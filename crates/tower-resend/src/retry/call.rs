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
use super::policy::{ends, Attempted, Decision, End, Ended, Ending, LocalRefusal, Retry};
use super::{CallOptions, RetryBudget, Token};
use crate::body::Replay;
use crate::classify::{is_replayed, Class, Classification, Classify, RequestFacts};
use crate::deadline::Deadline;
use crate::error::{refused_below, BoxError, Error, ErrorKind};
use crate::telemetry::{self, Outcome, WaitReason};
use crate::vocab::{Attempt, Attempts, Hedged, NextAttempt, RetryInCharge, Stop, Tried};

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
    /// Attempts not counted toward the cap: refused before they were
    /// sent, and tried at once at another instance.
    uncounted: u32,
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
            uncounted: 0,
            rng: None,
            span,
            attempt,
            wait_reason: WaitReason::Backoff,
            wants: Want::Retry,
            ended: false,
        })
    }

    /// What the attempt that just ended with `result` leads to: observed
    /// (classified and recorded), decided by the rules, and acted on (a
    /// retry takes its token, or waits for one; a stop ends the call).
    pub(super) fn ended<R>(&mut self, result: Result<Response<R>, BoxError>) -> Next<R>
    where
        B: Replay,
        C: Classify<R>,
    {
        // One clock read for the attempt's end, the time left and the
        // call's total.
        let now = Instant::now();
        let took = now.saturating_duration_since(self.attempt_start);
        let (c, refused) = self.observe(&result, took);
        // The body's copy is made only for an answer that is not final.
        let next_body = match c.class() {
            Class::Success | Class::Rejected => None,
            _ => self.body.as_ref().and_then(Replay::try_copy),
        };
        let remaining = self.deadline.map(|d| d.remaining_at(now));
        // Whether another instance could take a retry, and whether the
        // upstream fails as a whole (by the fleet's counts, or the
        // attempts failing in a row): asked only for an answer that is
        // not final (the question looks the fleet over).
        let next = match c.class() {
            Class::Success | Class::Rejected => NextAttempt::default(),
            _ => {
                let mut next = self.head.tried().map(Tried::next).unwrap_or_default();
                next.upstream_failing |= self.shared.streak.failing();
                next
            }
        };
        let attempted = Attempted {
            class: &c,
            status: result.as_ref().ok().map(Response::status),
            made: self.history.len(),
            uncounted: self.uncounted,
            replay_safe: self.replay_safe,
            allowed: self.allowed,
            refused,
            replayable: next_body.is_some(),
            remaining,
            max_attempts: self.options.max_attempts,
            next,
            call: ended_facts(&self.history, &self.head, &result),
        };
        let decision = self
            .shared
            .policy
            .decide(attempted, rng(&mut self.rng, &self.shared));
        trace_decision(&self.span, &attempted, decision);
        self.decided_at = now;
        match decision {
            Decision::Stop(end) => {
                // The first attempt began with the call.
                let elapsed = if self.attempt_start == self.start {
                    took
                } else {
                    now.saturating_duration_since(self.start)
                };
                let mut result = result;
                self.finish(elapsed, &mut result, end);
                Next::Done(result)
            }
            Decision::Retry(retry) => {
                if retry.token.is_none() && refused.is_none() {
                    self.shared.streak.free_retry();
                }
                self.uncounted += u32::from(retry.uncounted);
                self.retry(retry, next_body, result)
            }
        }
    }

    /// What the attempt that ended with `result` after `took` says,
    /// recorded where it counts: the throttle, the budget's token, the
    /// metrics, the attempt's span and the call's history. Its
    /// classification, and whether a layer below refused it (a circuit
    /// breaker, a fleet at capacity).
    fn observe<R>(
        &mut self,
        result: &Result<Response<R>, BoxError>,
        took: Duration,
    ) -> (Classification, Option<LocalRefusal>)
    where
        C: Classify<R>,
    {
        let c = self.classify(result);
        let refused = match c.class() {
            Class::NotSent => local_refusal(result),
            _ => None,
        };
        // (A layer's own refusal says nothing of the upstream.) A failure
        // is counted at its instance, the one this call used last.
        if refused.is_none() {
            let instance = match c.class() {
                Class::NotSent | Class::Overloaded | Class::Unknown => {
                    self.head.tried().and_then(Tried::last_used)
                }
                _ => None,
            };
            let at = self.attempt_start + took;
            let free = (self.shared.streak).ended(c.class(), instance, self.attempt_start, at);
            // The upstream fails as a whole: what the streak retried free
            // was an outage's, and costs its tokens after all.
            if let (Some(n), Some(budget)) = (free, &self.shared.budget) {
                budget.charge(n);
            }
        }
        if let Some(throttle) = &self.shared.throttle {
            throttle.answered_as(self.throttle_bin, c.class(), refused.is_some());
        }
        if let (Some(token), Some(budget)) = (self.token.take(), &self.shared.budget) {
            budget.settle(token, c.class());
        }
        // The instance that answered, when the upstream is a fleet.
        let server = self.head.tried().and_then(Tried::take_answered);
        self.shared
            .metrics
            .attempt_ended(&self.head.facts(), server.as_deref(), result, &c, took);
        if !self.attempt.is_disabled() {
            // The attempt's span ends here.
            telemetry::attempt_ended(&self.attempt, result, &c);
            self.attempt = tracing::Span::none();
        }
        let status = result.as_ref().ok().map(Response::status);
        let mut attempt = Attempt::new(c.class(), status, self.waited, took, c.retry_after())
            .with_grpc_code(c.grpc_code())
            .with_replayed(c.replayed())
            .with_maybe_processed(c.maybe_processed())
            .with_server(server);
        if let Some(h) = result
            .as_ref()
            .ok()
            .and_then(|r| r.extensions().get::<Hedged>())
        {
            attempt = attempt.with_copies(h.sent, h.won);
        }
        self.history.push(attempt);
        (c, refused)
    }

    /// A retry decided: its body kept, its token taken (or waited for,
    /// holding `last` to end with if none comes).
    fn retry<R>(
        &mut self,
        retry: Retry,
        next_body: Option<B>,
        last: Result<Response<R>, BoxError>,
    ) -> Next<R> {
        self.next_body = next_body;
        self.waited = retry.wait;
        self.wait_reason = retry.reason;
        if let (Some(wants), Some(budget)) = (retry.token, &self.shared.budget) {
            self.wants = wants;
            match budget.withdraw_for(wants) {
                Some(token) => self.token = Some(token),
                None => {
                    return Next::Throttled {
                        wait: retry.wait,
                        last,
                    }
                }
            }
        }
        let made = self.history.len();
        telemetry::wait_event(&self.span, retry.reason, retry.wait, None, made);
        Next::Retry { wait: retry.wait }
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

    /// Ends the call, `elapsed` after it began, with `result` as the rules
    /// said (`end`): the history written on the response, or the error
    /// made the call's. In place: the response is moved by value through
    /// every layer already, and this saves it two more moves.
    pub(super) fn finish<R>(
        &mut self,
        elapsed: Duration,
        result: &mut Result<Response<R>, BoxError>,
        end: End,
    ) {
        let mut history = std::mem::replace(&mut self.history, Attempts::new());
        history.finish(elapsed, end.stop);
        match (&mut *result, end.ending) {
            (Ok(resp), Ending::Answer) => {
                resp.extensions_mut().insert(history);
            }
            // (The rules make a response an error only as outcome unknown.)
            (Ok(_), _) => {
                let e = Error::retry(ErrorKind::OutcomeUnknown, history, None);
                *result = Err(self.keyed(e, false).into());
            }
            (Err(source), ending) => {
                // (A zero-sized placeholder: no allocation.)
                let source = std::mem::replace(source, Box::new(Taken));
                let (kind, unknown) = match ending {
                    Ending::Answer => (None, false),
                    Ending::Error(kind) => (Some(kind), false),
                    Ending::Unknown { under } => (under, true),
                };
                let e = match kind {
                    Some(kind) => Error::retry(kind, history, Some(source)),
                    None => Error::from_box(source).with_history(history),
                };
                *result = Err(self.keyed(e, unknown).into());
            }
        }
        self.report(result, end.stop);
    }

    /// `e` as the call's error: named after the upstream, and carrying the
    /// key the call was sent under (resend's or the caller's); outcome
    /// unknown over it when the rules say so.
    fn keyed(&self, mut e: Error, unknown: bool) -> Error {
        e.set_upstream_if_none(self.shared.upstream.as_ref());
        match self.head.key() {
            Some(key) if unknown => e.outcome_unknown_over(key),
            Some(key) => e.with_key(key),
            None => e,
        }
    }

    /// The call ends for `stop` with `result`, which no attempt of it made
    /// (its deadline passed, the throttle or the budget turned the next
    /// attempt away, the service failed): as the rules say.
    pub(super) fn stopped<R>(&mut self, result: &mut Result<Response<R>, BoxError>, stop: Stop) {
        let end = ends(stop, &ended_facts(&self.history, &self.head, result));
        let elapsed = Instant::now().saturating_duration_since(self.start);
        self.finish(elapsed, result, end);
    }
}

/// What the end of a call whose last result is `result` is decided from.
fn ended_facts<'a, R>(
    history: &'a Attempts,
    head: &'a Head,
    result: &Result<Response<R>, BoxError>,
) -> Ended<'a> {
    Ended {
        history,
        answered: result.is_ok(),
        deadline: result.as_ref().err().is_some_and(|e| {
            e.downcast_ref::<Error>()
                .is_some_and(Error::is_deadline_exceeded)
        }),
        request: head.facts(),
    }
}

/// The debug event of a decision, on the call's span.
/// (Its fields are worked out only when the event is on.)
#[inline]
fn trace_decision(span: &tracing::Span, attempted: &Attempted<'_>, decision: Decision) {
    tracing::debug!(
        parent: span,
        attempt = attempted.made,
        class = attempted.class.class().as_str(),
        status = attempted.status.map(|s| s.as_u16()),
        wait_ms = match decision {
            Decision::Retry(r) => Some(r.wait.as_millis() as u64),
            Decision::Stop(_) => None,
        },
        stop = match decision {
            Decision::Stop(end) => Some(tracing::field::display(end.stop)),
            Decision::Retry(_) => None,
        },
        time_left_ms = attempted.remaining.map(|d| d.as_millis() as u64),
        "attempt"
    );
}

/// The call's random numbers, drawn from one generator made when first
/// needed.
fn rng<'a, S, C>(
    slot: &'a mut Option<fastrand::Rng>,
    shared: &Shared<S, C>,
) -> &'a mut fastrand::Rng {
    slot.get_or_insert_with(|| match shared.seed {
        // Each call draws its own sequence, reproducibly.
        Some(seed) => {
            let n = shared.calls.fetch_add(1, Ordering::Relaxed);
            fastrand::Rng::with_seed(seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        }
        None => fastrand::Rng::new(),
    })
}

/// The refusal of a layer below (a circuit breaker's, a fleet's at
/// capacity) when `result` is one, anywhere in the error's chain.
fn local_refusal<R>(result: &Result<R, BoxError>) -> Option<LocalRefusal> {
    match refused_below(&**result.as_ref().err()?)? {
        ErrorKind::AtCapacity => Some(LocalRefusal::AtCapacity),
        ErrorKind::QuotaSpent => Some(LocalRefusal::QuotaSpent),
        _ => Some(LocalRefusal::CircuitOpen),
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
