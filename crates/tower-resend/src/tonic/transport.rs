//! A tonic channel as the transport of a stack.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use crate::classify::grpc_proves_not_sent as proves_not_sent;
use crate::deadline::{parse_grpc_timeout, GRPC_TIMEOUT};
use crate::error::{BoxError, Error, Phase};

/// True when `err`'s source chain holds tonic's
/// [`TimeoutExpired`](::tonic::TimeoutExpired).
fn timed_out(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if e.is::<::tonic::TimeoutExpired>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// A tonic channel as the transport of a tower-resend stack; see the
/// [module docs](crate::tonic).
///
/// It turns the stack's request body into a `tonic::body::Body`, and a
/// failure to connect into a [`tower_resend::Error`](crate::Error) that says
/// [not sent](crate::Error::is_not_sent).
///
/// ```
/// use std::time::Duration;
/// use http::{Request, Response};
/// use tower_resend::classify::GrpcClassifier;
/// use tower_resend::tonic::{TonicTransport};
/// use tower::service_fn;
///
/// // In production: `Endpoint::from_static("http://ledger:50051")
/// //     .connect_timeout(Duration::from_secs(2)).tcp_nodelay(true).connect_lazy()`.
/// let channel = service_fn(|_req: Request<tonic::body::Body>| async {
///     Ok::<_, std::convert::Infallible>(Response::new(tonic::body::Body::empty()))
/// });
/// let ledger = tower_resend::stack()
///     .name("ledger")
///     .retry(|r| r.classifier(GrpcClassifier::new().idempotent("/ledger.Ledger/GetBalance")))
///     .service(TonicTransport::new(channel));
/// # let _ = ledger;
/// ```
#[derive(Clone, Debug)]
pub struct TonicTransport<S> {
    inner: S,
}

impl<S> TonicTransport<S> {
    /// Wraps `channel`.
    pub const fn new(channel: S) -> Self {
        Self { inner: channel }
    }

    /// The channel.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The channel, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the channel.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResB> Service<Request<B>> for TonicTransport<S>
where
    S: Service<Request<::tonic::body::Body>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(|e| map_error(e.into()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The channel enforces the grpc-timeout the stack wrote (the time
        // left, less a margin): remember it, to tell that expiry from others.
        let budget = req
            .headers()
            .get(GRPC_TIMEOUT)
            .and_then(|v| parse_grpc_timeout(v.as_bytes()).ok())
            .map(|t| (t, Instant::now()));
        ResponseFuture {
            inner: self.inner.call(req.map(::tonic::body::Body::new)),
            budget,
        }
    }
}

/// A failure to connect becomes a not-sent resend error; anything else is
/// passed on as it is.
fn map_error(e: BoxError) -> BoxError {
    if proves_not_sent(&*e) {
        Error::connect(e).into()
    } else {
        e
    }
}

pin_project! {
    /// Response future of [`TonicTransport`].
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        // The request's grpc-timeout and when it was sent.
        budget: Option<(Duration, Instant)>,
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let budget = *this.budget;
        this.inner.poll(cx).map_err(|e| {
            let e = e.into();
            match budget {
                // The channel cut the call at the grpc-timeout, i.e. at the
                // deadline less its margin: the deadline ran out, not "some
                // timeout" (an `Endpoint::timeout` stays tonic's error).
                Some((limit, sent)) if timed_out(&*e) => {
                    let elapsed = sent.elapsed();
                    if elapsed >= limit {
                        // tonic's own error is not kept as the source: tonic
                        // clients would read it as CANCELLED.
                        Error::deadline_exceeded(Phase::Attempt, elapsed).into()
                    } else {
                        e
                    }
                }
                _ => map_error(e),
            }
        })
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::{Class, GrpcClassifier};

    #[test]
    fn connect_errors_are_not_sent() {
        use crate::classify::{Classify, HttpClassifier, RequestFacts};

        let grpc = Request::post("http://up/svc.S/Get")
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
        let facts = RequestFacts::of(&grpc);
        let connect = ::tonic::ConnectError(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        for c in [
            &GrpcClassifier::new() as &dyn Classify<()>,
            &HttpClassifier::new(),
        ] {
            assert_eq!(c.classify_error(&facts, &connect).class(), Class::NotSent);
            let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
            assert_eq!(c.classify_error(&facts, &reset).class(), Class::Unknown);
            let timeout = ::tonic::TimeoutExpired(());
            assert_eq!(c.classify_error(&facts, &timeout).class(), Class::Unknown);
        }
        let mapped = map_error(Box::new(connect));
        assert!(Error::from_box(mapped).is_not_sent());
    }
}
