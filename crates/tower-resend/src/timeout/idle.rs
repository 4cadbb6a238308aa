//! A limit on how long a response body may send nothing.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_layer::Layer;
use tower_service::Service;

use crate::error::{BoxError, Error, Phase};

/// Fails a response body that sends nothing for `idle` (reqwest's
/// `read_timeout`): its next read is an
/// [`AttemptTimeout`](crate::ErrorKind::AttemptTimeout) error in the
/// [`Body`](Phase::Body) phase, whose [`limit`](Error::limit) is `idle`.
///
/// Below a [`ReadAheadLayer`](crate::retry::ReadAheadLayer), as
/// [`StackBuilder::idle_timeout`](crate::StackBuilder::idle_timeout) puts
/// it, a body that stalls while it is read ahead fails its attempt, which a
/// replay-safe request retries; a body that stalls later (past the read-ahead
/// cap, or of a request that is not replay-safe) fails in the caller's
/// hands.
///
/// ```
/// use std::pin::Pin;
/// use std::task::{Context, Poll};
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body::Frame;
/// use http_body_util::BodyExt;
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_resend::timeout::IdleTimeoutLayer;
/// use tower_resend::{Error, ErrorKind};
///
/// /// A body that sends nothing, ever.
/// struct Silent;
/// impl http_body::Body for Silent {
///     type Data = Bytes;
///     type Error = std::io::Error;
///     fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
///         Poll::Pending
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let stalls = service_fn(|_: Request<()>| async { Ok::<_, std::convert::Infallible>(Response::new(Silent)) });
/// let svc = IdleTimeoutLayer::new(Duration::from_millis(200)).layer(stalls);
/// let body = svc.oneshot(Request::new(())).await.unwrap().into_body();
/// let err = body.collect().await.unwrap_err();
/// let err = err.downcast_ref::<Error>().unwrap();
/// assert_eq!(err.kind(), ErrorKind::AttemptTimeout);
/// assert_eq!(err.limit(), Some(Duration::from_millis(200)));
/// # }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct IdleTimeoutLayer {
    idle: Option<Duration>,
}

impl IdleTimeoutLayer {
    /// Fails a body silent for `idle`.
    pub const fn new(idle: Duration) -> Self {
        Self { idle: Some(idle) }
    }

    /// No limit: bodies pass as they are.
    pub const fn none() -> Self {
        Self { idle: None }
    }
}

impl<S> Layer<S> for IdleTimeoutLayer {
    type Service = IdleTimeout<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdleTimeout {
            inner,
            idle: self.idle,
        }
    }
}

/// Middleware limiting how long a response body may send nothing; see
/// [`IdleTimeoutLayer`].
#[derive(Clone, Debug)]
pub struct IdleTimeout<S> {
    inner: S,
    idle: Option<Duration>,
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for IdleTimeout<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    type Response = Response<IdleBody<ResB>>;
    type Error = S::Error;
    type Future = IdleFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        IdleFuture {
            inner: self.inner.call(req),
            idle: self.idle,
        }
    }
}

pin_project! {
    /// Response future of [`IdleTimeout`].
    #[derive(Debug)]
    pub struct IdleFuture<F> {
        #[pin]
        inner: F,
        idle: Option<Duration>,
    }
}

impl<F, B, E> Future for IdleFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<IdleBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let idle = *this.idle;
        let resp = ready!(this.inner.poll(cx))?;
        Poll::Ready(Ok(resp.map(|inner| IdleBody {
            inner,
            idle,
            timer: None,
        })))
    }
}

pin_project! {
    /// A response body that fails after `idle` without a frame; see
    /// [`IdleTimeoutLayer`].
    #[derive(Debug)]
    pub struct IdleBody<B> {
        #[pin]
        inner: B,
        idle: Option<Duration>,
        // Set on the first read that has to wait: a body that is all there
        // (the common small answer) never sets a timer. Boxed: the response
        // goes up through every layer by value, and a `Sleep` is 112 bytes.
        timer: Option<Pin<Box<Sleep>>>,
    }
}

impl<B> Body for IdleBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, BoxError>>> {
        let this = self.project();
        if let Poll::Ready(frame) = this.inner.poll_frame(cx) {
            if let (Some(idle), Some(timer)) = (*this.idle, this.timer.as_mut()) {
                timer.as_mut().reset(Instant::now() + idle);
            }
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let Some(idle) = *this.idle else {
            return Poll::Pending;
        };
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
        ready!(timer.as_mut().poll(cx));
        let e = Error::attempt_timeout(idle).with_phase(Phase::Body);
        Poll::Ready(Some(Err(e.into())))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
