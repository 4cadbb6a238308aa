//! The state every clone of a pacing layer shares: the quotas under a
//! lock, the calls out, and the counts a [`PaceStats`] shows.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use super::pace::{nanos, Admit, Quotas};
use super::{Doubt, QuotaReader};

/// How the layer tells the wall-clock time a reset written as a time (an
/// epoch, an RFC 3339 time) is read against.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wall {
    /// The system's clock.
    System,
    /// The time `wall` at tokio's instant `at`, and tokio's clock since:
    /// for tests on a paused clock.
    Anchored { at: Instant, wall: SystemTime },
}

impl Wall {
    fn now(self, now: Instant) -> SystemTime {
        match self {
            Self::System => SystemTime::now(),
            Self::Anchored { at, wall } => wall + now.saturating_duration_since(at),
        }
    }
}

/// The settings of a pacing layer.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) reader: QuotaReader,
    pub(crate) burst: u32,
    pub(crate) wall: Wall,
    #[cfg(feature = "otel")]
    pub(crate) metrics: Option<super::metrics::PaceMetrics>,
    /// Where the quotas are shared with other processes, if anywhere.
    #[cfg(feature = "quota-redis")]
    pub(crate) redis: Option<super::RedisQuota>,
}

/// What every clone of one layer shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: Config,
    /// An answer has stated a quota (or a Retry-After): until then, calls
    /// go without taking the lock.
    known: AtomicBool,
    /// Calls that took their place and have no answer yet.
    pending: AtomicU64,
    /// Until then (nanoseconds after `origin`), answers that are not a 429
    /// or a 403 go unread: every quota is far from spent, and the calls
    /// count themselves against the last reading (see
    /// `Quotas::quiet_for`). 0: every answer is read.
    quiet_until: AtomicU64,
    origin: Instant,
    quotas: Mutex<Quotas>,
    waits: AtomicU64,
    waited_us: AtomicU64,
    refused: AtomicU64,
    doubted: AtomicU64,
    ignored: AtomicU64,
    stale: AtomicU64,
    fallbacks: AtomicU64,
}

impl Shared {
    pub(crate) fn new(config: Config) -> Self {
        let origin = Instant::now();
        Self {
            config,
            known: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            quiet_until: AtomicU64::new(0),
            origin,
            quotas: Mutex::new(Quotas::new(origin)),
            waits: AtomicU64::new(0),
            waited_us: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            doubted: AtomicU64::new(0),
            ignored: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
        }
    }

    fn quotas(&self) -> MutexGuard<'_, Quotas> {
        // The rules do not panic; a poisoned lock still holds whole values.
        self.quotas.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// May a call whose deadline is `deadline` go now? Counts the wait or
    /// the refusal, and says it on the current (the attempt's) span.
    /// With the quotas shared, only while Redis is in an outage's quiet
    /// time (else a call [asks](Self::ask)): counted as a fallback.
    pub(crate) fn admit(&self, now: Instant, deadline: Option<Instant>) -> Admit {
        self.admit_at(now, self.ns(now), || deadline)
    }

    /// [`admit`](Self::admit) at `now`, `t` in nanoseconds from the origin
    /// (see [`ns`](Self::ns)).
    pub(crate) fn admit_at(
        &self,
        now: Instant,
        t: u64,
        deadline: impl Fn() -> Option<Instant>,
    ) -> Admit {
        #[cfg(feature = "quota-redis")]
        if self.config.redis.is_some() {
            self.fell_back();
        }
        self.count(now, self.decide(now, t, deadline))
    }

    /// `at` in nanoseconds from the layer's origin, as the quotas and the
    /// tickets keep times.
    pub(crate) fn ns(&self, at: Instant) -> u64 {
        nanos(at.saturating_duration_since(self.origin))
    }

    /// What this process's own view of the quotas says of a call.
    fn decide(&self, now: Instant, t: u64, deadline: impl Fn() -> Option<Instant>) -> Admit {
        if self.known.load(Ordering::Acquire) {
            let mut quotas = self.quotas();
            let admit = quotas.admit(now, t, deadline, self.config.burst);
            if std::mem::take(&mut quotas.near_end) {
                // This call brought a quota near its end: read every answer.
                self.quiet_until.store(0, Ordering::Relaxed);
            }
            admit
        } else {
            Admit::Go
        }
    }

    /// Whether an answer of `status` at `now` may go unread (see
    /// `quiet_until`).
    fn quiet(&self, status: StatusCode, at: u64) -> bool {
        let until = self.quiet_until.load(Ordering::Relaxed);
        until != 0
            && !matches!(
                status,
                StatusCode::TOO_MANY_REQUESTS | StatusCode::FORBIDDEN
            )
            && at < until
    }

    /// Whether a call at `now` asks Redis for its place (feature
    /// `quota-redis`): when the quotas are shared, and Redis is not in an
    /// outage's quiet time.
    #[cfg(feature = "quota-redis")]
    pub(crate) fn asks_redis(&self, now: Instant) -> bool {
        self.config.redis.as_ref().is_some_and(|r| r.asks(now))
    }

    /// Asks Redis for a call's place; when Redis fails, or knows nothing
    /// of the quotas yet, this process's own view says (a failure is
    /// counted). Counts the wait or the refusal as [`admit`](Self::admit).
    #[cfg(feature = "quota-redis")]
    pub(crate) async fn ask(self: std::sync::Arc<Self>, deadline: Option<Instant>) -> Admit {
        use super::redis_quota::Taken;
        let Some(redis) = &self.config.redis else {
            return self.admit(Instant::now(), deadline);
        };
        let time_left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let taken = redis
            .take(time_left, self.config.burst, super::pace::MIN_LEFT)
            .await;
        let now = Instant::now();
        let admit = match taken {
            Some(Taken::Place(after)) if after.is_zero() => Admit::Go,
            Some(Taken::Place(after)) => Admit::Wait {
                until: now + after,
                reserved: true,
            },
            Some(Taken::Spent(after)) => Admit::Wait {
                until: now + after,
                reserved: false,
            },
            Some(Taken::Refused(after)) => Admit::Refuse(after),
            Some(Taken::Unknown) => self.decide(now, self.ns(now), || deadline),
            None => {
                self.fell_back();
                self.decide(now, self.ns(now), || deadline)
            }
        };
        self.count(now, admit)
    }

    /// A call placed by this process's own view: the quotas' shared store
    /// failed (or is in an outage's quiet time).
    #[cfg(feature = "quota-redis")]
    fn fell_back(&self) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "otel")]
        if let Some(m) = &self.config.metrics {
            m.fell_back();
        }
    }

    /// Counts a call's wait or refusal, and says it on the current (the
    /// attempt's) span.
    fn count(&self, now: Instant, admit: Admit) -> Admit {
        match admit {
            Admit::Go => {}
            Admit::Wait { until, reserved } => {
                let wait = until.saturating_duration_since(now);
                self.waits.fetch_add(1, Ordering::Relaxed);
                let us = u64::try_from(wait.as_micros()).unwrap_or(u64::MAX);
                self.waited_us.fetch_add(us, Ordering::Relaxed);
                #[cfg(feature = "otel")]
                if let Some(m) = &self.config.metrics {
                    m.waited(wait, if reserved { "pace" } else { "spent" });
                }
                tracing::debug!(
                    resend.quota.wait_ms = millis(wait),
                    resend.quota.reason = if reserved { "pace" } else { "spent" },
                    "waiting for the upstream's quota",
                );
            }
            Admit::Refuse(wait) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                #[cfg(feature = "otel")]
                if let Some(m) = &self.config.metrics {
                    m.refused();
                }
                tracing::info!(
                    error.type = "quota_spent",
                    resend.quota.reset_ms = millis(wait),
                    "not sent: the upstream's quota has no room before the deadline",
                );
            }
        }
        admit
    }

    /// What an answer of `status` with `headers`, at `now`, says of the
    /// quotas; the call that had it is no longer out.
    fn observe(&self, status: StatusCode, headers: &HeaderMap, now: Instant, sent: u64) {
        let reading = self
            .config
            .reader
            .read(status, headers, self.config.wall.now(now));
        if !reading.doubted.is_empty() {
            self.doubted
                .fetch_add(reading.doubted.len() as u64, Ordering::Relaxed);
            for d in &reading.doubted {
                #[cfg(feature = "otel")]
                if let Some(m) = &self.config.metrics {
                    m.set_aside(doubt_str(d.doubt), 1);
                }
                tracing::debug!(
                    http.response.header = d.field.as_str(),
                    resend.quota.doubt = doubt_str(d.doubt),
                    "a quota value not taken as it was",
                );
            }
        }
        if reading.quotas.is_empty() && reading.retry_after.is_none() {
            return;
        }
        let pending = self.pending.load(Ordering::Acquire);
        let mut quotas = self.quotas();
        let seen = quotas.observe(&reading, now, sent, pending, self.config.reader.reset_cap());
        let quiet = quotas.quiet_for(now);
        self.quiet_until.store(
            if quiet.is_zero() {
                0
            } else {
                self.ns(now + quiet).max(1)
            },
            Ordering::Relaxed,
        );
        #[cfg(feature = "otel")]
        if let Some(m) = &self.config.metrics {
            for b in &quotas.buckets {
                m.remaining(&b.policy, b.left);
            }
        }
        drop(quotas);
        #[cfg(feature = "quota-redis")]
        if let Some(redis) = &self.config.redis {
            if redis.asks(now) {
                let sent = self.origin + Duration::from_nanos(sent);
                redis.note(&reading, sent, pending, self.config.reader.reset_cap());
            }
        }
        self.ignored.fetch_add(seen.ignored, Ordering::Relaxed);
        self.stale.fetch_add(seen.stale, Ordering::Relaxed);
        #[cfg(feature = "otel")]
        if let Some(m) = &self.config.metrics {
            m.set_aside("not_followed", seen.ignored);
            m.set_aside("stale", seen.stale);
        }
        self.known.store(true, Ordering::Release);
    }

    /// What the layer knows and has done so far.
    pub(crate) fn stats(&self, now: Instant) -> PaceStats {
        let held = self.quotas();
        let quotas = held
            .buckets
            .iter()
            .map(|b| {
                let reset_at = held.reset_at(b);
                QuotaLeft {
                    policy: b.policy.clone(),
                    partition: b.partition.clone(),
                    remaining: if now < reset_at { b.left } else { 0 },
                    reset: reset_at.saturating_duration_since(now),
                }
            })
            .collect();
        drop(held);
        PaceStats {
            quotas,
            pending: self.pending.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            waited: Duration::from_micros(self.waited_us.load(Ordering::Relaxed)),
            refused: self.refused.load(Ordering::Relaxed),
            doubted: self.doubted.load(Ordering::Relaxed),
            ignored: self.ignored.load(Ordering::Relaxed),
            stale: self.stale.load(Ordering::Relaxed),
            fallbacks: self.fallbacks.load(Ordering::Relaxed),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn doubt_str(d: Doubt) -> &'static str {
    match d {
        Doubt::Malformed => "malformed",
        Doubt::Negative => "negative",
        Doubt::PastCap => "past_cap",
    }
}

/// A call's place in the quota, from the moment it took one until its
/// answer (or its end without one): while it is out, it spends the quota.
#[derive(Debug)]
pub(crate) struct Ticket {
    shared: Option<std::sync::Arc<Shared>>,
    /// When the call went (or will go, its place taken), in nanoseconds
    /// from the layer's origin: an answer is judged quiet or not by it,
    /// without reading the clock again.
    at: u64,
}

impl Ticket {
    pub(crate) fn new(shared: std::sync::Arc<Shared>, at: Instant) -> Self {
        let at = shared.ns(at);
        Self::at(shared, at)
    }

    /// A ticket for a call that went at `at`, in nanoseconds from the
    /// layer's origin ([`Shared::ns`]).
    pub(crate) fn at(shared: std::sync::Arc<Shared>, at: u64) -> Self {
        shared.pending.fetch_add(1, Ordering::AcqRel);
        Self {
            shared: Some(shared),
            at,
        }
    }

    /// The call's answer came: what it says of the quotas.
    pub(crate) fn answered(mut self, status: StatusCode, headers: &HeaderMap) {
        if let Some(shared) = self.shared.take() {
            shared.pending.fetch_sub(1, Ordering::AcqRel);
            if !shared.quiet(status, self.at) {
                shared.observe(status, headers, Instant::now(), self.at);
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            shared.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What a [`PaceLayer`](super::PaceLayer) knows of the upstream's quotas
/// and what it has done, from [`PaceLayer::stats`](super::PaceLayer::stats):
/// for a gauge of what is left and counters of waits and refusals.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PaceStats {
    /// Each quota the answers stated (at most 16 are followed).
    pub quotas: Vec<QuotaLeft>,
    /// Calls that took their place and have no answer yet.
    pub pending: u64,
    /// Calls that waited (for their place in the pace, or for a reset).
    pub waits: u64,
    /// The time they waited, in all.
    pub waited: Duration,
    /// Calls refused, not sent, with [`ErrorKind::QuotaSpent`](crate::ErrorKind::QuotaSpent).
    pub refused: u64,
    /// Values read off the wire not taken as they were
    /// ([`Doubted`](super::Doubted): malformed, negative, past the cap).
    pub doubted: u64,
    /// Quotas not followed: an upstream that states more than 16.
    pub ignored: u64,
    /// Readings left out because they may tell of the window before the
    /// one the layer holds (their call went before its reset, and their
    /// answer was read after the layer went past it): such a reading
    /// would make the quota whole again too early.
    pub stale: u64,
    /// Calls whose place this process's own view decided because the
    /// quotas' shared store failed (feature `quota-redis`: Redis down, in
    /// error, or not answering within its timeout; and the calls of the
    /// quiet time after). A call that waits for a reset is decided again
    /// after it, and counted again. Always 0 for a layer that shares
    /// nothing.
    pub fallbacks: u64,
}

/// One quota as the layer knows it now.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QuotaLeft {
    /// Its policy ([`Quota::policy`](super::Quota::policy)).
    pub policy: Box<str>,
    /// Its partition key, if any.
    pub partition: Option<Box<[u8]>>,
    /// What may still be sent before its reset: the last answer's count
    /// less the calls out since.
    pub remaining: u64,
    /// Time until it is whole again.
    pub reset: Duration,
}
