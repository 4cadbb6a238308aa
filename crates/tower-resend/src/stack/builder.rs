use std::time::Duration;

use http::header::HeaderName;

use super::{DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_TOTAL};
use crate::breaker::{CircuitBreakerLayer, NoBreaker};
use crate::classify::HttpClassifier;
use crate::deadline::DeadlineHeaderLayer;
use crate::fleet::{FleetLayer, NoFleet};
use crate::hedge::{HedgeLayer, Hedging, NoHedge};
use crate::idempotency::SetIdempotencyKeyLayer;
use crate::name::Name;
use crate::quota::NoPace;
use crate::read_ahead::DEFAULT_READ_AHEAD;
use crate::retry::{Backoff, RetryBudget, RetryLayer};

/// Builds a [`Stack`](crate::stack::Stack); see [`stack()`](crate::stack()). Every setting's default is stated on
/// its method.
///
/// `C` classifies attempts for the retry layer; `B` is the circuit
/// breaker's place: [`NoBreaker`], or a [`CircuitBreakerLayer`](crate::breaker::CircuitBreakerLayer) once
/// [`circuit_breaker`](Self::circuit_breaker) put one there; `F` is the
/// fleet's place: [`NoFleet`], or a [`FleetLayer`] once
/// [`fleet`](Self::fleet) put one there; `H` is the hedge's place:
/// [`NoHedge`], or [`Hedging`] once [`hedge`](Self::hedge) turned it on;
/// `P` is the pacing layer's place: [`NoPace`], or a `PaceLayer` once
/// `pace` (feature `quota`) put one there.
/// How the settings become a stack is in `compose.rs`.
#[derive(Clone, Debug)]
pub struct StackBuilder<C = HttpClassifier, B = NoBreaker, F = NoFleet, H = NoHedge, P = NoPace> {
    pub(super) settings: Settings,
    pub(super) retry: RetryLayer<C>,
    pub(super) breaker: B,
    pub(super) fleet: F,
    pub(super) hedging: H,
    pub(super) pacing: P,
}

/// The settings whose types do not change with the classifier, the
/// breaker or the fleet.
#[derive(Clone, Debug)]
pub(super) struct Settings {
    pub(super) name: Option<Name>,
    pub(super) total: Duration,
    pub(super) attempt_timeout: Duration,
    pub(super) keys: SetIdempotencyKeyLayer,
    pub(super) header: DeadlineHeaderLayer,
    pub(super) read_ahead_cap: usize,
    pub(super) idle: Option<Duration>,
    /// The hedge's settings once [`hedge`](StackBuilder::hedge) (or
    /// `hedge_at_percentile`, or `maybe_hedge` with a time) turned it on.
    pub(super) hedge: Option<HedgeLayer<()>>,
}

impl StackBuilder {
    /// The defaults; see [`stack()`](crate::stack()).
    pub fn new() -> Self {
        Self {
            settings: Settings {
                name: None,
                total: DEFAULT_TOTAL,
                attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
                keys: SetIdempotencyKeyLayer::disabled(),
                header: DeadlineHeaderLayer::new(),
                read_ahead_cap: DEFAULT_READ_AHEAD,
                idle: None,
                hedge: None,
            },
            retry: RetryLayer::new(),
            breaker: NoBreaker,
            fleet: NoFleet,
            hedging: NoHedge,
            pacing: NoPace,
        }
    }
}

impl Default for StackBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl<C, B, F, H, P> StackBuilder<C, B, F, H, P> {
    /// Names the upstream: it shows up in errors, tracing and 504 bodies,
    /// names the circuit breaker (unless its layer was named), and counts
    /// this upstream's [derived](crate::idempotency::derive_keys)
    /// Idempotency-Keys. Default: unnamed.
    ///
    /// ```
    /// use tower::{service_fn, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let never = service_fn(|_: http::Request<_>| std::future::pending::<Result<http::Response<String>, tower_resend::BoxError>>());
    /// let shipping = tower_resend::stack().name("shipping").total(std::time::Duration::from_secs(1)).service(never);
    /// let err = shipping.oneshot(http::Request::new(String::new())).await.unwrap_err();
    /// assert_eq!(err.upstream(), Some("shipping"));
    /// # }
    /// ```
    #[must_use]
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        let name = name.into();
        self.retry = self.retry.upstream(name.clone());
        self.settings.keys = self.settings.keys.upstream(name.clone());
        self.settings.name = Some(name);
        self
    }

    /// The deadline budget of a call, shrunk to an inherited one. Default 10 s.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let slow = service_fn(|_: http::Request<_>| async {
    ///     tokio::time::sleep(Duration::from_secs(60)).await;
    ///     Ok::<_, tower_resend::BoxError>(http::Response::new(String::new()))
    /// });
    /// let stack = tower_resend::stack().total(Duration::from_secs(2)).service(slow);
    /// let start = tokio::time::Instant::now();
    /// let err = stack.oneshot(http::Request::new(String::new())).await.unwrap_err();
    /// assert_eq!(start.elapsed(), Duration::from_secs(2));
    /// assert!(err.is_deadline_exceeded());
    /// # }
    /// ```
    #[must_use]
    pub fn total(mut self, total: Duration) -> Self {
        self.settings.total = total;
        self
    }

    /// The limit of one attempt (never more than the time left). Default 5 s.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// use tower_resend::ErrorKind;
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let slow = service_fn(|_: http::Request<_>| async {
    ///     tokio::time::sleep(Duration::from_secs(60)).await;
    ///     Ok::<_, tower_resend::BoxError>(http::Response::new(String::new()))
    /// });
    /// // A POST without a key is not retried: its one attempt is cut at 1 s.
    /// let stack = tower_resend::stack().attempt_timeout(Duration::from_secs(1)).service(slow);
    /// let req = http::Request::post("/charges").body(String::new()).unwrap();
    /// let err = stack.oneshot(req).await.unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::OutcomeUnknown); // it may have run
    /// assert_eq!(err.attempts(), 1);
    /// # }
    /// ```
    #[must_use]
    pub fn attempt_timeout(mut self, per_attempt: Duration) -> Self {
        self.settings.attempt_timeout = per_attempt;
        self
    }

    /// Attempts in all, the first included. Default 3.
    ///
    /// ```
    /// use tower::{service_fn, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let unavailable = service_fn(|_: http::Request<_>| async {
    ///     Ok::<_, tower_resend::BoxError>(http::Response::builder().status(503).body(String::new()).unwrap())
    /// });
    /// let stack = tower_resend::stack().max_attempts(2).no_budget().service(unavailable);
    /// let resp = stack.oneshot(http::Request::new(String::new())).await.unwrap();
    /// assert_eq!(resp.extensions().get::<tower_resend::retry::Attempts>().unwrap().len(), 2);
    /// # }
    /// ```
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.retry = self.retry.max_attempts(attempts);
        self
    }

    /// The backoff between attempts. Default [`Backoff::DEFAULT`].
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.retry = self.retry.backoff(backoff);
        self
    }

    /// The retry budget, shared by every clone of the stack. Default
    /// [`RetryBudget::default`].
    #[must_use]
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.retry = self.retry.budget(budget);
        self
    }

    /// No retry budget: only attempts and time limit retries.
    #[must_use]
    pub fn no_budget(mut self) -> Self {
        self.retry = self.retry.no_budget();
        self
    }

    /// Throttles on the client side, by the SRE rule with its defaults (an
    /// upstream that rejects most calls receives about twice what it
    /// accepts; see [`AdaptiveThrottle`](crate::retry::AdaptiveThrottle)):
    /// attempts turned away fail at once, not sent, with
    /// [`ErrorKind::Throttled`](crate::ErrorKind::Throttled). Shared by
    /// every clone of the stack. Default: off.
    #[must_use]
    pub fn adaptive_throttling(self) -> Self {
        self.adaptive_throttle(crate::retry::AdaptiveThrottle::new())
    }

    /// Throttles on the client side with `throttle` (its ratio and window
    /// set; keep a clone to read its probability). Default: off.
    #[must_use]
    pub fn adaptive_throttle(mut self, throttle: crate::retry::AdaptiveThrottle) -> Self {
        self.retry = self.retry.adaptive_throttle(throttle);
        self
    }

    /// Seeds the jitter, for tests. Default: seeded from the system.
    ///
    /// ```
    /// let stack = tower_resend::stack().seed(7); // the same waits on every run
    /// # let _ = stack;
    /// ```
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.retry = self.retry.seed(seed);
        self
    }

    /// Configures the retry layer further (overload floor, server waits,
    /// replay cap…).
    #[must_use]
    pub fn retry<C2>(
        self,
        f: impl FnOnce(RetryLayer<C>) -> RetryLayer<C2>,
    ) -> StackBuilder<C2, B, F, H, P> {
        StackBuilder {
            settings: self.settings,
            retry: f(self.retry),
            breaker: self.breaker,
            fleet: self.fleet,
            hedging: self.hedging,
            pacing: self.pacing,
        }
    }

    /// Adds a circuit breaker with the defaults (see [`CircuitBreakerLayer`](crate::breaker::CircuitBreakerLayer):
    /// open when 10 % of at least 100 attempts in 30 s say the upstream is
    /// unwell, for 5 s, then 3 probes). It sits inside the retry layer and
    /// outside the attempt timeout, so it counts every attempt, timeouts
    /// included, and is shared by every clone of the stack. While it is
    /// open, calls fail at once with
    /// [`ErrorKind::CircuitOpen`](crate::ErrorKind::CircuitOpen), not sent.
    /// The stack is then a `Stack<S, C, CircuitBreakerLayer>`. Default: no
    /// breaker, and no layer in its place.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let shipping = tower_resend::stack()
    ///     .name("shipping")
    ///     .attempt_timeout(Duration::from_secs(2))
    ///     .circuit_breaker();
    /// # let _ = shipping;
    /// ```
    #[must_use]
    pub fn circuit_breaker(self) -> StackBuilder<C, CircuitBreakerLayer, F, H, P> {
        self.circuit_breaker_with(CircuitBreakerLayer::new())
    }

    /// Adds the circuit breaker `layer`, configured (ratio, throughput,
    /// window, break, probes, what counts, its classifier); see
    /// [`circuit_breaker`](Self::circuit_breaker). An unnamed layer takes
    /// the stack's [`name`](Self::name). Default: no breaker.
    #[must_use]
    pub fn circuit_breaker_with<K>(
        self,
        layer: CircuitBreakerLayer<K>,
    ) -> StackBuilder<C, CircuitBreakerLayer<K>, F, H, P> {
        // The stack's meter, if it has one, counts the breaker's changes
        // too (unless the layer has its own).
        StackBuilder {
            settings: self.settings,
            breaker: layer.or_metrics(self.retry.metrics()),
            retry: self.retry,
            fleet: self.fleet,
            hedging: self.hedging,
            pacing: self.pacing,
        }
    }

    /// Declares that this upstream honours `Idempotency-Key`: unsafe requests
    /// get one key per call (the caller's [`IdempotencyKey`](crate::IdempotencyKey),
    /// a key [derived](crate::idempotency::derive_keys) from a keyed inbound
    /// operation, or a UUID v4), reused on every attempt, which makes them
    /// replay-safe. Default: off.
    ///
    /// ```
    /// use tower::{service_fn, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let upstream = service_fn(|req: http::Request<_>| async move {
    ///     let status = if req.headers().contains_key("idempotency-key") { 201 } else { 400 };
    ///     Ok::<_, tower_resend::BoxError>(http::Response::builder().status(status).body(String::new()).unwrap())
    /// });
    /// let stack = tower_resend::stack().idempotency_keys().service(upstream);
    /// let post = http::Request::post("/orders").body(String::new()).unwrap();
    /// let resp = stack.oneshot(post).await.unwrap();
    /// assert_eq!(resp.status(), 201); // a generated key went out
    /// # }
    /// ```
    #[must_use]
    pub fn idempotency_keys(mut self) -> Self {
        self.settings.keys = match &self.settings.name {
            Some(name) => SetIdempotencyKeyLayer::new().upstream(name.clone()),
            None => SetIdempotencyKeyLayer::new(),
        };
        self
    }

    /// Reads the response bodies of replay-safe attempts up to `bytes`
    /// (whatever length they declare) before returning them, so that a
    /// connection that breaks inside one is a failed attempt, retried; the
    /// rest of a longer body, gRPC and event streams reach the caller as
    /// they come, and a break in them is the caller's error (see
    /// [`ReadAheadLayer`](crate::read_ahead::ReadAheadLayer)). Default [`DEFAULT_READ_AHEAD`] (64 KiB); 0 turns
    /// it off.
    ///
    /// ```
    /// // Small bodies only (4 KiB), or none at all.
    /// let small = tower_resend::stack().read_ahead(4 * 1024);
    /// let off = tower_resend::stack().read_ahead(0);
    /// # let _ = (small, off);
    /// ```
    #[must_use]
    pub fn read_ahead(mut self, bytes: usize) -> Self {
        self.settings.read_ahead_cap = bytes;
        self
    }

    /// Fails a response body that sends nothing for `idle` (reqwest's
    /// `read_timeout`; see [`ReadAheadLayer::idle_timeout`](crate::read_ahead::ReadAheadLayer::idle_timeout)): while it is read ahead,
    /// that fails the attempt, which a replay-safe request retries; later,
    /// the caller's read fails. Default: none (the attempt timeout and the
    /// deadline still bound what is read ahead).
    ///
    /// ```
    /// use std::time::Duration;
    /// let stack = tower_resend::stack().idle_timeout(Duration::from_secs(5));
    /// # let _ = stack;
    /// ```
    #[must_use]
    pub fn idle_timeout(mut self, idle: Duration) -> Self {
        self.settings.idle = Some(idle);
        self
    }

    /// Hedges replay-safe attempts: a backup copy `after` the first has not
    /// answered, the first good answer wins (see [`HedgeLayer`]: a backup
    /// spends a retry-budget token, at most two copies go out, each with
    /// the same Idempotency-Key, a POST without a key is never hedged, at
    /// most a tenth of the calls send one: [`hedge_share`](StackBuilder::hedge_share)).
    /// The stack is then a `Stack<S, C, B, F, Hedging>`. Default: off, and
    /// no layer in the hedge's place.
    ///
    /// ```
    /// use std::time::Duration;
    /// let stack = tower_resend::stack().hedge(Duration::from_millis(20));
    /// # let _ = stack;
    /// ```
    #[must_use]
    pub fn hedge(self, after: Duration) -> StackBuilder<C, B, F, Hedging, P> {
        self.hedging_with(HedgeLayer::new(after).classifier(()))
    }

    /// Hedges as [`hedge`](Self::hedge) does, sending the backup once the
    /// first copy has taken longer than the `p` quantile of recent calls
    /// (say 0.95), and at least `at_least`.
    #[must_use]
    pub fn hedge_at_percentile(
        self,
        p: f64,
        at_least: Duration,
    ) -> StackBuilder<C, B, F, Hedging, P> {
        self.hedging_with(HedgeLayer::at_percentile(p, at_least).classifier(()))
    }

    /// Hedges as [`hedge`](Self::hedge) does when `after` is `Some`; with
    /// `None` the stack sends one copy of each attempt, as one without
    /// hedging does, whatever `hedge_copies` and `hedge_share` say. For a
    /// setting read at run time: the stack has the hedge layer either way
    /// (one type), at its small cost when it does not hedge.
    ///
    /// ```
    /// use std::time::Duration;
    /// let hedge_after: Option<Duration> = None; // from your configuration
    /// let stack = tower_resend::stack().maybe_hedge(hedge_after).hedge_copies(3);
    /// # let _ = stack;
    /// ```
    #[must_use]
    pub fn maybe_hedge(self, after: Option<Duration>) -> StackBuilder<C, B, F, Hedging, P> {
        match after {
            Some(after) => self.hedge(after),
            None => self.hedgeable(),
        }
    }

    /// The hedge's place given a [`Hedge`](crate::hedge::Hedge) layer,
    /// which sends one copy unless [`hedge`](Self::hedge) turned hedging
    /// on: for tables of stacks of one type (routes, a gRPC service
    /// config), some of which hedge.
    pub(crate) fn hedgeable(self) -> StackBuilder<C, B, F, Hedging, P> {
        StackBuilder {
            settings: self.settings,
            retry: self.retry,
            breaker: self.breaker,
            fleet: self.fleet,
            hedging: Hedging,
            pacing: self.pacing,
        }
    }

    fn hedging_with(mut self, hedge: HedgeLayer<()>) -> StackBuilder<C, B, F, Hedging, P> {
        self.settings.hedge = Some(hedge);
        self.hedgeable()
    }

    /// Sends each attempt to one instance of a fleet (see
    /// [`fleet`](crate::fleet)): a retry or a hedged copy goes to another
    /// instance than the ones this call used, instances that keep failing
    /// are set aside, and an instance's `Retry-After` (or the overload
    /// floor) does not hold back an attempt that can go elsewhere.
    /// The stack is then a `Stack<S, C, B, FleetLayer>`, and classifies
    /// the instances' answers with its retry classifier. Default: none,
    /// one upstream address (the request's URI), and no layer in the
    /// fleet's place.
    ///
    /// ```
    /// use tower_resend::fleet::FleetLayer;
    /// let fleet = FleetLayer::fixed(["http://10.0.0.1:80", "http://10.0.0.2:80"]).unwrap();
    /// let stack = tower_resend::stack().fleet(fleet);
    /// # let _ = stack;
    /// ```
    #[must_use]
    pub fn fleet<C2>(self, fleet: FleetLayer<C2>) -> StackBuilder<C, B, FleetLayer, H, P> {
        StackBuilder {
            settings: self.settings,
            retry: self.retry,
            breaker: self.breaker,
            // (The stack classifies with its retry classifier.)
            fleet: fleet.classifier(HttpClassifier::new()),
            hedging: self.hedging,
            pacing: self.pacing,
        }
    }

    /// Paces every attempt by the quota the upstream states on its answers
    /// (see [`quota`](crate::quota#pacing)): the calls that remain are
    /// spread over the time that remains, a call waits for a spent quota's
    /// reset within its deadline, and fails at once, not sent, with
    /// [`ErrorKind::QuotaSpent`](crate::ErrorKind::QuotaSpent) when the
    /// reset is past it. It sits under the hedge and above the deadline
    /// header, so that every attempt and every hedged copy takes its place
    /// in the quota, its wait is outside the attempt timeout and inside the
    /// call's deadline, and the time left written below is what is left
    /// after it. Shared by every clone of the stack (and of `layer`). The
    /// stack is then a `Stack<S, C, B, F, H, PaceLayer>`. Default: none,
    /// and no layer in its place.
    ///
    /// ```
    /// use tower_resend::quota::PaceLayer;
    /// let github = tower_resend::stack().name("github").pace(PaceLayer::new());
    /// # let _ = github;
    /// ```
    #[cfg(feature = "quota")]
    #[cfg_attr(docsrs, doc(cfg(feature = "quota")))]
    #[must_use]
    pub fn pace(
        self,
        layer: crate::quota::PaceLayer,
    ) -> StackBuilder<C, B, F, H, crate::quota::PaceLayer> {
        StackBuilder {
            settings: self.settings,
            retry: self.retry,
            breaker: self.breaker,
            fleet: self.fleet,
            hedging: self.hedging,
            pacing: layer,
        }
    }

    /// Also writes the time left, in milliseconds, as `name` on HTTP requests
    /// (gRPC requests always carry `grpc-timeout`). Default: none.
    #[must_use]
    pub fn deadline_header(mut self, name: HeaderName) -> Self {
        self.settings.header = self.settings.header.http_header(name);
        self
    }
}

impl<C, B, F, P> StackBuilder<C, B, F, Hedging, P> {
    /// At most `n` copies of a hedged attempt (the first included), when
    /// hedging is on. Default 2.
    #[must_use]
    pub fn hedge_copies(mut self, n: u32) -> Self {
        self.settings.hedge = self.settings.hedge.map(|h| h.max_copies(n));
        self
    }

    /// At most this share of the calls (0 to 1) send a backup copy (plus
    /// about one a second: see [`HedgeLayer::max_share`]), when hedging is
    /// on. Default 0.1.
    #[must_use]
    pub fn hedge_share(mut self, share: f64) -> Self {
        self.settings.hedge = self.settings.hedge.map(|h| h.max_share(share));
        self
    }

    /// Every call may hedge, as a gRPC hedging policy says (no share of
    /// the calls; the copies, the deadline and the retry budget, if any,
    /// still limit them).
    #[must_use]
    #[cfg_attr(not(feature = "service-config"), allow(dead_code))]
    pub(crate) fn hedge_every_call(mut self) -> Self {
        self.settings.hedge =
            (self.settings.hedge).map(|h| h.share_budget(crate::retry::RetryBudget::every_call()));
        self
    }
}

#[cfg(feature = "otel")]
impl<C, F, H, P> StackBuilder<C, NoBreaker, F, H, P> {
    /// Records the stack's metrics on instruments made from `meter` (your
    /// meter provider's, or [`global_meter`](crate::telemetry::global_meter)):
    /// attempts and retries per call, each wait, budget exhaustion,
    /// outcome-unknown ends, and the circuit breaker's changes of state
    /// once one is added, named by the stack's [name](Self::name); see the
    /// [table](crate::telemetry#metrics-feature-otel). Default: none, and
    /// no cost.
    ///
    /// ```
    /// // `provider.meter("tower-resend")` from your `SdkMeterProvider`; the
    /// // global provider here, a no-op until one is set.
    /// let meter = opentelemetry::global::meter("tower-resend");
    /// let shipping = tower_resend::stack().name("shipping").meter(&meter);
    /// # let _ = shipping;
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(mut self, meter: &opentelemetry::metrics::Meter) -> Self {
        self.retry = self.retry.meter(meter);
        self
    }
}

#[cfg(feature = "otel")]
impl<C, K, F, H, P> StackBuilder<C, CircuitBreakerLayer<K>, F, H, P> {
    /// Records the stack's metrics on instruments made from `meter`, the
    /// circuit breaker's changes of state included (unless its layer was
    /// given a meter of its own); see the `meter` of a stack without a
    /// breaker, and the [table](crate::telemetry#metrics-feature-otel).
    /// Default: none, and no cost.
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(mut self, meter: &opentelemetry::metrics::Meter) -> Self {
        self.retry = self.retry.meter(meter);
        self.breaker = self.breaker.or_metrics(self.retry.metrics());
        self
    }
}
