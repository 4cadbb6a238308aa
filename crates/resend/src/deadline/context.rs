//! What an enclosing [`DeadlineLayer`](super::DeadlineLayer) tells the layers
//! inside it, and what they tell it back, without allocating or sharing state.
//!
//! The deadline service runs its inner `call` and every poll of its inner
//! future inside a task-local scope holding a [`CallContext`]: the call's
//! deadline, the instant the call began (only during the synchronous `call`,
//! so the first attempt need not read the clock again), and a [`Cell`] in
//! which a layer that is about to return `Pending` for a reason other than
//! "an attempt is in flight" (a retry waiting out a backoff) writes that
//! reason. When the deadline fires, it reports the phase last written.

use std::cell::Cell;

use tokio::time::Instant;

use super::Deadline;
use crate::error::Phase;

// A thread-local, not a tokio task-local: the context is only ever set for
// the length of one synchronous `call` or `poll` and restored before it
// returns (by a guard, also on unwind), so it can never be seen from another
// task, and a `Cell` of a `Copy` value costs a few instructions where
// `LocalKey::sync_scope` costs hundreds.
thread_local! {
    static CALL: Cell<Option<CallContext>> = const { Cell::new(None) };
}

#[derive(Clone, Copy)]
struct CallContext {
    deadline: Deadline,
    now: Option<Instant>,
    phase: Phase,
    /// An inner layer holds an armed timer that fires at or before the
    /// deadline and wakes the task: the deadline needs no timer of its own
    /// for this poll.
    covered: bool,
}

/// What the inner layers reported during one `call` or `poll`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Report {
    pub(crate) phase: Phase,
    pub(crate) covered: bool,
}

/// Puts the previous context back when dropped.
struct Restore(Option<CallContext>);

impl Drop for Restore {
    fn drop(&mut self) {
        CALL.with(|c| c.set(self.0));
    }
}

/// Runs `f` inside a call context and returns its result together with what
/// the inner layers reported (an attempt in flight and no cover, unless told
/// otherwise).
pub(crate) fn enter<R>(
    deadline: Deadline,
    now: Option<Instant>,
    f: impl FnOnce() -> R,
) -> (R, Report) {
    let cx = CallContext {
        deadline,
        now,
        phase: Phase::Attempt,
        covered: false,
    };
    let restore = Restore(CALL.with(|c| c.replace(Some(cx))));
    let r = f();
    let report = CALL.with(Cell::get).map_or(
        Report {
            phase: Phase::Attempt,
            covered: false,
        },
        |cx| Report {
            phase: cx.phase,
            covered: cx.covered,
        },
    );
    drop(restore);
    (r, report)
}

/// The enclosing call's deadline, and the current instant if the call is
/// being started right now (so the clock need not be read again).
pub(crate) fn current() -> Option<(Deadline, Option<Instant>)> {
    CALL.with(Cell::get).map(|cx| (cx.deadline, cx.now))
}

/// Tells an enclosing deadline that a timer firing at `until` is armed and
/// will wake the task; if that is no later than the deadline, the deadline
/// need not arm one of its own.
pub(crate) fn cover(until: Instant) {
    CALL.with(|c| {
        if let Some(mut cx) = c.get() {
            if until <= cx.deadline.instant() {
                cx.covered = true;
                c.set(Some(cx));
            }
        }
    });
}

/// Tells an enclosing deadline, if any, what the call is doing now.
pub(crate) fn report(phase: Phase) {
    CALL.with(|c| {
        if let Some(mut cx) = c.get() {
            cx.phase = phase;
            c.set(Some(cx));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn inner_report_reaches_the_nearest_context() {
        let d = Deadline::after(std::time::Duration::from_secs(1));
        report(Phase::Waiting); // no context: ignored
        assert!(current().is_none());
        let ((), outer) = enter(d, None, || {
            let ((), inner) = enter(d, Some(Instant::now()), || {
                assert!(current().is_some_and(|(_, now)| now.is_some()));
                report(Phase::Waiting);
                cover(d.instant());
            });
            assert_eq!(
                inner,
                Report {
                    phase: Phase::Waiting,
                    covered: true
                }
            );
            assert_eq!(current().map(|(d, _)| d), Some(d));
            // A timer past the deadline covers nothing.
            cover(d.instant() + std::time::Duration::from_millis(1));
        });
        assert_eq!(
            outer,
            Report {
                phase: Phase::Attempt,
                covered: false
            }
        );
    }
}
