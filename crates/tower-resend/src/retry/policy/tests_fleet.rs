//! The decision with a fleet below (`Attempted::next`): another instance
//! to go to, and an upstream that fails as a whole.

use super::tests::*;
use super::*;
use crate::vocab::NextAttempt;

#[test]
fn with_another_instance_the_wait_is_the_instances() {
    let p = policy();
    let rng = &mut fastrand::Rng::with_seed(5);
    let elsewhere = |c| Attempted {
        next: NextAttempt {
            elsewhere: true,
            upstream_failing: false,
        },
        ..attempted(c, true, 1, Some(2 * S))
    };
    let wait = |d| match d {
        Decision::Retry(r) => r.wait,
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
        why(p.decide(attempted(&ra, true, 1, Some(2 * S)), rng)),
        Some(Stop::ServerSaidNo)
    );
    // Not sent: at once, and without a token.
    let not_sent = cls(Class::NotSent);
    assert_eq!(
        p.decide(elsewhere(&not_sent), rng),
        Decision::Retry(Retry {
            wait: Duration::ZERO,
            reason: WaitReason::Backoff,
            token: None,
            uncounted: true,
        })
    );
    // A 429, or RESOURCE_EXHAUSTED, speaks for the whole service (a rate
    // limit, a quota): its wait holds wherever the next attempt goes.
    let limited = Attempted {
        status: Some(StatusCode::TOO_MANY_REQUESTS),
        ..elsewhere(&ra)
    };
    assert_eq!(why(p.decide(limited, rng)), Some(Stop::ServerSaidNo));
    let quota = cls(Class::Overloaded)
        .with_pushback(Some(Pushback::After(S)))
        .with_grpc_code(Some(GrpcCode::ResourceExhausted));
    let d = p.decide(elsewhere(&quota), rng);
    assert!(wait_of(d) >= S, "{d:?}");
    // The rest of the table holds: an unsafe request that may have run
    // still stops.
    let unknown = cls(Class::Unknown);
    let unsafe_unknown = Attempted {
        replay_safe: false,
        ..elsewhere(&unknown)
    };
    assert_eq!(
        why(p.decide(unsafe_unknown, rng)),
        Some(Stop::OutcomeUnknown)
    );
}

/// A refusal is retried at once and without a token while the upstream
/// otherwise answers; when it fails as a whole (an outage), as any
/// failure: after a backoff, with a token.
#[test]
fn a_refusal_in_an_outage_takes_a_token() {
    let p = policy();
    let rng = &mut fastrand::Rng::with_seed(5);
    let not_sent = cls(Class::NotSent);
    // Not sent, while every instance of the fleet fails as much (an
    // outage): a retry as any other, after a backoff, with a token.
    let outage = Attempted {
        next: NextAttempt {
            elsewhere: true,
            upstream_failing: true,
        },
        ..attempted(&not_sent, true, 1, Some(2 * S))
    };
    match p.decide(outage, rng) {
        Decision::Retry(r) => {
            assert_eq!(r.token, Some(Want::Retry), "{r:?}");
            assert!(r.wait > Duration::ZERO, "{r:?}");
        }
        other => panic!("{other:?}"),
    }
    // (With no other instance, and the fleet failing: the same.)
    let alone = Attempted {
        next: NextAttempt {
            elsewhere: false,
            upstream_failing: true,
        },
        ..outage
    };
    assert!(matches!(
        p.decide(alone, rng),
        Decision::Retry(Retry {
            token: Some(Want::Retry),
            ..
        })
    ));
}

/// gRFC A6: transparent retries do not count toward `maxAttempts`. A
/// request refused before it was sent, with another instance to take it,
/// goes there whatever the count, and the attempts the call made so do not
/// count toward its cap; a refusal with no instance left, or in an outage,
/// counts every attempt, as does nothing else.
#[test]
fn refusals_with_another_instance_to_go_to_are_not_counted() {
    let p = policy(); // 3 attempts
    let rng = &mut fastrand::Rng::with_seed(9);
    let not_sent = cls(Class::NotSent);
    let c503 = cls(Class::Overloaded).with_maybe_processed(true);
    let at = |c, made, uncounted, elsewhere, upstream_failing| Attempted {
        uncounted,
        next: NextAttempt {
            elsewhere,
            upstream_failing,
        },
        ..attempted(c, true, made, Some(10 * S))
    };
    let uncounted = |d| match d {
        Decision::Retry(r) => Some(r.uncounted),
        Decision::Stop(_) => None,
    };
    // The third attempt (and the fifth) refused, another instance left:
    // retried, uncounted.
    assert_eq!(
        uncounted(p.decide(at(&not_sent, 3, 2, true, false), rng)),
        Some(true)
    );
    assert_eq!(
        uncounted(p.decide(at(&not_sent, 5, 4, true, false), rng)),
        Some(true)
    );
    // A 503 at the fourth attempt after two uncounted: the second that
    // counts, so retried (counted); at the fifth, the third: the call stops.
    assert_eq!(
        uncounted(p.decide(at(&c503, 4, 2, true, false), rng)),
        Some(false)
    );
    assert_eq!(
        why(p.decide(at(&c503, 5, 2, true, false), rng)),
        Some(Stop::MaxAttempts)
    );
    // Refused with no instance left to try: every attempt counts (a fleet
    // that refuses everywhere ends the call once each refused it).
    assert_eq!(
        why(p.decide(at(&not_sent, 3, 2, false, false), rng)),
        Some(Stop::MaxAttempts)
    );
    // In an outage (the upstream fails as a whole) a refusal is no
    // transparent retry: counted, and at the cap the call stops.
    assert_eq!(
        why(p.decide(at(&not_sent, 3, 2, true, true), rng)),
        Some(Stop::MaxAttempts)
    );
    // A cap of 1 turns retries off, these too.
    let once = Attempted {
        max_attempts: Some(1),
        ..at(&not_sent, 1, 0, true, false)
    };
    assert_eq!(why(p.decide(once, rng)), Some(Stop::MaxAttempts));
    // Without a fleet (no instance elsewhere), as before: counted.
    assert_eq!(
        uncounted(p.decide(at(&not_sent, 1, 0, false, false), rng)),
        Some(false)
    );
    assert_eq!(
        why(p.decide(at(&not_sent, 3, 0, false, false), rng)),
        Some(Stop::MaxAttempts)
    );
}
