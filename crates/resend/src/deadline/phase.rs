//! A beacon through which inner layers tell an enclosing deadline what the
//! call is doing, without allocating or sharing state.
//!
//! The [`DeadlineLayer`](super::DeadlineLayer) future polls its inner future
//! inside a task-local scope holding a [`Cell`]; a layer that is about to
//! return `Pending` for a reason other than "an attempt is in flight" (a retry
//! waiting out a backoff) writes that reason into the cell. When the deadline
//! fires, it reports the phase its inner future last reported.

use std::cell::Cell;

use crate::error::Phase;

tokio::task_local! {
    static PHASE: Cell<Phase>;
}

/// Polls `poll` with a fresh beacon and returns its result together with the
/// phase the inner layers reported (an attempt in flight, unless told otherwise).
pub(crate) fn observe<R>(poll: impl FnOnce() -> R) -> (R, Phase) {
    PHASE.sync_scope(Cell::new(Phase::Attempt), || {
        let r = poll();
        (r, PHASE.with(Cell::get))
    })
}

/// Tells an enclosing deadline, if any, what the call is doing now.
#[allow(dead_code)] // used by the retry layer
pub(crate) fn report(phase: Phase) {
    let _ = PHASE.try_with(|c| c.set(phase));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inner_report_reaches_the_nearest_observer() {
        report(Phase::Waiting); // no observer: ignored
        let ((), outer) = observe(|| {
            let ((), inner) = observe(|| report(Phase::Waiting));
            assert_eq!(inner, Phase::Waiting);
        });
        assert_eq!(outer, Phase::Attempt);
    }
}
