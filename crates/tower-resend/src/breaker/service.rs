use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::{Permit, ResponseFuture};
use super::shared::Breaker;
use super::{CircuitBreakerLayer, CircuitState};
use crate::classify::{Classify, HttpClassifier};
use crate::error::BoxError;

/// Middleware that fails calls at once while its upstream looks unwell; see
/// [`CircuitBreakerLayer`].
///
/// Every clone shares one breaker.
pub struct CircuitBreaker<S, K = HttpClassifier> {
    inner: S,
    /// The upstream's circuit. None over a fleet, where the circuits are
    /// the instances' own (the fleet layer below holds them): this one
    /// lets every call through, uncounted, and a clone of it (made for
    /// every call) writes no count of a shared one.
    breaker: Option<Arc<Breaker<K>>>,
}

impl<S: Clone, K> Clone for CircuitBreaker<S, K> {
    #[inline]
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            breaker: self.breaker.clone(),
        }
    }
}

impl<S: std::fmt::Debug, K> std::fmt::Debug for CircuitBreaker<S, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("inner", &self.inner)
            .field("breaker", &self.breaker)
            .finish()
    }
}

impl<S> CircuitBreaker<S> {
    /// Wraps `inner` in a breaker with the defaults.
    pub fn new(inner: S) -> Self {
        CircuitBreakerLayer::new().into_service(inner)
    }

    /// A [`CircuitBreakerLayer`] with the defaults.
    pub const fn layer() -> CircuitBreakerLayer {
        CircuitBreakerLayer::new()
    }
}

impl<S, K> CircuitBreaker<S, K> {
    pub(crate) fn from_shared(inner: S, breaker: Arc<Breaker<K>>) -> Self {
        Self {
            inner,
            breaker: Some(breaker),
        }
    }

    /// The breaker of a stack over a fleet: every call passes, and the
    /// fleet's instances have the circuits.
    pub(crate) fn per_instance(inner: S) -> Self {
        Self {
            inner,
            breaker: None,
        }
    }

    /// The circuit's state. An open circuit whose break is over reports
    /// [`Open`](CircuitState::Open) until the next call, which is a probe.
    /// In a stack over a [fleet](crate::fleet), each instance has its own
    /// circuit, and this one stays closed.
    pub fn state(&self) -> CircuitState {
        self.breaker
            .as_ref()
            .map_or(CircuitState::Closed, |b| b.state())
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, K, ReqB, ResB> Service<Request<ReqB>> for CircuitBreaker<S, K>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    K: Classify<ResB>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, K>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let Some(breaker) = &self.breaker else {
            return ResponseFuture::uncounted(self.inner.call(req));
        };
        match breaker.admit(None) {
            Ok(ticket) => {
                let grpc = crate::classify::is_grpc(req.headers());
                let permit = Permit::new(Arc::clone(breaker), ticket, req.method().clone(), grpc);
                ResponseFuture::called(self.inner.call(req), permit)
            }
            // Fails at once: the upstream is not called.
            Err(e) => ResponseFuture::refused(e),
        }
    }
}
