use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use tokio::time::Instant;
use tower_service::Service;

use super::future::ResponseFuture;
use super::AttemptTimeoutLayer;
use crate::deadline::{clamp, Deadline};
use crate::error::BoxError;
use crate::vocab::RetryInCharge;

/// Middleware bounding each attempt; see [`AttemptTimeoutLayer`].
#[derive(Clone, Debug)]
pub struct AttemptTimeout<S> {
    inner: S,
    per_attempt: Duration,
}

impl<S> AttemptTimeout<S> {
    /// Wraps `inner`, giving each attempt at most `per_attempt`.
    pub const fn new(inner: S, per_attempt: Duration) -> Self {
        Self {
            inner,
            per_attempt: clamp(per_attempt),
        }
    }

    /// An [`AttemptTimeoutLayer`] giving each attempt at most `per_attempt`.
    pub const fn layer(per_attempt: Duration) -> AttemptTimeoutLayer {
        AttemptTimeoutLayer::new(per_attempt)
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

impl<S, B> Service<Request<B>> for AttemptTimeout<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let start = Instant::now();
        let ext = req.extensions();
        // A retry layer above may give this attempt its own limit (the
        // request's `CallOptions`). `per_attempt` is clamped at
        // construction, and so is an override: this cannot overflow.
        let per_attempt = RetryInCharge::of(ext)
            .and_then(|marker| marker.attempt_timeout)
            .map_or(self.per_attempt, clamp);
        let own = start + per_attempt;
        // The request's deadline (a deadline layer's, or the caller's own),
        // and the ambient one.
        let deadline = match (ext.get::<Deadline>(), Deadline::current()) {
            (Some(r), Some(a)) => Some(a.min(*r)),
            (r, a) => a.or(r.copied()),
        };
        match deadline {
            Some(d) if d.instant() <= start => ResponseFuture::expired(),
            Some(d) if d.instant() <= own => {
                ResponseFuture::new(self.inner.call(req), start, d.instant(), true, per_attempt)
            }
            _ => ResponseFuture::new(self.inner.call(req), start, own, false, per_attempt),
        }
    }
}
