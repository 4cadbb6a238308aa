use std::time::Duration;

use super::{Backoff, Stop};
use crate::classify::Pushback;
use crate::classify::{Class, Classification};

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
    /// The attempt's number: 1 for the first.
    pub(crate) made: u32,
    /// The request may be sent again even if it was processed (an
    /// idempotent method, or an Idempotency-Key).
    pub(crate) replay_safe: bool,
    /// Retries are allowed for this request (it carries no `NoRetry`).
    pub(crate) allowed: bool,
    /// A circuit breaker below refused the attempt.
    pub(crate) circuit_open: bool,
    /// Its body can be sent again.
    pub(crate) replayable: bool,
    /// Time left before the deadline, if the call has one.
    pub(crate) remaining: Option<Duration>,
    /// This request's own attempt cap (`CallOptions`), if it set one.
    pub(crate) max_attempts: Option<u32>,
    /// Another instance of the upstream (a fleet's) can take the next
    /// attempt, and the answer spoke for its own instance only: its wait
    /// (a `Retry-After`, the overload floor) is that instance's, and a
    /// failure not sent moves on at once.
    pub(crate) elsewhere: bool,
}

/// What to do after an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Send it again after `wait`; `token`: the retry spends a token of the
    /// retry budget (a request that was not sent costs the upstream
    /// nothing, and spends none, as gRPC's transparent retries).
    Retry { wait: Duration, token: bool },
    /// Stop, for this reason.
    Stop(Stop),
}

impl Policy {
    /// The decision table (the [module docs](super)), every row of it: what
    /// to do after `attempt`. Only the budget's token is left to the caller
    /// (it is taken, or waited for, once a retry is decided, so that a
    /// token is spent on real retries only).
    pub(crate) fn decide(&self, attempt: Attempted<'_>, rng: &mut fastrand::Rng) -> Decision {
        let c = attempt.class;
        // 1. Is the answer final, and may this request go out again at all?
        match c.class() {
            Class::Success | Class::Rejected => return Decision::Stop(Stop::Final),
            // A circuit breaker below refused it: the upstream is known to
            // be unwell, and trying again now would be refused too.
            Class::NotSent if attempt.circuit_open => return Decision::Stop(Stop::CircuitOpen),
            _ if !attempt.allowed => return Decision::Stop(Stop::Disabled),
            Class::NotSent | Class::NotProcessed => {}
            Class::Overloaded | Class::InProgress | Class::Unknown => {
                // The server's stored answer of an earlier attempt under this
                // key: every retry gets it again, and the work it records may
                // be half done (a handler cut by its deadline).
                if c.replayed() {
                    return Decision::Stop(Stop::Replayed);
                }
                if c.maybe_processed() && !attempt.replay_safe {
                    return Decision::Stop(Stop::OutcomeUnknown);
                }
            }
        }
        if c.pushback() == Some(Pushback::DoNotRetry) {
            return Decision::Stop(Stop::ServerSaidNo);
        }
        // The deadline has passed: say so, whatever the attempt count.
        if attempt.remaining == Some(Duration::ZERO) {
            return Decision::Stop(Stop::Deadline);
        }
        // 2. Attempts left?
        let max = attempt.max_attempts.map_or(self.max_attempts, |n| n.max(1));
        if attempt.made >= max {
            return Decision::Stop(Stop::MaxAttempts);
        }
        // 3. How long to wait: full jitter; after an overloaded answer, the
        // server's wait (or the floor), spread over half as much again and
        // never shorter, plus the jittered backoff, so that clients told the
        // same thing do not come back in step. A server wait on another
        // class (gRPC's pushback on any retryable status) is honoured the
        // same way.
        // With another instance to go to, the server's wait is its
        // instance's: the next attempt goes elsewhere after the usual
        // backoff, or at once if nothing was sent.
        let server_wait = c.retry_after().filter(|_| !attempt.elsewhere);
        if server_wait.is_some_and(|w| w > self.max_server_wait) {
            return Decision::Stop(Stop::ServerSaidNo);
        }
        let jitter = match c.class() {
            Class::NotSent if attempt.elsewhere => Duration::ZERO,
            _ => self.backoff.wait(attempt.made.saturating_sub(1), rng),
        };
        let asked = match c.class() {
            Class::Overloaded if !attempt.elsewhere => server_wait.or(Some(self.overload_floor)),
            _ => server_wait,
        };
        let spread = asked.map_or(Duration::ZERO, |w| w.mul_f64(self.wait_spread * rng.f64()));
        let at_least = asked.unwrap_or_default();
        let mut wait = at_least.saturating_add(spread).saturating_add(jitter);
        // 4. Time left: the wait and a useful attempt must fit; a server
        // wait past the deadline means give up now, not sleep. What the
        // server asked must fit; the spread and the jitter shrink to fit.
        if let Some(left) = attempt.remaining {
            if server_wait.is_some_and(|w| w >= left) || at_least + self.min_attempt > left {
                return Decision::Stop(Stop::Deadline);
            }
            if wait + self.min_attempt > left {
                if asked.is_none() {
                    return Decision::Stop(Stop::Deadline);
                }
                wait = left - self.min_attempt;
            }
        }
        // 5. A body to send again?
        if !attempt.replayable {
            return Decision::Stop(Stop::NotReplayable);
        }
        Decision::Retry {
            wait,
            token: c.class() != Class::NotSent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn policy() -> Policy {
        Policy {
            backoff: Backoff::new(Duration::from_millis(100), 2.0, Duration::from_secs(5)).unwrap(),
            ..Policy::default()
        }
    }

    /// An attempt of a call that may be retried: allowed, no breaker, a
    /// body to send again, the policy's cap.
    fn attempted(
        c: &Classification,
        safe: bool,
        made: u32,
        left: Option<Duration>,
    ) -> Attempted<'_> {
        Attempted {
            class: c,
            made,
            replay_safe: safe,
            allowed: true,
            circuit_open: false,
            replayable: true,
            remaining: left,
            max_attempts: None,
            elsewhere: false,
        }
    }

    fn decide(c: Classification, safe: bool, made: u32, left: Option<Duration>) -> Decision {
        policy().decide(
            attempted(&c, safe, made, left),
            &mut fastrand::Rng::with_seed(1),
        )
    }

    fn cls(class: Class) -> Classification {
        Classification::new(class)
    }

    fn retries(d: Decision) -> bool {
        matches!(d, Decision::Retry { .. })
    }

    #[test]
    fn the_design_decision_table_row_by_row() {
        // Success, Rejected: return it.
        for safe in [true, false] {
            assert_eq!(
                decide(cls(Class::Success), safe, 1, None),
                Decision::Stop(Stop::Final)
            );
            assert_eq!(
                decide(cls(Class::Rejected), safe, 1, None),
                Decision::Stop(Stop::Final)
            );
        }
        // NotSent, NotProcessed: retry after backoff, safe or not.
        for safe in [true, false] {
            assert!(retries(decide(cls(Class::NotSent), safe, 1, None)));
            assert!(retries(decide(cls(Class::NotProcessed), safe, 1, None)));
        }
        // Overloaded: 429 (not processed) retried either way; 503 (maybe
        // processed) only when replay-safe, else OutcomeUnknown.
        let c429 = cls(Class::Overloaded);
        let c503 = cls(Class::Overloaded).with_maybe_processed(true);
        assert!(retries(decide(c429, true, 1, None)));
        assert!(retries(decide(c429, false, 1, None)));
        assert!(retries(decide(c503, true, 1, None)));
        assert_eq!(
            decide(c503, false, 1, None),
            Decision::Stop(Stop::OutcomeUnknown)
        );
        // InProgress: retry with the same key.
        assert!(retries(decide(cls(Class::InProgress), true, 1, None)));
        // Unknown: retry when replay-safe, else OutcomeUnknown.
        assert!(retries(decide(cls(Class::Unknown), true, 1, None)));
        assert_eq!(
            decide(cls(Class::Unknown), false, 1, None),
            Decision::Stop(Stop::OutcomeUnknown)
        );
    }

    #[test]
    fn a_replayed_failure_stops_and_a_replayed_success_is_final() {
        // The server's stored answer of an earlier attempt: every retry under
        // the key would get it again, safe or not.
        for class in [Class::Unknown, Class::Overloaded, Class::InProgress] {
            for safe in [true, false] {
                assert_eq!(
                    decide(cls(class).with_replayed(true), safe, 1, None),
                    Decision::Stop(Stop::Replayed),
                    "{class:?} {safe}"
                );
            }
        }
        assert_eq!(
            decide(cls(Class::Success).with_replayed(true), true, 1, None),
            Decision::Stop(Stop::Final)
        );
        assert_eq!(
            decide(cls(Class::Rejected).with_replayed(true), true, 1, None),
            Decision::Stop(Stop::Final)
        );
    }

    #[test]
    fn waits_follow_the_class() {
        let wait = |c, made| match decide(c, true, made, None) {
            Decision::Retry { wait, .. } => wait,
            other => panic!("{other:?}"),
        };
        // Full jitter under the ceiling.
        assert!(wait(cls(Class::Unknown), 1) <= Duration::from_millis(100));
        assert!(wait(cls(Class::Unknown), 2) <= Duration::from_millis(200));
        // Overloaded without Retry-After: at least the floor, spread over
        // half as much again, plus the backoff's jitter.
        let w = wait(cls(Class::Overloaded), 1);
        assert!(
            w >= S && w <= S * 3 / 2 + Duration::from_millis(100),
            "{w:?}"
        );
        // With Retry-After: at least what the server asked.
        let ra = cls(Class::Overloaded).with_pushback(Some(Pushback::After(3 * S)));
        let w = wait(ra, 1);
        assert!(
            w >= 3 * S && w <= 3 * S * 3 / 2 + Duration::from_millis(100),
            "{w:?}"
        );
        // A server asking for more than we honour: stop.
        let long = cls(Class::Overloaded).with_pushback(Some(Pushback::After(120 * S)));
        assert_eq!(
            decide(long, true, 1, None),
            Decision::Stop(Stop::ServerSaidNo)
        );
        // A server wait on another class (gRPC pushback on INTERNAL) is
        // honoured too.
        let pushed = cls(Class::Unknown).with_pushback(Some(Pushback::After(2 * S)));
        let w = wait(pushed, 1);
        assert!(
            w >= 2 * S && w <= 3 * S + Duration::from_millis(100),
            "{w:?}"
        );
        let no = cls(Class::Overloaded).with_pushback(Some(Pushback::DoNotRetry));
        assert_eq!(
            decide(no, true, 1, None),
            Decision::Stop(Stop::ServerSaidNo)
        );
    }

    /// Clients told the same wait come back spread over half as much
    /// again: never earlier than asked, and not in step.
    #[test]
    fn server_waits_are_spread_never_shortened() {
        let p = policy();
        let ra = cls(Class::Overloaded).with_pushback(Some(Pushback::After(S)));
        let mut rng = fastrand::Rng::with_seed(3);
        let waits: Vec<Duration> = (0..1000)
            .map(
                |_| match p.decide(attempted(&ra, true, 1, None), &mut rng) {
                    Decision::Retry { wait, .. } => wait,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        assert!(waits.iter().all(|w| *w >= S));
        // 50 ms windows over [1 s, 1.6 s]: the busiest holds at most twice
        // its share.
        let mut windows = [0usize; 12];
        for w in &waits {
            windows[((w.as_millis() - 1000) / 50).min(11) as usize] += 1;
        }
        let busiest = *windows.iter().max().unwrap();
        assert!(busiest <= 2 * 1000 / 11, "{windows:?}");
        // Under a deadline, what was asked must fit; the spread shrinks.
        match p.decide(
            attempted(&ra, true, 1, Some(S + Duration::from_millis(100))),
            &mut rng,
        ) {
            Decision::Retry { wait, .. } => {
                assert!(
                    wait >= S && wait <= S + Duration::from_millis(50),
                    "{wait:?}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_spent_deadline_is_blamed_before_the_attempt_cap() {
        assert_eq!(
            decide(cls(Class::Unknown), true, 3, Some(Duration::ZERO)),
            Decision::Stop(Stop::Deadline)
        );
    }

    #[test]
    fn attempts_and_time_bound_retries() {
        assert!(retries(decide(cls(Class::NotSent), true, 2, None)));
        assert_eq!(
            decide(cls(Class::NotSent), true, 3, None),
            Decision::Stop(Stop::MaxAttempts)
        );
        // A Retry-After at or past the deadline: stop at once.
        let ra = cls(Class::Overloaded).with_pushback(Some(Pushback::After(60 * S)));
        let p = Policy {
            max_server_wait: 120 * S,
            ..policy()
        };
        assert_eq!(
            p.decide(
                attempted(&ra, true, 1, Some(10 * S)),
                &mut fastrand::Rng::with_seed(1)
            ),
            Decision::Stop(Stop::Deadline)
        );
        // The wait plus a useful attempt must fit.
        assert_eq!(
            decide(
                cls(Class::Unknown),
                true,
                1,
                Some(Duration::from_millis(40))
            ),
            Decision::Stop(Stop::Deadline)
        );
        assert!(retries(decide(
            cls(Class::Unknown),
            true,
            1,
            Some(Duration::from_millis(200))
        )));
    }

    /// The rows around the class table: a breaker's refusal, `NoRetry`, the
    /// request's own cap, a body that cannot be sent again, and which
    /// retries spend a budget token.
    #[test]
    fn the_rows_around_the_class_table() {
        let p = policy();
        let rng = &mut fastrand::Rng::with_seed(1);
        let unknown = cls(Class::Unknown);
        let not_sent = cls(Class::NotSent);

        let open = Attempted {
            circuit_open: true,
            ..attempted(&not_sent, true, 1, None)
        };
        assert_eq!(p.decide(open, rng), Decision::Stop(Stop::CircuitOpen));
        // A final answer is final whatever else is true.
        let success = cls(Class::Success);
        let final_open = Attempted {
            circuit_open: true,
            allowed: false,
            ..attempted(&success, true, 1, None)
        };
        assert_eq!(p.decide(final_open, rng), Decision::Stop(Stop::Final));

        let off = Attempted {
            allowed: false,
            ..attempted(&unknown, true, 1, None)
        };
        assert_eq!(p.decide(off, rng), Decision::Stop(Stop::Disabled));

        let own_cap = Attempted {
            max_attempts: Some(5),
            ..attempted(&unknown, true, 3, None)
        };
        assert!(retries(p.decide(own_cap, rng)));
        let own_cap = Attempted {
            max_attempts: Some(0), // counts as 1
            ..attempted(&unknown, true, 1, None)
        };
        assert_eq!(p.decide(own_cap, rng), Decision::Stop(Stop::MaxAttempts));

        let capped = Attempted {
            replayable: false,
            ..attempted(&unknown, true, 1, None)
        };
        assert_eq!(p.decide(capped, rng), Decision::Stop(Stop::NotReplayable));
        // Every other stop comes first: the attempts...
        let capped_last = Attempted {
            replayable: false,
            ..attempted(&unknown, true, 3, None)
        };
        assert_eq!(
            p.decide(capped_last, rng),
            Decision::Stop(Stop::MaxAttempts)
        );

        // A request not sent costs the upstream nothing: no token.
        assert!(matches!(
            p.decide(attempted(&not_sent, false, 1, None), rng),
            Decision::Retry { token: false, .. }
        ));
        for class in [
            Class::NotProcessed,
            Class::Overloaded,
            Class::InProgress,
            Class::Unknown,
        ] {
            let c = cls(class);
            assert!(
                matches!(
                    p.decide(attempted(&c, true, 1, None), rng),
                    Decision::Retry { token: true, .. }
                ),
                "{class:?}"
            );
        }
    }

    #[test]
    fn with_another_instance_the_wait_is_the_instances() {
        let p = policy();
        let rng = &mut fastrand::Rng::with_seed(5);
        let elsewhere = |c| Attempted {
            elsewhere: true,
            ..attempted(c, true, 1, Some(2 * S))
        };
        let wait = |d| match d {
            Decision::Retry { wait, .. } => wait,
            other => panic!("{other:?}"),
        };
        // An overloaded answer: no floor, no Retry-After, the usual backoff.
        let c503 = cls(Class::Overloaded).with_maybe_processed(true);
        assert!(wait(p.decide(elsewhere(&c503), rng)) <= Duration::from_millis(100));
        let ra = cls(Class::Overloaded).with_pushback(Some(Pushback::After(60 * S)));
        assert!(wait(p.decide(elsewhere(&ra), rng)) <= Duration::from_millis(100));
        // (The same answers from the only instance: the floor, and a wait
        // past what is honoured stops the call.)
        assert!(wait(p.decide(attempted(&c503, true, 1, Some(2 * S)), rng)) >= S);
        assert_eq!(
            p.decide(attempted(&ra, true, 1, Some(2 * S)), rng),
            Decision::Stop(Stop::ServerSaidNo)
        );
        // Not sent: at once, and without a token.
        let not_sent = cls(Class::NotSent);
        assert_eq!(
            p.decide(elsewhere(&not_sent), rng),
            Decision::Retry {
                wait: Duration::ZERO,
                token: false
            }
        );
        // The rest of the table holds: an unsafe request that may have run
        // still stops.
        let unknown = cls(Class::Unknown);
        let unsafe_unknown = Attempted {
            replay_safe: false,
            ..elsewhere(&unknown)
        };
        assert_eq!(
            p.decide(unsafe_unknown, rng),
            Decision::Stop(Stop::OutcomeUnknown)
        );
    }
}
