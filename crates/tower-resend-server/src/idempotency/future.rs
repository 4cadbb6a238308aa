//! [`ResponseFuture`]: the response future of [`Idempotency`](super::Idempotency).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::body::MaybeBuffered;

/// The boxed path of a request the layer works on.
pub(crate) type Boxed<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<MaybeBuffered<B>>, E>> + Send>>;

pin_project! {
    /// Response future of [`Idempotency`](super::Idempotency): requests that
    /// are not the layer's go straight through; the layer's own answers are
    /// ready at once; keyed ones take a boxed path through the store.
    ///
    /// Dropping it (the client went away, an attempt timeout cut the
    /// connection, an outer deadline fired) once a keyed request's handler
    /// has started does not cancel the work: it runs in a task of its own,
    /// still bounded by the inbound deadline, and its end is kept for the
    /// caller's retry.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        Passthrough { #[pin] future: F },
        Keyed { run: Boxed<B, E> },
        Ready { response: Option<Response<MaybeBuffered<B>>> },
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            state: State::Passthrough { future },
        }
    }

    pub(crate) fn keyed(run: Boxed<B, E>) -> Self {
        Self {
            state: State::Keyed { run },
        }
    }

    pub(crate) fn ready(response: Response<MaybeBuffered<B>>) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<MaybeBuffered<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Passthrough { future } => future
                .poll(cx)
                .map(|r| r.map(|resp| resp.map(MaybeBuffered::inner))),
            StateProj::Keyed { run } => run.as_mut().poll(cx),
            StateProj::Ready { response } => match response.take() {
                Some(r) => Poll::Ready(Ok(r)),
                None => Poll::Pending,
            },
        }
    }
}
