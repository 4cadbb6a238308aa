use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use tokio::time::Instant;
use tower_service::Service;

use super::future::ResponseFuture;
use super::AttemptTimeoutLayer;
use crate::deadline::{after, Deadline};
use crate::error::BoxError;

/// Middleware bounding each attempt; see [`AttemptTimeoutLayer`].
#[derive(Clone, Debug)]
pub struct AttemptTimeout<S> {
    inner: S,
    per_attempt: Duration,
}

impl<S> AttemptTimeout<S> {
    /// Wraps `inner`, giving each attempt at most `per_attempt`.
    pub const fn new(inner: S, per_attempt: Duration) -> Self {
        Self { inner, per_attempt }
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
        let own = after(start, self.per_attempt);
        let deadline = req.extensions().get::<Deadline>().copied();
        match deadline.or_else(Deadline::current) {
            Some(d) if d.instant() <= start => ResponseFuture::expired(),
            Some(d) if d.instant() <= own => ResponseFuture::new(
                self.inner.call(req),
                start,
                d.instant(),
                true,
                self.per_attempt,
            ),
            _ => ResponseFuture::new(self.inner.call(req), start, own, false, self.per_attempt),
        }
    }
}
