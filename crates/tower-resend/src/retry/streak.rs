//! Whether the upstream fails as a whole: the last attempts of a stack's
//! calls, wherever they went, all failed.
//!
//! A request not sent is retried at once and without a budget token (as
//! gRPC's transparent retries) while the upstream otherwise answers: one
//! instance gone, a connection that broke. When every attempt fails (an
//! outage), that rule would send every call's attempts to the end, three
//! refusals a call; gRPC sends nothing to a failing connection at all. So
//! then a refusal is retried as any failure is, after a backoff and with
//! a token. Failures in a row say it at once, where a second's counts
//! still hold the healthy second before the outage; a fleet's counts say
//! it too ([`Elsewhere::failing`](crate::vocab::Elsewhere::failing)).

use std::sync::atomic::{AtomicU32, Ordering};

use crate::classify::Class;

/// Attempts failing in a row that say the upstream fails as a whole: five,
/// to different instances of a fleet or to the one upstream. With a third
/// of a fleet refusing, five in a row come once in 243 attempts; the
/// refusal then retried takes a budget token that refusals otherwise leave
/// unspent.
pub(crate) const IN_A_ROW: u32 = 5;

/// The attempts of a stack's calls failing in a row since the last that
/// did not: a failure as a fleet counts one (not sent, overloaded, outcome
/// unknown); an answer, even a refusal of the request, ends the streak.
#[derive(Debug, Default)]
pub(crate) struct Streak(AtomicU32);

impl Streak {
    /// An attempt ended as `class`.
    pub(crate) fn ended(&self, class: Class) {
        match class {
            Class::NotSent | Class::Overloaded | Class::Unknown => {
                if self.0.load(Ordering::Relaxed) < u32::MAX {
                    self.0.fetch_add(1, Ordering::Relaxed);
                }
            }
            // (Not written again while it is 0: most attempts answer well,
            // and a store takes the line from every other core.)
            _ => {
                if self.0.load(Ordering::Relaxed) != 0 {
                    self.0.store(0, Ordering::Relaxed);
                }
            }
        }
    }

    /// The upstream fails as a whole.
    pub(crate) fn failing(&self) -> bool {
        self.0.load(Ordering::Relaxed) >= IN_A_ROW
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn five_failures_in_a_row_and_any_answer_ends_them() {
        let s = Streak::default();
        for class in [
            Class::NotSent,
            Class::Overloaded,
            Class::Unknown,
            Class::NotSent,
        ] {
            s.ended(class);
        }
        assert!(!s.failing(), "four");
        s.ended(Class::NotSent);
        assert!(s.failing(), "five");
        for answered in [
            Class::Success,
            Class::Rejected,
            Class::NotProcessed,
            Class::InProgress,
        ] {
            for _ in 0..5 {
                s.ended(Class::NotSent);
            }
            assert!(s.failing());
            s.ended(answered);
            assert!(!s.failing(), "{answered:?}");
        }
    }
}
