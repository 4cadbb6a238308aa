//! The steps of the attempts after the first, for the response future to
//! drive: make the service ready (within the deadline) and send, or wait
//! for a budget token. Only calls that retry get here.

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::announce::announce;
use super::budget::Want;
use super::call::Call;
use super::policy::{gate, Unsent};
use super::{RetryBudget, Token};
use crate::error::{BoxError, Error, Phase};
use crate::telemetry::{self, WaitReason};
use crate::vocab::Stop;

/// A wait for a budget token: the token, or none if none came in time.
/// Boxed, and of one type whatever the service: it holds only the budget.
pub(super) type TokenWait = Pin<Box<dyn Future<Output = Option<Token>> + Send>>;

/// How a call ended: its answer, or its error.
pub(super) type CallResult<R> = Result<Response<R>, BoxError>;

impl<S, B, C> Call<S, B, C> {
    /// Makes the service ready and sends the next attempt; the call's end
    /// if it cannot be sent: the service failed, or `deadline` (armed here
    /// the first time the service is not ready) passed first.
    pub(super) fn poll_send<R>(
        &mut self,
        cx: &mut Context<'_>,
        deadline: &mut Option<Pin<Box<Sleep>>>,
    ) -> Poll<Result<S::Future, CallResult<R>>>
    where
        S: Service<Request<B>, Response = Response<R>> + Clone,
        S::Error: Into<BoxError>,
    {
        // Later attempts go through a clone of the layer's template, made
        // (and made ready) only now.
        let shared = &self.shared;
        let service = self
            .service
            .get_or_insert_with(|| Box::new(shared.service()));
        match service.poll_ready(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(self.send()),
            Poll::Ready(Err(e)) => {
                // Nothing was sent: the service failed before the call.
                let mut result = Err(Error::from_box(e.into()).into());
                self.stopped(&mut result, Stop::Final);
                Poll::Ready(Err(result))
            }
            Poll::Pending => {
                let Some(at) = self.deadline else {
                    return Poll::Pending;
                };
                let sleep = deadline
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.instant())));
                ready!(sleep.as_mut().poll(cx));
                // The deadline passed while the service was not ready.
                Poll::Ready(Err(self.out_of_time(Phase::Waiting)))
            }
        }
    }

    /// The call ends, its deadline passed before the next attempt went
    /// out (`phase`: before the first, or while waiting to send a later
    /// one); nothing more is sent.
    pub(super) fn out_of_time<R>(&mut self, phase: Phase) -> CallResult<R> {
        let elapsed = self.start.elapsed();
        let mut result = Err(Error::deadline_exceeded(phase, elapsed).into());
        self.stopped(&mut result, Stop::Deadline);
        result
    }

    /// The call ends, its next attempt not sent (`why`).
    pub(super) fn unsent<R>(&mut self, why: Unsent) -> CallResult<R> {
        match why {
            Unsent::Deadline => self.out_of_time(Phase::Start),
            Unsent::Throttled => {
                let mut result = Err(Error::throttled().into());
                self.stopped(&mut result, Stop::Throttled);
                result
            }
        }
    }

    /// Sends the next attempt through the service, now ready.
    fn send<R>(&mut self) -> Result<S::Future, CallResult<R>>
    where
        S: Service<Request<B>>,
    {
        let now = Instant::now();
        match gate(now, self.deadline, self.shared.throttle.as_ref()) {
            Ok(bin) => self.throttle_bin = bin,
            Err(Unsent::Deadline) => return Err(self.out_of_time(Phase::Waiting)),
            Err(why) => return Err(self.unsent(why)),
        }
        let (Some(body), Some(service)) = (self.next_body.take(), self.service.as_mut()) else {
            return Err(Err("retry without a body or a service".into()));
        };
        let mut req = self.head.request(body);
        let previous = self.history.len();
        announce(&mut req, previous, self.shared.attempt_header.as_ref());
        self.shared.metrics.waited(self.wait_reason, self.waited);
        let fleet = self.shared.fleet;
        self.attempt = telemetry::attempt_span(&self.span, &self.head.facts(), previous, fleet);
        self.attempt_start = now;
        let _span = self.attempt.enter();
        Ok(service.call(req))
    }

    /// The wait for a budget token for the next attempt, which goes out
    /// once its backoff `wait` is over; none when there is no time to wait
    /// for one (within the longest budget wait and the deadline).
    pub(super) fn token_wait(&mut self, wait: Duration) -> Option<(TokenWait, Instant)> {
        let wants = self.wants;
        let now = Instant::now();
        let not_before = now + wait;
        let stop_at = self
            .shared
            .policy
            .token_wait_until(now, not_before, self.deadline)?;
        let budget = self.budget()?.clone();
        // (A wait for a token: the retry budget is empty.)
        self.wait_reason = WaitReason::Budget;
        let made = self.history.len();
        let span_wait = Some(stop_at.saturating_duration_since(now));
        telemetry::wait_event(&self.span, WaitReason::Budget, wait, span_wait, made);
        Some((Box::pin(withdraw(budget, wants, stop_at)), not_before))
    }

    /// The call ends out of budget with `last`, its last attempt's answer.
    pub(super) fn out_of_budget<R>(&mut self, last: &mut Result<Response<R>, BoxError>) {
        self.stopped(last, Stop::Budget);
    }

    /// A token came: the retry holds it, and goes out at `not_before` (at
    /// once, usually). The tokens of an empty budget come one at a time,
    /// evenly spaced, so the calls they release come back paced, not in
    /// step.
    pub(super) fn took_token(&mut self, token: Token, not_before: Instant) -> Instant {
        self.token = Some(token);
        let at = not_before.max(Instant::now());
        self.waited = at.saturating_duration_since(self.decided_at);
        at
    }
}

/// A token from `budget` for a retry that `wants` it, waiting for one
/// given back (or left to it, or for the floor's next refill) until
/// `stop_at`.
async fn withdraw(budget: RetryBudget, wants: Want, stop_at: Instant) -> Option<Token> {
    // An outcome retry is first in line while it waits.
    let _waiting = (wants == Want::Outcome).then(|| budget.outcome_waits());
    loop {
        if let Some(token) = budget.withdraw_for(wants) {
            return Some(token);
        }
        let now = Instant::now();
        if now >= stop_at {
            return None;
        }
        // Woken by a token given back or left to it, or at the floor's
        // next refill.
        let recheck = budget
            .next_refill()
            .map_or(stop_at, |d| (now + d).min(stop_at));
        let mut returned = pin!(budget.returned());
        let mut left = pin!(budget.left_for_outcome());
        let mut recheck = pin!(tokio::time::sleep_until(recheck));
        poll_fn(|cx| {
            if returned.as_mut().poll(cx).is_ready()
                || (wants == Want::Outcome && left.as_mut().poll(cx).is_ready())
                || recheck.as_mut().poll(cx).is_ready()
            {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }
}
