use crate::name::Name;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::HeaderName;
use tower_layer::Layer;

use super::policy::Policy;
use super::streak::Streak;
use super::{AdaptiveThrottle, Backoff, Retry, RetryBudget};
use crate::classify::HttpClassifier;
use crate::telemetry::{CallMetrics, ClientMetrics};

/// The header on which a later attempt of a gRPC call says how many attempts
/// came before it (gRPC's retry design, A6).
pub const GRPC_PREVIOUS_RPC_ATTEMPTS: HeaderName =
    HeaderName::from_static("grpc-previous-rpc-attempts");

/// The header on which a later attempt of an HTTP request says how many
/// attempts came before it (by default; see
/// [`RetryLayer::attempt_header`]): `resend-previous-attempts: 1` on the
/// first retry, 2 on the second. The first attempt carries none, as with
/// gRPC's [`GRPC_PREVIOUS_RPC_ATTEMPTS`]: a server that sheds load reads
/// its absence as a first attempt, and sheds the retries first
/// (`tower_resend_server::ShedLayer`).
pub const RESEND_PREVIOUS_ATTEMPTS: HeaderName =
    HeaderName::from_static("resend-previous-attempts");

/// Retries what is safe to retry, when it is worth it, and nothing else.
///
/// After each attempt the classifier says what the server may have done
/// ([`classify`](crate::classify)); the layer then decides by the table of
/// the [module docs](super): it returns final answers, never resends a
/// request that may have been processed unless it is replay-safe (an
/// idempotent method, or an Idempotency-Key), and retries the rest after a
/// wait while attempts, time before the deadline and the shared
/// [`RetryBudget`] last.
///
/// Defaults: 3 attempts in all, [`Backoff::DEFAULT`] (100 ms base, doubling,
/// 5 s cap, full jitter), an overload floor of 1 s, server waits honoured up to
/// 30 s and spread over half as much again, 50 ms as the least useful
/// attempt, 64 KiB of body kept for replays, and the [default
/// budget](RetryBudget::default) with up to 5 s of waiting for a token.
///
/// Attempts of replay-safe requests are marked so that a
/// [`ReadAheadLayer`](crate::read_ahead::ReadAheadLayer) below reads their small
/// response bodies before returning them: a break inside one is then a
/// failed attempt, retried.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::retry::{Backoff, RetryLayer};
///
/// let layer = RetryLayer::new()
///     .max_attempts(4)
///     .backoff(Backoff::new(Duration::from_millis(50), 2.0, Duration::from_secs(2)).unwrap())
///     .upstream("shipping");
/// # let _ = layer;
/// ```
#[derive(Clone, Debug)]
pub struct RetryLayer<C = HttpClassifier> {
    pub(crate) classifier: C,
    policy: Policy,
    pub(crate) budget: Option<RetryBudget>,
    seed: Option<u64>,
    upstream: Option<Name>,
    pub(crate) attempt_header: Option<HeaderName>,
    metrics: ClientMetrics,
    /// A fleet layer below picks instances: each call carries the record
    /// of those it used.
    pub(crate) fleet: bool,
    throttle: Option<AdaptiveThrottle>,
}

/// What every clone of one retry service shares, on cache lines of its
/// own (`align(128)`, as crossbeam's `CachePadded`): the `Arc`'s counts,
/// which every clone of the stack writes, would otherwise share a line
/// with what every call reads (`stack()` shared by two threads, run as
/// `benches/fleet_cost.rs` runs them: 1.64x one thread's cost a call,
/// 1.36x apart).
#[repr(align(128))]
pub(crate) struct Shared<S, C> {
    /// Later attempts go through a clone of this, made only when a retry
    /// happens: the success path clones no inner service (a hyper client
    /// clone is several reference counts that cores contend for). Behind a
    /// mutex so that a service that is `Send` but not `Sync` still works.
    pub(crate) template: Mutex<S>,
    pub(crate) classifier: C,
    pub(crate) policy: Policy,
    pub(crate) budget: Option<RetryBudget>,
    pub(crate) seed: Option<u64>,
    pub(crate) calls: AtomicU64,
    pub(crate) upstream: Option<Name>,
    /// Where a later attempt of an HTTP request says how many came before
    /// it (gRPC requests always use `grpc-previous-rpc-attempts`).
    pub(crate) attempt_header: Option<HeaderName>,
    /// The instruments the calls record on, if the layer was given a meter.
    pub(crate) metrics: CallMetrics,
    pub(crate) fleet: bool,
    /// Client-side throttling, if on: gates every attempt.
    pub(crate) throttle: Option<AdaptiveThrottle>,
    /// The calls' attempts failing in a row: whether the upstream fails
    /// as a whole.
    pub(crate) streak: Streak,
}

impl<S, C: std::fmt::Debug> std::fmt::Debug for Shared<S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("classifier", &self.classifier)
            .field("policy", &self.policy)
            .field("budget", &self.budget)
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl<S: Clone, C> Shared<S, C> {
    /// A fresh handle on the inner service, for a retry.
    pub(crate) fn service(&self) -> S {
        self.template
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl RetryLayer<HttpClassifier> {
    /// A retry layer with the defaults and the [`HttpClassifier`].
    pub fn new() -> Self {
        Self {
            classifier: HttpClassifier::new(),
            policy: Policy::default(),
            budget: Some(RetryBudget::default()),
            seed: None,
            upstream: None,
            attempt_header: Some(RESEND_PREVIOUS_ATTEMPTS),
            metrics: ClientMetrics::OFF,
            fleet: false,
            throttle: None,
        }
    }
}

impl Default for RetryLayer<HttpClassifier> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> RetryLayer<C> {
    /// Classifies attempts with `classifier` instead.
    pub fn classifier<C2>(self, classifier: C2) -> RetryLayer<C2> {
        RetryLayer {
            classifier,
            policy: self.policy,
            budget: self.budget,
            seed: self.seed,
            upstream: self.upstream,
            attempt_header: self.attempt_header,
            metrics: self.metrics,
            fleet: self.fleet,
            throttle: self.throttle,
        }
    }

    /// Attempts in all, the first included. Default 3; 1 turns retries off
    /// (0 counts as 1). An attempt refused before it was sent, which a
    /// fleet sends on at once to an instance the call has not used, is not
    /// counted, as gRPC's transparent retries are not (see the
    /// [module docs](super)).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.policy.max_attempts = attempts.max(1);
        self
    }

    /// The backoff between attempts. Default [`Backoff::DEFAULT`].
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.policy.backoff = backoff;
        self
    }

    /// The least wait after an overloaded answer (429, 503) without
    /// `Retry-After`, so throttling is never retried within milliseconds.
    /// Default 1 s.
    #[must_use]
    pub fn overload_floor(mut self, floor: Duration) -> Self {
        self.policy.overload_floor = floor;
        self
    }

    /// The longest wait a server may ask for (`Retry-After`) that the layer
    /// honours; a longer one ends retrying, as the layer neither waits that
    /// long nor comes back sooner than asked. Default 30 s.
    #[must_use]
    pub fn max_server_wait(mut self, max: Duration) -> Self {
        self.policy.max_server_wait = max;
        self
    }

    /// The least time an attempt must have before the deadline for a retry to
    /// be worth it. Default 50 ms.
    #[must_use]
    pub fn min_attempt_time(mut self, min: Duration) -> Self {
        self.policy.min_attempt = min;
        self
    }

    /// How many bytes of request body to keep for replays; a larger body is
    /// sent once and not retried. Default 64 KiB.
    #[must_use]
    pub fn replay_cap(mut self, bytes: usize) -> Self {
        self.policy.replay_cap = bytes;
        self
    }

    /// How far a server-requested wait (`Retry-After`, gRPC pushback) and
    /// the overload floor are spread: a client told to wait `w` comes back
    /// at a random time in `[w, w * (1 + spread)]` (plus the backoff's
    /// jitter), never earlier than asked, so that clients told the same
    /// thing do not come back in step. Default 0.5; values outside 0 to 10
    /// are clamped to it.
    #[must_use]
    pub fn wait_spread(mut self, spread: f64) -> Self {
        self.policy.wait_spread = if spread.is_nan() {
            0.0
        } else {
            spread.clamp(0.0, 10.0)
        };
        self
    }

    /// The longest a retry waits for a token of the [budget](Self::budget)
    /// when it finds none (and the call's deadline allows). A call whose
    /// time cannot fit ends [`BudgetExhausted`](crate::ErrorKind::BudgetExhausted).
    /// Default 5 s; zero fails at once.
    #[must_use]
    pub fn max_budget_wait(mut self, max: Duration) -> Self {
        self.policy.max_budget_wait = max;
        self
    }

    /// The shared retry budget. Default [`RetryBudget::default`]. Every
    /// service this layer makes, and every clone of them, share it.
    #[must_use]
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Retries without a budget: only attempts and time limit them.
    #[must_use]
    pub fn no_budget(mut self) -> Self {
        self.budget = None;
        self
    }

    /// Seeds the jitter, so a test sees the same waits on every run. Each call
    /// still draws its own sequence. Default: seeded from the system.
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Makes every attempt after the first of an HTTP request say how many
    /// attempts came before it, as `name: N`, so that an overloaded upstream
    /// can shed retries first. gRPC requests always carry it as
    /// [`grpc-previous-rpc-attempts`](GRPC_PREVIOUS_RPC_ATTEMPTS), as gRPC's
    /// own retries do. The first attempt carries nothing. Default:
    /// [`RESEND_PREVIOUS_ATTEMPTS`]; [`no_attempt_header`](Self::no_attempt_header)
    /// sends none on HTTP.
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_resend::retry::RetryLayer;
    ///
    /// let layer = RetryLayer::new().attempt_header(HeaderName::from_static("x-retry-attempt"));
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn attempt_header(mut self, name: HeaderName) -> Self {
        self.attempt_header = Some(name);
        self
    }

    /// Sends no attempt header on HTTP requests (gRPC ones still carry
    /// [`grpc-previous-rpc-attempts`](GRPC_PREVIOUS_RPC_ATTEMPTS)).
    #[must_use]
    pub fn no_attempt_header(mut self) -> Self {
        self.attempt_header = None;
        self
    }

    /// Throttles on the client side with `throttle` (see
    /// [`AdaptiveThrottle`]): when the upstream has been rejecting most
    /// attempts, first attempts and retries alike are turned away here, not
    /// sent, with [`ErrorKind::Throttled`](crate::ErrorKind::Throttled). Its
    /// clones share one window. Default: off.
    #[must_use]
    pub fn adaptive_throttle(mut self, throttle: AdaptiveThrottle) -> Self {
        self.throttle = Some(throttle);
        self
    }

    /// Names the upstream in errors and tracing. Default: unnamed.
    #[must_use]
    pub fn upstream(mut self, name: impl Into<Name>) -> Self {
        self.upstream = Some(name.into());
        self
    }

    /// Records the calls' metrics (attempts, retries, waits, budget
    /// exhaustion, outcome-unknown ends) on instruments made from `meter`,
    /// once, and shared by every service this layer makes: see the
    /// [table](crate::telemetry#metrics-feature-otel). Default: none, and
    /// no cost.
    ///
    /// ```
    /// use tower_resend::retry::RetryLayer;
    ///
    /// // The application's meter provider (here the global one, a no-op
    /// // until one is set).
    /// let meter = opentelemetry::global::meter("tower-resend");
    /// let layer = RetryLayer::new().upstream("shipping").meter(&meter);
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(mut self, meter: &opentelemetry::metrics::Meter) -> Self {
        self.metrics = ClientMetrics::new(meter);
        self
    }

    /// How many bytes of a stream body are kept for replays.
    pub(crate) fn kept_bytes(&self) -> usize {
        self.policy.replay_cap
    }

    /// The instruments given, if any (the stack hands them to its breaker).
    pub(crate) fn metrics(&self) -> &ClientMetrics {
        &self.metrics
    }
}

impl<C> RetryLayer<C> {
    /// What `layer` makes, consuming the configuration (no `C: Clone` needed).
    pub(crate) fn into_service<S: Clone>(self, inner: S) -> Retry<S, C> {
        Retry::from_shared(
            inner.clone(),
            Arc::new(Shared {
                template: Mutex::new(inner),
                classifier: self.classifier,
                policy: self.policy,
                budget: self.budget,
                seed: self.seed,
                calls: AtomicU64::new(0),
                metrics: self.metrics.bind(self.upstream.as_ref()),
                upstream: self.upstream,
                attempt_header: self.attempt_header,
                fleet: self.fleet,
                throttle: self.throttle,
                streak: Streak::default(),
            }),
        )
    }
}

impl<S: Clone, C: Clone> Layer<S> for RetryLayer<C> {
    type Service = Retry<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        self.clone().into_service(inner)
    }
}
