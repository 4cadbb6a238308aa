//! How a call that stops ends: what its last result becomes. A pure
//! function of why it stopped and of the call so far, beside
//! [`Policy::decide`](super::Policy::decide), which calls it for every stop
//! it decides; the call's other ends (its deadline passed before the next
//! attempt, the throttle or the budget turned it away, the service failed)
//! call it too.

use crate::classify::RequestFacts;
use crate::error::ErrorKind;
use crate::vocab::{Attempt, Attempts, Class, Stop};

/// What the end of a call is decided from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ended<'a> {
    /// The attempts made, the last one included (none when the call ended
    /// before its first attempt went out).
    pub(crate) history: &'a Attempts,
    /// The last result is a response (else an error).
    pub(crate) answered: bool,
    /// The last result is the call's deadline running out.
    pub(crate) deadline: bool,
    /// The request, which says whether it was sent under an
    /// Idempotency-Key (resend's or the caller's): looked up only when a
    /// rule asks, so that a call's success does not pay for it.
    pub(crate) request: RequestFacts<'a>,
}

impl Ended<'_> {
    /// The call was sent under an Idempotency-Key.
    pub(crate) fn keyed(&self) -> bool {
        self.request.has_idempotency_key()
    }
}

/// Why a call stopped, and what it ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct End {
    pub(crate) stop: Stop,
    pub(crate) ending: Ending,
}

/// What a call's last result becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The last result as it is: a response with the call's history in
    /// its extensions, or an error of its own kind with the history.
    Answer,
    /// An error of this kind, with the last failure (if any) as its source.
    Error(ErrorKind),
    /// Outcome unknown: an attempt under the call's key may have run, and
    /// no answer settles it. The error the call would otherwise end with
    /// (the last failure as it is, or of kind `under`) is its source; the
    /// key is readable, and the advice is to send it again with that key.
    Unknown { under: Option<ErrorKind> },
}

/// How a call that stopped for `stop` ends, by the rules:
///
/// | the last result | stop | ends |
/// |---|---|---|
/// | any | `OutcomeUnknown` (an unsafe request may have run) | outcome unknown |
/// | a response | `Final` (a success, a refusal) | the response, with the history |
/// | a response | `Replayed` (the server's stored failure) | outcome unknown |
/// | a response | `Disabled` (`NoRetry`, or an outer retry layer in charge) | the response |
/// | a response, keyed | another attempt under the key still runs (409), or the last attempt was turned away (overloaded, not processed) after an earlier one that may have run | outcome unknown |
/// | a response | any other | the response, with the history |
/// | an error that is the deadline | any | `DeadlineExceeded` |
/// | an error | `MaxAttempts` after more than one attempt | `RetriesExhausted` |
/// | an error | `Budget`, `NotReplayable`, `Deadline` | `BudgetExhausted`, `BodyNotReplayable`, `DeadlineExceeded` |
/// | an error | any other | the error as it is |
/// | an error, keyed, and an attempt may have run | any | outcome unknown, over the above |
#[inline]
pub(crate) fn ends(stop: Stop, call: &Ended<'_>) -> End {
    let ending = if call.answered {
        answered(stop, call)
    } else {
        failed(stop, call)
    };
    End { stop, ending }
}

fn answered(stop: Stop, call: &Ended<'_>) -> Ending {
    match stop {
        // A success or a refusal: the answer, whatever came before.
        Stop::Final => Ending::Answer,
        Stop::OutcomeUnknown | Stop::Replayed => Ending::Error(ErrorKind::OutcomeUnknown),
        // (An outer retry layer, when there is one, settles it.)
        Stop::Disabled => Ending::Answer,
        _ if unsettled(call.history) && call.keyed() => Ending::Error(ErrorKind::OutcomeUnknown),
        _ => Ending::Answer,
    }
}

fn failed(stop: Stop, call: &Ended<'_>) -> Ending {
    let kind = match stop {
        Stop::OutcomeUnknown => return Ending::Error(ErrorKind::OutcomeUnknown),
        // A deadline that ran out stays the reason, whatever else also
        // stopped the call: the caller can tell which limit fired.
        _ if call.deadline => Some(ErrorKind::DeadlineExceeded),
        Stop::MaxAttempts if call.history.len() > 1 => Some(ErrorKind::RetriesExhausted),
        Stop::Budget => Some(ErrorKind::BudgetExhausted),
        Stop::NotReplayable => Some(ErrorKind::BodyNotReplayable),
        Stop::Deadline => Some(ErrorKind::DeadlineExceeded),
        _ => None,
    };
    if call.history.iter().any(Attempt::may_have_run) && call.keyed() {
        return Ending::Unknown { under: kind };
    }
    kind.map_or(Ending::Answer, Ending::Error)
}

/// True when a keyed call's last answer leaves its operation unsettled:
/// another attempt under the key still runs (409 "in progress"), or the
/// server turned the last attempt away (overloaded, or not processed) after
/// an earlier one that may have run. Sent again with the same key, the
/// server's record answers; the last answer alone says nothing of the
/// operation.
fn unsettled(history: &Attempts) -> bool {
    let Some(last) = history.last() else {
        return false;
    };
    let earlier = history.len().saturating_sub(1) as usize;
    match last.class() {
        Class::InProgress => true,
        Class::Overloaded | Class::NotProcessed => {
            history.iter().take(earlier).any(Attempt::may_have_run)
        }
        Class::Success | Class::Rejected | Class::NotSent | Class::Unknown => false,
    }
}

/// True when an error that reached the stack without the retry layer's
/// verdict (the call's deadline cut it, outside the retry layer) leaves a
/// keyed call's outcome unknown: something was sent, and not every attempt
/// says it was not acted on. The rule of [`ends`] for such an error.
pub(crate) fn unknown_under_key(e: &crate::error::Error) -> bool {
    e.kind() != ErrorKind::OutcomeUnknown && !e.is_not_sent() && !e.nothing_processed()
}
