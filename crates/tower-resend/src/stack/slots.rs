//! What sits in a stack's optional places, each its own type parameter
//! of [`StackBuilder`]: the circuit breaker (`B`), the fleet (`F`), the
//! hedge (`H`) and the pacing layer (`P`), and what each, once there,
//! lets the builder set (hedged copies, the breaker's meter). The settings
//! that leave the stack's type as it is are in `builder.rs`.

use std::time::Duration;

use super::StackBuilder;
use crate::breaker::CircuitBreakerLayer;
#[cfg(feature = "otel")]
use crate::breaker::NoBreaker;
use crate::classify::HttpClassifier;
use crate::fleet::FleetLayer;
use crate::hedge::{HedgeLayer, Hedging};

impl<C, B, F, H, P> StackBuilder<C, B, F, H, P> {
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
