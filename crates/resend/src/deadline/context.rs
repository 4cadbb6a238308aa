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
}

/// Puts the previous context back when dropped.
struct Restore(Option<CallContext>);

impl Drop for Restore {
    fn drop(&mut self) {
        CALL.with(|c| c.set(self.0));
    }
}

/// Runs `f` inside a call context and returns its result together with the
/// phase the inner layers reported (an attempt in flight, unless told otherwise).
pub(crate) fn enter<R>(
    deadline: Deadline,
    now: Option<Instant>,
    f: impl FnOnce() -> R,
) -> (R, Phase) {
    let cx = CallContext {
        deadline,
        now,
        phase: Phase::Attempt,
    };
    let restore = Restore(CALL.with(|c| c.replace(Some(cx))));
    let r = f();
    let phase = CALL.with(Cell::get).map_or(Phase::Attempt, |cx| cx.phase);
    drop(restore);
    (r, phase)
}

/// The enclosing call's deadline, and the current instant if the call is
/// being started right now (so the clock need not be read again).
pub(crate) fn current() -> Option<(Deadline, Option<Instant>)> {
    CALL.with(Cell::get).map(|cx| (cx.deadline, cx.now))
}

/// Tells an enclosing deadline, if any, what the call is doing now.
#[allow(dead_code)] // used by the retry layer
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
            });
            assert_eq!(inner, Phase::Waiting);
            assert_eq!(current().map(|(d, _)| d), Some(d));
        });
        assert_eq!(outer, Phase::Attempt);
    }
}
