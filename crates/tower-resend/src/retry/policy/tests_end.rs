//! How a call ends, row by row (`end.rs`): the stop, the kind of error and
//! what it says was done, for every way a call can end.

use super::tests::*;
use super::*;
use crate::vocab::{Attempt, Attempts};

/// An attempt's record, as the call keeps it.
fn attempt(class: Class, status: Option<u16>, maybe_processed: bool) -> Attempt {
    let status = status.map(|s| StatusCode::from_u16(s).unwrap());
    Attempt::new(class, status, Duration::ZERO, Duration::ZERO, None)
        .with_maybe_processed(maybe_processed)
}

fn history(attempts: &[Attempt]) -> Attempts {
    let mut h = Attempts::new();
    for a in attempts {
        h.push(a.clone());
    }
    h
}

/// [`ends`], row by row: how a call that stops ends.
#[test]
fn how_a_call_ends_row_by_row() {
    use crate::error::ErrorKind::*;
    let ok = attempt(Class::Success, Some(200), false);
    let timed_out = attempt(Class::Unknown, None, true);
    let plain_503 = attempt(Class::Overloaded, Some(503), true);
    let shed_503 = attempt(Class::Overloaded, Some(503), false);
    let too_many = attempt(Class::Overloaded, Some(429), false);
    let busy_409 = attempt(Class::InProgress, Some(409), false);
    let refused = attempt(Class::NotSent, None, false);
    let ended = |h: &Attempts, answered, deadline, keyed, stop| {
        let call = Ended {
            history: h,
            answered,
            deadline,
            request: request(keyed),
        };
        ends(stop, &call).ending
    };
    let answer = |h: &[Attempt], keyed, stop| ended(&history(h), true, false, keyed, stop);
    let error =
        |h: &[Attempt], deadline, keyed, stop| ended(&history(h), false, deadline, keyed, stop);
    let unknown = Ending::Error(OutcomeUnknown);

    // Answers.
    assert_eq!(
        answer(std::slice::from_ref(&ok), true, Stop::Final),
        Ending::Answer
    );
    assert_eq!(
        answer(
            std::slice::from_ref(&timed_out),
            false,
            Stop::OutcomeUnknown
        ),
        unknown
    );
    assert_eq!(
        answer(std::slice::from_ref(&plain_503), true, Stop::Replayed),
        unknown
    );
    // Keyed, and the last answer does not settle it: still running, or
    // turned away after an earlier attempt that may have run.
    assert_eq!(
        answer(std::slice::from_ref(&busy_409), true, Stop::MaxAttempts),
        unknown
    );
    for last in [&plain_503, &shed_503, &too_many] {
        assert_eq!(
            answer(&[timed_out.clone(), last.clone()], true, Stop::MaxAttempts),
            unknown,
            "{last:?}"
        );
        // Not keyed: the answer as it is.
        assert_eq!(
            answer(&[timed_out.clone(), last.clone()], false, Stop::MaxAttempts),
            Ending::Answer
        );
    }
    // Keyed, every attempt turned away and none may have run: overload,
    // the answer as it is.
    assert_eq!(
        answer(
            &[shed_503.clone(), too_many.clone(), shed_503.clone()],
            true,
            Stop::MaxAttempts
        ),
        Ending::Answer
    );
    assert_eq!(
        answer(&[shed_503.clone(), shed_503.clone()], true, Stop::Budget),
        Ending::Answer
    );
    // NoRetry, or an outer retry layer in charge: the answer as it is.
    assert_eq!(
        answer(std::slice::from_ref(&busy_409), true, Stop::Disabled),
        Ending::Answer
    );

    // Errors.
    assert_eq!(
        error(
            std::slice::from_ref(&timed_out),
            false,
            false,
            Stop::OutcomeUnknown
        ),
        unknown
    );
    assert_eq!(
        error(
            &[timed_out.clone(), timed_out.clone()],
            false,
            false,
            Stop::MaxAttempts
        ),
        Ending::Error(RetriesExhausted)
    );
    assert_eq!(
        error(
            std::slice::from_ref(&timed_out),
            false,
            false,
            Stop::MaxAttempts
        ),
        Ending::Answer
    );
    assert_eq!(
        error(std::slice::from_ref(&timed_out), false, false, Stop::Budget),
        Ending::Error(BudgetExhausted)
    );
    assert_eq!(
        error(
            std::slice::from_ref(&timed_out),
            false,
            false,
            Stop::NotReplayable
        ),
        Ending::Error(BodyNotReplayable)
    );
    assert_eq!(
        error(&[], true, false, Stop::Deadline),
        Ending::Error(DeadlineExceeded)
    );
    // The deadline stays the reason, whatever else stopped the call.
    assert_eq!(
        error(
            &[timed_out.clone(), timed_out.clone()],
            true,
            false,
            Stop::MaxAttempts
        ),
        Ending::Error(DeadlineExceeded)
    );
    assert_eq!(
        error(std::slice::from_ref(&refused), false, false, Stop::Final),
        Ending::Answer
    );
    // Keyed, and an attempt may have run: outcome unknown over the rest.
    assert_eq!(
        error(std::slice::from_ref(&timed_out), true, true, Stop::Deadline),
        Ending::Unknown {
            under: Some(DeadlineExceeded)
        }
    );
    assert_eq!(
        error(
            &[timed_out.clone(), refused.clone()],
            false,
            true,
            Stop::Final
        ),
        Ending::Unknown { under: None }
    );
    // Keyed, and nothing may have run (refused, shed, 429): not unknown.
    assert_eq!(
        error(
            &[refused.clone(), shed_503.clone(), too_many.clone()],
            true,
            true,
            Stop::Deadline
        ),
        Ending::Error(DeadlineExceeded)
    );
    assert_eq!(error(&[], false, true, Stop::Throttled), Ending::Answer);
    // A fleet at capacity: its refusal as it is (not sent, with its
    // advice); keyed after an attempt that may have run, outcome unknown
    // over it.
    assert_eq!(
        error(
            std::slice::from_ref(&refused),
            false,
            false,
            Stop::AtCapacity
        ),
        Ending::Answer
    );
    assert_eq!(
        error(
            &[timed_out.clone(), refused.clone()],
            false,
            true,
            Stop::AtCapacity
        ),
        Ending::Unknown { under: None }
    );
}
