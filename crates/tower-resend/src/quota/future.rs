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

/// A call waiting for its place in the pace, or for a reset, or for
/// Redis to say which.
struct Waiting<S, ReqB> {
    /// Redis is asked for the call's place (a task, bounded by the
    /// quota's timeout).
    asking: Option<tokio::task::JoinHandle<Admit>>,
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

impl<S, ReqB> Waiting<S, ReqB> {
    /// What the call does on `admit`: goes, with its ticket; waits again
    /// (its place taken, or for a reset); or is refused, with this error.
    fn admitted(&mut self, admit: Admit, ticket: &mut Option<Ticket>) -> Option<BoxError> {
        match admit {
            Admit::Go => {
                *ticket = Some(Ticket::new(Arc::clone(&self.shared), Instant::now()));
                self.slept = true;
                self.again = false;
            }
            Admit::Wait { until, reserved } => {
                self.sleep.as_mut().reset(until);
                self.slept = false;
                self.again = !reserved;
                if reserved {
                    *ticket = Some(Ticket::new(Arc::clone(&self.shared), until));
                }
            }
            Admit::Refuse(after) => return Some(Error::quota_spent(after).into()),
        }
        None
    }

    /// Asks Redis for the call's place, in a task (feature `quota-redis`).
    #[cfg(feature = "quota-redis")]
    fn ask(&self) -> tokio::task::JoinHandle<Admit> {
        tokio::spawn(Arc::clone(&self.shared).ask(self.deadline))
    }
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
                    asking: None,
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

    /// A call that asks Redis for its place first (feature `quota-redis`).
    #[cfg(feature = "quota-redis")]
    pub(super) fn asking(
        service: S,
        req: Request<ReqB>,
        shared: Arc<Shared>,
        deadline: Option<Instant>,
    ) -> Self {
        let mut this = Self::waiting(Instant::now(), service, req, shared, deadline, None);
        if let State::Waiting { wait } = &mut this.state {
            wait.asking = Some(wait.ask());
        }
        this
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
                    if let Some(asking) = wait.asking.as_mut() {
                        let admit = match ready!(Pin::new(asking).poll(cx)) {
                            Ok(admit) => admit,
                            // (The task cannot panic; if it is gone, the
                            // process's own view says.)
                            Err(_) => wait.shared.admit(Instant::now(), wait.deadline),
                        };
                        wait.asking = None;
                        if let Some(error) = wait.admitted(admit, this.ticket) {
                            this.state.set(State::Refused { error: Some(error) });
                        }
                        continue;
                    }
                    if !wait.slept {
                        ready!(wait.sleep.as_mut().poll(cx));
                        wait.slept = true;
                        if wait.again {
                            // The reset has come: its place now, or later.
                            #[cfg(feature = "quota-redis")]
                            if wait.shared.asks_redis(Instant::now()) {
                                wait.asking = Some(wait.ask());
                                continue;
                            }
                            let admit = wait.shared.admit(Instant::now(), wait.deadline);
                            if let Some(error) = wait.admitted(admit, this.ticket) {
                                this.state.set(State::Refused { error: Some(error) });
                            }
                            continue;
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
