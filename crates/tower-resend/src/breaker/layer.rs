use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::per_instance::InstanceCircuits;
use super::shared::{Breaker, Config};
use super::state::{Classes, Rules};
use super::CircuitBreaker;
use crate::classify::{Class, HttpClassifier};
use crate::deadline::clamp;
use crate::name::Name;
use crate::telemetry::ClientMetrics;

/// Default failure ratio that opens the circuit: 10 %.
pub const DEFAULT_FAILURE_RATIO: f64 = 0.1;
/// Default least number of calls in the window before the ratio counts: 100.
pub const DEFAULT_MIN_THROUGHPUT: u32 = 100;
/// Default sampling window: 30 s.
pub const DEFAULT_SAMPLING_WINDOW: Duration = Duration::from_secs(30);
/// Default time the circuit stays open: 5 s.
pub const DEFAULT_BREAK_DURATION: Duration = Duration::from_secs(5);
/// Default number of probes the half-open circuit lets through, all of
/// which must succeed to close it: 3.
pub const DEFAULT_PROBES: u32 = 3;

/// The shortest sampling window: 10 ms (ten buckets of a millisecond).
const MIN_WINDOW: Duration = Duration::from_millis(10);
/// The shortest break: 1 ms.
const MIN_BREAK: Duration = Duration::from_millis(1);

/// Opens a circuit per upstream when it looks unwell, so that calls fail at
/// once instead of waiting on it; see the [module docs](super).
///
/// Defaults, as Polly's and seatbelt's: the circuit opens when at least
/// [100 calls](DEFAULT_MIN_THROUGHPUT) ended in the last
/// [30 s](DEFAULT_SAMPLING_WINDOW) and [10 %](DEFAULT_FAILURE_RATIO) of
/// them failed; it stays open for [5 s](DEFAULT_BREAK_DURATION), then lets
/// [3 probes](DEFAULT_PROBES) through: one failure opens it again, three
/// successes close it. Failures are the [`HttpClassifier`]'s
/// [`Unknown`](Class::Unknown) (5xx, timeouts, resets),
/// [`Overloaded`](Class::Overloaded) (429, 503) and
/// [`NotSent`](Class::NotSent) (refused or timed-out connections).
///
/// Each service the layer makes has a breaker of its own, which every clone
/// of that service shares: build the service once per upstream and clone it.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::breaker::CircuitBreakerLayer;
///
/// let layer = CircuitBreakerLayer::new()
///     .failure_ratio(0.25)
///     .expect("a ratio in (0, 1]")
///     .min_throughput(20)
///     .sampling_window(Duration::from_secs(10))
///     .break_duration(Duration::from_secs(2))
///     .probes(1)
///     .upstream("shipping");
/// # let _ = layer;
/// assert!(CircuitBreakerLayer::new().failure_ratio(1.5).is_err());
/// ```
#[derive(Clone, Debug)]
pub struct CircuitBreakerLayer<K = HttpClassifier> {
    classifier: K,
    config: Config,
}

/// Why a circuit breaker setting was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidCircuitBreaker {
    reason: &'static str,
}

impl fmt::Display for InvalidCircuitBreaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid circuit breaker: {}", self.reason)
    }
}

impl std::error::Error for InvalidCircuitBreaker {}

impl CircuitBreakerLayer<HttpClassifier> {
    /// A breaker with the defaults and the [`HttpClassifier`].
    pub const fn new() -> Self {
        Self {
            classifier: HttpClassifier::new(),
            config: Config {
                rules: Rules {
                    ratio_ppm: 100_000,
                    min_throughput: DEFAULT_MIN_THROUGHPUT,
                    break_duration: DEFAULT_BREAK_DURATION,
                    probes: DEFAULT_PROBES,
                },
                window: DEFAULT_SAMPLING_WINDOW,
                failing: Classes::DEFAULT,
                upstream: None,
                metrics: ClientMetrics::OFF,
            },
        }
    }
}

impl Default for CircuitBreakerLayer<HttpClassifier> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K> CircuitBreakerLayer<K> {
    /// Classifies attempts with `classifier` instead. The breaker shows it
    /// each attempt's result, the request's method, and whether the request
    /// was gRPC (as `content-type: application/grpc`); it keeps no copy of
    /// the request's URI or headers, so that the success path copies
    /// nothing, and shows `/` and no other header instead. tower-resend's
    /// classifiers classify results without them, as far as what the
    /// breaker counts goes: the default [`HttpClassifier`] reads a gRPC
    /// answer's `grpc-status`.
    pub fn classifier<K2>(self, classifier: K2) -> CircuitBreakerLayer<K2> {
        CircuitBreakerLayer {
            classifier,
            config: self.config,
        }
    }

    /// The share of the window's calls that must fail to open the circuit,
    /// in `(0, 1]`: 0.1 opens it when 10 % or more failed. Default 0.1.
    ///
    /// A ratio that is not a number, zero or less, or more than one is
    /// refused.
    pub fn failure_ratio(mut self, ratio: f64) -> Result<Self, InvalidCircuitBreaker> {
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(InvalidCircuitBreaker {
                reason: "the failure ratio must be a number above 0 and at most 1",
            });
        }
        // In (0, 1] after the check: the product is in (0, 1e6].
        let ppm = (ratio * 1_000_000.0).round().max(1.0) as u32;
        self.config.rules.ratio_ppm = ppm;
        Ok(self)
    }

    /// The least number of calls that must have ended in the window before
    /// the ratio can open the circuit, so that a few failures of a quiet
    /// client do not. Default 100; 0 counts as 1.
    #[must_use]
    pub fn min_throughput(mut self, calls: u32) -> Self {
        self.config.rules.min_throughput = calls.max(1);
        self
    }

    /// How far back the window counts calls and failures; it slides by a
    /// tenth of its length. Default 30 s; at least 10 ms (a shorter one
    /// counts as 10 ms).
    #[must_use]
    pub fn sampling_window(mut self, window: Duration) -> Self {
        self.config.window = clamp(window).max(MIN_WINDOW);
        self
    }

    /// How long the circuit stays open before it probes the upstream.
    /// Default 5 s; at least 1 ms (a shorter one counts as 1 ms).
    #[must_use]
    pub fn break_duration(mut self, duration: Duration) -> Self {
        self.config.rules.break_duration = clamp(duration).max(MIN_BREAK);
        self
    }

    /// How many probes the half-open circuit lets through at once; one
    /// failure opens it again, and that many successes close it. The other
    /// calls fail at once meanwhile. Default 3; 0 counts as 1.
    #[must_use]
    pub fn probes(mut self, probes: u32) -> Self {
        self.config.rules.probes = probes.max(1);
        self
    }

    /// The classes of attempt results counted as failures. Default
    /// [`Unknown`](Class::Unknown), [`Overloaded`](Class::Overloaded) and
    /// [`NotSent`](Class::NotSent). [`Success`](Class::Success) and
    /// [`Rejected`](Class::Rejected) never count, even when listed: a
    /// rejection is about the request, not about the upstream's health.
    ///
    /// ```
    /// use tower_resend::classify::Class;
    /// use tower_resend::breaker::CircuitBreakerLayer;
    ///
    /// // Throttling (429, 503) is the upstream's business: only 5xx,
    /// // timeouts and resets count.
    /// let layer = CircuitBreakerLayer::new().failure_classes([Class::Unknown]);
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn failure_classes(mut self, classes: impl IntoIterator<Item = Class>) -> Self {
        self.config.failing = Classes::of(classes);
        self
    }

    /// Names the upstream in errors and tracing events. Default: unnamed
    /// (the [stack](crate::stack())'s name when the stack adds it).
    #[must_use]
    pub fn upstream(mut self, name: impl Into<Name>) -> Self {
        self.config.upstream = Some(name.into());
        self
    }

    /// Counts the breaker's changes of state
    /// (`resend.client.breaker.state_changes`, by the new state and the
    /// upstream's name) on a counter made from `meter`; see the
    /// [table](crate::telemetry#metrics-feature-otel). Default: not
    /// counted (each change is still a tracing event).
    ///
    /// ```
    /// use tower_resend::breaker::CircuitBreakerLayer;
    ///
    /// let meter = opentelemetry::global::meter("tower-resend");
    /// let layer = CircuitBreakerLayer::new().upstream("shipping").meter(&meter);
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(mut self, meter: &opentelemetry::metrics::Meter) -> Self {
        self.config.metrics = ClientMetrics::new(meter);
        self
    }

    /// Counts on `metrics` unless the layer has instruments of its own (the
    /// stack's meter, for a breaker added before or after it).
    #[cfg_attr(not(feature = "otel"), allow(dead_code))]
    pub(crate) fn or_metrics(mut self, metrics: &ClientMetrics) -> Self {
        if !self.config.metrics.is_on() {
            self.config.metrics = metrics.clone();
        }
        self
    }

    /// True when no name was given.
    pub(crate) fn is_unnamed(&self) -> bool {
        self.config.upstream.is_none()
    }

    /// Over a fleet: a breaker that lets every call through, and the
    /// circuits of the fleet's instances, one each, with this layer's rules.
    pub(crate) fn into_instances<S>(self, inner: S) -> (CircuitBreaker<S, K>, InstanceCircuits) {
        (
            CircuitBreaker::per_instance(inner),
            InstanceCircuits::new(self.config),
        )
    }

    /// What `layer` makes, consuming the configuration (no `K: Clone` needed).
    pub(crate) fn into_service<S>(self, inner: S) -> CircuitBreaker<S, K> {
        CircuitBreaker::from_shared(
            inner,
            Arc::new(Breaker::new(self.config, self.classifier, true)),
        )
    }
}

impl<S, K: Clone> Layer<S> for CircuitBreakerLayer<K> {
    type Service = CircuitBreaker<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        self.clone().into_service(inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_or_clamped() {
        for bad in [0.0, -0.1, 1.01, f64::NAN, f64::INFINITY] {
            let e = CircuitBreakerLayer::new().failure_ratio(bad).unwrap_err();
            assert!(e.to_string().contains("failure ratio"), "{bad}: {e}");
        }
        let l = CircuitBreakerLayer::new().failure_ratio(1.0).unwrap();
        assert_eq!(l.config.rules.ratio_ppm, 1_000_000);
        let l = CircuitBreakerLayer::new().failure_ratio(1e-9).unwrap();
        assert_eq!(l.config.rules.ratio_ppm, 1);
        let l = CircuitBreakerLayer::new()
            .min_throughput(0)
            .probes(0)
            .break_duration(Duration::ZERO)
            .sampling_window(Duration::ZERO);
        assert_eq!(l.config.rules.min_throughput, 1);
        assert_eq!(l.config.rules.probes, 1);
        assert_eq!(l.config.rules.break_duration, MIN_BREAK);
        assert_eq!(l.config.window, MIN_WINDOW);
        let l = CircuitBreakerLayer::new().break_duration(Duration::MAX);
        assert!(l.config.rules.break_duration < Duration::MAX);
    }

    #[test]
    fn the_defaults_are_the_documented_ones() {
        let l = CircuitBreakerLayer::new();
        assert_eq!(
            l.config.rules.ratio_ppm,
            (DEFAULT_FAILURE_RATIO * 1e6) as u32
        );
        assert_eq!(l.config.rules.min_throughput, 100);
        assert_eq!(l.config.rules.break_duration, Duration::from_secs(5));
        assert_eq!(l.config.rules.probes, 3);
        assert_eq!(l.config.window, Duration::from_secs(30));
        assert_eq!(l.config.failing, Classes::DEFAULT);
    }
}
