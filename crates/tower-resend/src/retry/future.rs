//! The response future of [`Retry`](super::Retry): the attempts of one
//! call, a state each, with what comes after an attempt decided by
//! [`Call::ended`].
//!
//! Written by hand rather than as a boxed `async` block: boxing one
//! (`Pin<Box<dyn Future + Send>>`) needs `S::Future: Send` in the layer's
//! `Service` impl, and with that bound on the retry and hedge layers a
//! stack nested in a stack took rustc minutes to type-check (a retry layer
//! three deep over a stack: 57 s, against 0.2 s without the bound). Here
//! the future is `Send` when its parts are, and proving it costs nothing
//! extra.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::call::{Call, Next};
use super::policy::Unsent;
use super::run::TokenWait;
use crate::body::Replay;
use crate::classify::Classify;
use crate::error::BoxError;

pin_project! {
    /// Response future of [`Retry`](super::Retry).
    pub struct ResponseFuture<F, S, B, C, R> {
        // The call's state; none when an outer retry layer is in charge.
        call: Option<Box<Call<S, B, C>>>,
        #[pin]
        state: State<F, R>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, R> {
        // An attempt in flight (or, with no call, the request passing
        // through to an outer retry layer's attempt).
        Attempt { #[pin] future: F },
        // The backoff before the next attempt.
        Backoff { sleep: Pin<Box<Sleep>> },
        // Waiting for a budget token, then for `not_before`; `last` ends
        // the call if none comes.
        Throttled {
            token: TokenWait,
            not_before: Instant,
            last: Option<Result<Response<R>, BoxError>>,
        },
        // Making the service ready for the next attempt, until the
        // deadline (its timer armed once the service is not ready).
        Ready { deadline: Option<Pin<Box<Sleep>>> },
        // The first attempt was not sent, for this reason.
        Unsent { why: Unsent },
        Done,
    }
}

impl<F, S, B, C, R> ResponseFuture<F, S, B, C, R> {
    pub(super) fn passthrough(future: F) -> Self {
        Self {
            call: None,
            state: State::Attempt { future },
        }
    }

    pub(super) fn unsent(call: Box<Call<S, B, C>>, why: Unsent) -> Self {
        Self {
            call: Some(call),
            state: State::Unsent { why },
        }
    }

    pub(super) fn first(future: F, call: Box<Call<S, B, C>>) -> Self {
        Self {
            call: Some(call),
            state: State::Attempt { future },
        }
    }
}

impl<F, S, B, C, R, E> Future for ResponseFuture<F, S, B, C, R>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
    S: Service<Request<B>, Response = Response<R>, Future = F, Error = E> + Clone,
    B: Replay,
    C: Classify<R>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let Some(call) = this.call.as_mut() else {
            return match this.state.project() {
                StateProj::Attempt { future } => future.poll(cx).map_err(Into::into),
                _ => after_completion(),
            };
        };
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Attempt { future } => {
                    // The attempt runs in its own span, a child of the call's.
                    let result = {
                        let _attempt = call.attempt.enter();
                        ready!(future.poll(cx))
                    };
                    call.ended(result.map_err(Into::into))
                }
                StateProj::Backoff { sleep } => {
                    ready!(sleep.as_mut().poll(cx));
                    this.state.set(State::Ready { deadline: None });
                    continue;
                }
                StateProj::Throttled {
                    token,
                    not_before,
                    last,
                } => {
                    let Some(token) = ready!(token.as_mut().poll(cx)) else {
                        // No token came in time: the last answer, out of budget.
                        let mut last = last.take().unwrap_or_else(|| Err("no answer".into()));
                        call.out_of_budget(&mut last);
                        this.state.set(State::Done);
                        return Poll::Ready(last);
                    };
                    let at = call.took_token(token, *not_before);
                    let sleep = Box::pin(tokio::time::sleep_until(at));
                    this.state.set(State::Backoff { sleep });
                    continue;
                }
                StateProj::Ready { deadline } => match ready!(call.poll_send(cx, deadline)) {
                    Ok(future) => {
                        this.state.set(State::Attempt { future });
                        continue;
                    }
                    Err(end) => Next::Done(end),
                },
                StateProj::Unsent { why } => Next::Done(call.unsent(*why)),
                StateProj::Done => return after_completion(),
            };
            let state = match next {
                Next::Done(result) => {
                    this.state.set(State::Done);
                    return Poll::Ready(result);
                }
                Next::Retry { wait } if wait.is_zero() => State::Ready { deadline: None },
                Next::Retry { wait } => State::Backoff {
                    sleep: Box::pin(tokio::time::sleep(wait)),
                },
                Next::Throttled { wait, mut last } => match call.token_wait(wait) {
                    Some((token, not_before)) => State::Throttled {
                        token,
                        not_before,
                        last: Some(last),
                    },
                    // No time to wait for one: out of budget now.
                    None => {
                        call.out_of_budget(&mut last);
                        this.state.set(State::Done);
                        return Poll::Ready(last);
                    }
                },
            };
            this.state.set(state);
        }
    }
}

fn after_completion<T>() -> Poll<Result<T, BoxError>> {
    Poll::Ready(Err("retry future polled after completion".into()))
}

impl<F, S, B, C, R> std::fmt::Debug for ResponseFuture<F, S, B, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match (&self.call, &self.state) {
            (None, _) => "passthrough",
            (_, State::Attempt { .. }) => "attempt",
            (_, State::Backoff { .. }) => "backoff",
            (_, State::Throttled { .. }) => "waiting for a budget token",
            (_, State::Ready { .. }) => "waiting for the service",
            (_, State::Unsent { .. }) => "not sent",
            (_, State::Done) => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
