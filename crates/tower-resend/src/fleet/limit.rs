//! A limit on the attempts in flight at each instance, found from the
//! latency of its answers, so that first attempts the fleet cannot serve
//! fail at once instead of queueing past their callers' patience.
//!
//! A gradient, as the server's `ShedLayer::adaptive` finds its own limit,
//! with what a client adds: no limit binds until the instance shows it has
//! too much, and a limit that has stopped binding lapses. The rules, each a
//! small function of what was observed:
//!
//! - **what an answer says** ([`signal`]): an answer's time is a sample of
//!   the instance's latency; an overloaded answer (a 503, a 429, gRPC's
//!   UNAVAILABLE or RESOURCE_EXHAUSTED) or an attempt timeout says it has
//!   too much; a failure to connect or a broken connection says nothing of
//!   its load;
//! - **a window** ([`closes`]): the samples of the attempts sent since it
//!   began, once it is [`window`](InstanceLimit::window) old (100 ms) and
//!   has ten of them;
//! - **what a window makes of the limit** ([`after_window`]): its mean
//!   against the fastest seen (the instance's own time, without a queue),
//!   each beyond the noise of its answers: a window is judged by its mean
//!   less three standard errors (what it surely shows), and the fastest is
//!   the lowest of the windows' means plus three standard errors. Surely
//!   slower by more than the [`tolerance`](InstanceLimit::tolerance) (1.5
//!   times) is a congestion event: the limit becomes what was in flight
//!   (the limit, or the most in flight at once when that is fewer) scaled
//!   by fastest / mean, at most halved (by Little's law, what the instance
//!   served at once). Otherwise a limit reached in the window grows by its
//!   square root, and one not reached for ten windows in a row lapses (no
//!   limit, as at the start). A cut that did not bring the latency down,
//!   or congestion at the floor, says the latency is the work's own: it
//!   becomes the fastest from then on.
//!
//!   So a few answers whose times vary widely (a quiet client of an
//!   instance whose latency has a long tail) cut nothing, while the many
//!   answers of a busy instance, where a limit matters, show a queue
//!   within a window or two;
//! - **an overload answer** ([`after_overload`]) cuts at once to half of
//!   what was in flight, once for the attempts sent under one limit (those
//!   sent before a cut, answered after it, cut nothing more);
//! - **admitted** ([`admits`]): an instance takes another attempt while
//!   fewer than its limit are in flight.
//!
//! Why a gradient rather than AIMD alone: when an instance's capacity
//! drops, AIMD cuts by a constant factor per event and takes several
//! rounds of queueing to find it, where the gradient lands on it in one
//! cut (what was in flight, scaled by how much slower the answers got).
//! AIMD's halving is kept where there is no latency to scale by: an
//! overloaded answer, or an attempt that timed out.

use std::time::Duration;

use crate::classify::Class;

/// How each instance of a fleet finds its limit on attempts in flight; see
/// [`FleetLayer::limit`](super::FleetLayer::limit) for what it does.
///
/// Values out of range are clamped where they are set, as each setter says;
/// none panics.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::fleet::{FleetLayer, InstanceLimit};
///
/// let limit = InstanceLimit::adaptive()
///     .floor(2)
///     .tolerance(2.0)
///     .window(Duration::from_millis(250));
/// let fleet = FleetLayer::fixed(["http://10.0.0.1:8080", "http://10.0.0.2:8080"])
///     .unwrap()
///     .limit(limit);
/// # let _ = fleet;
/// assert_eq!(InstanceLimit::adaptive().floor(0), InstanceLimit::adaptive().floor(1));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InstanceLimit {
    pub(super) floor: u32,
    pub(super) tolerance: f64,
    pub(super) window: Duration,
}

impl Default for InstanceLimit {
    /// [`InstanceLimit::adaptive`].
    fn default() -> Self {
        Self::adaptive()
    }
}

impl InstanceLimit {
    /// A limit found from latency: none until an instance shows it has too
    /// much; then never under 1 attempt in flight; latency may grow to 1.5
    /// times the fastest seen before the limit comes down; windows of at
    /// least 100 ms and ten answers.
    pub const fn adaptive() -> Self {
        Self {
            floor: 1,
            tolerance: 1.5,
            window: Duration::from_millis(100),
        }
    }

    /// The fewest attempts the limit lets in flight at one instance, at
    /// least 1 (an instance with nothing in flight always takes one).
    /// Default: 1.
    #[must_use]
    pub const fn floor(mut self, n: u32) -> Self {
        self.floor = if n == 0 { 1 } else { n };
        self
    }

    /// How much slower than the fastest seen an instance's answers may get
    /// before its limit comes down: 1.5 lets them take half as long again.
    /// Clamped to 1.05..=10 (NaN: the default). Default: 1.5.
    #[must_use]
    pub fn tolerance(mut self, ratio: f64) -> Self {
        self.tolerance = if ratio.is_nan() {
            Self::adaptive().tolerance
        } else {
            ratio.clamp(1.05, 10.0)
        };
        self
    }

    /// The shortest window of answers the limit moves on (a window also
    /// lasts until ten attempts sent in it have been answered). Clamped to
    /// 1 ms..=60 s. Default: 100 ms.
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window.clamp(Duration::from_millis(1), Duration::from_secs(60));
        self
    }
}

/// The fewest answers a window decides on.
pub(crate) const MIN_SAMPLES: u32 = 10;

/// Standard errors a window's mean is taken to be off by, either way: at
/// three, a window of answers whose times do not change is judged slower
/// than the fastest (with the tolerance) about once in a million.
pub(crate) const ERRORS: f64 = 3.0;

/// Latency is compared with the fastest seen or this, whichever is more:
/// a queue of less than a millisecond is scheduling noise, not one worth
/// refusing calls for (and a clock that did not move, as a paused one over
/// loopback, is no base to divide by).
pub(crate) const MIN_BASE: Duration = Duration::from_millis(1);

/// Windows in a row within the tolerance, the limit not reached, after
/// which a limit lapses.
pub(crate) const LAPSE: u32 = 10;

/// What an overload answer leaves of what was in flight.
pub(crate) const OVERLOAD_CUT: f64 = 0.5;

/// How an attempt that did not answer ran out of time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TimedOut {
    /// Its own time limit (the attempt timeout) fired.
    Attempt,
    /// The call's deadline cut it, before its own limit.
    Deadline,
}

/// What an attempt's end says to its instance's limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    /// A sample of the instance's latency.
    Took(Duration),
    /// The instance has too much.
    Overload,
    /// Nothing of its load.
    Nothing,
}

/// What the end of an attempt sent `took` ago says, classified as `class`,
/// `answered` (a response) or not, and `timed_out` if it ran out of time:
///
/// | the attempt | says |
/// |---|---|
/// | answered or failed as overloaded (503, 429, UNAVAILABLE, RESOURCE_EXHAUSTED) | overload |
/// | its attempt timeout fired | overload |
/// | answered otherwise (a success, a 4xx, a 5xx) | its time, a sample |
/// | cut by the call's deadline | its time so far, a sample (the latency is at least that) |
/// | failed otherwise (not sent, a reset) | nothing |
///
/// An overloaded answer is no sample: a shed is answered at once, and its
/// time would make a queue look short.
pub(crate) fn signal(
    class: Class,
    answered: bool,
    timed_out: Option<TimedOut>,
    took: Duration,
) -> Signal {
    match (class, answered, timed_out) {
        (Class::Overloaded, _, _) | (_, _, Some(TimedOut::Attempt)) => Signal::Overload,
        (_, true, _) | (_, false, Some(TimedOut::Deadline)) => Signal::Took(took),
        (_, false, None) => Signal::Nothing,
    }
}

/// What the end of an attempt says to the fleet's [total
/// limit](super::FleetLayer::limit_total): the fleet's latency only. One
/// instance's overload says nothing of the fleet's (a shed is answered at
/// once and the pick goes elsewhere; the instance's own limit and the
/// outlier rules act on it), and an attempt that ran out of time took at
/// least its time:
///
/// | the attempt | says |
/// |---|---|
/// | answered or failed as overloaded | nothing |
/// | answered otherwise, or out of time (its own timeout, the deadline) | its time, a sample |
/// | failed otherwise (not sent, a reset) | nothing |
///
/// So a total limit comes down only when the answers of the fleet as a
/// whole are surely slower than its fastest, beyond the noise of a window
/// (one instance that times out among many moves no window), and is left
/// alone by servers that shed their own excess.
pub(crate) fn total_signal(
    class: Class,
    answered: bool,
    timed_out: Option<TimedOut>,
    took: Duration,
) -> Signal {
    match (class, timed_out) {
        (Class::Overloaded, _) => Signal::Nothing,
        (_, Some(TimedOut::Attempt)) => Signal::Took(took),
        // Otherwise as an instance's limit reads it.
        _ => signal(class, answered, timed_out, took),
    }
}

/// A window `age` old with `samples` answers closes.
pub(crate) fn closes(cfg: &InstanceLimit, age: Duration, samples: u32) -> bool {
    age >= cfg.window && samples >= MIN_SAMPLES
}

/// What windows move: the limit, and what its next moves are judged by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Level {
    /// Attempts let in flight at once; infinite while no limit binds.
    pub(crate) limit: f64,
    /// The lowest mean of a window (plus its noise): the instance's own
    /// time, no queue.
    pub(crate) base: Option<Duration>,
    /// The cut the previous window made, if it made one.
    pub(crate) cut: Option<Cut>,
    /// Windows in a row within the tolerance with the limit not reached.
    pub(crate) calm: u32,
}

impl Level {
    /// Before anything is measured: no limit.
    pub(crate) const START: Self = Self {
        limit: f64::INFINITY,
        base: None,
        cut: None,
        calm: 0,
    };

    /// The limit in whole attempts: `None` while none binds.
    pub(crate) fn whole(&self) -> Option<u32> {
        // (A finite limit is kept at or above the floor, at least 1.)
        self.limit
            .is_finite()
            .then(|| self.limit.min(f64::from(u32::MAX)) as u32)
    }
}

/// A cut a window made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Cut {
    pub(crate) before: f64,
    pub(crate) after: f64,
    /// The mean of the window that made it.
    pub(crate) mean: Duration,
}

/// What a closed window saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    /// The mean time of its answers.
    pub(crate) mean: Duration,
    /// How far off that mean may be: the standard error of its answers'
    /// times (their standard deviation over the square root of their
    /// number).
    pub(crate) error: Duration,
    /// A pick found the instance at its limit in it.
    pub(crate) limited: bool,
    /// The most attempts in flight at once in it.
    pub(crate) peak: u32,
}

/// What the window `w` makes of `level` (see the [module docs](self)), its
/// mean `m` give or take `e` (three standard errors), the fastest `b`:
///
/// | the window | the limit | becomes |
/// |---|---|---|
/// | not surely slower: (m − e) / b within the tolerance, the limit reached | L | L + √L |
/// | not surely slower, not reached | L | L; none after ten such windows in a row |
/// | not surely slower | none | none |
/// | surely slower, m / b = r | L, or none (the most in flight: P) | min(L, P) / r, at most halved, at least the floor |
/// | surely slower, after a cut that did not bring the latency down | L | L, m the fastest from now on |
/// | surely slower, with no more than the floor in flight | L | L, m the fastest from now on |
///
/// and the fastest becomes m + e when that is lower.
pub(crate) fn after_window(cfg: &InstanceLimit, level: Level, w: Window) -> Level {
    let off_by =
        Duration::try_from_secs_f64(w.error.as_secs_f64() * ERRORS).unwrap_or(Duration::MAX);
    let surely_within = w.mean.saturating_add(off_by);
    let surely_over = w.mean.saturating_sub(off_by);
    let base = match level.base {
        Some(b) if b <= surely_within => b,
        _ => surely_within,
    };
    let mut next = Level {
        base: Some(base),
        cut: None,
        ..level
    };
    let floor = f64::from(cfg.floor);
    let against = base.max(MIN_BASE).as_secs_f64();
    if surely_over.as_secs_f64() / against > cfg.tolerance {
        let ratio = w.mean.as_secs_f64() / against;
        next.calm = 0;
        // A cut that did not bring the latency down: the latency is not
        // the queue this limit lets form. Learn it as the work's own.
        let unmoved = level.cut.is_some_and(|c| {
            c.after <= 0.8 * c.before
                && w.mean.as_secs_f64() >= c.mean.as_secs_f64() * (1.0 + c.after / c.before) / 2.0
        });
        let from = level.limit.min(f64::from(w.peak));
        if unmoved || from <= floor {
            next.base = Some(w.mean);
            return next;
        }
        next.limit = (from / ratio).max(from / 2.0).max(floor);
        next.cut = Some(Cut {
            before: from,
            after: next.limit,
            mean: w.mean,
        });
    } else if level.limit.is_finite() {
        if w.limited {
            next.limit = level.limit + level.limit.sqrt();
            next.calm = 0;
        } else {
            next.calm = level.calm + 1;
            if next.calm >= LAPSE {
                next.limit = f64::INFINITY;
                next.calm = 0;
            }
        }
    }
    next
}

/// An overload answer to an attempt sent under `level`, the most in flight
/// at once since it began `peak`: half of what was in flight (the limit, or
/// `peak` when that is fewer), at least the floor.
pub(crate) fn after_overload(cfg: &InstanceLimit, level: Level, peak: u32) -> Level {
    let from = level.limit.min(f64::from(peak));
    Level {
        limit: (from * OVERLOAD_CUT).max(f64::from(cfg.floor)),
        cut: None,
        calm: 0,
        ..level
    }
}

/// An instance with `in_flight` attempts takes another under `limit`
/// (`None`: no limit binds).
pub(crate) fn admits(limit: Option<u32>, in_flight: u32) -> bool {
    limit.is_none_or(|l| in_flight < l)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn level(limit: f64, base: u64, calm: u32) -> Level {
        Level {
            limit,
            base: Some(Duration::from_millis(base)),
            cut: None,
            calm,
        }
    }

    fn window(mean: u64, limited: bool, peak: u32) -> Window {
        noisy(mean, 0, limited, peak)
    }

    /// A window whose mean may be off by `error` ms (one standard error).
    fn noisy(mean: u64, error: u64, limited: bool, peak: u32) -> Window {
        Window {
            mean: Duration::from_millis(mean),
            error: Duration::from_millis(error),
            limited,
            peak,
        }
    }

    const NONE: f64 = f64::INFINITY;

    /// [`after_window`], row by row: the limit each window leaves.
    #[test]
    fn what_a_window_makes_of_the_limit_row_by_row() {
        let cfg = InstanceLimit::adaptive();
        #[rustfmt::skip]
        let rows: &[(Level, Window, Option<u32>, u64)] = &[
            // (before, the window, the limit after, the fastest after in ms)
            // Within the tolerance (1.5 times 20 ms).
            (level(64.0, 20, 0), window(20, true, 64), Some(72), 20),   // reached: + sqrt
            (level(64.0, 20, 0), window(29, true, 64), Some(72), 20),   // slower, within it
            (level(64.0, 20, 0), window(20, false, 30), Some(64), 20),  // not reached
            (level(64.0, 20, 9), window(20, false, 30), None, 20),      // the tenth calm: lapses
            (level(NONE, 20, 0), window(25, false, 80), None, 20),      // none binds: none
            (level(NONE, 20, 0), window(12, false, 80), None, 12),      // faster: the new fastest
            (Level::START, window(20, false, 5), None, 20),             // the first window
            // Slower than the tolerance: a cut, to what was served.
            (level(NONE, 20, 0), window(40, false, 80), Some(40), 20),  // none bound: from the most in flight
            (level(96.0, 20, 0), window(40, true, 96), Some(48), 20),   // 96 * 20 / 40
            (level(96.0, 20, 0), window(31, true, 96), Some(61), 20), // 96 * 20 / 31
            (level(64.0, 20, 0), window(200, true, 64), Some(32), 20),  // at most halved
            (level(64.0, 20, 0), window(40, false, 10), Some(5), 20),   // from the 10 in flight
            (level(NONE, 20, 5), window(40, false, 1), None, 40),       // one at a time: the work's own
            (level(4.0, 20, 0), window(40, true, 4), Some(2), 20),
            (level(1.0, 20, 0), window(40, true, 1), Some(1), 40),      // at the floor: the work's own
            // Sub-millisecond latency is measured against 1 ms.
            (level(NONE, 0, 0), window(1, false, 50), None, 0),
            // Noisy windows: judged by what is sure, the mean less three
            // standard errors; the fastest, the mean plus three.
            (level(64.0, 20, 0), noisy(40, 5, true, 64), Some(72), 20),   // 40 - 15: within
            (level(64.0, 20, 0), noisy(70, 5, true, 64), Some(32), 20),   // 70 - 15: slower
            (level(NONE, 20, 0), noisy(8, 1, false, 5), None, 11),        // faster: 8 + 3
            (Level::START, noisy(20, 4, false, 5), None, 32),             // the first: 20 + 12
        ];
        for (i, &(before, w, limit, base)) in rows.iter().enumerate() {
            let after = after_window(&cfg, before, w);
            assert_eq!(after.whole(), limit, "row {i}: {after:?}");
            assert_eq!(
                after.base,
                Some(Duration::from_millis(base)),
                "row {i}: {after:?}"
            );
        }
    }

    /// A cut that did not bring the latency down is not cut again: the
    /// latency is the work's own, and the limit grows from there.
    #[test]
    fn latency_a_cut_did_not_bring_down_becomes_the_work_s_own() {
        let cfg = InstanceLimit::adaptive();
        let cut = after_window(&cfg, level(64.0, 20, 0), window(40, true, 64));
        assert_eq!(cut.whole(), Some(32));
        assert!(cut.cut.is_some());
        // Still 40 ms with half as many in flight: the work got slower.
        let learned = after_window(&cfg, cut, window(40, true, 32));
        assert_eq!((learned.whole(), learned.base), (Some(32), Some(40 * MS)));
        assert_eq!(
            after_window(&cfg, learned, window(40, true, 32)).whole(),
            Some(37)
        );
        // A cut from 80 ms that brought it down to 35 ms (a queue that
        // shrank): still slower than the tolerance, cut again.
        let cut = after_window(&cfg, level(64.0, 20, 0), window(80, true, 64));
        assert_eq!(cut.whole(), Some(32), "at most halved");
        let again = after_window(&cfg, cut, window(35, true, 32));
        assert_eq!(again.whole(), Some(18), "32 * 20 / 35");
    }

    /// A limit grows by its square root while reached and calm, and lapses
    /// after ten calm windows in a row not reached; a cut or a reached
    /// window starts the count again.
    #[test]
    fn a_limit_that_stops_binding_lapses() {
        let cfg = InstanceLimit::adaptive();
        let mut l = level(16.0, 20, 0);
        for _ in 0..LAPSE - 1 {
            l = after_window(&cfg, l, window(20, false, 8));
        }
        assert_eq!((l.whole(), l.calm), (Some(16), LAPSE - 1));
        let reached = after_window(&cfg, l, window(20, true, 16));
        assert_eq!((reached.whole(), reached.calm), (Some(20), 0));
        let lapsed = after_window(&cfg, l, window(20, false, 8));
        assert_eq!((lapsed.whole(), lapsed.calm), (None, 0));
        let overloaded = after_overload(&cfg, l, 16);
        assert_eq!(overloaded.calm, 0);
    }

    /// [`after_overload`] and [`admits`], row by row.
    #[test]
    fn an_overload_answer_halves_what_was_in_flight() {
        let cfg = InstanceLimit::adaptive();
        #[rustfmt::skip]
        let rows: &[(f64, u32, u32)] = &[
            // (the limit, the most in flight, the limit after)
            (NONE, 40, 20),   // none bound: half the most in flight
            (30.0, 40, 15),   // the limit, fewer
            (30.0, 10, 5),    // the most in flight, fewer
            (3.0, 3, 1),      // 1.5: one whole attempt
            (1.0, 1, 1),      // never under the floor
            (NONE, 0, 1),
        ];
        for (i, &(limit, peak, want)) in rows.iter().enumerate() {
            let after = after_overload(&cfg, level(limit, 20, 3), peak);
            assert_eq!(after.whole(), Some(want), "row {i}");
            assert_eq!(after.base, Some(20 * MS), "row {i}: the fastest is kept");
        }
        let floor = InstanceLimit::adaptive().floor(4);
        assert_eq!(after_overload(&floor, Level::START, 5).whole(), Some(4));

        assert!(admits(None, u32::MAX - 1));
        assert!(admits(Some(3), 2));
        assert!(!admits(Some(3), 3));
        assert!(admits(Some(1), 0), "an idle instance always takes one");
    }

    /// [`signal`], row by row.
    #[test]
    fn what_an_attempt_s_end_says_row_by_row() {
        let took = 30 * MS;
        #[rustfmt::skip]
        let rows: &[(Class, bool, Option<TimedOut>, Signal)] = &[
            (Class::Success, true, None, Signal::Took(took)),
            (Class::Rejected, true, None, Signal::Took(took)),
            (Class::Unknown, true, None, Signal::Took(took)),           // a 500 answered
            (Class::NotProcessed, true, None, Signal::Took(took)),
            (Class::Overloaded, true, None, Signal::Overload),          // a 503, a 429
            (Class::Overloaded, false, None, Signal::Overload),         // a gRPC status as an error
            (Class::Unknown, false, Some(TimedOut::Attempt), Signal::Overload),
            (Class::Unknown, false, Some(TimedOut::Deadline), Signal::Took(took)),
            (Class::Unknown, false, None, Signal::Nothing),             // a reset
            (Class::NotSent, false, None, Signal::Nothing),             // refused
        ];
        for (i, &(class, answered, timed_out, want)) in rows.iter().enumerate() {
            assert_eq!(signal(class, answered, timed_out, took), want, "row {i}");
        }
        // The total's, for the same rows: overloads say nothing, time is
        // a sample however the attempt ended.
        let total = [
            Signal::Took(took),
            Signal::Took(took),
            Signal::Took(took),
            Signal::Took(took),
            Signal::Nothing,
            Signal::Nothing,
            Signal::Took(took),
            Signal::Took(took),
            Signal::Nothing,
            Signal::Nothing,
        ];
        for (i, (&(class, answered, timed_out, _), want)) in rows.iter().zip(total).enumerate() {
            assert_eq!(
                total_signal(class, answered, timed_out, took),
                want,
                "row {i}"
            );
        }
        let cfg = InstanceLimit::adaptive();
        assert!(!closes(&cfg, 99 * MS, 100), "too short");
        assert!(!closes(&cfg, 10 * cfg.window, MIN_SAMPLES - 1), "too few");
        assert!(closes(&cfg, 100 * MS, MIN_SAMPLES));
    }

    #[test]
    fn settings_out_of_range_are_clamped() {
        let s = InstanceLimit::adaptive();
        assert_eq!(s.floor(0).floor, 1);
        assert_eq!(s.tolerance(f64::NAN).tolerance, 1.5);
        assert_eq!(s.tolerance(0.5).tolerance, 1.05);
        assert_eq!(s.tolerance(f64::INFINITY).tolerance, 10.0);
        assert_eq!(s.window(Duration::ZERO).window, MS);
        assert_eq!(s.window(Duration::MAX).window, Duration::from_secs(60));
        assert_eq!(InstanceLimit::default(), s);
    }
}
