//! tower-resend's layers as methods on tower's `ServiceBuilder`.

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

/// Adds tower-resend's layers to [`ServiceBuilder`], outside in in the order
/// [`stack`](crate::stack()) composes for you.
///
/// Every method starts with `resend_`, so none is ever shadowed by one of
/// `ServiceBuilder`'s own (tower's inherent `retry` and `timeout` win over
/// any trait method of the same name, and would build tower's layers).
/// This example builds under tower's `full` feature, and calls the service.
///
/// ```
/// use std::time::Duration;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use bytes::Bytes;
/// use tower_resend::ServiceBuilderExt;
/// use tower::{ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_resend::BoxError> {
/// let upstream = tower::service_fn(|_req: Request<_>| async {
///     Ok::<_, tower_resend::BoxError>(Response::new(Full::new(Bytes::from_static(b"ok"))))
/// });
/// let svc = ServiceBuilder::new()
///     .resend_deadline(Duration::from_secs(10))
///     .resend_idempotency_key()
///     .resend_retry(tower_resend::RetryLayer::new())
///     .resend_circuit_breaker(tower_resend::CircuitBreakerLayer::new().upstream("shipping"))
///     .resend_deadline_header()
///     .resend_attempt_timeout(Duration::from_secs(5))
///     .service(upstream);
///
/// let resp = svc.oneshot(Request::get("http://shipping/").body(Full::new(Bytes::new())).unwrap()).await?;
/// let attempts = resp.extensions().get::<tower_resend::Attempts>().map_or(0, |a| a.len());
/// assert_eq!(attempts, 1);
/// # Ok(())
/// # }
/// ```
pub trait ServiceBuilderExt<L>: sealed::Sealed<L> + Sized {
    /// A [`DeadlineLayer`]: see [`deadline`](crate::deadline).
    fn resend_deadline(self, total: Duration) -> ServiceBuilder<Stack<DeadlineLayer, L>>;

    /// An [`IdempotencyKeyLayer`]: see [`idempotency`](crate::idempotency).
    fn resend_idempotency_key(self) -> ServiceBuilder<Stack<IdempotencyKeyLayer, L>>;

    /// A [`RetryLayer`]: see [`retry`](crate::retry).
    fn resend_retry<C>(self, layer: RetryLayer<C>) -> ServiceBuilder<Stack<RetryLayer<C>, L>>;

    /// A [`CircuitBreakerLayer`]: see [`breaker`](crate::breaker). Place it
    /// inside the retry layer and outside the attempt timeout, so that it
    /// counts every attempt, timeouts included.
    fn resend_circuit_breaker<K>(
        self,
        layer: CircuitBreakerLayer<K>,
    ) -> ServiceBuilder<Stack<CircuitBreakerLayer<K>, L>>;

    /// A [`DeadlineHeaderLayer`] with the defaults: see
    /// [`deadline`](crate::deadline).
    fn resend_deadline_header(self) -> ServiceBuilder<Stack<DeadlineHeaderLayer, L>>;

    /// An [`AttemptTimeoutLayer`]: see [`timeout`](crate::timeout).
    fn resend_attempt_timeout(
        self,
        per_attempt: Duration,
    ) -> ServiceBuilder<Stack<AttemptTimeoutLayer, L>>;
}

impl<L> ServiceBuilderExt<L> for ServiceBuilder<L> {
    fn resend_deadline(self, total: Duration) -> ServiceBuilder<Stack<DeadlineLayer, L>> {
        self.layer(DeadlineLayer::new(total))
    }

    fn resend_idempotency_key(self) -> ServiceBuilder<Stack<IdempotencyKeyLayer, L>> {
        self.layer(IdempotencyKeyLayer::new())
    }

    fn resend_retry<C>(self, layer: RetryLayer<C>) -> ServiceBuilder<Stack<RetryLayer<C>, L>> {
        self.layer(layer)
    }

    fn resend_circuit_breaker<K>(
        self,
        layer: CircuitBreakerLayer<K>,
    ) -> ServiceBuilder<Stack<CircuitBreakerLayer<K>, L>> {
        self.layer(layer)
    }

    fn resend_deadline_header(self) -> ServiceBuilder<Stack<DeadlineHeaderLayer, L>> {
        self.layer(DeadlineHeaderLayer::new())
    }

    fn resend_attempt_timeout(
        self,
        per_attempt: Duration,
    ) -> ServiceBuilder<Stack<AttemptTimeoutLayer, L>> {
        self.layer(AttemptTimeoutLayer::new(per_attempt))
    }
}
