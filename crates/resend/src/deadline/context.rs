//! What an enclosing [`DeadlineLayer`](super::DeadlineLayer) tells the layers
//! inside it, and what they tell it back, without allocating or sharing state.
//!
//! The deadline service runs its inner `call`, and every poll of its inner
//! future, with a call context set: the call's deadline, the instant the call
//! began (only during the synchronous `call`, so the first attempt need not
//! read the clock again), and a [`Report`] that inner layers write: a retry
//! waiting out a backoff says so (the phase a firing deadline reports), and
//! an attempt timeout whose armed timer fires no later than the deadline says
//! that it covers it (so the deadline arms no timer of its own).

use std::cell::Cell;

use tokio::time::Instant;

use super::Deadline;
use crate::error::Phase;

// Thread-locals, not a tokio task-local: the context is only ever set for
// the length of one synchronous `call` or `poll` and restored before it
// returns (by a guard, also on unwind), so it can never be seen from another
// task. One `Cell` per field keeps each access a word-sized load or store;
// `LocalKey::sync_scope` costs hundreds of instructions.
thread_local! {
    static DEADLINE: Cell<Option<Deadline>> = const { Cell::new(None) };
    static NOW: Cell<Option<Instant>> = const { Cell::new(None) };
    static REPORT: Cell<Report> = const { Cell::new(Report::NONE) };
}

/// What the inner layers reported during one `call` or `poll`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Report {
    pub(crate) phase: Phase,
    /// An inner layer holds an armed timer that fires at or before the
    /// deadline and wakes the task: the deadline needs no timer of its own
    /// for this poll.
    pub(crate) covered: bool,
}

impl Report {
    const NONE: Self = Self {
        phase: Phase::Attempt,
        covered: false,
    };
}

/// Puts the previous context back when dropped.
struct Restore(Option<Deadline>, Option<Instant>, Report);

impl Drop for Restore {
    fn drop(&mut self) {
        DEADLINE.set(self.0);
        NOW.set(self.1);
        REPORT.set(self.2);
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
    let restore = Restore(
        DEADLINE.replace(Some(deadline)),
        NOW.replace(now),
        REPORT.replace(Report::NONE),
    );
    let r = f();
    let report = REPORT.get();
    drop(restore);
    (r, report)
}

/// The enclosing call's deadline, and the current instant if the call is
/// being started right now (so the clock need not be read again).
pub(crate) fn current() -> Option<(Deadline, Option<Instant>)> {
    DEADLINE.get().map(|d| (d, NOW.get()))
}

/// Tells an enclosing deadline that a timer firing at `until` is armed and
/// will wake the task; if that is no later than the deadline, the deadline
/// need not arm one of its own.
pub(crate) fn cover(until: Instant) {
    if DEADLINE.get().is_some_and(|d| until <= d.instant()) {
        let mut r = REPORT.get();
        r.covered = true;
        REPORT.set(r);
    }
}

/// Tells an enclosing deadline, if any, what the call is doing now.
pub(crate) fn report(phase: Phase) {
    if DEADLINE.get().is_some() {
        let mut r = REPORT.get();
        r.phase = phase;
        REPORT.set(r);
    }
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
