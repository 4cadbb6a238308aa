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

// A thread-local, not a tokio task-local: the context is only ever set for
// the length of one synchronous `call` or `poll` and restored before it
// returns (by a guard, also on unwind), so it can never be seen from another
// task. One `Cell` of a `Copy` struct keeps every access a plain load or
// store at one address; `LocalKey::sync_scope` costs hundreds of
// instructions.
thread_local! {
    static CONTEXT: Cell<Ctx> = const { Cell::new(Ctx::NONE) };
    /// What a retry layer tells the layers below about the attempt it is
    /// starting, for the length of its synchronous `call` of the next layer.
    static ATTEMPT: Cell<Attempt> = const { Cell::new(Attempt::NONE) };
}

/// What a retry layer tells the layers below about one attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Attempt {
    /// Its own limit, from the request's [`CallOptions`](crate::CallOptions):
    /// read by the first attempt timeout below.
    pub(crate) limit: Option<std::time::Duration>,
    /// Its response body may be read ahead (a replay-safe request the
    /// retry layer may retry): read by a read-ahead layer below.
    pub(crate) read_ahead: bool,
}

impl Attempt {
    const NONE: Self = Self {
        limit: None,
        read_ahead: false,
    };
}

/// Tells the layers below about the attempt about to be called, until the
/// returned guard is dropped.
#[inline]
pub(crate) fn attempt(attempt: Attempt) -> AttemptGuard {
    AttemptGuard(ATTEMPT.replace(attempt))
}

/// The per-attempt limit a retry layer set for the attempt being called,
/// taken: only the first attempt timeout below the retry layer applies it.
#[inline]
pub(crate) fn take_attempt_limit() -> Option<std::time::Duration> {
    let mut a = ATTEMPT.get();
    let limit = a.limit.take();
    if limit.is_some() {
        ATTEMPT.set(a);
    }
    limit
}

/// Whether the attempt being called may have its body read ahead, taken.
#[inline]
pub(crate) fn take_read_ahead() -> bool {
    let mut a = ATTEMPT.get();
    let read = std::mem::take(&mut a.read_ahead);
    if read {
        ATTEMPT.set(a);
    }
    read
}

/// Puts what was said of the previous attempt back when dropped.
#[must_use = "the attempt's settings are left as soon as the guard is dropped"]
pub(crate) struct AttemptGuard(Attempt);

impl Drop for AttemptGuard {
    #[inline]
    fn drop(&mut self) {
        ATTEMPT.set(self.0);
    }
}

#[derive(Clone, Copy)]
struct Ctx {
    deadline: Option<Deadline>,
    now: Option<Instant>,
    report: Report,
}

impl Ctx {
    const NONE: Self = Self {
        deadline: None,
        now: None,
        report: Report::NONE,
    };
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

/// A call context, set while it lives; dropping it (also on unwind) puts the
/// previous one back. A guard rather than a closure, so that neither the
/// request nor the inner future is moved through one more frame.
#[must_use = "the context is left as soon as the guard is dropped"]
pub(crate) struct Entered(Ctx);

impl Entered {
    /// What the inner layers reported since the context was entered (an
    /// attempt in flight and no cover, unless told otherwise).
    #[inline]
    pub(crate) fn report(&self) -> Report {
        CONTEXT.get().report
    }
}

impl Drop for Entered {
    #[inline]
    fn drop(&mut self) {
        CONTEXT.set(self.0);
    }
}

/// Sets a call context until the returned guard is dropped.
#[inline]
pub(crate) fn enter(deadline: Deadline, now: Option<Instant>) -> Entered {
    Entered(CONTEXT.replace(Ctx {
        deadline: Some(deadline),
        now,
        report: Report::NONE,
    }))
}

/// The enclosing call's deadline, and the current instant if the call is
/// being started right now (so the clock need not be read again).
#[inline]
pub(crate) fn current() -> Option<(Deadline, Option<Instant>)> {
    let c = CONTEXT.get();
    c.deadline.map(|d| (d, c.now))
}

/// Tells an enclosing deadline that a timer firing at `until` is armed and
/// will wake the task; if that is no later than the deadline, the deadline
/// need not arm one of its own.
#[inline]
pub(crate) fn cover(until: Instant) {
    let mut c = CONTEXT.get();
    if c.deadline.is_some_and(|d| until <= d.instant()) {
        c.report.covered = true;
        CONTEXT.set(c);
    }
}

/// Tells an enclosing deadline, if any, what the call is doing now.
#[inline]
pub(crate) fn report(phase: Phase) {
    let mut c = CONTEXT.get();
    if c.deadline.is_some() {
        c.report.phase = phase;
        CONTEXT.set(c);
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
        let outer = enter(d, None);
        {
            let inner = enter(d, Some(Instant::now()));
            assert!(current().is_some_and(|(_, now)| now.is_some()));
            report(Phase::Waiting);
            cover(d.instant());
            assert_eq!(
                inner.report(),
                Report {
                    phase: Phase::Waiting,
                    covered: true
                }
            );
            assert_eq!(current().map(|(d, _)| d), Some(d));
        }
        assert_eq!(current().map(|(d, _)| d), Some(d));
        // A timer past the deadline covers nothing.
        cover(d.instant() + std::time::Duration::from_millis(1));
        assert_eq!(
            outer.report(),
            Report {
                phase: Phase::Attempt,
                covered: false
            }
        );
        drop(outer);
        assert!(current().is_none());
    }
}
