use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Method, Response};
use pin_project_lite::pin_project;

use super::shared::{Breaker, Ticket};
use super::state::Outcome;
use crate::classify::Classify;
use crate::error::{BoxError, Error};

pin_project! {
    /// Response future of [`CircuitBreaker`](super::CircuitBreaker).
    pub struct ResponseFuture<F, K> {
        #[pin]
        state: State<F>,
        // What the outcome is counted against; `None` once counted, and for
        // a refused call.
        permit: Option<Permit<K>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Called { #[pin] future: F },
        Refused { error: Option<Error> },
    }
}

impl<F, K> std::fmt::Debug for ResponseFuture<F, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Called { .. } => "called",
            State::Refused { .. } => "refused",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("permit", &self.permit)
            .finish()
    }
}

impl<F, K> ResponseFuture<F, K> {
    pub(super) fn called(future: F, permit: Permit<K>) -> Self {
        Self {
            state: State::Called { future },
            permit: Some(permit),
        }
    }

    /// Not counted here (the instances of a fleet have the circuits).
    pub(super) fn uncounted(future: F) -> Self {
        Self {
            state: State::Called { future },
            permit: None,
        }
    }

    pub(super) fn refused(error: Error) -> Self {
        Self {
            state: State::Refused { error: Some(error) },
            permit: None,
        }
    }
}

impl<F, K, R, E> Future for ResponseFuture<F, K>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
    K: Classify<R>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        match this.state.project() {
            StateProj::Called { future } => {
                let result = ready!(future.poll(cx)).map_err(Into::into);
                if let Some(mut permit) = this.permit.take() {
                    let outcome = permit.breaker.judge(&permit.method, permit.grpc, &result);
                    permit.settle(outcome);
                }
                Poll::Ready(result)
            }
            StateProj::Refused { error } => Poll::Ready(Err(match error.take() {
                Some(e) => e.into(),
                None => "circuit breaker future polled after completion".into(),
            })),
        }
    }
}

/// A call let through: counts its outcome once, and gives a probe's place
/// back if the call is dropped before it ends.
pub(crate) struct Permit<K> {
    breaker: Arc<Breaker<K>>,
    ticket: Ticket,
    method: Method,
    /// The request was gRPC (`content-type: application/grpc…`).
    grpc: bool,
    settled: bool,
}

impl<K> Permit<K> {
    pub(super) fn new(
        breaker: Arc<Breaker<K>>,
        ticket: Ticket,
        method: Method,
        grpc: bool,
    ) -> Self {
        Self {
            breaker,
            ticket,
            method,
            grpc,
            settled: false,
        }
    }

    fn settle(&mut self, outcome: Outcome) {
        self.settled = true;
        self.breaker.settle(self.ticket, outcome);
    }
}

impl<K> Drop for Permit<K> {
    fn drop(&mut self) {
        if !self.settled {
            self.breaker.settle(self.ticket, Outcome::Ignored);
        }
    }
}

impl<K> std::fmt::Debug for Permit<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("ticket", &self.ticket)
            .field("method", &self.method)
            .finish_non_exhaustive()
    }
}
