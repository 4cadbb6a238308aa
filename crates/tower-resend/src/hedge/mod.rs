//! Hedged calls: a backup copy of a slow attempt, only where it is safe.

mod future;
mod rules;
mod slot;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderName, Request, Response};

use tower_layer::Layer;
use tower_service::Service;

use crate::body::Replay;
use crate::classify::{Classify, HttpClassifier, RequestFacts};
use crate::error::BoxError;
use crate::name::Name;
use crate::retry::{NoRetry, RetryBudget, DEFAULT_HEDGE_SHARE, RESEND_PREVIOUS_ATTEMPTS};
use crate::telemetry::{CallMetrics, ClientMetrics};
pub use crate::vocab::Hedged;
pub use future::ResponseFuture;
use future::Template;
pub(crate) use slot::sealed::WrapsHedge;
pub use slot::{HedgeSlot, Hedging, NoHedge};

/// When a backup copy goes out.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Delay {
    /// A fixed time after the last copy.
    Fixed(Duration),
    /// At the `p` quantile of recent calls' latency, never sooner than
    /// `at_least`.
    Percentile { p: f64, at_least: Duration },
}

/// Sends a backup copy of a replay-safe attempt that is slow to answer (as
/// gRPC's hedging policy, A6, and Finagle's backup requests do), and takes
/// the first good answer.
///
/// Only a request the classifier calls replay-safe is hedged: an idempotent
/// method, or one with an Idempotency-Key (every copy carries the same
/// key). Backups have a budget of their own, a share of the calls
/// ([`max_share`](Self::max_share), 10 % by default: when every call is
/// slow, not every call is hedged), and each also spends a token of the
/// [`RetryBudget`]; none is sent when either is dry. At most
/// [`max_copies`](Self::max_copies) are in flight (2 by default: the first
/// and one backup). Every copy after the first says how many came before
/// it, as a retry does (`resend-previous-attempts`, or
/// `grpc-previous-rpc-attempts` on gRPC): a server that sheds load
/// (`tower_resend_server::ShedLayer`) sheds backups before first attempts. A final answer from any
/// copy (a success, or a rejection) ends the call and drops the others (a
/// copy dropped mid-body closes its connection rather than reuse it); an
/// answer that may change (overloaded, unknown, not sent) sends the next
/// copy at once, unless the server asked for a wait (`Retry-After`,
/// `grpc-retry-pushback-ms`), which stops further copies and, once none is
/// left in flight, goes up to the retry layer. The call's one deadline
/// bounds every copy. The winning response says what happened in a
/// [`Hedged`] extension, and so does the attempt's record in the call's
/// [`Attempts`](crate::retry::Attempts) ([`copies`](crate::retry::Attempt::copies),
/// [`winning_copy`](crate::retry::Attempt::winning_copy)).
///
/// [`StackBuilder::hedge`](crate::stack::StackBuilder::hedge) puts it in the stack
/// (inside the retry layer, which treats the hedged copies as one attempt).
///
/// ```
/// use std::time::Duration;
/// use tower_resend::hedge::HedgeLayer;
///
/// // A backup after 20 ms; or at the 95th percentile of recent calls.
/// let fixed = HedgeLayer::new(Duration::from_millis(20));
/// let adaptive = HedgeLayer::at_percentile(0.95, Duration::from_millis(5));
/// # let _ = (fixed, adaptive);
/// ```
#[derive(Clone, Debug)]
pub struct HedgeLayer<C = HttpClassifier> {
    delay: Delay,
    max_copies: u32,
    budget: Option<RetryBudget>,
    share: RetryBudget,
    attempt_header: Option<HeaderName>,
    classifier: C,
    metrics: ClientMetrics,
    upstream: Option<Name>,
}

impl HedgeLayer<HttpClassifier> {
    /// A backup `after` the first copy has not answered.
    pub fn new(after: Duration) -> Self {
        Self {
            delay: Delay::Fixed(after),
            max_copies: 2,
            budget: None,
            share: RetryBudget::share(DEFAULT_HEDGE_SHARE),
            attempt_header: Some(RESEND_PREVIOUS_ATTEMPTS),
            classifier: HttpClassifier::new(),
            metrics: ClientMetrics::OFF,
            upstream: None,
        }
    }

    /// A backup once the first copy has taken longer than the `p` quantile
    /// (0 to 1, say 0.95) of recent calls' latency, and at least
    /// `at_least` (also the delay until 64 calls have been seen).
    pub fn at_percentile(p: f64, at_least: Duration) -> Self {
        Self {
            delay: Delay::Percentile {
                p: if p.is_finite() {
                    p.clamp(0.0, 1.0)
                } else {
                    0.95
                },
                at_least,
            },
            ..Self::new(at_least)
        }
    }
}

impl<C> HedgeLayer<C> {
    /// At most `n` copies in flight, the first included (at least 1: no
    /// hedging). Default 2.
    #[must_use]
    pub fn max_copies(mut self, n: u32) -> Self {
        self.max_copies = n.max(1);
        self
    }

    /// Backups spend tokens of `budget` (a stack gives its retry budget).
    /// Without one, backups are limited by the copies alone.
    #[must_use]
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// At most this share of the calls (0 to 1) send a backup copy, plus
    /// about one a second, so that a quiet client still hedges. Default
    /// 0.1, the share published adaptive-hedging designs use: when an
    /// upstream slows every call, one in ten is hedged, not all of them.
    /// The clones of a layer share it.
    #[must_use]
    pub fn max_share(mut self, share: f64) -> Self {
        self.share = RetryBudget::share(share);
        self
    }

    /// Backups spend tokens of `share` instead of the layer's share of the
    /// calls (a gRPC hedging policy hedges every call:
    /// [`RetryBudget::every_call`]).
    #[must_use]
    #[cfg_attr(not(feature = "service-config"), allow(dead_code))]
    pub(crate) fn share_budget(mut self, share: RetryBudget) -> Self {
        self.share = share;
        self
    }

    /// Backup copies of HTTP requests say how many copies came before them
    /// on `name` (gRPC requests always use `grpc-previous-rpc-attempts`).
    /// Default [`RESEND_PREVIOUS_ATTEMPTS`]; a stack gives its retry
    /// layer's.
    #[must_use]
    pub fn attempt_header(mut self, name: Option<HeaderName>) -> Self {
        self.attempt_header = name;
        self
    }

    /// Classifies with `classifier` (a stack gives its retry classifier).
    #[must_use]
    pub fn classifier<C2>(self, classifier: C2) -> HedgeLayer<C2> {
        HedgeLayer {
            delay: self.delay,
            max_copies: self.max_copies,
            budget: self.budget,
            share: self.share,
            attempt_header: self.attempt_header,
            classifier,
            metrics: self.metrics,
            upstream: self.upstream,
        }
    }

    /// Records the copies of each hedged attempt on the stack's instruments
    /// (`resend.client.hedge.copies`), for the upstream `name`.
    pub(crate) fn metrics(mut self, metrics: ClientMetrics, name: Option<Name>) -> Self {
        self.metrics = metrics;
        self.upstream = name;
        self
    }

    /// Names the upstream in what this layer records (`resend.upstream`).
    /// A stack gives its own name.
    #[must_use]
    pub fn upstream(mut self, name: impl Into<Name>) -> Self {
        self.upstream = Some(name.into());
        self
    }

    /// Records the copies of each hedged attempt, and which one won, on
    /// `resend.client.hedge.copies`, made from `meter` (see the
    /// [table](crate::telemetry#metrics-feature-otel)). A stack gives its
    /// own meter. Default: none, and no cost.
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(mut self, meter: &opentelemetry::metrics::Meter) -> Self {
        self.metrics = ClientMetrics::new(meter);
        self
    }
}

impl<S, C: Clone> Layer<S> for HedgeLayer<C> {
    type Service = Hedge<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        // One copy: nothing to share, and a clone of the service copies no
        // `Arc` for it.
        let shared = (self.max_copies > 1).then(|| {
            Arc::new(Shared {
                delay: self.delay,
                max_copies: self.max_copies,
                budget: self.budget.clone(),
                share: self.share.clone(),
                attempt_header: self.attempt_header.clone(),
                classifier: self.classifier.clone(),
                latency: Latency::default(),
                metrics: self.metrics.bind(self.upstream.as_ref()),
            })
        });
        Hedge { inner, shared }
    }
}

struct Shared<C> {
    delay: Delay,
    max_copies: u32,
    budget: Option<RetryBudget>,
    /// The backups' own budget: a share of the calls.
    share: RetryBudget,
    attempt_header: Option<HeaderName>,
    classifier: C,
    latency: Latency,
    metrics: CallMetrics,
}

/// Recent latencies, and their quantile, refreshed every 64.
#[derive(Default)]
struct Latency {
    recent: Mutex<VecDeque<Duration>>,
    quantile_nanos: AtomicU64,
}

impl Latency {
    const KEEP: usize = 512;
    const EVERY: usize = 64;

    fn record(&self, took: Duration, p: f64) {
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        if recent.len() == Self::KEEP {
            recent.pop_front();
        }
        recent.push_back(took);
        if recent.len().is_multiple_of(Self::EVERY) {
            let mut sorted: Vec<Duration> = recent.iter().copied().collect();
            sorted.sort_unstable();
            let i = ((sorted.len() - 1) as f64 * p).round() as usize;
            let q = sorted.get(i).copied().unwrap_or_default();
            let nanos = u64::try_from(q.as_nanos()).unwrap_or(u64::MAX);
            self.quantile_nanos.store(nanos, Ordering::Relaxed);
        }
    }

    fn quantile(&self) -> Option<Duration> {
        match self.quantile_nanos.load(Ordering::Relaxed) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }
}

impl<C> Shared<C> {
    fn after(&self) -> Duration {
        match self.delay {
            Delay::Fixed(d) => d,
            Delay::Percentile { at_least, .. } => self
                .latency
                .quantile()
                .map_or(at_least, |q| q.max(at_least)),
        }
    }
}

/// Middleware that hedges replay-safe attempts; see [`HedgeLayer`].
pub struct Hedge<S, C = HttpClassifier> {
    inner: S,
    /// None when only one copy may be in flight: nothing is hedged.
    shared: Option<Arc<Shared<C>>>,
}

impl<S: Clone, C> Clone for Hedge<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: std::fmt::Debug, C> std::fmt::Debug for Hedge<S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Hedge");
        d.field("inner", &self.inner);
        match &self.shared {
            Some(shared) => d
                .field("delay", &shared.delay)
                .field("max_copies", &shared.max_copies),
            None => d.field("max_copies", &1),
        };
        d.finish_non_exhaustive()
    }
}

impl<S, C, B, R> Service<Request<B>> for Hedge<S, C>
where
    S: Service<Request<B>, Response = Response<R>> + Clone,
    S::Error: Into<BoxError>,
    C: Classify<R>,
    B: Replay,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, S, B, C, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // What the copies are made of: the head, and a body replaying from
        // the start (none: too large to keep, so no copies).
        let copies = self
            .shared
            .as_ref()
            .filter(|shared| {
                req.extensions().get::<NoRetry>().is_none()
                    && Classify::<R>::is_replay_safe(&shared.classifier, &RequestFacts::of(&req))
            })
            .and_then(|shared| {
                let template = Template::of(&req, shared.attempt_header.as_ref())?;
                // A call that may be hedged earns its share.
                shared.share.deposit();
                Some((template, Arc::clone(shared)))
            });
        let first = self.inner.call(req);
        match copies {
            // Not hedged (the usual call): no box, no timer.
            None => ResponseFuture::direct(first),
            Some((template, shared)) => {
                ResponseFuture::hedged(first, self.inner.clone(), template, shared)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The adaptive delay: `at_least` until 64 calls are seen, then the
    /// quantile of the recent ones (never under `at_least`), refreshed
    /// every 64.
    #[test]
    fn the_adaptive_delay_follows_recent_latency() {
        let layer = HedgeLayer::at_percentile(0.9, Duration::from_millis(5));
        let hedge = layer.layer(());
        let shared = hedge.shared.as_ref().unwrap();
        assert_eq!(shared.after(), Duration::from_millis(5));
        // 64 calls of 1 to 64 ms: the 0.9 quantile is 58 ms.
        for ms in 1..=64 {
            shared.latency.record(Duration::from_millis(ms), 0.9);
        }
        assert_eq!(shared.after(), Duration::from_millis(58));
        // 512 fast ones (the slow ones out of the 512 kept): the quantile
        // falls, but never under the floor.
        for _ in 0..512 {
            shared.latency.record(Duration::from_micros(100), 0.9);
        }
        assert_eq!(shared.after(), Duration::from_millis(5));
        // A fixed delay is fixed.
        let fixed = HedgeLayer::new(Duration::from_millis(20)).layer(());
        assert_eq!(fixed.shared.unwrap().after(), Duration::from_millis(20));
        // One copy: nothing shared, nothing hedged.
        let one = HedgeLayer::new(Duration::from_millis(20)).max_copies(1);
        assert!(one.layer(()).shared.is_none());
    }
}
