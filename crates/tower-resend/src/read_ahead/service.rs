use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::{ReadAheadBody, ReadAheadLayer, ResponseFuture};
use crate::error::BoxError;
use crate::vocab::RetryInCharge;

/// Middleware that reads small response bodies ahead; see
/// [`ReadAheadLayer`].
#[derive(Clone, Debug)]
pub struct ReadAhead<S> {
    inner: S,
    cap: usize,
    idle: Option<Duration>,
}

impl<S> ReadAhead<S> {
    /// Wraps `inner`, reading marked bodies of at most `cap` bytes.
    pub const fn new(inner: S, cap: usize) -> Self {
        Self {
            inner,
            cap,
            idle: None,
        }
    }

    pub(super) const fn with_idle(mut self, idle: Option<Duration>) -> Self {
        self.idle = idle;
        self
    }

    /// A [`ReadAheadLayer`] with the cap `cap`.
    pub const fn layer(cap: usize) -> ReadAheadLayer {
        ReadAheadLayer::new(cap)
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

impl<S, ReqB, ResB> Service<Request<ReqB>> for ReadAhead<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    ResB: Body,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<ReadAheadBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    // Inline: the future is built where its caller keeps it, not moved
    // there (a move fewer a layer; see BENCHMARKS.md, `callgrind`).
    #[inline]
    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // The retry layer above says, on the attempt it sends, whether it
        // may retry a break in the body.
        let cap = match RetryInCharge::of(req.extensions()) {
            Some(marker) if marker.read_ahead => self.cap,
            _ => 0,
        };
        ResponseFuture::new(self.inner.call(req), cap, self.idle)
    }
}
