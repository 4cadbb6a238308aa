//! Each instance's limit on attempts in flight, kept as the rules of
//! [`limit`](super::limit) say, in atomics: a pick reads the limit with one
//! load, and an answer adds its time (and its square) to the window with
//! two adds. The answer
//! that closes a window (once a window, 100 ms at least) or that cuts on an
//! overload moves the limit, under a `try_lock` that no attempt waits on:
//! when another answer holds it, that one is moving the same window.
//! Concurrent answers may lose a sample at a window's turn: a gauge of
//! latency, not a ledger.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, TryLockError};
use std::time::Duration;

use super::limit::{after_overload, after_window, closes, InstanceLimit, Level, Signal, Window};

/// No limit binds: what picks read then.
const NONE: u32 = u32::MAX;

/// A window's answers and their time: the count in the bits above
/// [`TIME_BITS`], microseconds below.
const TIME_BITS: u32 = 40;
const ONE: u64 = 1 << TIME_BITS;
/// The longest time one answer adds: a minute (so that the sum of a window
/// cannot reach the count's bits before sixteen thousand such answers).
const LONGEST: u64 = 60_000_000;

/// One instance's limit and the window of answers that moves it.
#[derive(Debug)]
pub(crate) struct Gauge {
    /// The limit picks read: attempts let in flight at once ([`NONE`]:
    /// no limit binds).
    limit: AtomicU32,
    /// A pick found the instance at its limit in this window.
    limited: AtomicBool,
    /// The most attempts in flight at once in this window.
    peak: AtomicU32,
    /// When the window began: nanoseconds from the fleet's origin, plus
    /// one (0: the first window, since the start).
    start: AtomicU64,
    /// The window's answers and their time.
    sums: AtomicU64,
    /// The sum of the squares of their times, in microseconds squared (for
    /// how far their mean may be off).
    squares: AtomicU64,
    /// What windows move; taken only to move it.
    level: Mutex<Level>,
}

impl Default for Gauge {
    fn default() -> Self {
        Self {
            limit: AtomicU32::new(NONE),
            limited: AtomicBool::new(false),
            peak: AtomicU32::new(0),
            start: AtomicU64::new(0),
            sums: AtomicU64::new(0),
            squares: AtomicU64::new(0),
            level: Mutex::new(Level::START),
        }
    }
}

impl Gauge {
    /// The limit now: `None` while none binds.
    pub(crate) fn limit(&self) -> Option<u32> {
        Some(self.limit.load(Relaxed)).filter(|&l| l != NONE)
    }

    /// A pick found the instance with as many in flight as its limit.
    pub(crate) fn passed_over(&self) {
        if !self.limited.load(Relaxed) {
            self.limited.store(true, Relaxed);
        }
    }

    /// An attempt was let in: `in_flight` now, with it.
    pub(crate) fn admitted(&self, in_flight: u32) {
        if in_flight > self.peak.load(Relaxed) {
            self.peak.fetch_max(in_flight, Relaxed);
        }
    }

    /// An attempt sent at `sent` ended at `now` (both nanoseconds from the
    /// fleet's origin, plus one) and said `signal`; `in_flight` are still
    /// in flight, it included. An attempt sent before the window began ran
    /// under an older limit and says nothing of this one.
    pub(crate) fn ended(
        &self,
        cfg: &InstanceLimit,
        sent: u64,
        now: u64,
        signal: Signal,
        in_flight: u32,
    ) {
        let start = self.start.load(Relaxed);
        if sent < start {
            return;
        }
        match signal {
            Signal::Nothing => {}
            Signal::Overload => self.move_level(start, now, in_flight, |level, _| {
                after_overload(cfg, level, self.peak.load(Relaxed))
            }),
            Signal::Took(took) => {
                let micros = u64::try_from(took.as_micros()).map_or(LONGEST, |m| m.min(LONGEST));
                let added = ONE | micros;
                self.squares.fetch_add(micros * micros, Relaxed);
                let sums = self.sums.fetch_add(added, Relaxed).wrapping_add(added);
                let samples = u32::try_from(sums >> TIME_BITS).unwrap_or(u32::MAX);
                let age = Duration::from_nanos(now.saturating_sub(start));
                if closes(cfg, age, samples) {
                    self.move_level(start, now, in_flight, |level, answers| {
                        let (mean, error) = answers.mean_and_error();
                        let w = Window {
                            mean,
                            error,
                            limited: self.limited.load(Relaxed),
                            peak: self.peak.load(Relaxed),
                        };
                        after_window(cfg, level, w)
                    });
                }
            }
        }
    }

    /// Moves the level of the window that began at `start` by `rule` (given
    /// the window's answers) and begins the next at `now`, unless another
    /// answer is moving it or has moved it.
    fn move_level(
        &self,
        start: u64,
        now: u64,
        in_flight: u32,
        rule: impl FnOnce(Level, Answers) -> Level,
    ) {
        let mut level = match self.level.try_lock() {
            Ok(level) => level,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        if self.start.load(Relaxed) != start {
            return;
        }
        // The next window begins: what the attempts sent from now do is
        // judged on its own.
        self.start.store(now.max(start.saturating_add(1)), Relaxed);
        let sums = self.sums.swap(0, Relaxed);
        let answers = Answers {
            count: sums >> TIME_BITS,
            micros: sums & (ONE - 1),
            squares: self.squares.swap(0, Relaxed),
        };
        *level = rule(*level, answers);
        self.limited.store(false, Relaxed);
        self.peak.store(in_flight, Relaxed);
        self.limit.store(level.whole().unwrap_or(NONE), Relaxed);
    }
}

/// A window's answers: how many, the sum of their times and of their
/// squares (microseconds).
#[derive(Clone, Copy, Debug)]
struct Answers {
    count: u64,
    micros: u64,
    squares: u64,
}

impl Answers {
    /// Their mean time, and its standard error (their standard deviation
    /// over the square root of their number).
    fn mean_and_error(self) -> (Duration, Duration) {
        let n = self.count.max(1) as f64;
        let mean = self.micros as f64 / n;
        let variance = if self.count > 1 {
            ((self.squares as f64 - mean * mean * n) / (n - 1.0)).max(0.0)
        } else {
            0.0
        };
        let error = (variance / n).sqrt();
        (micros(mean), micros(error))
    }
}

/// `us` microseconds, as a duration (0 if not finite).
fn micros(us: f64) -> Duration {
    Duration::try_from_secs_f64(us / 1e6).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::super::limit::MIN_SAMPLES;
    use super::*;

    const MS: u64 = 1_000_000;

    /// Ten answers of `each` ms for attempts sent at `sent`, ending at
    /// `end` (ms), with `in_flight` at once.
    fn answers(g: &Gauge, sent: u64, end: u64, each: u64, in_flight: u32) {
        let cfg = InstanceLimit::adaptive();
        for _ in 0..MIN_SAMPLES {
            g.admitted(in_flight);
            let took = Signal::Took(Duration::from_millis(each));
            g.ended(&cfg, sent * MS, end * MS, took, in_flight);
        }
    }

    #[test]
    fn no_limit_binds_until_the_latency_climbs() {
        let g = Gauge::default();
        answers(&g, 1, 120, 20, 40);
        assert_eq!(g.limit(), None, "20 ms: the fastest");
        answers(&g, 121, 240, 25, 40);
        assert_eq!(g.limit(), None, "within the tolerance");
        // 40 at once, 40 ms where 20 is the instance's own: 20.
        answers(&g, 241, 360, 40, 40);
        assert_eq!(g.limit(), Some(20));
        // Attempts sent before that window closed cut nothing more.
        answers(&g, 300, 480, 80, 40);
        assert_eq!(g.limit(), Some(20));
        // Reached, and answered in 20 ms again: it grows.
        g.passed_over();
        answers(&g, 361, 480, 20, 20);
        assert_eq!(g.limit(), Some(24), "20 + sqrt(20)");
    }

    #[test]
    fn an_overload_answer_cuts_once_for_the_attempts_sent_under_one_limit() {
        let cfg = InstanceLimit::adaptive();
        let g = Gauge::default();
        for n in 1..=30 {
            g.admitted(n);
        }
        g.ended(&cfg, MS, 5 * MS, Signal::Overload, 30);
        assert_eq!(g.limit(), Some(15));
        // Sent before the cut: nothing more.
        g.ended(&cfg, 2 * MS, 6 * MS, Signal::Overload, 29);
        assert_eq!(g.limit(), Some(15));
        // Sent after it, shed too: half again.
        g.admitted(15);
        g.ended(&cfg, 7 * MS, 8 * MS, Signal::Overload, 15);
        assert_eq!(g.limit(), Some(7));
        // A failure that says nothing of the load: nothing.
        g.ended(&cfg, 9 * MS, 10 * MS, Signal::Nothing, 7);
        assert_eq!(g.limit(), Some(7));
    }

    #[test]
    fn a_window_says_its_mean_and_how_far_off_it_may_be() {
        let same = Answers {
            count: 10,
            micros: 10 * 20_000,
            squares: 10 * 20_000 * 20_000,
        };
        assert_eq!(
            same.mean_and_error(),
            (Duration::from_millis(20), Duration::ZERO)
        );
        // Half at 10 ms, half at 30: a deviation of 10.5 ms, over √10.
        let spread = Answers {
            count: 10,
            micros: 5 * 10_000 + 5 * 30_000,
            squares: 5 * 10_000 * 10_000 + 5 * 30_000 * 30_000,
        };
        let (mean, error) = spread.mean_and_error();
        assert_eq!(mean, Duration::from_millis(20));
        assert_eq!(error.as_micros(), 3_333);
    }

    #[test]
    fn a_window_closes_once_however_many_answers_close_it() {
        let g = Gauge::default();
        answers(&g, 1, 50, 20, 10);
        assert_eq!(g.start.load(Relaxed), 0, "too short a window");
        answers(&g, 1, 120, 20, 10);
        assert_eq!(
            g.start.load(Relaxed),
            120 * MS,
            "closed at its first answer past 100 ms"
        );
        // The other answers of attempts sent before it closed count
        // nowhere.
        assert_eq!(g.sums.load(Relaxed), 0);
        // A held level: the answer that would close the window leaves it.
        let held = g.level.lock().unwrap();
        answers(&g, 121, 300, 80, 10);
        assert_eq!(g.start.load(Relaxed), 120 * MS);
        drop(held);
        answers(&g, 121, 300, 80, 10);
        assert_eq!(g.start.load(Relaxed), 300 * MS);
        assert_eq!(g.limit(), Some(5), "10 at once, halved");
    }
}
