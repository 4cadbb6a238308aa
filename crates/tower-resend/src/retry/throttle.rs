//! Client-side throttling, as Google's SRE book ("Handling Overload") and
//! the gRPC clients do it: each client counts, over a recent window, the
//! attempts it made and those the upstream accepted, and turns a new
//! attempt away locally with probability
//! `max(0, (requests - K * accepts) / (requests + padding))`.
//!
//! When an upstream rejects most calls for minutes, the retry budget bounds
//! the retries but every first attempt still goes out; with the throttle,
//! the upstream receives about `K` times what it accepts, and the calls
//! turned away cost it nothing. As it recovers, accepts come back and the
//! probability falls to zero within the window.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// The default ratio `K`: an upstream receives about twice what it accepts.
pub const DEFAULT_THROTTLE_RATIO: f64 = 2.0;
/// The default window over which attempts and accepts are counted.
pub const DEFAULT_THROTTLE_WINDOW: Duration = Duration::from_secs(30);
/// The window's bins (grpc-go's: 100).
const BINS: usize = 100;
/// Added to the requests in the probability's denominator, so that a few
/// early rejections do not turn calls away (grpc-go's padding).
const PADDING: f64 = 8.0;

/// Adaptive client-side throttling for a [`RetryLayer`](super::RetryLayer)
/// or a stack ([`StackBuilder::adaptive_throttling`](crate::stack::StackBuilder::adaptive_throttling)):
/// gates first attempts and retries alike. An attempt it turns away is not
/// sent: the call fails at once with
/// [`ErrorKind::Throttled`](crate::ErrorKind::Throttled), which a job
/// runner can requeue. An attempt counts as accepted unless the upstream
/// said it was overloaded or refused the connection (a 4xx the caller
/// caused is an accept). Clones share one window.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::retry::AdaptiveThrottle;
///
/// let throttle = AdaptiveThrottle::new().ratio(2.0).window(Duration::from_secs(30));
/// let stack = tower_resend::stack().adaptive_throttle(throttle.clone());
/// // Later: how likely an attempt is to be turned away now.
/// assert_eq!(throttle.probability(), 0.0);
/// # let _ = stack;
/// ```
#[derive(Clone)]
pub struct AdaptiveThrottle {
    inner: Arc<Inner>,
}

/// Requests in a count's high half, accepts in its low half: one atomic
/// add counts either, and one load reads both.
const REQUEST: u64 = 1 << 32;
const ACCEPT: u64 = 1;

fn halves(count: u64) -> (u64, u64) {
    (count >> 32, count & 0xffff_ffff)
}

struct Inner {
    ratio: f64,
    bin_nanos: u64,
    origin: Instant,
    /// The counts of the last `BINS` bins, by epoch modulo `BINS`.
    bins: [AtomicU64; BINS],
    /// Their sums, kept as bins come and go, so that an attempt reads one
    /// number rather than adding up the window.
    sums: AtomicU64,
    /// The newest bin's epoch: bins older than `BINS` epochs are out.
    newest: AtomicU64,
    /// Held by whoever moves the window on (once a bin's time, 0.3 s by
    /// default); counting takes no lock.
    advancing: Mutex<()>,
    turned_away: AtomicU64,
}

impl Inner {
    /// Counts `count` (a request, or an accept) in the bin of `epoch`.
    ///
    /// Two relaxed atomic adds, and a look at the newest epoch: the
    /// success path takes no lock (a mutex held twice an attempt cost
    /// ~45 ns). The window moves on under a lock, once a bin's time: the
    /// bins it leaves behind are emptied, then taken off the sums, then the
    /// new epoch is published, so an add that sees the new epoch lands in
    /// an emptied bin. (An add made from a clock read a whole window old
    /// would land in a recycled bin: a count out of place, never lost from
    /// the sums for good.)
    fn count(&self, epoch: u64, count: u64) -> u64 {
        if epoch > self.newest.load(Ordering::Acquire) {
            self.advance(epoch);
        }
        self.bins[(epoch % BINS as u64) as usize].fetch_add(count, Ordering::Relaxed);
        self.sums.fetch_add(count, Ordering::Relaxed)
    }

    /// Moves the window on to `epoch`.
    fn advance(&self, epoch: u64) {
        let _moving = self
            .advancing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let newest = self.newest.load(Ordering::Acquire);
        if epoch <= newest {
            return;
        }
        let leaving = (epoch - newest).min(BINS as u64);
        let (mut requests, mut accepts) = (0, 0);
        for e in epoch + 1 - leaving..=epoch {
            let (r, a) = halves(self.bins[(e % BINS as u64) as usize].swap(0, Ordering::Relaxed));
            requests += r;
            accepts += a;
        }
        // Taken off half by half, never below zero (an add between the
        // swap and here is in the sums already, or will be).
        let _ = self
            .sums
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |sums| {
                let (r, a) = halves(sums);
                Some((r.saturating_sub(requests) << 32) | a.saturating_sub(accepts))
            });
        self.newest.store(epoch, Ordering::Release);
    }

    /// The sums of the window ending at `epoch`.
    fn sums(&self, epoch: u64) -> (u64, u64) {
        if epoch > self.newest.load(Ordering::Acquire) {
            self.advance(epoch);
        }
        halves(self.sums.load(Ordering::Relaxed))
    }
}

impl Default for AdaptiveThrottle {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for AdaptiveThrottle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveThrottle")
            .field("ratio", &self.inner.ratio)
            .field("window", &self.window_len())
            .field("probability", &self.probability())
            .field("turned_away", &self.turned_away())
            .finish()
    }
}

impl AdaptiveThrottle {
    /// A throttle with the SRE rule's defaults: `K` = 2 over 30 s.
    pub fn new() -> Self {
        Self::build(DEFAULT_THROTTLE_RATIO, DEFAULT_THROTTLE_WINDOW)
    }

    fn build(ratio: f64, window: Duration) -> Self {
        let bin_nanos = u64::try_from((window / BINS as u32).as_nanos()).unwrap_or(u64::MAX);
        Self {
            inner: Arc::new(Inner {
                ratio,
                bin_nanos: bin_nanos.max(1),
                origin: Instant::now(),
                bins: [const { AtomicU64::new(0) }; BINS],
                sums: AtomicU64::new(0),
                newest: AtomicU64::new(0),
                advancing: Mutex::new(()),
                turned_away: AtomicU64::new(0),
            }),
        }
    }

    /// `K`: the upstream receives about `K` times the attempts it accepts
    /// (at least 1; the SRE book's 2 by default, lower is more aggressive).
    /// A value out of range is clamped; one that is not a number keeps the
    /// default.
    #[must_use]
    pub fn ratio(self, k: f64) -> Self {
        let k = if k.is_finite() {
            k.clamp(1.0, 100.0)
        } else {
            DEFAULT_THROTTLE_RATIO
        };
        Self::build(k, self.window_len())
    }

    /// The window over which attempts and accepts are counted (at least
    /// 1 s; 30 s by default).
    #[must_use]
    pub fn window(self, window: Duration) -> Self {
        Self::build(self.inner.ratio, window.max(Duration::from_secs(1)))
    }

    fn window_len(&self) -> Duration {
        Duration::from_nanos(self.inner.bin_nanos) * BINS as u32
    }

    /// The probability that an attempt is turned away now.
    pub fn probability(&self) -> f64 {
        let (requests, accepts) = self.inner.sums(self.epoch(Instant::now()));
        self.reject_probability(requests, accepts)
    }

    /// Records the probability that an attempt is turned away now as the
    /// gauge `resend.client.throttle.probability` (unit `1`) on `meter`,
    /// observed at each collection while the throttle lives (call it after
    /// [`ratio`](Self::ratio) and [`window`](Self::window), which make a new
    /// window). Attempts turned away are in the call metrics already, as
    /// calls that ended with `error.type` `throttled`.
    ///
    /// ```
    /// use tower_resend::retry::AdaptiveThrottle;
    ///
    /// let meter = opentelemetry::global::meter("tower-resend");
    /// let throttle = AdaptiveThrottle::new().meter(&meter);
    /// let stack = tower_resend::stack().adaptive_throttle(throttle);
    /// # let _ = stack;
    /// ```
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(self, meter: &opentelemetry::metrics::Meter) -> Self {
        let watched = Arc::downgrade(&self.inner);
        meter
            .f64_observable_gauge("resend.client.throttle.probability")
            .with_unit("1")
            .with_description(
                "The probability that the adaptive throttle turns an attempt away now",
            )
            .with_callback(move |gauge| {
                if let Some(inner) = watched.upgrade() {
                    gauge.observe(Self { inner }.probability(), &[]);
                }
            })
            .build();
        self
    }

    /// Attempts turned away so far.
    pub fn turned_away(&self) -> u64 {
        self.inner.turned_away.load(Ordering::Relaxed)
    }

    fn reject_probability(&self, requests: u64, accepts: u64) -> f64 {
        let requests = requests as f64;
        let excess = requests - self.inner.ratio * accepts as f64;
        (excess / (requests + PADDING)).max(0.0)
    }

    fn epoch(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.inner.origin);
        let nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
        nanos / self.inner.bin_nanos
    }

    /// Adds to the bin of `now`.
    #[cfg(test)]
    fn count(&self, now: Instant, requests: u32, accepts: u32) {
        let count = u64::from(requests) * REQUEST + u64::from(accepts) * ACCEPT;
        self.inner.count(self.epoch(now), count);
    }

    /// An attempt about to go out at `now`: counted, and let through
    /// (true) or turned away (false).
    pub(crate) fn admit(&self, now: Instant) -> bool {
        // The window before this attempt decides (a client's first attempt
        // is never turned away); the attempt then counts as a request
        // whether it goes out or not.
        let (requests, accepts) = halves(self.inner.count(self.epoch(now), REQUEST));
        // Nothing to reject while the upstream accepts: no arithmetic.
        if requests as f64 <= self.inner.ratio * accepts as f64 {
            return true;
        }
        let p = self.reject_probability(requests, accepts);
        if p > 0.0 && fastrand::f64() < p {
            self.inner.turned_away.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// An attempt let through ended at `now`: `accepted` unless the
    /// upstream was overloaded or refused it.
    pub(crate) fn answered(&self, now: Instant, accepted: bool) {
        if accepted {
            self.inner.count(self.epoch(now), ACCEPT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_probability_follows_the_sre_rule_over_the_window() {
        let t = AdaptiveThrottle::new();
        let now = Instant::now();
        // Every attempt accepted: never throttled.
        for _ in 0..100 {
            assert!(t.admit(now));
            t.answered(now, true);
        }
        assert_eq!(t.probability(), 0.0);

        // 100 requests, 10 of them accepted.
        let t = AdaptiveThrottle::new();
        for i in 0..100 {
            t.count(now, 1, u32::from(i % 10 == 0));
        }
        let p = t.probability();
        let want = (100.0 - 2.0 * 10.0) / (100.0 + PADDING);
        assert!((p - want).abs() < 1e-9, "{p} {want}");

        // Rejections that are fed back move it; once they leave the
        // window, it is back to zero.
        tokio::time::advance(DEFAULT_THROTTLE_WINDOW).await;
        assert_eq!(t.probability(), 0.0);
    }

    /// An upstream with capacity for a tenth of what the callers offer
    /// (10 000 attempts a second, 1 000 accepted): throttled, it receives
    /// about twice what it accepts.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_upstream_at_a_tenth_of_the_load_gets_about_k_times_its_accepts() {
        let t = AdaptiveThrottle::new();
        let (mut sent, mut accepted) = (0u32, 0u32);
        for _slice in 0..200 {
            // 10 ms: 100 attempts offered, room for 10.
            let mut room = 10;
            for _ in 0..100 {
                let now = Instant::now();
                if t.admit(now) {
                    sent += 1;
                    let ok = room > 0;
                    room -= u32::from(ok);
                    accepted += u32::from(ok);
                    t.answered(now, ok);
                }
            }
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        let ratio = f64::from(sent) / f64::from(accepted);
        assert!(ratio < 2.3, "sent {sent}, accepted {accepted}");
        assert!(accepted > 1500, "the capacity is still used: {accepted}");
        assert_eq!(u64::from(20_000 - sent), t.turned_away());
    }

    /// A fresh client's first attempts, each answered, are never turned
    /// away (the padding keeps the first few from tipping it).
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_fresh_clients_first_attempts_go_out() {
        for _ in 0..1000 {
            let t = AdaptiveThrottle::new();
            let now = Instant::now();
            for _ in 0..5 {
                assert!(t.admit(now));
                t.answered(now, true);
            }
        }
    }

    #[test]
    fn settings_out_of_range_are_clamped() {
        let t = AdaptiveThrottle::new().ratio(0.1).window(Duration::ZERO);
        assert_eq!(t.inner.ratio, 1.0);
        assert_eq!(t.window_len(), Duration::from_secs(1));
        assert_eq!(AdaptiveThrottle::new().ratio(f64::NAN).inner.ratio, 2.0);
    }
}
