//! [`PaceLayer`]: the pacing layer's settings, and the state its clones
//! share.

use std::sync::Arc;
use std::time::SystemTime;

use tokio::time::Instant;
use tower_layer::Layer;

use super::shared::{Config, PaceStats, Shared, Wall};
use super::{Pace, QuotaReader};

/// Paces calls by the quota the upstream states on its answers; see the
/// [module docs](super#pacing).
///
/// Its clones, and every service it makes, share one state: what the
/// answers said of each quota, the calls out, the counts of
/// [`stats`](Self::stats). A setter starts a new state: set it up before
/// cloning it.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::quota::{PaceLayer, QuotaReader};
///
/// let pace = PaceLayer::new()
///     .reader(QuotaReader::new().cap(Duration::from_secs(120)))
///     .burst(4);
/// let github = tower_resend::stack().name("github").pace(pace.clone());
/// # let _ = github;
/// assert_eq!(pace.stats().waits, 0); // its counts, shared with the stack's
/// ```
#[derive(Clone, Debug)]
pub struct PaceLayer {
    pub(crate) shared: Arc<Shared>,
}

/// Calls that may go at once beyond the pace, by default.
pub const DEFAULT_BURST: u32 = 2;

impl Default for PaceLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl PaceLayer {
    /// Reads every form of the [module docs'](super) table, with a reset
    /// cap of 10 minutes, and lets [`DEFAULT_BURST`] calls go at once
    /// beyond the pace.
    pub fn new() -> Self {
        Self::with(Config {
            reader: QuotaReader::new(),
            burst: DEFAULT_BURST,
            wall: Wall::System,
            #[cfg(feature = "otel")]
            metrics: None,
            #[cfg(feature = "quota-redis")]
            redis: None,
        })
    }

    fn with(config: Config) -> Self {
        Self {
            shared: Arc::new(Shared::new(config)),
        }
    }

    fn set(&self, f: impl FnOnce(&mut Config)) -> Self {
        let mut config = self.shared.config.clone();
        f(&mut config);
        Self::with(config)
    }

    /// Reads the answers with `reader`: its [cap](QuotaReader::cap) on
    /// resets (also the longest the layer holds calls back for on what a
    /// peer said), and [forms of your own](QuotaReader::form). Default:
    /// [`QuotaReader::new`].
    #[must_use]
    pub fn reader(self, reader: QuotaReader) -> Self {
        self.set(|c| c.reader = reader)
    }

    /// How many calls may go at once beyond the pace (after a quiet time,
    /// or at a window's reset). Default [`DEFAULT_BURST`]; 0 spreads every
    /// call.
    #[must_use]
    pub fn burst(self, calls: u32) -> Self {
        self.set(|c| c.burst = calls)
    }

    /// Tells the layer that the wall clock reads `now` at this moment, and
    /// to follow tokio's clock from here: resets written as a time (an
    /// epoch, an RFC 3339 time) are then read against it. For tests on
    /// tokio's paused clock, whose upstream writes times from the same
    /// clock. Default: the system's clock, read at each answer.
    #[must_use]
    pub fn wall_clock(self, now: SystemTime) -> Self {
        let at = Instant::now();
        self.set(|c| c.wall = Wall::Anchored { at, wall: now })
    }

    /// Records on instruments made from `meter` (feature `otel`): each
    /// wait (`resend.client.quota.wait`, seconds, by `resend.quota.reason`:
    /// `pace` or `spent`), each refusal (`resend.client.quota.refused`),
    /// what is left of each quota after each answer
    /// (`resend.client.quota.remaining`, a gauge by `resend.quota.policy`),
    /// each value read off the wire and set aside
    /// (`resend.client.quota.set_aside`, by `resend.quota.set_aside`:
    /// `malformed`, `negative`, `past_cap`, `stale`, `not_followed`), and,
    /// with the quotas shared, each call placed by this process's own view
    /// because the store failed (`resend.client.quota.fallbacks`).
    /// Default: none, and no cost.
    ///
    /// ```
    /// let meter = opentelemetry::global::meter("tower-resend");
    /// let pace = tower_resend::quota::PaceLayer::new().meter(&meter);
    /// # let _ = pace;
    /// ```
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(self, meter: &opentelemetry::metrics::Meter) -> Self {
        let metrics = super::metrics::PaceMetrics::new(meter);
        self.set(|c| c.metrics = Some(metrics))
    }

    /// Shares the quotas with every process that paces its calls to the
    /// same upstream through `redis` (feature `quota-redis`): each call
    /// takes its place in Redis, and each answer is written there, so that
    /// the processes together never spend more than the quota. When Redis
    /// fails, calls are paced by this process's own view, which every
    /// answer keeps up to date, and counted ([`PaceStats::fallbacks`]).
    /// See [`RedisQuota`](super::RedisQuota). Default: nothing shared
    /// beyond the layer's clones.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_resend::quota::{PaceLayer, RedisQuota};
    ///
    /// # async fn demo() -> Result<(), redis::RedisError> {
    /// let manager = redis::Client::open("redis://127.0.0.1:6379")?.get_connection_manager().await?;
    /// let quota = RedisQuota::new(manager, "github").timeout(Duration::from_millis(20));
    /// let pace = PaceLayer::new().shared_in(quota);
    /// # let _ = pace;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "quota-redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "quota-redis")))]
    #[must_use]
    pub fn shared_in(self, redis: super::RedisQuota) -> Self {
        self.set(|c| c.redis = Some(redis))
    }

    /// What the layer knows of each quota now, and the calls it made wait
    /// or refused so far (every clone's).
    pub fn stats(&self) -> PaceStats {
        self.shared.stats(Instant::now())
    }
}

impl<S> Layer<S> for PaceLayer {
    type Service = Pace<S>;

    fn layer(&self, inner: S) -> Pace<S> {
        Pace::new(inner, self.clone())
    }
}
