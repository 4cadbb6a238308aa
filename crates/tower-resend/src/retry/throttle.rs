//! Client-side throttling, as Google's SRE book ("Handling Overload") and
//! the gRPC clients do it: each client counts, over a recent window, the
//! attempts answered (and those it turned away) and those the upstream
//! accepted, and turns a new attempt away locally with probability
//! `max(0, (requests - K * accepts) / (requests + padding))`. An attempt
//! counts when its answer comes, as in grpc-go: attempts in flight are
//! neither requests nor accepts yet.
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

use super::PerShard;

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
    /// The counts of the last `BINS` bins, by epoch modulo `BINS`, but
    /// for the attempts accepted: the upstream's rejects and the attempts
    /// turned away, written off the success path.
    bins: [AtomicU64; BINS],
    /// The attempts accepted (a request and its accept), by the same bins,
    /// in this thread's shard: the success path writes no count that every
    /// thread's calls share (`stack().adaptive_throttling()` shared by two
    /// threads, each with a runtime of its own as `benches/fleet_cost.rs`
    /// runs them: 1.78x one thread's cost a call with one line, 1.29x with
    /// shards and the retry layer's state apart from its `Arc`'s counts).
    accepted: PerShard<Bins>,
    /// The sums of the window's bins but the newest, set as the window
    /// moves on: an attempt adds the newest bin's count to it rather than
    /// adding up the window.
    older: AtomicU64,
    /// The newest bin's epoch: bins older than `BINS` epochs are out.
    newest: AtomicU64,
    /// Held by whoever moves the window on (once a bin's time, 0.3 s by
    /// default); counting takes no lock.
    advancing: Mutex<()>,
    turned_away: AtomicU64,
}

/// One shard of the accepted attempts' bins.
struct Bins([AtomicU64; BINS]);

impl Default for Bins {
    fn default() -> Self {
        Self([const { AtomicU64::new(0) }; BINS])
    }
}

impl Inner {
    /// Counts `count` (a request, and its accept if it was) in the bin of
    /// `epoch`.
    ///
    /// One relaxed atomic add and a load: the success path takes no
    /// lock (a mutex held twice an attempt cost ~45 ns; an add to a
    /// running sum as well as to the bin, another ~25). The window moves
    /// on under a lock, once a bin's time: the bins it enters are emptied,
    /// the older bins summed, then the new epoch is published, so an add
    /// that sees the new epoch lands in an emptied bin. (An add made from a
    /// clock read a bin late lands in an older bin, and counts from the
    /// window's next move: a count late, never lost.)
    fn count(&self, epoch: u64, count: u64) {
        let newest = self.newest.load(Ordering::Acquire);
        // An answer counts in the newest bin, whatever the bin of its
        // attempt: seen at once, and never in a bin the window has left.
        let epoch = if epoch > newest {
            self.advance(epoch);
            epoch
        } else {
            newest
        };
        let bins = if count == REQUEST | ACCEPT {
            &self.accepted.mine().0
        } else {
            &self.bins
        };
        bins[(epoch % BINS as u64) as usize].fetch_add(count, Ordering::Relaxed);
    }

    /// Every set of bins: the one off the success path, then the shards.
    fn all_bins(&self) -> impl Iterator<Item = &[AtomicU64; BINS]> {
        std::iter::once(&self.bins).chain(self.accepted.all().map(|b| &b.0))
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
        let entering = (epoch - newest).min(BINS as u64);
        for bins in self.all_bins() {
            for e in epoch + 1 - entering..=epoch {
                bins[(e % BINS as u64) as usize].store(0, Ordering::Relaxed);
            }
        }
        let newest_bin = (epoch % BINS as u64) as usize;
        let older = (self.all_bins())
            .flat_map(|bins| bins.iter().enumerate())
            .filter(|&(i, _)| i != newest_bin)
            .map(|(_, bin)| bin.load(Ordering::Relaxed))
            .sum();
        self.older.store(older, Ordering::Relaxed);
        self.newest.store(epoch, Ordering::Release);
    }

    /// The sums of the window ending at `epoch`: with the shards of the
    /// newest bin's accepts (`all`), or without them, which reads no count
    /// the success path writes.
    fn sums(&self, epoch: u64, all: bool) -> (u64, u64) {
        if epoch > self.newest.load(Ordering::Acquire) {
            self.advance(epoch);
        }
        let newest = self.newest.load(Ordering::Acquire);
        let i = (newest % BINS as u64) as usize;
        let bin: u64 = if all {
            self.all_bins().map(|b| b[i].load(Ordering::Relaxed)).sum()
        } else {
            self.bins[i].load(Ordering::Relaxed)
        };
        halves(self.older.load(Ordering::Relaxed) + bin)
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
                accepted: Default::default(),
                older: AtomicU64::new(0),
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
        let (requests, accepts) = self.inner.sums(self.epoch(Instant::now()), true);
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

    /// An attempt about to go out at `now`: let through (the bin to give
    /// [`answered`](Self::answered)) or turned away (`None`).
    ///
    /// The window's answers decide; attempts still in flight are no part
    /// of it (as grpc-go's throttler, which counts a request when its
    /// answer comes): counted as requests before their answer, a burst of
    /// attempts at once (a client's first, or slow calls) would look like
    /// rejections and turn their followers away from an upstream that
    /// accepts them all. An attempt turned away counts as a request not
    /// accepted (so the throttle holds while the upstream has not shown it
    /// accepts again). Reads two counts: no write on the way of an attempt
    /// let through.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let bin = self.epoch(now);
        // Nothing to reject while the upstream accepts: no arithmetic, and
        // the shards of the newest bin's accepts are not read (each adds a
        // request and its accept, which with `K` >= 1 only lowers the
        // probability).
        let (requests, accepts) = self.inner.sums(bin, false);
        if requests as f64 <= self.inner.ratio * accepts as f64 {
            return Some(bin);
        }
        let (requests, accepts) = self.inner.sums(bin, true);
        if requests as f64 <= self.inner.ratio * accepts as f64 {
            return Some(bin);
        }
        let p = self.reject_probability(requests, accepts);
        if p > 0.0 && fastrand::f64() < p {
            self.inner.turned_away.fetch_add(1, Ordering::Relaxed);
            self.inner.count(bin, REQUEST);
            return None;
        }
        Some(bin)
    }

    /// An attempt that `admit` let through in `bin` ended, answered as
    /// `class`: the upstream's reject when it was overloaded or refused the
    /// connection, else its accept; nothing when a layer below refused it
    /// (`refused_below`: a circuit breaker's, a fleet's at capacity), which
    /// is no word of the upstream.
    pub(crate) fn answered_as(&self, bin: u64, class: crate::vocab::Class, refused_below: bool) {
        use crate::vocab::Class;
        if refused_below {
            return;
        }
        let rejected = matches!(class, Class::Overloaded | Class::NotSent);
        self.answered(bin, !rejected);
    }

    /// An attempt that `admit` let through in `bin` ended: a request,
    /// `accepted` unless the upstream was overloaded or refused it. It
    /// counts in the newest bin (the clock is not read again: the window
    /// has moved on if a later attempt's read said so).
    pub(crate) fn answered(&self, bin: u64, accepted: bool) {
        let count = if accepted { REQUEST | ACCEPT } else { REQUEST };
        self.inner.count(bin, count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Accepts counted on other threads (each in its thread's shard) hold
    /// the throttle off as those counted here do.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn accepts_counted_on_other_threads_count() {
        let t = AdaptiveThrottle::new();
        let bin = t.admit(Instant::now()).expect("let through");
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| (0..250).for_each(|_| t.answered(bin, true)));
            }
        });
        (0..300).for_each(|_| t.answered(bin, false));
        // 1 300 requests, 1 000 accepts: under `K` = 2 times the accepts.
        assert_eq!(t.inner.sums(bin, true), (1300, 1000));
        assert_eq!(t.probability(), 0.0);
        assert!((0..100).all(|_| t.admit(Instant::now()).is_some()));
        assert_eq!(t.turned_away(), 0);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_probability_follows_the_sre_rule_over_the_window() {
        let t = AdaptiveThrottle::new();
        let now = Instant::now();
        // Every attempt accepted: never throttled.
        for _ in 0..100 {
            let bin = t.admit(now).expect("let through");
            t.answered(bin, true);
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
                if let Some(bin) = t.admit(now) {
                    sent += 1;
                    let ok = room > 0;
                    room -= u32::from(ok);
                    accepted += u32::from(ok);
                    t.answered(bin, ok);
                }
            }
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        let ratio = f64::from(sent) / f64::from(accepted);
        assert!(ratio < 2.3, "sent {sent}, accepted {accepted}");
        assert!(accepted > 1500, "the capacity is still used: {accepted}");
        assert_eq!(u64::from(20_000 - sent), t.turned_away());
    }

    /// An answer whose attempt began a whole window ago counts now, in the
    /// newest bin: it is seen at once, and never lands in a bin the window
    /// has left (which a later epoch reuses).
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_late_answer_counts_in_the_newest_bin() {
        let t = AdaptiveThrottle::new();
        let slow = t.admit(Instant::now()).expect("let through");
        tokio::time::advance(DEFAULT_THROTTLE_WINDOW + Duration::from_secs(1)).await;
        // Ten requests in the new window, none accepted yet: rejecting.
        for _ in 0..10 {
            t.count(Instant::now(), 1, 0);
        }
        let before = t.probability();
        assert!(before > 0.0, "{before}");
        // The slow attempt's accept lands in the window, at once.
        t.answered(slow, true);
        let (requests, accepts) = t.inner.sums(t.epoch(Instant::now()), true);
        assert_eq!((requests, accepts), (11, 1));
        assert!(t.probability() < before);
    }

    /// A fresh client's first attempts, each answered, are never turned
    /// away (the padding keeps the first few from tipping it).
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_fresh_clients_first_attempts_go_out() {
        for _ in 0..1000 {
            let t = AdaptiveThrottle::new();
            let now = Instant::now();
            for _ in 0..5 {
                let bin = t.admit(now).expect("a first attempt goes out");
                t.answered(bin, true);
            }
        }
    }

    /// Attempts in flight are no rejections: a burst of attempts at once
    /// from a fresh client (or slow calls, many at a time) all go out, and
    /// so do the next ones once they are all accepted. Before, each
    /// counted as a request at once, and the burst's followers saw
    /// requests and no accepts: the eighth was turned away one time in two.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn attempts_in_flight_are_no_rejections() {
        let t = AdaptiveThrottle::new();
        let now = Instant::now();
        let bins: Vec<u64> = (0..1000)
            .map(|_| t.admit(now).expect("nothing rejected yet"))
            .collect();
        assert_eq!(t.probability(), 0.0);
        for bin in bins {
            t.answered(bin, true);
        }
        assert_eq!(t.inner.sums(t.epoch(now), true), (1000, 1000));
        assert!((0..1000).all(|_| t.admit(now).is_some()));
        assert_eq!(t.turned_away(), 0);
    }

    /// An attempt turned away counts as a request the upstream did not
    /// accept: the throttle holds until answers show it accepts again.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_attempt_turned_away_counts_as_a_request_not_accepted() {
        let t = AdaptiveThrottle::new();
        let now = Instant::now();
        let mut rejected = 0;
        while rejected < 100 {
            if let Some(bin) = t.admit(now) {
                t.answered(bin, false);
                rejected += 1;
            }
        }
        let before = t.turned_away();
        assert!(before > 0);
        let turned = (0..100).filter(|_| t.admit(now).is_none()).count() as u64;
        assert!(turned > 50, "{turned}");
        let (requests, accepts) = t.inner.sums(t.epoch(now), true);
        assert_eq!((requests, accepts), (100 + before + turned, 0));
    }

    #[test]
    fn settings_out_of_range_are_clamped() {
        let t = AdaptiveThrottle::new().ratio(0.1).window(Duration::ZERO);
        assert_eq!(t.inner.ratio, 1.0);
        assert_eq!(t.window_len(), Duration::from_secs(1));
        assert_eq!(AdaptiveThrottle::new().ratio(f64::NAN).inner.ratio, 2.0);
    }
}
