use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Response;
use pin_project_lite::pin_project;
use tokio::task::futures::TaskLocalFuture;
use tokio::time::{Instant, Sleep};
use tower_resend::deadline::{server::Ambient, server::TimeLedger};
use tower_resend::Deadline;
use tower_service::Service;

use super::attribution::Attribution;
use crate::body::MaybeBuffered;
use crate::problems::Protocol;

pin_project! {
    /// Calls the service on the first poll, so that its `call` too runs
    /// inside the deadline scope.
    pub struct Lazy<S: Service<R>, R> {
        service: Option<S>,
        request: Option<R>,
        #[pin]
        future: Option<S::Future>,
    }
}

impl<S: Service<R>, R> std::fmt::Debug for Lazy<S, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lazy").finish_non_exhaustive()
    }
}

impl<S: Service<R>, R> Future for Lazy<S, R> {
    type Output = Result<S::Response, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let (Some(mut svc), Some(req)) = (this.service.take(), this.request.take()) {
            this.future.set(Some(svc.call(req)));
        }
        match this.future.as_pin_mut() {
            Some(f) => f.poll(cx),
            None => Poll::Pending,
        }
    }
}

pin_project! {
    /// Response future of [`InboundDeadline`](super::InboundDeadline): the
    /// handler inside the deadline scope, raced against the deadline. A
    /// response that is ready wins a tie with the clock.
    pub struct ResponseFuture<S: Service<R>, R, B> {
        #[pin]
        state: State<S, R, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S: Service<R>, R, B> {
        Running {
            #[pin]
            inner: TaskLocalFuture<Ambient, Lazy<S, R>>,
            #[pin]
            sleep: Sleep,
            ledger: TimeLedger,
            start: Instant,
            budget: Duration,
            protocol: Protocol,
        },
        Expired { response: Option<Response<MaybeBuffered<B>>> },
    }
}

impl<S: Service<R>, R, B> std::fmt::Debug for ResponseFuture<S, R, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, R, B> ResponseFuture<S, R, B>
where
    S: Service<R, Response = Response<B>>,
{
    pub(crate) fn new(
        service: S,
        request: R,
        deadline: Deadline,
        ledger: TimeLedger,
        start: Instant,
        budget: Duration,
        protocol: Protocol,
    ) -> Self {
        let lazy = Lazy {
            service: Some(service),
            request: Some(request),
            future: None,
        };
        Self {
            state: State::Running {
                inner: tower_resend::deadline::server::scope_with_ledger(
                    deadline,
                    ledger.clone(),
                    lazy,
                ),
                sleep: tokio::time::sleep_until(deadline.instant()),
                ledger,
                start,
                budget,
                protocol,
            },
        }
    }

    pub(crate) fn expired(response: Response<MaybeBuffered<B>>) -> Self {
        Self {
            state: State::Expired {
                response: Some(response),
            },
        }
    }
}

impl<S, R, B> Future for ResponseFuture<S, R, B>
where
    S: Service<R, Response = Response<B>>,
{
    type Output = Result<Response<MaybeBuffered<B>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Running {
                inner,
                sleep,
                ledger,
                start,
                budget,
                protocol,
            } => {
                if let Poll::Ready(r) = inner.poll(cx) {
                    return Poll::Ready(r.map(|resp| resp.map(MaybeBuffered::inner)));
                }
                if sleep.poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let a = Attribution::from_snapshot(ledger.snapshot(), *budget, start.elapsed());
                tracing::warn!(
                    source = a.source.as_str(),
                    name = a.name.as_deref().unwrap_or(""),
                    "inbound deadline exceeded: {}",
                    a.summary()
                );
                Poll::Ready(Ok(a.response(*protocol)))
            }
            StateProj::Expired { response } => match response.take() {
                Some(r) => Poll::Ready(Ok(r)),
                None => Poll::Pending,
            },
        }
    }
}
