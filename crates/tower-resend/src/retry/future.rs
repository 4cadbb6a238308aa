use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::{HeaderName, HeaderValue, Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::layer::GRPC_PREVIOUS_RPC_ATTEMPTS;
use super::policy::Decision;
use super::retrying::Retrying;
use super::{Attempt, Hedged, ReplayBody, RetryBudget, Stop, Token};
use crate::classify::{is_replayed, Class, Classification, Classify};
use crate::deadline::context;
use crate::error::{BoxError, Error, ErrorKind, Phase};
use crate::telemetry::{self, WaitReason};

pin_project! {
    /// Response future of [`Retry`](super::Retry).
    pub struct ResponseFuture<F: Future, S, B, C> {
        #[pin]
        state: State<F>,
        // `None`: an outer retry layer is in charge; the call passes through.
        // Boxed: the future moves through every layer on its way out of
        // `call`, and one allocation costs less than moving ~500 bytes each
        // time (measured with the callgrind bench).
        retrying: Option<Box<Retrying<S, B, C>>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F: Future> {
        Calling { #[pin] future: F },
        // Boxed: a wait is the rare path, and an inline `Sleep` would make
        // every call's future larger than its attempt needs.
        Waiting { sleep: Pin<Box<Sleep>> },
        // No budget token: waiting for one (given back by a retry that
        // succeeded, or the floor's refill) until `until`, holding the last
        // attempt's result to return if none comes.
        Throttled { throttle: Box<Throttle<F::Output>> },
        Readying,
        Done,
    }
}

/// A retry waiting for a budget token.
struct Throttle<R> {
    /// The last attempt's answer, to return if no token comes: a response
    /// (in `ok`) or an error.
    ok: Option<R>,
    error: Option<BoxError>,
    /// When the wait gives up: the longest budget wait, or the deadline less
    /// a useful attempt.
    stop_at: Instant,
    /// The earliest the retry may go out (its backoff).
    not_before: Instant,
    returned: Pin<Box<tokio::sync::futures::OwnedNotified>>,
    recheck: Pin<Box<Sleep>>,
}

impl<F: Future, S, B, C> ResponseFuture<F, S, B, C> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            state: State::Calling { future },
            retrying: None,
        }
    }

    pub(crate) fn retrying(future: F, retrying: Box<Retrying<S, B, C>>) -> Self {
        Self {
            state: State::Calling { future },
            retrying: Some(retrying),
        }
    }
}

impl<F, S, B, C, ResB, E> Future for ResponseFuture<F, S, B, C>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    E: Into<BoxError>,
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>, Future = F, Error = E> + Clone,
    C: Classify<ResB>,
    B: Body,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let Some(r) = this.retrying.as_mut() else {
            return match this.state.project() {
                StateProj::Calling { future } => future.poll(cx).map_err(Into::into),
                _ => Poll::Ready(Err("retry future polled after completion".into())),
            };
        };
        // An attempt in flight runs in its own span (a child of the call's,
        // entered around its poll); the call's span is entered for the rest,
        // the waits and the retries (entering a span is a call into the
        // subscriber, and tracing-opentelemetry's is not cheap).
        let span = match &*this.state {
            State::Calling { .. } => None,
            _ => Some(r.span.clone()),
        };
        let _entered = span.as_ref().map(tracing::Span::enter);
        loop {
            match this.state.as_mut().project() {
                StateProj::Calling { future } => {
                    let result = {
                        let _attempt = r.attempt.enter();
                        ready!(future.poll(cx)).map_err(Into::into)
                    };
                    // One clock read for the attempt's end, the time left
                    // and the call's total.
                    let now = Instant::now();
                    let took = now.saturating_duration_since(r.attempt_start);
                    let facts = r.head.facts();
                    let (c, status): (Classification, _) = match &result {
                        Ok(resp) => {
                            let c = r.shared.classifier.classify_response(&facts, resp);
                            // Only a failure's replay changes the decision:
                            // a success pays no header lookup.
                            let replayed = !matches!(c.class(), Class::Success | Class::Rejected)
                                && is_replayed(resp.headers());
                            (c.with_replayed(replayed), Some(resp.status()))
                        }
                        Err(e) => (r.shared.classifier.classify_error(&facts, &**e), None),
                    };
                    r.shared.metrics.attempt_ended(&facts, &result, &c, took);
                    if !r.attempt.is_disabled() {
                        // The attempt's span ends here.
                        telemetry::attempt_ended(&r.attempt, &result, &c);
                        r.attempt = tracing::Span::none();
                    }
                    let made = r.history.len() + 1;
                    let mut attempt =
                        Attempt::new(c.class(), status, r.waited, took, c.retry_after())
                            .with_grpc_code(c.grpc_code())
                            .with_replayed(c.replayed());
                    if let Some(h) = result
                        .as_ref()
                        .ok()
                        .and_then(|r| r.extensions().get::<Hedged>())
                    {
                        attempt = attempt.with_copies(h.sent, h.won);
                    }
                    r.history.push(attempt);
                    let decision = match c.class() {
                        // A final answer (the decision table's first row)
                        // needs neither the time left nor a random draw.
                        Class::Success | Class::Rejected => Decision::Stop(Stop::Final),
                        // A circuit breaker below refused the attempt: the
                        // upstream is known to be unwell, and trying again
                        // now would be refused too. The error says when.
                        Class::NotSent if is_circuit_open(&result) => {
                            Decision::Stop(Stop::CircuitOpen)
                        }
                        _ if !r.allowed => Decision::Stop(Stop::Disabled),
                        _ => {
                            let remaining = r.deadline.map(|d| d.remaining_at(now));
                            let mut policy = r.shared.policy;
                            if let Some(n) = r.options.max_attempts {
                                policy.max_attempts = n.max(1);
                            }
                            let replay_safe = r.replay_safe;
                            policy.decide(&c, replay_safe, made, r.rng(), remaining)
                        }
                    };
                    // A retry that succeeded gives its budget token back:
                    // as the upstream recovers, tokens return as fast as
                    // it answers.
                    if let (Some(token), Some(budget)) = (r.token.take(), &r.shared.budget) {
                        match c.class() {
                            // The upstream answered as a well one does: a
                            // success, a final refusal, or "another attempt
                            // holds this key" (409): not a failed probe.
                            Class::Success | Class::Rejected | Class::InProgress => {
                                budget.give_back();
                            }
                            // A probe of a failing upstream failed.
                            _ if token == Token::Floor => budget.floor_failed(),
                            _ => budget.failed(),
                        }
                    }
                    let decision = match decision {
                        Decision::Retry { wait } => {
                            match r.body.as_ref().map(ReplayBody::try_clone) {
                                Some(Some(body)) => {
                                    r.next_body = Some(body);
                                    Decision::Retry { wait }
                                }
                                _ => Decision::Stop(Stop::NotReplayable),
                            }
                        }
                        stop => stop,
                    };
                    // A request that was not sent costs the upstream
                    // nothing: its retry spends no token (gRPC's
                    // transparent retries); it is still bounded by the
                    // attempts and the backoff.
                    let token = match decision {
                        Decision::Retry { .. } if c.class() != Class::NotSent => {
                            r.shared.budget.as_ref().map(RetryBudget::withdraw)
                        }
                        _ => None,
                    };
                    tracing::debug!(
                        parent: &r.span,
                        attempt = made,
                        class = c.class().as_str(),
                        status = status.map(|s| s.as_u16()),
                        wait_ms = match decision {
                            Decision::Retry { wait } => Some(wait.as_millis() as u64),
                            _ => None,
                        },
                        stop = match decision {
                            Decision::Stop(s) => Some(tracing::field::display(s)),
                            _ => None,
                        },
                        time_left_ms = r.deadline.map(|d| d.remaining_at(now).as_millis() as u64),
                        "attempt"
                    );
                    r.decided_at = now;
                    match (decision, token) {
                        (Decision::Retry { wait }, Some(None)) => {
                            // No token: wait for one (within the deadline
                            // and the longest budget wait), holding the
                            // result to return if none comes.
                            let policy = &r.shared.policy;
                            let mut stop_at = now + policy.max_budget_wait;
                            if let Some(d) = r.deadline {
                                let latest = d.instant().checked_sub(policy.min_attempt);
                                stop_at = stop_at.min(latest.unwrap_or(now));
                            }
                            let not_before = now + wait;
                            let budget = r.shared.budget.clone();
                            let Some(budget) = budget.filter(|_| stop_at > not_before) else {
                                // No time to wait for one: out of budget now.
                                this.state.set(State::Done);
                                let elapsed = now.saturating_duration_since(r.start).max(took);
                                let mut result = result;
                                r.finish(elapsed, &mut result, Stop::Budget);
                                return Poll::Ready(result);
                            };
                            let returned = Box::pin(budget.returned());
                            let recheck = Box::pin(tokio::time::sleep_until(recheck_at(
                                &budget, now, stop_at,
                            )));
                            // (A wait for a token: the retry budget is empty.)
                            r.wait_reason = WaitReason::Budget;
                            telemetry::wait_event(
                                &r.span,
                                WaitReason::Budget,
                                wait,
                                Some(stop_at.saturating_duration_since(now)),
                                made,
                            );
                            let (ok, error) = match result {
                                Ok(resp) => (Some(Ok(resp)), None),
                                Err(e) => (None, Some(e)),
                            };
                            this.state.set(State::Throttled {
                                throttle: Box::new(Throttle {
                                    ok,
                                    error,
                                    stop_at,
                                    not_before,
                                    returned,
                                    recheck,
                                }),
                            });
                        }
                        (Decision::Retry { wait }, token) => {
                            drop(result);
                            r.token = token.flatten();
                            r.waited = wait;
                            r.wait_reason = if c.retry_after().is_some() {
                                WaitReason::RetryAfter
                            } else if c.class() == Class::Overloaded {
                                WaitReason::Overloaded
                            } else {
                                WaitReason::Backoff
                            };
                            telemetry::wait_event(&r.span, r.wait_reason, wait, None, made);
                            this.state.set(State::Waiting {
                                sleep: Box::pin(tokio::time::sleep(wait)),
                            });
                        }
                        (Decision::Stop(stop), _) => {
                            this.state.set(State::Done);
                            // The first attempt began with the call.
                            let elapsed = if r.attempt_start == r.start {
                                took
                            } else {
                                now.saturating_duration_since(r.start)
                            };
                            let mut result = result;
                            r.finish(elapsed, &mut result, stop);
                            return Poll::Ready(result);
                        }
                    }
                }
                StateProj::Throttled { throttle } => {
                    let now = Instant::now();
                    let budget = r.shared.budget.as_ref();
                    if let Some(token) = budget.and_then(RetryBudget::withdraw) {
                        // A token: the retry goes out once its backoff is
                        // over (at once, usually). The tokens of an empty
                        // budget come one at a time, evenly spaced, so the
                        // calls they release come back paced, not in step.
                        r.token = Some(token);
                        let at = throttle.not_before.max(now);
                        r.waited = at.saturating_duration_since(r.decided_at);
                        this.state.set(State::Waiting {
                            sleep: Box::pin(tokio::time::sleep_until(at)),
                        });
                        continue;
                    }
                    if now >= throttle.stop_at {
                        // No token came in time: the last answer, out of
                        // budget.
                        let mut result = match (throttle.ok.take(), throttle.error.take()) {
                            (Some(ok), _) => ok.map_err(Into::into),
                            (None, Some(e)) => Err(e),
                            (None, None) => Err("retry budget wait without an answer".into()),
                        };
                        this.state.set(State::Done);
                        let elapsed = now.saturating_duration_since(r.start);
                        r.finish(elapsed, &mut result, Stop::Budget);
                        return Poll::Ready(result);
                    }
                    let mut woke = false;
                    if throttle.returned.as_mut().poll(cx).is_ready() {
                        if let Some(b) = budget {
                            throttle.returned = Box::pin(b.returned());
                        }
                        woke = true;
                    }
                    if throttle.recheck.as_mut().poll(cx).is_ready() {
                        if let Some(b) = budget {
                            let at = recheck_at(b, now, throttle.stop_at);
                            throttle.recheck.as_mut().reset(at);
                        }
                        woke = true;
                    }
                    if !woke {
                        context::report(Phase::Waiting);
                        return Poll::Pending;
                    }
                }
                StateProj::Waiting { sleep } => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        context::report(Phase::Waiting);
                        return Poll::Pending;
                    }
                    this.state.set(State::Readying);
                }
                StateProj::Readying => {
                    let shared = &r.shared;
                    let service = r.service.get_or_insert_with(|| Box::new(shared.service()));
                    match service.poll_ready(cx) {
                        Poll::Pending => {
                            context::report(Phase::Waiting);
                            return Poll::Pending;
                        }
                        Poll::Ready(Err(e)) => {
                            // Nothing was sent: the service failed before the call.
                            this.state.set(State::Done);
                            let e = Error::from_box(e.into());
                            let elapsed = r.start.elapsed();
                            let mut result = Err(e.into());
                            r.finish(elapsed, &mut result, Stop::Final);
                            return Poll::Ready(result);
                        }
                        Poll::Ready(Ok(())) => {}
                    }
                    let Some(body) = r.next_body.take() else {
                        this.state.set(State::Done);
                        return Poll::Ready(Err("retry without a body to send".into()));
                    };
                    let mut req = r.head.request(body);
                    let previous = r.history.len();
                    announce(&mut req, previous, r.shared.attempt_header.as_ref());
                    r.shared.metrics.waited(r.wait_reason, r.waited);
                    r.attempt = telemetry::attempt_span(&r.span, &r.head.facts(), previous);
                    let _span = r.attempt.enter();
                    r.attempt_start = Instant::now();
                    let _attempt = context::attempt(context::Attempt {
                        limit: r.options.attempt_timeout,
                        read_ahead: r.replay_safe && r.allowed,
                    });
                    let future = match r.service.as_mut() {
                        Some(service) => service.call(req),
                        None => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err("retry without a service to call".into()));
                        }
                    };
                    this.state.set(State::Calling { future });
                }
                StateProj::Done => {
                    return Poll::Ready(Err("retry future polled after completion".into()));
                }
            }
        }
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

/// When a retry waiting for a budget token looks again without being woken:
/// at the floor's next refill, or when its wait ends.
fn recheck_at(budget: &RetryBudget, now: Instant, stop_at: Instant) -> Instant {
    budget
        .next_refill()
        .map_or(stop_at, |d| (now + d).min(stop_at))
}

/// Tells the upstream how many attempts came before this one: on gRPC
/// requests as `grpc-previous-rpc-attempts`, on others under the configured
/// header, if any.
fn announce<B>(req: &mut Request<B>, previous: u32, http: Option<&HeaderName>) {
    let name = if crate::deadline::is_grpc(req) {
        &GRPC_PREVIOUS_RPC_ATTEMPTS
    } else {
        match http {
            Some(name) => name,
            None => return,
        }
    };
    req.headers_mut()
        .insert(name.clone(), HeaderValue::from(previous));
}

impl<F: Future, S, B, C> std::fmt::Debug for ResponseFuture<F, S, B, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ResponseFuture");
        if let Some(r) = &self.retrying {
            d.field("attempts", &r.history.len());
        } else {
            d.field("passthrough", &true);
        }
        d.finish_non_exhaustive()
    }
}
