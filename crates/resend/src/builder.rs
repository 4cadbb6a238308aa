//! resend's layers as methods on tower's `ServiceBuilder`.

use std::time::Duration;

use tower::layer::util::Stack;
use tower::ServiceBuilder;

use crate::breaker::CircuitBreakerLayer;
use crate::deadline::{DeadlineHeaderLayer, DeadlineLayer};
use crate::idempotency::IdempotencyKeyLayer;
use crate::retry::RetryLayer;
use crate::timeout::AttemptTimeoutLayer;

mod sealed {
    pub trait Sealed<T> {}
    impl<L> Sealed<L> for tower::ServiceBuilder<L> {}
}

/// Adds resend's layers to [`ServiceBuilder`], outside in as DESIGN's order
/// has them. [`stack`](crate::stack()) composes the same order for you.
///
/// ```
/// use std::time::Duration;
/// use resend::ServiceBuilderExt;
/// use tower::ServiceBuilder;
///
/// let layers = ServiceBuilder::new()
///     .deadline(Duration::from_secs(10))
///     .idempotency_key()
///     .retry(resend::RetryLayer::new())
///     .circuit_breaker(resend::CircuitBreakerLayer::new().upstream("shipping"))
///     .deadline_header()
///     .attempt_timeout(Duration::from_secs(5));
/// # let _ = layers;
/// ```
pub trait ServiceBuilderExt<L>: sealed::Sealed<L> + Sized {
    /// A [`DeadlineLayer`]: see [`deadline`](crate::deadline).
    fn deadline(self, total: Duration) -> ServiceBuilder<Stack<DeadlineLayer, L>>;

    /// An [`IdempotencyKeyLayer`]: see [`idempotency`](crate::idempotency).
    fn idempotency_key(self) -> ServiceBuilder<Stack<IdempotencyKeyLayer, L>>;

    /// A [`RetryLayer`]: see [`retry`](crate::retry).
    fn retry<C>(self, layer: RetryLayer<C>) -> ServiceBuilder<Stack<RetryLayer<C>, L>>;

    /// A [`CircuitBreakerLayer`]: see [`breaker`](crate::breaker). Place it
    /// inside the retry layer and outside the attempt timeout, so that it
    /// counts every attempt, timeouts included.
    fn circuit_breaker<K>(
        self,
        layer: CircuitBreakerLayer<K>,
    ) -> ServiceBuilder<Stack<CircuitBreakerLayer<K>, L>>;

    /// A [`DeadlineHeaderLayer`] with the defaults: see
    /// [`deadline`](crate::deadline).
    fn deadline_header(self) -> ServiceBuilder<Stack<DeadlineHeaderLayer, L>>;

    /// An [`AttemptTimeoutLayer`]: see [`timeout`](crate::timeout).
    fn attempt_timeout(
        self,
        per_attempt: Duration,
    ) -> ServiceBuilder<Stack<AttemptTimeoutLayer, L>>;
}

impl<L> ServiceBuilderExt<L> for ServiceBuilder<L> {
    fn deadline(self, total: Duration) -> ServiceBuilder<Stack<DeadlineLayer, L>> {
        self.layer(DeadlineLayer::new(total))
    }

    fn idempotency_key(self) -> ServiceBuilder<Stack<IdempotencyKeyLayer, L>> {
        self.layer(IdempotencyKeyLayer::new())
    }

    fn retry<C>(self, layer: RetryLayer<C>) -> ServiceBuilder<Stack<RetryLayer<C>, L>> {
        self.layer(layer)
    }

    fn circuit_breaker<K>(
        self,
        layer: CircuitBreakerLayer<K>,
    ) -> ServiceBuilder<Stack<CircuitBreakerLayer<K>, L>> {
        self.layer(layer)
    }

    fn deadline_header(self) -> ServiceBuilder<Stack<DeadlineHeaderLayer, L>> {
        self.layer(DeadlineHeaderLayer::new())
    }

    fn attempt_timeout(
        self,
        per_attempt: Duration,
    ) -> ServiceBuilder<Stack<AttemptTimeoutLayer, L>> {
        self.layer(AttemptTimeoutLayer::new(per_attempt))
    }
}
