//! The rules of a hedged call, one small function per step, as the retry
//! layer's are; the copies, the timer, the budgets and the body stay in
//! the response future.

use tokio::time::Instant;

use crate::classify::Class;
use crate::deadline::Deadline;

/// What a hedged call does after a copy's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OnAnswer {
    /// Final (a success, a refusal): the call ends with it, and the other
    /// copies are dropped.
    End,
    /// It may change: the call goes on with the copies in flight; a backup
    /// goes out at once when `backup` (not after the server asked for a
    /// wait, which the retry layer above honours, or a layer below refused
    /// the copy, and would refuse a backup too).
    GoOn { backup: bool },
}

/// After a copy answered as `class`, `hold` when a backup now would not
/// help: the server said how long to wait (or not to retry), or a layer
/// below refused the copy without sending it (every circuit open, the
/// fleet at capacity), and would refuse a backup too.
pub(super) const fn on_answer(class: Class, hold: bool) -> OnAnswer {
    match class {
        Class::Success | Class::Rejected => OnAnswer::End,
        _ => OnAnswer::GoOn { backup: !hold },
    }
}

/// Before a backup is made: the call has sent `sent` copies of at most
/// `max` (the budgets and the body are asked after).
pub(super) const fn room_for_backup(sent: u32, max: u32) -> bool {
    sent < max
}

/// A backup ready to go out at `now` goes only before the call's deadline.
pub(super) fn in_time(deadline: Option<Deadline>, now: Instant) -> bool {
    deadline.is_none_or(|d| now < d.instant())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_hedging_rules_row_by_row() {
        // A final answer ends the call, whatever the server said.
        for class in [Class::Success, Class::Rejected] {
            assert_eq!(on_answer(class, false), OnAnswer::End);
            assert_eq!(on_answer(class, true), OnAnswer::End);
        }
        // Any other: on, with a backup at once unless the server asked for
        // a wait or a layer below refused the copy (a not-sent refusal).
        for class in [
            Class::NotSent,
            Class::NotProcessed,
            Class::Overloaded,
            Class::InProgress,
            Class::Unknown,
        ] {
            assert_eq!(on_answer(class, false), OnAnswer::GoOn { backup: true });
            assert_eq!(on_answer(class, true), OnAnswer::GoOn { backup: false });
        }
        assert!(room_for_backup(1, 2));
        assert!(!room_for_backup(2, 2));
        let now = Instant::now();
        assert!(in_time(None, now));
        assert!(in_time(
            Some(Deadline::at(now + Duration::from_millis(1))),
            now
        ));
        assert!(!in_time(Some(Deadline::at(now)), now));
    }
}
