//! Setting aside the instances that keep failing, and giving their
//! capacity back as soon as it can be used.
//!
//! As Envoy's outlier detection, with what its success-rate and
//! failure-percentage detectors add: an instance is an outlier only
//! against the rest of the fleet. The rules, each a small function of what
//! was observed:
//!
//! - **set aside** ([`sets_aside`]): `consecutive` failures in a row that
//!   say "this instance" (one, back from a pause, before its first
//!   success; one that was not sent, a refused connection or stream, as
//!   gRPC's subchannel fails on a failed connection), while the *other*
//!   instances fail less than `others_below` of their recent attempts, and
//!   while fewer than `max_share` of the fleet are set aside (at least
//!   one, never all);
//! - **probed** ([`Health::take_probe`]): an instance set aside gets one
//!   attempt every `probe_every`, and the fleet's probes are at most
//!   `probe_share` of its attempts (at least one every `probe_every`): with
//!   a third of a hundred instances aside, a probe each every 500 ms would
//!   be most of a client's attempts. The first that answers well brings it
//!   back at once, not after a fixed pause (its pause, doubling while it
//!   keeps failing, is only the longest it stays aside unprobed);
//! - **let back** ([`degraded`]): when the instances in service fail too
//!   (`others_below` of their recent attempts or more), setting one aside
//!   is not the cure and takes capacity the load needs: every instance is
//!   in service again until they recover (Envoy's panic threshold, measured
//!   by what the instances answer rather than by a count of hosts).
//!
//! State is atomics (no lock on the way of an attempt); the recent counts
//! are a window of two one-second bins. Concurrent updates may lose a
//! count at a bin's turn: a detector of rates, not a ledger.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::retry::PerShard;

/// When an instance that keeps failing is set aside, and how it comes back.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::fleet::{FleetLayer, Outliers};
///
/// let fleet = FleetLayer::fixed(["http://10.0.0.1:8080", "http://10.0.0.2:8080"])
///     .unwrap()
///     .outliers(Outliers::default().consecutive(3).probe_every(Duration::from_millis(250)));
/// # let _ = fleet;
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outliers {
    pub(super) consecutive: u32,
    pub(super) base_pause: Duration,
    pub(super) max_pause: Duration,
    pub(super) max_share: f64,
    pub(super) probe_every: Duration,
    pub(super) probe_share: f64,
    pub(super) others_below: f64,
    pub(super) not_sent_at_once: bool,
}

impl Default for Outliers {
    /// 5 failures in a row (one not sent), while the others fail less than
    /// half of their recent attempts; probed every 500 ms, the probes at
    /// most 5 % of the fleet's attempts; aside for 10 s at most unless a
    /// probe answers well, doubled while it keeps failing (up to 5
    /// minutes); at most half the fleet.
    fn default() -> Self {
        Self {
            consecutive: 5,
            base_pause: Duration::from_secs(10),
            max_pause: Duration::from_secs(300),
            max_share: 0.5,
            probe_every: Duration::from_millis(500),
            probe_share: 0.05,
            others_below: 0.5,
            not_sent_at_once: true,
        }
    }
}

impl Outliers {
    /// Sets an instance aside after `n` failures in a row (at least 1).
    #[must_use]
    pub fn consecutive(mut self, n: u32) -> Self {
        self.consecutive = n.max(1);
        self
    }

    /// Whether one failure not sent (a refused connection, a refused
    /// stream: the instance cannot take requests now) sets an instance
    /// aside at once (by default), as gRPC's subchannel fails on one
    /// failed connection, or counts as one of `consecutive`. At a hundred
    /// client processes and a hundred instances, each process makes under
    /// one attempt a second at each instance: five refusals in a row take
    /// longer than most restarts, and until then a third of a fleet gone
    /// takes a third of the attempts.
    #[must_use]
    pub fn not_sent_at_once(mut self, at_once: bool) -> Self {
        self.not_sent_at_once = at_once;
        self
    }

    /// The longest an instance set aside stays aside without a probe that
    /// answers well, the first time, and the longest it ever does.
    #[must_use]
    pub fn pause(mut self, base: Duration, max: Duration) -> Self {
        self.base_pause = base;
        self.max_pause = max.max(base);
        self
    }

    /// At most this share of the instances (0 to 1) set aside at once; at
    /// least one, and never all of them.
    #[must_use]
    pub fn max_share(mut self, share: f64) -> Self {
        self.max_share = share_or(share, Self::default().max_share);
        self
    }

    /// An instance set aside gets one attempt (a probe) every `every`
    /// (default 500 ms; at least 1 ms): the first that answers well brings
    /// it back.
    #[must_use]
    pub fn probe_every(mut self, every: Duration) -> Self {
        self.probe_every = every.max(Duration::from_millis(1));
        self
    }

    /// An instance is set aside only while the others fail less than this
    /// share (0 to 1, default 0.5) of their recent attempts, and the ones
    /// set aside are let back when the instances in service fail as much:
    /// an outlier is one against the rest. 1 turns the comparison off.
    #[must_use]
    pub fn others_failing_below(mut self, share: f64) -> Self {
        self.others_below = share_or(share, Self::default().others_below);
        self
    }

    /// The fleet's probes of the instances set aside are at most this
    /// share (0 to 1, default 0.05) of its recent attempts, and at least
    /// one every `probe_every`.
    #[must_use]
    pub fn probe_share(mut self, share: f64) -> Self {
        self.probe_share = share_or(share, Self::default().probe_share);
        self
    }

    /// Never sets an instance aside.
    #[must_use]
    pub fn off(mut self) -> Self {
        self.consecutive = u32::MAX;
        self.not_sent_at_once = false;
        self
    }
}

/// `share` within 0 to 1, or `default` if it is not a number.
fn share_or(share: f64, default: f64) -> f64 {
    if share.is_finite() {
        share.clamp(0.0, 1.0)
    } else {
        default
    }
}

/// Attempts, and how many of them failed, over a recent window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Ratio {
    pub(crate) attempts: u32,
    pub(crate) failures: u32,
}

/// Fewer recent attempts than this say nothing of a rate.
const MIN_VOLUME: u32 = 10;

impl Ratio {
    /// The failing share, or `None` with too few attempts to tell.
    fn share(self) -> Option<f64> {
        (self.attempts >= MIN_VOLUME).then(|| f64::from(self.failures) / f64::from(self.attempts))
    }

    /// These counts and `more`'s.
    fn plus(self, more: Self) -> Self {
        Self {
            attempts: self.attempts.saturating_add(more.attempts),
            failures: self.failures.saturating_add(more.failures),
        }
    }

    /// These counts less `part`'s (the others of an instance).
    pub(crate) fn less(self, part: Self) -> Self {
        Self {
            attempts: self.attempts.saturating_sub(part.attempts),
            failures: self.failures.saturating_sub(part.failures),
        }
    }
}

/// After a failure that says "this instance", `in_a_row` of them (or one,
/// `at_once`: on probation, or not sent): is it set aside? Only against the
/// rest (`others`, the other instances' recent counts, failing less than
/// `others_below`), and only while fewer than the share of the `fleet` are
/// (`aside` now).
pub(crate) fn sets_aside(
    o: &Outliers,
    in_a_row: u32,
    at_once: bool,
    others: Ratio,
    aside: usize,
    fleet: usize,
) -> bool {
    let failing = at_once || in_a_row >= o.consecutive;
    let outlier = others.share().is_none_or(|s| s < o.others_below);
    let share = (fleet as f64 * o.max_share).floor() as usize;
    let room = aside < share.max(1).min(fleet.saturating_sub(1));
    failing && outlier && room
}

/// How long an instance set aside for the `ejections`-th time in a row
/// stays aside without a probe that answers well.
pub(crate) fn pause(o: &Outliers, ejections: u32) -> Duration {
    o.base_pause
        .saturating_mul(1u32 << ejections.min(16))
        .min(o.max_pause)
}

/// The fleet's probes in its recent window (`probes`) leave room for
/// another, against its recent attempts (`fleet`): at most `probe_share`
/// of them, and at least one every `probe_every` over the window.
pub(crate) fn probe_room(o: &Outliers, probes: u32, fleet: Ratio) -> bool {
    let window = 2.0 * BIN.as_secs_f64();
    let floor = (window / o.probe_every.as_secs_f64()).ceil();
    let share = o.probe_share * f64::from(fleet.attempts);
    f64::from(probes) < floor.max(share)
}

/// The instances in service fail as much as an outlier would (`fleet`,
/// their recent counts): the ones set aside are let back.
pub(crate) fn degraded(o: &Outliers, fleet: Ratio) -> bool {
    o.others_below < 1.0 && fleet.share().is_some_and(|s| s >= o.others_below)
}

/// Recent attempts and failures, in two bins of [`BIN`] each.
#[derive(Debug, Default)]
pub(crate) struct Recent {
    /// Per bin: attempts in the high 32 bits, failures in the low.
    counts: [AtomicU64; 2],
    epochs: [AtomicU64; 2],
}

/// The whole fleet's [`Recent`]: its failures counted in one place, its
/// attempts that did not fail in this thread's shard, so that the success
/// path writes no count that every thread's calls share (`stack().fleet(..)`
/// over 100 instances shared by two threads, run as `benches/fleet_cost.rs`
/// runs them: 1.89x one thread's cost a call with one line, 1.56x with
/// shards and the retry layer's state apart from its `Arc`'s counts). The
/// failures alone say most of what a pick asks ([`FleetRecent::failed`]);
/// the shards are summed only when something has failed.
#[derive(Debug, Default)]
pub(crate) struct FleetRecent {
    failed: Recent,
    answered: PerShard<Recent>,
}

impl FleetRecent {
    /// An attempt ended in bin `epoch`, `failed` or not.
    pub(crate) fn record(&self, epoch: u64, failed: bool) {
        if failed {
            self.failed.record(epoch, true);
        } else {
            self.answered.mine().record(epoch, false);
        }
    }

    /// The counts of bin `epoch` and the one before.
    pub(crate) fn ratio(&self, epoch: u64) -> Ratio {
        (self.answered.all()).fold(self.failed.ratio(epoch), |r, s| r.plus(s.ratio(epoch)))
    }

    /// The failed attempts alone of bin `epoch` and the one before: read
    /// without the shards.
    pub(crate) fn failed(&self, epoch: u64) -> Ratio {
        self.failed.ratio(epoch)
    }
}

/// The width of a bin of [`Recent`].
pub(crate) const BIN: Duration = Duration::from_secs(1);

impl Recent {
    /// An attempt ended in bin `epoch`, `failed` or not.
    pub(crate) fn record(&self, epoch: u64, failed: bool) {
        let i = (epoch % 2) as usize;
        if self.epochs[i].load(Ordering::Relaxed) != epoch {
            self.epochs[i].store(epoch, Ordering::Relaxed);
            self.counts[i].store(0, Ordering::Relaxed);
        }
        self.counts[i].fetch_add((1 << 32) | u64::from(failed), Ordering::Relaxed);
    }

    /// The counts of bin `epoch` and the one before.
    pub(crate) fn ratio(&self, epoch: u64) -> Ratio {
        let mut r = Ratio::default();
        for i in 0..2 {
            let e = self.epochs[i].load(Ordering::Relaxed);
            if e == epoch || e.wrapping_add(1) == epoch {
                let c = self.counts[i].load(Ordering::Relaxed);
                r.attempts = r.attempts.saturating_add((c >> 32) as u32);
                r.failures = r.failures.saturating_add(c as u32);
            }
        }
        r
    }
}

/// An instance's health: its failures in a row, whether and until when it
/// is set aside, when it may next be probed. Times are nanoseconds from
/// the fleet's origin (0: none). Whether it is aside first (`repr(C)`: see
/// the instance's layout).
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct Health {
    aside_until: AtomicU64,
    probe_at: AtomicU64,
    pub(crate) in_a_row: AtomicU32,
    ejections: AtomicU32,
    probation: AtomicBool,
}

impl Health {
    /// Set aside at `now`.
    pub(crate) fn aside(&self, now: u64) -> bool {
        self.aside_until.load(Ordering::Relaxed) > now
    }

    /// Set aside at `now`, and the probe due: it is taken (the next one is
    /// `every` later), and true. One caller wins a due probe.
    pub(crate) fn take_probe(&self, now: u64, every: Duration) -> bool {
        let at = self.probe_at.load(Ordering::Relaxed);
        at <= now
            && self
                .probe_at
                .compare_exchange(
                    at,
                    now.saturating_add(nanos(every)),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// A failure at `now`: the failures in a row, and whether the instance
    /// is on probation (back from a pause, not yet answered well); `None`
    /// while it is set aside (a probe that failed: it stays aside).
    pub(crate) fn failure(&self, now: u64) -> Option<(u32, bool)> {
        let until = self.aside_until.load(Ordering::Relaxed);
        if until > now {
            return None;
        }
        if until != 0 {
            // Back from a pause: on probation.
            self.aside_until.store(0, Ordering::Relaxed);
            self.probation.store(true, Ordering::Relaxed);
        }
        let in_a_row = self
            .in_a_row
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        Some((in_a_row, self.probation.load(Ordering::Relaxed)))
    }

    /// Sets it aside at `now` for its pause, its first probe `every` later.
    pub(crate) fn set_aside(&self, o: &Outliers, now: u64) {
        let ejections = self.ejections.fetch_add(1, Ordering::Relaxed);
        let until = now.saturating_add(nanos(pause(o, ejections)));
        self.probe_at
            .store(now.saturating_add(nanos(o.probe_every)), Ordering::Relaxed);
        self.aside_until.store(until, Ordering::Relaxed);
        self.in_a_row.store(0, Ordering::Relaxed);
    }

    /// It answered well: back in service at once, its failures forgotten.
    /// What is already as it should be is not written again: most answers
    /// are of an instance in service, and a store, even of the same value,
    /// takes the line from every other core reading the instance.
    pub(crate) fn success(&self) {
        if self.aside_until.load(Ordering::Relaxed) != 0 {
            self.aside_until.store(0, Ordering::Relaxed);
        }
        if self.in_a_row.load(Ordering::Relaxed) != 0 {
            self.in_a_row.store(0, Ordering::Relaxed);
        }
        if self.ejections.load(Ordering::Relaxed) != 0 {
            self.ejections.store(0, Ordering::Relaxed);
        }
        if self.probation.load(Ordering::Relaxed) {
            self.probation.store(false, Ordering::Relaxed);
        }
    }
}

/// `d` in nanoseconds, saturating.
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ratio(attempts: u32, failures: u32) -> Ratio {
        Ratio { attempts, failures }
    }

    /// [`sets_aside`] and [`degraded`], row by row.
    #[test]
    fn the_outlier_rules_row_by_row() {
        let o = Outliers::default();
        let calm = ratio(100, 5);
        let failing = ratio(100, 60);
        let quiet = ratio(3, 3);
        #[rustfmt::skip]
        let rows: &[(u32, bool, Ratio, usize, usize, bool)] = &[
            // (in a row, at once, others, aside now, fleet, set aside?)
            (4, false, calm, 0, 3, false),   // not yet
            (5, false, calm, 0, 3, true),    // five in a row, the others well
            (1, true, calm, 0, 3, true),     // on probation, or not sent: one
            (5, false, failing, 0, 3, false),// the others fail too: no outlier
            (5, false, quiet, 0, 3, true),   // too few attempts to compare: as alone
            (5, false, calm, 1, 3, false),   // half of three is one, taken
            (5, false, calm, 1, 4, true),    // half of four is two
            (5, false, calm, 0, 1, false),   // never all
            (5, false, calm, 0, 2, true),    // at least one
        ];
        for (i, &(in_a_row, probation, others, aside, fleet, want)) in rows.iter().enumerate() {
            assert_eq!(
                sets_aside(&o, in_a_row, probation, others, aside, fleet),
                want,
                "row {i}"
            );
        }
        assert!(!degraded(&o, calm));
        assert!(degraded(&o, failing));
        assert!(!degraded(&o, quiet), "too few to tell");
        assert!(!degraded(&o.others_failing_below(1.0), ratio(100, 100)));
        // Probes: at least one every 500 ms over the two-second window,
        // at most 5 % of the fleet's attempts beyond that.
        assert!(probe_room(&o, 3, ratio(10, 0)));
        assert!(!probe_room(&o, 4, ratio(10, 0)));
        assert!(probe_room(&o, 9, ratio(200, 0)));
        assert!(!probe_room(&o, 10, ratio(200, 0)));
        assert!(!probe_room(&o.probe_share(0.0), 4, ratio(1000, 0)));
        // Pauses double, up to the longest.
        assert_eq!(pause(&o, 0), Duration::from_secs(10));
        assert_eq!(pause(&o, 1), Duration::from_secs(20));
        assert_eq!(pause(&o, 30), Duration::from_secs(300));
    }

    #[test]
    fn the_fleets_counts_add_up_over_the_threads_that_made_them() {
        let r = FleetRecent::default();
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| (0..10).for_each(|_| r.record(5, false)));
            }
        });
        r.record(5, true);
        r.record(5, true);
        assert_eq!(r.ratio(5), ratio(32, 2));
        assert_eq!(r.ratio(6), ratio(32, 2));
        assert_eq!(r.failed(5), ratio(2, 2));
        assert_eq!(r.ratio(7), ratio(0, 0));
    }

    #[test]
    fn a_window_of_two_bins_keeps_the_last_two_seconds() {
        let r = Recent::default();
        r.record(7, true);
        r.record(7, false);
        r.record(8, true);
        assert_eq!(r.ratio(8), ratio(3, 2));
        assert_eq!(r.ratio(9), ratio(1, 1));
        r.record(9, false);
        assert_eq!(r.ratio(9), ratio(2, 1));
        assert_eq!(r.ratio(11), Ratio::default());
    }

    #[test]
    fn an_instance_aside_is_probed_and_a_good_answer_brings_it_back() {
        let o = Outliers::default();
        let h = Health::default();
        let ms = |n: u64| n * 1_000_000;
        h.set_aside(&o, ms(1000));
        assert!(h.aside(ms(1000)));
        assert!(!h.take_probe(ms(1499), o.probe_every), "not yet");
        assert!(h.take_probe(ms(1500), o.probe_every));
        assert!(!h.take_probe(ms(1500), o.probe_every), "one caller wins");
        assert!(h.take_probe(ms(2000), o.probe_every));
        // A failed probe: it stays aside.
        assert_eq!(h.failure(ms(2001)), None);
        assert!(h.aside(ms(2001)));
        // A good answer: back at once.
        h.success();
        assert!(!h.aside(ms(2002)));
        assert_eq!(h.failure(ms(2003)), Some((1, false)));
        // Its pause over without a good answer: on probation.
        h.set_aside(&o, ms(3000));
        assert_eq!(h.failure(ms(3000) + nanos(o.base_pause)), Some((1, true)));
    }
}
