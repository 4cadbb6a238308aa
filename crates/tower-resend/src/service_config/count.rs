//! The transport of a service config's stacks: counts each attempt's end
//! in the channel's `retryThrottling` tokens.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::classify::{answer_code, error_code, CodeSet};
use crate::classify::{grpc_proves_not_sent, GrpcCode};
use crate::error::BoxError;
use crate::retry::RetryBudget;

/// Wraps the transport of each stack a
/// [`ServiceConfig`](super::ServiceConfig) builds: with `retryThrottling`,
/// every attempt (every hedged copy too) that ends with one of its
/// method's codes takes a token from the channel's count, and every
/// success gives `tokenRatio` back; without, it only passes the calls on.
///
/// It sits below the attempt timeout, so it sees each physical attempt
/// once: an attempt the timeout cuts, or a hedged copy dropped because
/// another won, is not counted. A success is an answer without a status
/// in its headers (its status comes in the trailers, which the retry
/// layer never sees either) or with OK.
#[derive(Clone, Debug)]
pub struct CountAttempts<S> {
    inner: S,
    count: Option<(RetryBudget, CodeSet)>,
}

impl<S> CountAttempts<S> {
    pub(crate) fn new(inner: S, count: Option<(RetryBudget, CodeSet)>) -> Self {
        Self { inner, count }
    }
}

impl<S, B, R> Service<Request<B>> for CountAttempts<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = CountFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        CountFuture {
            inner: self.inner.call(req),
            count: self.count.clone(),
        }
    }
}

pin_project! {
    /// Response future of [`CountAttempts`].
    #[derive(Debug)]
    pub struct CountFuture<F> {
        #[pin]
        inner: F,
        count: Option<(RetryBudget, CodeSet)>,
    }
}

impl<F, R, E> Future for CountFuture<F>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = ready!(this.inner.poll(cx)).map_err(Into::into);
        if let Some((tokens, codes)) = this.count.take() {
            match &result {
                Ok(resp) => match answer_code(resp) {
                    None | Some(GrpcCode::Ok) => tokens.succeeded(),
                    Some(code) if codes.contains(code) => tokens.failed_attempt(),
                    Some(_) => {}
                },
                // Not sent: a transparent retry, not counted.
                Err(e) if grpc_proves_not_sent(&**e) => {}
                // A transport failure as the status gRPC gives it.
                Err(e) if codes.contains(error_code(&**e)) => tokens.failed_attempt(),
                Err(_) => {}
            }
        }
        Poll::Ready(result)
    }
}
