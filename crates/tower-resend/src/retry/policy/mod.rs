//! The rules of the retry layer, each a pure function of what was
//! observed: [`Policy::decide`] after an attempt (the decision table of the
//! [module docs](super)), [`ends`] for how a call that stops ends, and
//! [`gate`] before each attempt goes out. The I/O (timers, the budget, the
//! body, telemetry) stays around them, in the call.

mod end;
mod gate;

use std::time::Duration;

use http::StatusCode;
use tokio::time::Instant;

pub(crate) use self::end::{ends, unknown_under_key, End, Ended, Ending};
pub(crate) use self::gate::{gate, Unsent};
use super::budget::Want;
use super::{Backoff, Stop};
use crate::classify::{Class, Classification, GrpcCode, Pushback};
use crate::deadline::Deadline;
use crate::telemetry::WaitReason;
use crate::vocab::NextAttempt;

/// The limits and waits of a retry layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) overload_floor: Duration,
    pub(crate) max_server_wait: Duration,
    pub(crate) min_attempt: Duration,
    pub(crate) replay_cap: usize,
    /// A server-requested wait (or the overload floor) is spread over
    /// `[wait, wait * (1 + spread)]`.
    pub(crate) wait_spread: f64,
    /// The longest a retry waits for a budget token.
    pub(crate) max_budget_wait: Duration,
}

/// Default attempts in all, first included.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Default least wait after an overloaded answer without `Retry-After`.
pub const DEFAULT_OVERLOAD_FLOOR: Duration = Duration::from_secs(1);
/// Default longest server-requested wait the layer will honour.
pub const DEFAULT_MAX_SERVER_WAIT: Duration = Duration::from_secs(30);
/// Default least time an attempt must have for a retry to be worth it.
pub const DEFAULT_MIN_ATTEMPT: Duration = Duration::from_millis(50);
/// Default spread of a server-requested wait (and of the overload floor):
/// clients told to wait `w` come back over `[w, 1.5 w]`.
pub const DEFAULT_WAIT_SPREAD: f64 = 0.5;
/// Default longest wait for a retry budget token: 5 s.
pub const DEFAULT_MAX_BUDGET_WAIT: Duration = Duration::from_secs(5);

impl Default for Policy {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff: Backoff::DEFAULT,
            overload_floor: DEFAULT_OVERLOAD_FLOOR,
            max_server_wait: DEFAULT_MAX_SERVER_WAIT,
            min_attempt: DEFAULT_MIN_ATTEMPT,
            replay_cap: crate::body::DEFAULT_REPLAY_CAP,
            wait_spread: DEFAULT_WAIT_SPREAD,
            max_budget_wait: DEFAULT_MAX_BUDGET_WAIT,
        }
    }
}

/// What the decision needs to know of one attempt and of its call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attempted<'a> {
    /// What the server may have done.
    pub(crate) class: &'a Classification,
    /// The attempt's HTTP status, when it was answered.
    pub(crate) status: Option<StatusCode>,
    /// The attempt's number: 1 for the first.
    pub(crate) made: u32,
    /// Of the attempts before it, those not counted toward the cap:
    /// refused before they were sent and tried at once at another
    /// instance (see [`Retry::uncounted`]).
    pub(crate) uncounted: u32,
    /// The request may be sent again even if it was processed (an
    /// idempotent method, or an Idempotency-Key).
    pub(crate) replay_safe: bool,
    /// Retries are allowed for this request (it carries no `NoRetry`).
    pub(crate) allowed: bool,
    /// A layer below refused the attempt before sending it.
    pub(crate) refused: Option<LocalRefusal>,
    /// Its body can be sent again.
    pub(crate) replayable: bool,
    /// Time left before the deadline, if the call has one.
    pub(crate) remaining: Option<Duration>,
    /// This request's own attempt cap (`CallOptions`), if it set one.
    pub(crate) max_attempts: Option<u32>,
    /// What the call's fleet, if it has one, says of the next attempt
    /// (whether an instance the call has not used can take it), and
    /// whether the upstream fails as a whole.
    pub(crate) next: NextAttempt,
    /// How the call ends if it stops here (see [`Ended`]).
    pub(crate) call: Ended<'a>,
}

/// Why a layer below the retry layer refused an attempt, sending nothing:
/// what it knows of the upstream says that sending again now would be
/// refused too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LocalRefusal {
    /// A circuit breaker: the upstream (or every instance of it) is unwell.
    CircuitOpen,
    /// A fleet: every instance the call could use is at its limit on
    /// attempts in flight.
    AtCapacity,
    /// A pacing layer: the upstream's stated quota has no room for the
    /// attempt before the call's deadline.
    QuotaSpent,
}

impl LocalRefusal {
    /// Why the call stops.
    const fn stop(self) -> Stop {
        match self {
            Self::CircuitOpen => Stop::CircuitOpen,
            Self::AtCapacity => Stop::AtCapacity,
            Self::QuotaSpent => Stop::QuotaSpent,
        }
    }
}

/// What to do after an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Send it again, after the wait.
    Retry(Retry),
    /// Stop, for this reason, ending as the rules say.
    Stop(End),
}

/// A retry: how long to wait, why, and what budget token it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Retry {
    pub(crate) wait: Duration,
    pub(crate) reason: WaitReason,
    /// The retry budget's token it spends, and how urgently it wants one:
    /// none for a request that was not sent (it costs the upstream nothing,
    /// as gRPC's transparent retries), unless its fleet fails as a whole;
    /// first in line for a keyed call whose attempt may have run (it
    /// retries to learn its outcome).
    pub(crate) token: Option<Want>,
    /// The attempt it follows is not counted toward the cap: it was not
    /// sent, and another instance the call has not used takes the retry
    /// (gRFC A6: transparent retries do not count toward `maxAttempts`).
    pub(crate) uncounted: bool,
}

impl Policy {
    /// The decision table (the [module docs](super)), every row of it: what
    /// to do after `attempt`, and if it stops, how the call ends. Only the
    /// budget's token is left to the caller (it is taken, or waited for,
    /// once a retry is decided, so that a token is spent on real retries
    /// only).
    pub(crate) fn decide(&self, attempt: Attempted<'_>, rng: &mut fastrand::Rng) -> Decision {
        let stop = |why| Decision::Stop(ends(why, &attempt.call));
        let c = attempt.class;
        // 1. Is the answer final, and may this request go out again at all?
        match (c.class(), attempt.refused) {
            (Class::Success | Class::Rejected, _) => return stop(Stop::Final),
            // A layer below refused it: a circuit breaker (the upstream is
            // known to be unwell) or a fleet at capacity (every instance
            // has as much in flight as it serves). Trying again now would
            // be refused too, and waiting here would hold the caller for a
            // refusal it can act on at once (its advice says when).
            (Class::NotSent, Some(why)) => return stop(why.stop()),
            _ if !attempt.allowed => return stop(Stop::Disabled),
            (Class::NotSent | Class::NotProcessed, _) => {}
            (Class::Overloaded | Class::InProgress | Class::Unknown, _) => {
                // The server's stored answer of an earlier attempt under this
                // key: every retry gets it again, and the work it records may
                // be half done (a handler cut by its deadline).
                if c.replayed() {
                    return stop(Stop::Replayed);
                }
                if c.maybe_processed() && !attempt.replay_safe {
                    return stop(Stop::OutcomeUnknown);
                }
            }
        }
        if c.pushback() == Some(Pushback::DoNotRetry) {
            return stop(Stop::ServerSaidNo);
        }
        // The deadline has passed: say so, whatever the attempt count.
        if attempt.remaining == Some(Duration::ZERO) {
            return stop(Stop::Deadline);
        }
        // A request not sent is sent again without a token (gRPC's
        // transparent retries; at once when another instance can take
        // it), while the upstream otherwise answers. When it fails as a
        // whole (an outage, not an instance gone: see `retry::streak`), a
        // refusal is retried as any failure is, after a backoff and with a
        // token: gRPC does not send to a failing connection at all, and an
        // outage must cost the upstream little more than the calls.
        let transparent = c.class() == Class::NotSent && !attempt.next.upstream_failing;
        // With another instance to go to, an answer that speaks for its
        // own instance only has its wait: the next attempt goes elsewhere
        // after the usual backoff, or at once if nothing was sent. A 429
        // (or gRPC's RESOURCE_EXHAUSTED) speaks for the whole service: a
        // rate limit or a quota is the caller's wherever it goes.
        let for_service = attempt.status == Some(StatusCode::TOO_MANY_REQUESTS)
            || c.grpc_code() == Some(GrpcCode::ResourceExhausted);
        let elsewhere = attempt.next.elsewhere && !for_service;
        // 2. Attempts left? The cap counts attempts that went out, as
        // gRPC's `maxAttempts` does not count its transparent retries: a
        // request refused before it was sent, with another instance the
        // call has not used to take it, goes there uncounted. Once none
        // is left, its refusals count with the rest, so that a fleet that
        // refuses everywhere ends the call once each instance refused it.
        // A cap of 1 turns every retry off, these too.
        let max = attempt.max_attempts.map_or(self.max_attempts, |n| n.max(1));
        let uncounted = transparent && elsewhere && max > 1;
        let counted = if c.class() == Class::NotSent {
            attempt.made
        } else {
            attempt.made.saturating_sub(attempt.uncounted)
        };
        if !uncounted && counted >= max {
            return stop(Stop::MaxAttempts);
        }
        // 3. How long to wait: full jitter; after an overloaded answer, the
        // server's wait (or the floor), spread over half as much again and
        // never shorter, plus the jittered backoff, so that clients told the
        // same thing do not come back in step. A server wait on another
        // class (gRPC's pushback on any retryable status) is honoured the
        // same way.
        let server_wait = c.retry_after().filter(|_| !elsewhere);
        if server_wait.is_some_and(|w| w > self.max_server_wait) {
            return stop(Stop::ServerSaidNo);
        }
        let jitter = if transparent && elsewhere {
            Duration::ZERO
        } else {
            self.backoff.wait(counted.saturating_sub(1), rng)
        };
        let (asked, reason) = match (server_wait, c.class()) {
            (Some(w), _) => (Some(w), WaitReason::RetryAfter),
            (None, Class::Overloaded) if !elsewhere => {
                (Some(self.overload_floor), WaitReason::Overloaded)
            }
            (None, _) => (None, WaitReason::Backoff),
        };
        let spread = asked.map_or(Duration::ZERO, |w| w.mul_f64(self.wait_spread * rng.f64()));
        let at_least = asked.unwrap_or_default();
        let mut wait = at_least.saturating_add(spread).saturating_add(jitter);
        // 4. Time left: the wait and a useful attempt must fit; a server
        // wait past the deadline means give up now, not sleep. What the
        // server asked must fit; the spread and the jitter shrink to fit.
        if let Some(left) = attempt.remaining {
            if server_wait.is_some_and(|w| w >= left) || at_least + self.min_attempt > left {
                return stop(Stop::Deadline);
            }
            if wait + self.min_attempt > left {
                if asked.is_none() {
                    return stop(Stop::Deadline);
                }
                wait = left - self.min_attempt;
            }
        }
        // 5. A body to send again?
        if !attempt.replayable {
            return stop(Stop::NotReplayable);
        }
        // 6. Which token: none for what was not sent (while the fleet
        // answers); a keyed call whose attempt may have run (its answer
        // lost, or its key still running) retries to learn its outcome,
        // first in line.
        let token = match c.class() {
            _ if transparent => None,
            Class::Unknown | Class::InProgress if attempt.call.keyed() => Some(Want::Outcome),
            _ => Some(Want::Retry),
        };
        Decision::Retry(Retry {
            wait,
            reason,
            token,
            uncounted,
        })
    }
}

impl Policy {
    /// How long a retry that found no budget token at `now` may wait for
    /// one: as long as the longest budget wait, and a useful attempt still
    /// fits before the `deadline`; `None` when that is no later than its
    /// backoff's end, `not_before` (then it does not wait: out of budget).
    pub(crate) fn token_wait_until(
        &self,
        now: Instant,
        not_before: Instant,
        deadline: Option<Deadline>,
    ) -> Option<Instant> {
        let mut stop_at = now + self.max_budget_wait;
        if let Some(d) = deadline {
            let latest = d.instant().checked_sub(self.min_attempt);
            stop_at = stop_at.min(latest.unwrap_or(now));
        }
        (stop_at > not_before).then_some(stop_at)
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_end;
#[cfg(test)]
mod tests_fleet;
