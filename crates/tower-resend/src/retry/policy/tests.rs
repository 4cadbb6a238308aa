use super::*;
use crate::vocab::{Attempts, NextAttempt};

pub(super) const S: Duration = Duration::from_secs(1);

pub(super) fn policy() -> Policy {
    Policy {
        backoff: Backoff::new(Duration::from_millis(100), 2.0, Duration::from_secs(5)).unwrap(),
        ..Policy::default()
    }
}

/// An attempt of a call that may be retried: allowed, no breaker, a
/// body to send again, the policy's cap.
pub(super) fn attempted(
    c: &Classification,
    safe: bool,
    made: u32,
    left: Option<Duration>,
) -> Attempted<'_> {
    Attempted {
        class: c,
        status: None,
        made,
        uncounted: 0,
        replay_safe: safe,
        allowed: true,
        refused: None,
        replayable: true,
        remaining: left,
        max_attempts: None,
        next: NextAttempt::default(),
        call: unkeyed_answer(),
    }
}

/// A call with no history, ended by a response, not keyed.
pub(super) fn unkeyed_answer() -> Ended<'static> {
    Ended {
        history: Box::leak(Box::new(Attempts::new())),
        answered: true,
        deadline: false,
        request: request(false),
    }
}

/// A POST's facts, with an Idempotency-Key when `keyed`.
pub(super) fn request(keyed: bool) -> crate::classify::RequestFacts<'static> {
    let mut req = http::Request::post("http://up/charges");
    if keyed {
        req = req.header("idempotency-key", "k");
    }
    crate::classify::RequestFacts::of(Box::leak(Box::new(req.body(()).unwrap())))
}

pub(super) fn decide(c: Classification, safe: bool, made: u32, left: Option<Duration>) -> Decision {
    policy().decide(
        attempted(&c, safe, made, left),
        &mut fastrand::Rng::with_seed(1),
    )
}

pub(super) fn cls(class: Class) -> Classification {
    Classification::new(class)
}

pub(super) fn retries(d: Decision) -> bool {
    matches!(d, Decision::Retry(_))
}

/// Why the decision stops, if it does.
pub(super) fn why(d: Decision) -> Option<Stop> {
    match d {
        Decision::Stop(end) => Some(end.stop),
        Decision::Retry(_) => None,
    }
}

/// The wait of a retry.
pub(super) fn wait_of(d: Decision) -> Duration {
    match d {
        Decision::Retry(r) => r.wait,
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_design_decision_table_row_by_row() {
    // Success, Rejected: return it.
    for safe in [true, false] {
        assert_eq!(
            why(decide(cls(Class::Success), safe, 1, None)),
            Some(Stop::Final)
        );
        assert_eq!(
            why(decide(cls(Class::Rejected), safe, 1, None)),
            Some(Stop::Final)
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
        why(decide(c503, false, 1, None)),
        Some(Stop::OutcomeUnknown)
    );
    // InProgress: retry with the same key.
    assert!(retries(decide(cls(Class::InProgress), true, 1, None)));
    // Unknown: retry when replay-safe, else OutcomeUnknown.
    assert!(retries(decide(cls(Class::Unknown), true, 1, None)));
    assert_eq!(
        why(decide(cls(Class::Unknown), false, 1, None)),
        Some(Stop::OutcomeUnknown)
    );
}

#[test]
fn a_replayed_failure_stops_and_a_replayed_success_is_final() {
    // The server's stored answer of an earlier attempt: every retry under
    // the key would get it again, safe or not.
    for class in [Class::Unknown, Class::Overloaded, Class::InProgress] {
        for safe in [true, false] {
            assert_eq!(
                why(decide(cls(class).with_replayed(true), safe, 1, None)),
                Some(Stop::Replayed),
                "{class:?} {safe}"
            );
        }
    }
    assert_eq!(
        why(decide(
            cls(Class::Success).with_replayed(true),
            true,
            1,
            None
        )),
        Some(Stop::Final)
    );
    assert_eq!(
        why(decide(
            cls(Class::Rejected).with_replayed(true),
            true,
            1,
            None
        )),
        Some(Stop::Final)
    );
}

#[test]
fn waits_follow_the_class() {
    let wait = |c, made| match decide(c, true, made, None) {
        Decision::Retry(r) => r.wait,
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
    assert_eq!(why(decide(long, true, 1, None)), Some(Stop::ServerSaidNo));
    // A server wait on another class (gRPC pushback on INTERNAL) is
    // honoured too.
    let pushed = cls(Class::Unknown).with_pushback(Some(Pushback::After(2 * S)));
    let w = wait(pushed, 1);
    assert!(
        w >= 2 * S && w <= 3 * S + Duration::from_millis(100),
        "{w:?}"
    );
    let no = cls(Class::Overloaded).with_pushback(Some(Pushback::DoNotRetry));
    assert_eq!(why(decide(no, true, 1, None)), Some(Stop::ServerSaidNo));
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
                Decision::Retry(r) => r.wait,
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
        Decision::Retry(Retry { wait, .. }) => {
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
        why(decide(cls(Class::Unknown), true, 3, Some(Duration::ZERO))),
        Some(Stop::Deadline)
    );
}

#[test]
fn attempts_and_time_bound_retries() {
    assert!(retries(decide(cls(Class::NotSent), true, 2, None)));
    assert_eq!(
        why(decide(cls(Class::NotSent), true, 3, None)),
        Some(Stop::MaxAttempts)
    );
    // A Retry-After at or past the deadline: stop at once.
    let ra = cls(Class::Overloaded).with_pushback(Some(Pushback::After(60 * S)));
    let p = Policy {
        max_server_wait: 120 * S,
        ..policy()
    };
    assert_eq!(
        why(p.decide(
            attempted(&ra, true, 1, Some(10 * S)),
            &mut fastrand::Rng::with_seed(1)
        )),
        Some(Stop::Deadline)
    );
    // The wait plus a useful attempt must fit.
    assert_eq!(
        why(decide(
            cls(Class::Unknown),
            true,
            1,
            Some(Duration::from_millis(40))
        )),
        Some(Stop::Deadline)
    );
    assert!(retries(decide(
        cls(Class::Unknown),
        true,
        1,
        Some(Duration::from_millis(200))
    )));
}

/// The rows around the class table: a breaker's refusal, a fleet's at
/// capacity, `NoRetry`, the request's own cap, a body that cannot be sent
/// again, and which retries spend a budget token.
#[test]
fn the_rows_around_the_class_table() {
    let p = policy();
    let rng = &mut fastrand::Rng::with_seed(1);
    let unknown = cls(Class::Unknown);
    let not_sent = cls(Class::NotSent);

    // A layer below refused it, not sent: the call stops as it said, with
    // time, attempts and another instance left, not at once elsewhere.
    for (refused, stop) in [
        (LocalRefusal::CircuitOpen, Stop::CircuitOpen),
        (LocalRefusal::AtCapacity, Stop::AtCapacity),
        (LocalRefusal::QuotaSpent, Stop::QuotaSpent),
    ] {
        for safe in [true, false] {
            let below = Attempted {
                refused: Some(refused),
                next: NextAttempt {
                    elsewhere: true,
                    upstream_failing: false,
                },
                ..attempted(&not_sent, safe, 1, Some(10 * S))
            };
            assert_eq!(why(p.decide(below, rng)), Some(stop), "{refused:?}");
        }
        // The second attempt refused: the same; the first attempt's
        // answer is kept in the history the end is decided from.
        let after_a_shed = Attempted {
            refused: Some(refused),
            ..attempted(&not_sent, true, 2, Some(10 * S))
        };
        assert_eq!(why(p.decide(after_a_shed, rng)), Some(stop));
    }
    // A final answer is final whatever else is true.
    let success = cls(Class::Success);
    let final_open = Attempted {
        refused: Some(LocalRefusal::CircuitOpen),
        allowed: false,
        ..attempted(&success, true, 1, None)
    };
    assert_eq!(why(p.decide(final_open, rng)), Some(Stop::Final));

    let off = Attempted {
        allowed: false,
        ..attempted(&unknown, true, 1, None)
    };
    assert_eq!(why(p.decide(off, rng)), Some(Stop::Disabled));

    let own_cap = Attempted {
        max_attempts: Some(5),
        ..attempted(&unknown, true, 3, None)
    };
    assert!(retries(p.decide(own_cap, rng)));
    let own_cap = Attempted {
        max_attempts: Some(0), // counts as 1
        ..attempted(&unknown, true, 1, None)
    };
    assert_eq!(why(p.decide(own_cap, rng)), Some(Stop::MaxAttempts));

    let capped = Attempted {
        replayable: false,
        ..attempted(&unknown, true, 1, None)
    };
    assert_eq!(why(p.decide(capped, rng)), Some(Stop::NotReplayable));
    // Every other stop comes first: the attempts...
    let capped_last = Attempted {
        replayable: false,
        ..attempted(&unknown, true, 3, None)
    };
    assert_eq!(why(p.decide(capped_last, rng)), Some(Stop::MaxAttempts));

    // A request not sent costs the upstream nothing: no token.
    assert!(matches!(
        p.decide(attempted(&not_sent, false, 1, None), rng),
        Decision::Retry(Retry { token: None, .. })
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
                Decision::Retry(Retry {
                    token: Some(Want::Retry),
                    ..
                })
            ),
            "{class:?}"
        );
    }
}

/// Which token a retry asks the budget for, and why it waits.
#[test]
fn tokens_and_wait_reasons() {
    let p = policy();
    let rng = &mut fastrand::Rng::with_seed(9);
    let token = |c: &Classification, keyed: bool| {
        let a = Attempted {
            call: Ended {
                request: request(keyed),
                ..unkeyed_answer()
            },
            ..attempted(c, true, 1, None)
        };
        match p.decide(a, &mut fastrand::Rng::with_seed(9)) {
            Decision::Retry(r) => r.token,
            other => panic!("{other:?}"),
        }
    };
    // A keyed call whose attempt may have run retries to learn its
    // outcome: first in line. Not keyed, or a refusal: any retry.
    for class in [Class::Unknown, Class::InProgress] {
        assert_eq!(token(&cls(class), true), Some(Want::Outcome), "{class:?}");
        assert_eq!(token(&cls(class), false), Some(Want::Retry), "{class:?}");
    }
    for class in [Class::Overloaded, Class::NotProcessed] {
        assert_eq!(token(&cls(class), true), Some(Want::Retry), "{class:?}");
    }
    assert_eq!(token(&cls(Class::NotSent), true), None);

    let mut reason = |c: Classification| match p.decide(attempted(&c, true, 1, None), rng) {
        Decision::Retry(r) => r.reason,
        other => panic!("{other:?}"),
    };
    assert_eq!(reason(cls(Class::Unknown)), WaitReason::Backoff);
    assert_eq!(reason(cls(Class::Overloaded)), WaitReason::Overloaded);
    assert_eq!(
        reason(cls(Class::Overloaded).with_pushback(Some(Pushback::After(S)))),
        WaitReason::RetryAfter
    );
    assert_eq!(
        reason(cls(Class::Unknown).with_pushback(Some(Pushback::After(S)))),
        WaitReason::RetryAfter
    );
}

/// A retry that found no token waits for one as long as the longest budget
/// wait and the deadline (less a useful attempt) allow, and not at all when
/// that ends before its backoff does.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn how_long_a_retry_waits_for_a_token() {
    let p = policy();
    let now = tokio::time::Instant::now();
    let soon = now + Duration::from_millis(100);
    // No deadline: the longest budget wait.
    assert_eq!(
        p.token_wait_until(now, soon, None),
        Some(now + DEFAULT_MAX_BUDGET_WAIT)
    );
    // A deadline in 2 s: until a useful attempt before it.
    let d = crate::deadline::Deadline::at(now + 2 * S);
    assert_eq!(
        p.token_wait_until(now, soon, Some(d)),
        Some(now + 2 * S - DEFAULT_MIN_ATTEMPT)
    );
    // No time past the backoff: no wait at all.
    let close = crate::deadline::Deadline::at(now + Duration::from_millis(120));
    assert_eq!(p.token_wait_until(now, soon, Some(close)), None);
    let passed = crate::deadline::Deadline::at(now);
    assert_eq!(p.token_wait_until(now, now, Some(passed)), None);
}
