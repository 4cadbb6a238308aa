use crate::name::Name;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tokio::time::Instant;
use tower_service::Service;

use super::future::ResponseFuture;
use super::header::is_grpc;
use super::wire::parse_grpc_timeout;
use super::{ambient, clamp, CallDeadlineLayer, Deadline, DeadlineBody, Source, GRPC_TIMEOUT};
use crate::error::BoxError;

/// The `grpc-timeout` a gRPC request already carries (the caller's: tonic
/// writes `Request::set_timeout` there), if it is valid; a malformed one is
/// ignored with a debug event (the [`DeadlineHeaderLayer`](super::DeadlineHeaderLayer)
/// replaces it on the wire).
fn caller_grpc_timeout<B>(req: &Request<B>) -> Option<Duration> {
    if !is_grpc(req) {
        return None;
    }
    let value = req.headers().get(GRPC_TIMEOUT)?;
    match parse_grpc_timeout(value.as_bytes()) {
        Ok(timeout) => Some(timeout),
        Err(e) => {
            tracing::debug!(value = ?value, error = %e, "ignoring malformed grpc-timeout");
            None
        }
    }
}

/// Middleware that fixes and enforces a call's deadline.
///
/// See [`CallDeadlineLayer`] for what it does.
#[derive(Clone, Debug)]
pub struct CallDeadline<S> {
    inner: S,
    total: Duration,
    upstream: Option<Name>,
    /// The layers inside wake the call by its deadline whatever they wait
    /// for (a stack's attempt timeout, backoff and readiness waits are all
    /// bounded by it): no timer of its own is armed.
    woken_inside: bool,
}

impl<S> CallDeadline<S> {
    /// Wraps `inner`, giving each call at most `total`.
    pub const fn new(inner: S, total: Duration) -> Self {
        Self {
            inner,
            total: clamp(total),
            upstream: None,
            woken_inside: false,
        }
    }

    /// Arms no timer of its own: the layers inside (a stack's) wake the
    /// call by its deadline, whatever they wait for. One timer a call
    /// rather than two.
    pub(crate) fn woken_inside(mut self) -> Self {
        self.woken_inside = true;
        self
    }

    pub(crate) fn with_upstream(mut self, upstream: Option<Name>) -> Self {
        self.upstream = upstream;
        self
    }

    /// A [`CallDeadlineLayer`] giving each call at most `total`.
    pub const fn layer(total: Duration) -> CallDeadlineLayer {
        CallDeadlineLayer::new(total)
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

impl<S, ReqB, ResB> Service<Request<ReqB>> for CallDeadline<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<DeadlineBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    // Inline: the future is built where its caller keeps it, not moved
    // there (a move fewer a layer; see BENCHMARKS.md, `callgrind`).
    #[inline]
    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        let start = Instant::now();
        // `total` is clamped at construction: this cannot overflow.
        let mut deadline = Deadline::at(start + self.total);
        let mut ledger = None;
        if let Some((ambient, l)) = ambient() {
            deadline = deadline.min(ambient);
            ledger = l;
        }
        if let Some(own) = req.extensions().get::<Deadline>() {
            deadline = deadline.min(*own);
        }
        // A gRPC caller's own timeout (tonic's `Request::set_timeout`)
        // travels as `grpc-timeout`: it is the call's, like a `Deadline`.
        if let Some(theirs) = caller_grpc_timeout(&req) {
            deadline = deadline.min(Deadline::at(start + clamp(theirs)));
        }
        let upstream = self.upstream.clone();
        if deadline.instant() <= start {
            // The budget was spent before the call began: send nothing.
            return ResponseFuture::expired(start, upstream);
        }
        // The layers inside read it there.
        req.extensions_mut().insert(deadline);
        let future = self.inner.call(req);
        // Inside a server's scope, say where the time goes.
        let guard = ledger.map(|l| {
            let name = upstream.clone().unwrap_or_else(|| Name::from("upstream"));
            l.start(Source::Upstream, name)
        });
        ResponseFuture::new(future, deadline, start, upstream, guard, !self.woken_inside)
    }
}
