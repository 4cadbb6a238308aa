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
//!
//! The refusals retried free in the streak before it said so were, it
//! turns out, an outage's: they are charged to the budget then
//! ([`Streak::ended`] says how many, `RetryBudget::charge` takes them), so
//! that what an outage costs the upstream in its first second is the
//! budget's share of the calls, as in every later second.
//!
//! The streak is the stack's (its clones share it), whatever host each
//! attempt went to: a stack that calls several upstreams sees one of them
//! down as failures between the others' answers, no streak, and its
//! refusals stay free, as they were before the rule.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::time::Instant;

use crate::classify::Class;

/// Attempts failing in a row that say the upstream fails as a whole: five,
/// at five instances of a fleet (one after another), or at the one
/// upstream. With a third
/// of a fleet refusing, five in a row come once in 243 attempts; the
/// refusal then retried takes a budget token that refusals otherwise leave
/// unspent.
pub(crate) const IN_A_ROW: u32 = 5;

/// The attempts failing in a row since the last that did not: a failure
/// as a fleet counts one (not sent, overloaded, outcome unknown); an
/// answer, even a refusal of the request, ends the streak. Failures of
/// the instance that failed last count once: an instance killed fails
/// every attempt it had at once, and that is one instance gone, not an
/// outage. An answer to an attempt sent before the streak's first
/// failure does not end it either: a server draining answers the work it
/// had queued while it refuses everything new, and those late answers
/// say nothing of it now. Lossy under races (a detector, not a ledger).
#[derive(Debug)]
pub(crate) struct Streak {
    count: AtomicU64,
    /// When the streak's first failure ended, in nanoseconds from `origin`.
    began: AtomicU64,
    /// Refusals retried free (without a budget token) since the streak's
    /// first failure.
    free: AtomicU32,
    origin: Instant,
}

impl Default for Streak {
    fn default() -> Self {
        Self {
            count: AtomicU64::new(0),
            began: AtomicU64::new(0),
            free: AtomicU32::new(0),
            origin: Instant::now(),
        }
    }
}

impl Streak {
    /// An attempt sent at `sent` ended at `at` as `class`, at `instance`
    /// (a fleet's id) if known. When this failure is the one that makes
    /// the streak say the upstream fails as a whole, the refusals retried
    /// free before it in the streak (see [`free_retry`](Self::free_retry)),
    /// to be charged as the tokens they would have taken.
    pub(crate) fn ended(
        &self,
        class: Class,
        instance: Option<u64>,
        sent: Instant,
        at: Instant,
    ) -> Option<u32> {
        let nanos = |t: Instant| {
            u64::try_from(t.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
        };
        let now = self.count.load(Ordering::Relaxed);
        match class {
            Class::NotSent | Class::Overloaded | Class::Unknown => {
                let (count, last) = ((now >> 32) as u32, now as u32);
                // (Ids are small; one of u32::MAX instances apart may be
                // taken for the same.)
                let id = instance.map_or(0, |i| (i as u32).max(1));
                if id != 0 && id == last && count > 0 {
                    return None;
                }
                if count == 0 {
                    self.began.store(nanos(at), Ordering::Relaxed);
                }
                let count = count.saturating_add(1);
                self.count
                    .store((u64::from(count) << 32) | u64::from(id), Ordering::Relaxed);
                (count == IN_A_ROW).then(|| self.free.swap(0, Ordering::Relaxed))
            }
            // (Not written again while it is 0: most attempts answer well,
            // and a store takes the line from every other core.)
            _ => {
                if now != 0 && nanos(sent) >= self.began.load(Ordering::Relaxed) {
                    self.count.store(0, Ordering::Relaxed);
                    self.free.store(0, Ordering::Relaxed);
                }
                None
            }
        }
    }

    /// A refusal counted in the streak is retried free: while the streak
    /// has not yet said the upstream fails as a whole, it is counted, to
    /// be charged if it does.
    pub(crate) fn free_retry(&self) {
        let count = (self.count.load(Ordering::Relaxed) >> 32) as u32;
        if count > 0 && count < IN_A_ROW {
            self.free.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The upstream fails as a whole.
    pub(crate) fn failing(&self) -> bool {
        (self.count.load(Ordering::Relaxed) >> 32) as u32 >= IN_A_ROW
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// One instant for tests in which when does not matter.
    fn t0() -> Instant {
        static AT: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *AT.get_or_init(Instant::now)
    }

    #[test]
    fn five_failures_in_a_row_and_any_answer_ends_them() {
        let s = Streak::default();
        for class in [
            Class::NotSent,
            Class::Overloaded,
            Class::Unknown,
            Class::NotSent,
        ] {
            s.ended(class, None, t0(), t0());
        }
        assert!(!s.failing(), "four");
        s.ended(Class::NotSent, None, t0(), t0());
        assert!(s.failing(), "five");
        for answered in [
            Class::Success,
            Class::Rejected,
            Class::NotProcessed,
            Class::InProgress,
        ] {
            for _ in 0..5 {
                s.ended(Class::NotSent, None, t0(), t0());
            }
            assert!(s.failing());
            s.ended(answered, None, t0(), t0());
            assert!(!s.failing(), "{answered:?}");
        }
    }

    #[test]
    fn an_instance_that_fails_all_it_had_at_once_counts_once() {
        let s = Streak::default();
        for _ in 0..40 {
            s.ended(Class::NotSent, Some(7), t0(), t0());
        }
        assert!(!s.failing(), "one instance killed");
        for id in [8, 7, 9, 10] {
            s.ended(Class::NotSent, Some(id), t0(), t0());
        }
        assert!(s.failing(), "five instances in a row");
    }

    #[test]
    fn the_fifth_failure_says_how_many_refusals_were_retried_free() {
        let s = Streak::default();
        s.free_retry();
        assert_eq!(s.ended(Class::NotSent, Some(1), t0(), t0()), None);
        s.free_retry();
        s.ended(Class::NotSent, Some(2), t0(), t0());
        s.free_retry();
        // An answer ends the streak and what it counted.
        s.ended(Class::Success, Some(3), t0(), t0());
        for id in 1..=4 {
            assert_eq!(s.ended(Class::NotSent, Some(id), t0(), t0()), None);
            s.free_retry();
        }
        assert_eq!(s.ended(Class::NotSent, Some(5), t0(), t0()), Some(4));
        // Said once: later failures and retries are charged as they go.
        s.free_retry();
        assert_eq!(s.ended(Class::NotSent, Some(6), t0(), t0()), None);
    }

    #[test]
    fn an_answer_to_an_attempt_sent_before_the_streak_does_not_end_it() {
        let s = Streak::default();
        let (before, first, later) = (
            t0(),
            t0() + Duration::from_millis(10),
            t0() + Duration::from_millis(20),
        );
        for id in 1..=5 {
            s.ended(Class::NotSent, Some(id), first, first);
        }
        assert!(s.failing());
        // A draining server answers what it had queued: sent before.
        s.ended(Class::Success, Some(9), before, later);
        assert!(s.failing(), "a late answer to an earlier attempt");
        // An attempt sent since the first failure, answered: over.
        s.ended(Class::Success, Some(9), first, later);
        assert!(!s.failing(), "an answer to an attempt of the streak's time");
    }
}
