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

    // Inline: the future is built where its caller keeps it, not moved
    // there (a move fewer a layer; see BENCHMARKS.md, `callgrind`).
    #[inline]
    fn call(&mut self, req: Request<B>) -> Self::Future {
        let ext = req.extensions();
        let marker = RetryInCharge::of(ext);
        // A retry layer above may give this attempt its own limit (the
        // request's `CallOptions`). `per_attempt` is clamped at
        // construction, and so is an override: this cannot overflow.
        let per_attempt = marker
            .and_then(|marker| marker.attempt_timeout)
            .map_or(self.per_attempt, clamp);
        // The request's deadline (a deadline layer's, or the caller's own),
        // and the ambient one.
        let deadline = Deadline::of(ext).map(Deadline::instant);
        if marker.is_some() {
            // The retry layer in charge sends an attempt only while its
            // deadline holds, by the clock it has just read: the attempt's
            // timer starts when it first waits, with no second reading.
            return ResponseFuture::new(self.inner.call(req), None, deadline, per_attempt);
        }
        let start = Instant::now();
        if deadline.is_some_and(|d| d <= start) {
            return ResponseFuture::expired();
        }
        ResponseFuture::new(self.inner.call(req), Some(start), deadline, per_attempt)
    }
}
