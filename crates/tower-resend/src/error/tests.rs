use super::*;
use std::fmt;

#[test]
fn boxed_resend_error_comes_back_as_it_was() {
    let e = Error::attempt_timeout(Duration::from_millis(400));
    let back = Error::from_box(Box::new(e));
    assert_eq!(back.kind(), ErrorKind::AttemptTimeout);
    assert_eq!(back.limit(), Some(Duration::from_millis(400)));
}

#[test]
fn not_sent_is_found_down_the_source_chain() {
    #[derive(Debug)]
    struct Wrapper(Error);
    impl fmt::Display for Wrapper {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("client error")
        }
    }
    impl std::error::Error for Wrapper {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    let e = Error::from_box(Box::new(Wrapper(Error::connect(Box::new(refused)))));
    assert_eq!(e.kind(), ErrorKind::Transport);
    assert!(e.is_not_sent());
    // The original error is kept as the source.
    assert!(std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<Wrapper>())
        .is_some());

    let e = Error::from_box(Box::new(Wrapper(Error::connect_timeout(
        Duration::from_secs(2),
    ))));
    assert_eq!(e.kind(), ErrorKind::ConnectTimeout);
    assert!(e.is_not_sent());
}

#[test]
fn foreign_errors_are_transport_and_maybe_sent() {
    let e = Error::from_box("boom".into());
    assert_eq!(e.kind(), ErrorKind::Transport);
    assert!(!e.is_not_sent());
    assert_eq!(e.to_string(), "transport error: boom");
}

#[test]
fn messages_say_what_fired() {
    let mut e = Error::deadline_exceeded(Phase::Waiting, Duration::from_secs(1));
    e.set_upstream_if_none(Some(&crate::name::Name::from("shipping")));
    assert_eq!(
        e.to_string(),
        "shipping: deadline exceeded while waiting to retry after 1 s"
    );
    assert_eq!(
        Error::attempt_timeout(Duration::from_millis(400)).to_string(),
        "attempt timed out after 400 ms"
    );
}

#[test]
fn nothing_processed_when_not_sent_or_no_attempt_was_acted_on() {
    use crate::vocab::{Attempt, Stop};
    use http::StatusCode;

    fn history(attempts: &[(Class, u16)]) -> Attempts {
        let mut a = Attempts::new();
        for &(class, status) in attempts {
            let status = StatusCode::from_u16(status).unwrap();
            a.push(Attempt::new(
                class,
                Some(status),
                Duration::ZERO,
                Duration::ZERO,
                None,
            ));
        }
        a.finish(Duration::from_secs(1), Stop::MaxAttempts);
        a
    }

    // Not sent: from the connector, the connect timeout, a deadline
    // that had passed before the start.
    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    assert!(Error::connect(Box::new(refused)).nothing_processed());
    assert!(Error::connect_timeout(Duration::from_secs(2)).nothing_processed());
    assert!(Error::deadline_exceeded(Phase::Start, Duration::ZERO).nothing_processed());

    // The upstream may have acted.
    assert!(!Error::deadline_exceeded(Phase::Attempt, Duration::from_secs(1)).nothing_processed());
    assert!(!Error::attempt_timeout(Duration::from_secs(1)).nothing_processed());
    assert!(!Error::from_box("reset".into()).nothing_processed());

    // Every attempt refused with 429 or 408, then the cap: nothing done.
    let h = history(&[(Class::Overloaded, 429), (Class::NotProcessed, 408)]);
    let e = Error::retry(ErrorKind::RetriesExhausted, h, Some("last".into()));
    assert!(!e.is_not_sent());
    assert!(e.nothing_processed());

    // One attempt got a 503 or a 500: unknown.
    for (class, status) in [(Class::Overloaded, 503), (Class::Unknown, 500)] {
        let h = history(&[(Class::Overloaded, 429), (class, status)]);
        let e = Error::retry(ErrorKind::RetriesExhausted, h, Some("last".into()));
        assert!(!e.nothing_processed(), "{status}");
    }
    let h = history(&[(Class::Unknown, 500)]);
    assert!(!Error::retry(ErrorKind::OutcomeUnknown, h, None).nothing_processed());
}

#[test]
fn a_circuit_open_call_is_not_sent_unless_an_earlier_attempt_was() {
    use crate::vocab::{Attempt, Stop};
    use crate::vocab::{Refusal, Why};

    let open = || {
        Error::circuit_open(
            Refusal::Open {
                left: Duration::from_secs(2),
                why: Why::Probe,
            },
            None,
        )
    };
    let history = |classes: &[Class]| {
        let mut a = Attempts::new();
        for &class in classes {
            a.push(Attempt::new(
                class,
                None,
                Duration::ZERO,
                Duration::ZERO,
                None,
            ));
        }
        a.finish(Duration::from_secs(1), Stop::Final);
        a
    };
    let e = open().with_history(history(&[Class::NotSent]));
    assert!(e.is_not_sent());
    assert_eq!(e.retry_advice(), RetryAdvice::After(Duration::from_secs(2)));
    // The first attempt timed out in flight: the call may have reached it.
    let e = open().with_history(history(&[Class::Unknown, Class::NotSent]));
    assert_eq!(e.kind(), ErrorKind::CircuitOpen);
    assert!(!e.is_not_sent());
    assert!(!e.nothing_processed());
    assert_eq!(e.retry_advice(), RetryAdvice::After(Duration::from_secs(2)));
    assert_eq!(
        e.to_string(),
        "circuit open for another 2 s after a probe failed (2 attempts)"
    );
}

#[test]
fn error_is_one_pointer_wide() {
    assert_eq!(std::mem::size_of::<Error>(), std::mem::size_of::<usize>());
}

/// Every kind, in the situations that change its advice: the sentence
/// advises exactly what [`Error::retry_advice`] does, never more, never
/// else.
#[test]
fn every_kind_says_what_its_advice_says() {
    use crate::vocab::{Attempt, Refusal, Stop, Why};
    use http::StatusCode;

    let key = http::HeaderValue::from_static("charge-42");
    let attempt = |class, status: Option<u16>, maybe: bool| {
        Attempt::new(
            class,
            status.map(|s| StatusCode::from_u16(s).unwrap()),
            Duration::ZERO,
            Duration::from_millis(5),
            None,
        )
        .with_maybe_processed(maybe)
    };
    let history = |attempts: &[Attempt]| {
        let mut h = Attempts::new();
        for a in attempts {
            h.push(a.clone());
        }
        h.finish(Duration::from_millis(30), Stop::MaxAttempts);
        h
    };
    let timed_out = attempt(Class::Unknown, None, true);
    let shed = attempt(Class::Overloaded, Some(503), false);
    let rejected = attempt(Class::Rejected, Some(400), false);
    let replayed = attempt(Class::Unknown, Some(504), true).with_replayed(true);
    let refused = attempt(Class::NotSent, None, false);

    // Each kind, by an exhaustive match, so that a new kind needs its rows.
    let situations = |kind: ErrorKind| -> Vec<Error> {
        let with = |h: &[Attempt]| Error::retry(kind, history(h), Some("cause".into()));
        match kind {
            ErrorKind::DeadlineExceeded => vec![
                Error::deadline_exceeded(Phase::Start, Duration::ZERO),
                Error::deadline_exceeded(Phase::Attempt, Duration::from_secs(1)),
                with(std::slice::from_ref(&timed_out)).with_key(key.clone()),
            ],
            ErrorKind::AttemptTimeout => vec![Error::attempt_timeout(Duration::from_millis(400))],
            ErrorKind::ConnectTimeout => vec![Error::connect_timeout(Duration::from_secs(2))],
            ErrorKind::Transport => vec![
                Error::transport("reset".into()),
                Error::connect("refused".into()),
                Error::from_box("x".into()).with_history(history(std::slice::from_ref(&rejected))),
            ],
            ErrorKind::OutcomeUnknown => vec![
                with(std::slice::from_ref(&timed_out)),
                with(std::slice::from_ref(&timed_out)).with_key(key.clone()),
                with(std::slice::from_ref(&replayed)).with_key(key.clone()),
                with(&[timed_out.clone(), replayed.clone()]),
                Error::deadline_exceeded(Phase::Attempt, Duration::from_secs(1))
                    .outcome_unknown_over(key.clone()),
            ],
            ErrorKind::RetriesExhausted => vec![
                with(&[timed_out.clone(), timed_out.clone()]),
                with(&[shed.clone(), shed.clone()]).with_key(key.clone()),
                with(&[refused.clone(), refused.clone()]),
            ],
            ErrorKind::BudgetExhausted => vec![
                with(std::slice::from_ref(&timed_out)),
                with(std::slice::from_ref(&shed)),
            ],
            ErrorKind::BodyNotReplayable => vec![
                with(std::slice::from_ref(&timed_out)),
                with(std::slice::from_ref(&shed)),
                with(std::slice::from_ref(&refused)),
            ],
            ErrorKind::CircuitOpen => vec![Error::circuit_open(
                Refusal::Open {
                    left: Duration::from_secs(3),
                    why: Why::Probe,
                },
                None,
            )],
            ErrorKind::Throttled => vec![Error::throttled()],
            ErrorKind::AtCapacity => vec![
                Error::at_capacity(),
                // A retry refused after an attempt that was answered.
                Error::at_capacity().with_history(history(std::slice::from_ref(&shed))),
                Error::at_capacity()
                    .with_history(history(std::slice::from_ref(&timed_out)))
                    .outcome_unknown_over(key.clone()),
            ],
            ErrorKind::QuotaSpent => vec![
                Error::quota_spent(Duration::from_secs(7)),
                // A retry refused after an attempt that was answered.
                Error::quota_spent(Duration::from_secs(7))
                    .with_history(history(std::slice::from_ref(&shed))),
                Error::quota_spent(Duration::from_secs(7))
                    .with_history(history(std::slice::from_ref(&timed_out)))
                    .outcome_unknown_over(key.clone()),
            ],
        }
    };
    let kinds = [
        ErrorKind::DeadlineExceeded,
        ErrorKind::AttemptTimeout,
        ErrorKind::ConnectTimeout,
        ErrorKind::Transport,
        ErrorKind::OutcomeUnknown,
        ErrorKind::RetriesExhausted,
        ErrorKind::BudgetExhausted,
        ErrorKind::BodyNotReplayable,
        ErrorKind::CircuitOpen,
        ErrorKind::Throttled,
        ErrorKind::AtCapacity,
        ErrorKind::QuotaSpent,
    ];
    let mut seen = Vec::new();
    for kind in kinds {
        for e in situations(kind) {
            let text = e.to_string();
            let advice = e.retry_advice();
            let same_key = matches!(advice, RetryAdvice::SameKey(_));
            let verify = advice == RetryAdvice::VerifyFirst;
            let never = advice == RetryAdvice::Never;
            assert_eq!(
                text.contains("same Idempotency-Key"),
                same_key,
                "{advice:?}: {text}"
            );
            assert_eq!(text.contains("verify"), verify, "{advice:?}: {text}");
            assert_eq!(text.contains("will not help"), never, "{advice:?}: {text}");
            // No other words tell the caller what to do.
            for other in ["send it again", "resend", "retry with"] {
                if !(same_key || verify) {
                    assert!(!text.contains(other), "{advice:?}: {text}");
                }
            }
            if let RetryAdvice::SameKey(wait) = advice {
                assert!(text.contains("charge-42"), "{text}");
                assert!(
                    text.ends_with(&format!("after {}", crate::vocab::Readable(wait))),
                    "{text}"
                );
            }
            // The summary advises the same.
            if let Some((_, advice_words)) = text.rsplit_once(';') {
                assert!(e.summary().to_string().ends_with(advice_words), "{text}");
            }
            seen.push(std::mem::discriminant(&advice));
        }
    }
    // Every advice is met somewhere in the walk.
    for advice in [
        RetryAdvice::After(Duration::ZERO),
        RetryAdvice::VerifyFirst,
        RetryAdvice::Never,
        RetryAdvice::SameKey(Duration::ZERO),
    ] {
        assert!(
            seen.contains(&std::mem::discriminant(&advice)),
            "{advice:?}"
        );
    }
}

/// A call answered with a failure the server replayed: its words and its
/// advice agree on "verify first", never "send it again with the same key".
#[test]
fn a_replayed_failure_advises_verifying_in_words_too() {
    use crate::vocab::{Attempt, Stop};
    let mut h = Attempts::new();
    h.push(
        Attempt::new(
            Class::Unknown,
            Some(http::StatusCode::GATEWAY_TIMEOUT),
            Duration::ZERO,
            Duration::ZERO,
            None,
        )
        .with_replayed(true),
    );
    h.finish(Duration::from_secs(1), Stop::Replayed);
    let e = Error::retry(ErrorKind::OutcomeUnknown, h, None)
        .with_key(http::HeaderValue::from_static("k1"));
    assert_eq!(e.retry_advice(), RetryAdvice::VerifyFirst);
    let text = e.to_string();
    assert!(text.contains("verify (look the resource up)"), "{text}");
    assert!(!text.contains("send it again only with"), "{text}");
}
