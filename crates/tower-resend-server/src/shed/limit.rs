//! How many requests may run at once: a fixed number, or one the layer finds
//! from latency (a gradient; see [`AdaptiveLimit`]).

use std::time::Duration;

use tokio::time::Instant;

/// Settings of an adaptive limit: the layer finds how much work may run at
/// once from how long the work takes, between a floor and a ceiling; see
/// [`ShedLayer::adaptive`](super::ShedLayer::adaptive) for the algorithm.
///
/// Values out of range are clamped where they are set, as each setter
/// says; none panics.
///
/// ```
/// use std::time::Duration;
/// use tower_resend_server::shed::AdaptiveLimit;
///
/// let limit = AdaptiveLimit::between(16, 512)
///     .initial(64)
///     .tolerance(1.25)
///     .window(Duration::from_millis(200));
/// assert_eq!((limit.floor(), limit.ceiling()), (16, 512));
/// // A ceiling under the floor is raised to it.
/// assert_eq!(AdaptiveLimit::between(16, 4).ceiling(), 16);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveLimit {
    floor: usize,
    ceiling: usize,
    initial: usize,
    tolerance: f64,
    window: Duration,
}

impl Default for AdaptiveLimit {
    fn default() -> Self {
        Self::new()
    }
}

/// The fewest samples a window decides on.
const MIN_SAMPLES: u32 = 10;

impl AdaptiveLimit {
    /// Between 8 and 1000 requests at once, starting at 20; latency may
    /// grow to 1.5 times the fastest seen before the limit comes down;
    /// windows of at least 100 ms.
    pub const fn new() -> Self {
        Self {
            floor: 8,
            ceiling: 1000,
            initial: 20,
            tolerance: 1.5,
            window: Duration::from_millis(100),
        }
    }

    /// The defaults of [`new`](Self::new), between `floor` (at least one)
    /// and `ceiling` (at least `floor`).
    pub const fn between(floor: usize, ceiling: usize) -> Self {
        let floor = if floor == 0 { 1 } else { floor };
        let ceiling = if ceiling < floor { floor } else { ceiling };
        let mut this = Self::new();
        this.floor = floor;
        this.ceiling = ceiling;
        this
    }

    /// The limit before anything has been measured, clamped between the
    /// floor and the ceiling. Default: 20.
    #[must_use]
    pub const fn initial(mut self, n: usize) -> Self {
        self.initial = n;
        self
    }

    /// How much slower than the fastest seen the work may get before the
    /// limit comes down: 1.5 lets it take half as long again. Clamped to
    /// 1.05..=10 (NaN: the default). Default: 1.5.
    #[must_use]
    pub fn tolerance(mut self, ratio: f64) -> Self {
        self.tolerance = if ratio.is_nan() {
            Self::new().tolerance
        } else {
            ratio.clamp(1.05, 10.0)
        };
        self
    }

    /// The shortest window of measurements the limit moves on (a window
    /// also lasts until ten requests admitted in it have finished).
    /// Clamped to 1 ms..=60 s. Default: 100 ms.
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window.clamp(Duration::from_millis(1), Duration::from_secs(60));
        self
    }

    /// The fewest requests let run at once.
    pub const fn floor(&self) -> usize {
        self.floor
    }

    /// The most requests let run at once.
    pub const fn ceiling(&self) -> usize {
        self.ceiling
    }
}

/// A layer's limit on the work running at once.
#[derive(Debug)]
pub(super) enum Limit {
    Fixed(usize),
    Adaptive(Gradient),
}

impl Limit {
    /// The requests that may run now.
    pub(super) fn current(&self) -> usize {
        match self {
            Self::Fixed(n) => *n,
            Self::Adaptive(g) => g.current(),
        }
    }

    /// The requests that may wait by default: as many as run under a fixed
    /// limit; under an adaptive one as many while it is climbing from its
    /// start (slow start), then half as many, as its limit lets a queue
    /// form in the service too (up to the tolerance).
    pub(super) fn queue(&self) -> usize {
        match self {
            Self::Fixed(n) => *n,
            Self::Adaptive(g) if g.slow_start => g.current(),
            Self::Adaptive(g) => g.current().div_ceil(2),
        }
    }

    /// A request found every slot taken.
    pub(super) fn limited(&mut self) {
        if let Self::Adaptive(g) = self {
            g.window.limited = true;
        }
    }

    /// Work admitted at `started` finished, after `took`.
    pub(super) fn sample(&mut self, started: Instant, took: Duration, now: Instant) {
        if let Self::Adaptive(g) = self {
            g.sample(started, took, now);
        }
    }
}

/// The adaptive limit's state: a gradient on the mean time of the work of
/// each window (see [`ShedLayer::adaptive`](super::ShedLayer::adaptive)).
#[derive(Debug)]
pub(super) struct Gradient {
    cfg: AdaptiveLimit,
    limit: f64,
    /// Growing by one for each fast sample until the first congestion.
    slow_start: bool,
    /// The lowest mean of a window: the work's own time, without a queue.
    base: Option<Duration>,
    window: Window,
    /// The cut the previous window made, if it made one.
    last_cut: Option<Cut>,
}

#[derive(Debug)]
struct Window {
    start: Instant,
    /// The time of the work admitted in the window and finished.
    total: Duration,
    samples: u32,
    /// A request found every slot taken in this window.
    limited: bool,
}

impl Window {
    fn new(start: Instant) -> Self {
        Self {
            start,
            total: Duration::ZERO,
            samples: 0,
            limited: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Cut {
    before: f64,
    after: f64,
    /// The mean of the window that made it.
    mean: Duration,
}

impl Gradient {
    pub(super) fn new(cfg: AdaptiveLimit, now: Instant) -> Self {
        Self {
            cfg,
            limit: cfg.initial.clamp(cfg.floor, cfg.ceiling) as f64,
            slow_start: true,
            base: None,
            window: Window::new(now),
            last_cut: None,
        }
    }

    pub(super) fn current(&self) -> usize {
        // (the limit is kept within floor..=ceiling, both usize)
        (self.limit as usize).clamp(self.cfg.floor, self.cfg.ceiling)
    }

    fn sample(&mut self, started: Instant, took: Duration, now: Instant) {
        // Work admitted before this window ran under an older limit: it
        // says nothing of this one (so a cut is judged only on work
        // admitted after it, and a congestion event cuts once).
        if started < self.window.start {
            return;
        }
        let w = &mut self.window;
        w.total = w.total.saturating_add(took);
        w.samples += 1;
        if self.slow_start && w.limited {
            let fast = self
                .base
                .is_none_or(|b| took.as_secs_f64() <= b.as_secs_f64() * self.cfg.tolerance);
            if fast {
                self.limit = (self.limit + 1.0).min(self.cfg.ceiling as f64);
            }
        }
        // In slow start a window is its first samples, whatever their
        // time: the first is the work of the few admitted on a cold server
        // (the work's own time), and the next see an overshoot soon.
        let long_enough =
            self.slow_start || now.saturating_duration_since(w.start) >= self.cfg.window;
        if long_enough && w.samples >= MIN_SAMPLES {
            self.close(now);
        }
    }

    /// The window's decision: cut on congestion (once), grow while
    /// latency holds and the limit was reached.
    fn close(&mut self, now: Instant) {
        let window = std::mem::replace(&mut self.window, Window::new(now));
        let cut = self.last_cut.take();
        let Some(mean) = window.total.checked_div(window.samples) else {
            return;
        };
        let base = match self.base {
            Some(b) if b <= mean => b,
            _ => {
                self.base = Some(mean);
                mean
            }
        };
        let (floor, ceiling) = (self.cfg.floor as f64, self.cfg.ceiling as f64);
        let ratio = mean.as_secs_f64() / base.as_secs_f64().max(f64::MIN_POSITIVE);
        if ratio > self.cfg.tolerance {
            // A cut that did not bring the latency down (or none left to
            // make): the latency is not the queue this limit lets form.
            // Learn it as the work's own.
            let unmoved = cut.is_some_and(|c| {
                c.after <= 0.8 * c.before
                    && mean.as_secs_f64() >= c.mean.as_secs_f64() * (1.0 + c.after / c.before) / 2.0
            });
            if unmoved || self.limit <= floor {
                self.base = Some(mean);
                return;
            }
            let before = self.limit;
            // What the work ran at, scaled to the latency without a queue
            // (at most halved in one step).
            self.limit = (self.limit / ratio).max(self.limit / 2.0).max(floor);
            self.last_cut = Some(Cut {
                before,
                after: self.limit,
                mean,
            });
            self.slow_start = false;
        } else if window.limited && !self.slow_start {
            self.limit = (self.limit + self.limit.sqrt()).min(ceiling);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A settled gradient: slow start over, the work's own time 20 ms,
    /// the limit at `limit`.
    fn settled(cfg: AdaptiveLimit, limit: f64, now: Instant) -> Gradient {
        let mut g = Gradient::new(cfg, now);
        g.slow_start = false;
        g.base = Some(20 * MS);
        g.limit = limit;
        g
    }

    /// One window of work admitted at `now`, each piece taking `took`
    /// (the reached limit marked first when `limited`); the time it ends.
    fn window(g: &mut Gradient, now: Instant, took: Duration, limited: bool) -> Instant {
        g.window = Window::new(now);
        g.window.limited = limited;
        let end = now + g.cfg.window.max(took);
        for _ in 0..MIN_SAMPLES {
            g.sample(now, took, end);
        }
        assert_eq!(g.window.start, end, "the window closed");
        end
    }

    #[test]
    fn the_limit_grows_while_latency_holds_and_the_limit_is_reached() {
        let mut now = Instant::now();
        let mut g = settled(AdaptiveLimit::new(), 64.0, now);
        now = window(&mut g, now, 20 * MS, true);
        assert_eq!(g.current(), 72, "64 + sqrt(64)");
        // Slower, but within the tolerance: still grows.
        now = window(&mut g, now, 29 * MS, true);
        assert_eq!(g.current(), 80);
        // Latency holds but the limit was not reached: no growth.
        window(&mut g, now, 20 * MS, false);
        assert_eq!(g.current(), 80);
    }

    #[test]
    fn a_congestion_event_cuts_once_to_the_capacity_it_shows() {
        let mut now = Instant::now();
        let mut g = settled(AdaptiveLimit::new(), 96.0, now);
        // 96 at once, 40 ms where 20 is the work's own: 48 is what the
        // server does at once.
        now = window(&mut g, now, 40 * MS, true);
        assert_eq!(g.current(), 48);
        // Work admitted before the cut, still slow, finishing now: not a
        // second event.
        let before = now - 30 * MS;
        for _ in 0..4 * MIN_SAMPLES {
            g.sample(before, 40 * MS, now + 200 * MS);
        }
        assert_eq!(g.current(), 48);
        assert_eq!(g.window.samples, 0, "counted nothing");
        // Work admitted after the cut is fast again: it grows.
        window(&mut g, now, 20 * MS, true);
        assert_eq!(g.current(), 54, "48 + sqrt(48)");
    }

    #[test]
    fn a_cut_at_most_halves_and_stops_at_the_floor() {
        let mut now = Instant::now();
        let cfg = AdaptiveLimit::between(10, 100);
        let mut g = settled(cfg, 64.0, now);
        now = window(&mut g, now, 200 * MS, true);
        assert_eq!(g.current(), 32, "halved, not cut tenfold");
        // The latency came down with the cut (to what 32 at once gives):
        // still congested, so cut again; never under the floor.
        now = window(&mut g, now, 100 * MS, true);
        assert_eq!(g.current(), 16);
        window(&mut g, now, 50 * MS, true);
        assert_eq!(g.current(), 10);
    }

    #[test]
    fn growth_stops_at_the_ceiling() {
        let mut now = Instant::now();
        let mut g = settled(AdaptiveLimit::between(1, 70), 64.0, now);
        for _ in 0..5 {
            now = window(&mut g, now, 20 * MS, true);
        }
        assert_eq!(g.current(), 70);
        // In slow start too.
        let mut g = Gradient::new(AdaptiveLimit::between(1, 25), now);
        window(&mut g, now, 20 * MS, true);
        assert_eq!(g.current(), 25);
    }

    #[test]
    fn slow_start_adds_one_for_each_fast_piece_of_work_until_congestion() {
        let mut now = Instant::now();
        let mut g = Gradient::new(AdaptiveLimit::new(), now);
        assert_eq!(g.current(), 20);
        now = window(&mut g, now, 20 * MS, true);
        assert_eq!(g.current(), 20 + MIN_SAMPLES as usize);
        // Not reached: no growth.
        now = window(&mut g, now, 20 * MS, false);
        assert_eq!(g.current(), 30);
        // Slow pieces of work do not add; the window is congested: cut.
        window(&mut g, now, 60 * MS, true);
        assert_eq!(g.current(), 15, "30 halved");
        assert!(!g.slow_start);
    }

    #[test]
    fn latency_a_cut_did_not_bring_down_becomes_the_work_s_own() {
        let mut now = Instant::now();
        let mut g = settled(AdaptiveLimit::new(), 64.0, now);
        // The work itself got twice as slow, whatever runs at once.
        now = window(&mut g, now, 40 * MS, true);
        assert_eq!(g.current(), 32);
        now = window(&mut g, now, 40 * MS, true);
        assert_eq!(g.current(), 32, "no second cut");
        assert_eq!(g.base, Some(40 * MS));
        // And grows from there while 40 ms holds.
        window(&mut g, now, 40 * MS, true);
        assert_eq!(g.current(), 37);
        // At the floor, congestion re-learns the work's time at once.
        let mut g = settled(AdaptiveLimit::between(8, 100), 8.0, now);
        window(&mut g, now, 100 * MS, true);
        assert_eq!((g.current(), g.base), (8, Some(100 * MS)));
    }

    #[test]
    fn settings_out_of_range_are_clamped() {
        let s = AdaptiveLimit::between(0, 0);
        assert_eq!((s.floor(), s.ceiling()), (1, 1));
        let s = AdaptiveLimit::between(50, 10);
        assert_eq!((s.floor(), s.ceiling()), (50, 50));
        assert_eq!(AdaptiveLimit::new().tolerance(f64::NAN).tolerance, 1.5);
        assert_eq!(AdaptiveLimit::new().tolerance(0.5).tolerance, 1.05);
        assert_eq!(
            AdaptiveLimit::new().tolerance(f64::INFINITY).tolerance,
            10.0
        );
        assert_eq!(AdaptiveLimit::new().window(Duration::ZERO).window, MS);
        let now = Instant::now();
        let high = Gradient::new(AdaptiveLimit::between(4, 40).initial(1000), now);
        assert_eq!(high.current(), 40);
        let low = Gradient::new(AdaptiveLimit::between(4, 40).initial(0), now);
        assert_eq!(low.current(), 4);
    }

    #[test]
    fn too_few_samples_or_too_short_a_window_decide_nothing() {
        let now = Instant::now();
        let mut g = settled(AdaptiveLimit::new(), 64.0, now);
        g.window.limited = true;
        // Enough samples, but the window is not over.
        for _ in 0..2 * MIN_SAMPLES {
            g.sample(now, 80 * MS, now + 50 * MS);
        }
        assert_eq!(g.current(), 64);
        // Over, but one sample short.
        let mut g = settled(AdaptiveLimit::new(), 64.0, now);
        for _ in 1..MIN_SAMPLES {
            g.sample(now, 80 * MS, now + 200 * MS);
        }
        assert_eq!(g.current(), 64);
        g.sample(now, 80 * MS, now + 200 * MS);
        assert_eq!(g.current(), 32);
    }
}
