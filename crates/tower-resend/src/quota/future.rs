//! The response future of [`Pace`](super::Pace): a call that goes at once
//! is its inner future and its place in the quota; one that waits is
//! boxed (the slow path) with its service and request until its time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::pace::Admit;
use super::shared::{Shared, Ticket};
use crate::error::{BoxError, Error};

pin_project! {
    /// Response future of [`Pace`](super::Pace).
    pub struct ResponseFuture<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
        // The call's place in the quota, once it has one.
        ticket: Option<Ticket>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        Sent { #[pin] future: S::Future },
        Waiting { wait: Box<Waiting<S, ReqB>> },
        Refused { error: Option<BoxError> },
    }
}

/// A call waiting for its place in the pace, or for a reset.
struct Waiting<S, ReqB> {
    sleep: Pin<Box<Sleep>>,
    /// The wait is over: the service is being readied.
    slept: bool,
    /// It waits for a reset, after which it asks for its place again.
    again: bool,
    service: S,
    req: Option<Request<ReqB>>,
    shared: Arc<Shared>,
    deadline: Option<Instant>,
}

impl<S, ReqB> std::fmt::Debug for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Sent { .. } => "sent",
            State::Waiting { .. } => "waiting",
            State::Refused { .. } => "refused",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl<S, ReqB> ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    pub(super) fn sent(future: S::Future, ticket: Ticket) -> Self {
        Self {
            state: State::Sent { future },
            ticket: Some(ticket),
        }
    }

    pub(super) fn waiting(
        until: Instant,
        service: S,
        req: Request<ReqB>,
        shared: Arc<Shared>,
        deadline: Option<Instant>,
        ticket: Option<Ticket>,
    ) -> Self {
        let again = ticket.is_none();
        Self {
            state: State::Waiting {
                wait: Box::new(Waiting {
                    sleep: Box::pin(tokio::time::sleep_until(until)),
                    slept: false,
                    again,
                    service,
                    req: Some(req),
                    shared,
                    deadline,
                }),
            },
            ticket,
        }
    }

    pub(super) fn refused(error: BoxError) -> Self {
        Self {
            state: State::Refused { error: Some(error) },
            ticket: None,
        }
    }
}

impl<S, ReqB, ResB> Future for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Sent { future } => {
                    let result = ready!(future.poll(cx)).map_err(Into::into);
                    if let (Ok(resp), Some(ticket)) = (&result, this.ticket.take()) {
                        ticket.answered(resp.status(), resp.headers());
                    }
                    // (An error: the ticket's drop counts the call out.)
                    return Poll::Ready(result);
                }
                StateProj::Refused { error } => {
                    let error = error
                        .take()
                        .unwrap_or_else(|| "polled after completion".into());
                    return Poll::Ready(Err(error));
                }
                StateProj::Waiting { wait } => {
                    if !wait.slept {
                        ready!(wait.sleep.as_mut().poll(cx));
                        wait.slept = true;
                        if wait.again {
                            // The reset has come: its place now, or later.
                            match wait.shared.admit(Instant::now(), wait.deadline) {
                                Admit::Go => {
                                    *this.ticket = Some(Ticket::new(Arc::clone(&wait.shared)));
                                }
                                Admit::Wait { until, reserved } => {
                                    wait.sleep.as_mut().reset(until);
                                    wait.slept = false;
                                    wait.again = !reserved;
                                    if reserved {
                                        *this.ticket = Some(Ticket::new(Arc::clone(&wait.shared)));
                                    }
                                    continue;
                                }
                                Admit::Refuse(after) => {
                                    let error = Error::quota_spent(after).into();
                                    this.state.set(State::Refused { error: Some(error) });
                                    continue;
                                }
                            }
                        }
                    }
                    ready!(wait.service.poll_ready(cx)).map_err(Into::into)?;
                    let Some(req) = wait.req.take() else {
                        return Poll::Ready(Err("polled after completion".into()));
                    };
                    wait.service.call(req)
                }
            };
            this.state.set(State::Sent { future: next });
        }
    }
}
