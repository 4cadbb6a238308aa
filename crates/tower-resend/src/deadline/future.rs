use crate::name::Name;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use super::{Deadline, DeadlineBody, LedgerGuard};
use crate::error::{BoxError, Error, Phase};

pin_project! {
    /// Response future of [`CallDeadline`](super::CallDeadline).
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
        start: Instant,
        upstream: Option<Name>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<F> {
        Running {
            #[pin]
            inner: F,
            // Armed only when the inner future is pending: a call answered at
            // once never arms it, so it is boxed rather than moved, 112 bytes
            // of it, through every layer.
            sleep: Option<Pin<Box<Sleep>>>,
            // False when the layers inside wake the call by the deadline
            // (a stack's): no timer of its own.
            arm: bool,
            deadline: Deadline,
            // The call's entry in the ambient ledger, ended when it is dropped.
            ledger: Option<LedgerGuard>,
        },
        Expired,
        Done,
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn new(
        inner: F,
        deadline: Deadline,
        start: Instant,
        upstream: Option<Name>,
        ledger: Option<LedgerGuard>,
        arm: bool,
    ) -> Self {
        Self {
            kind: Kind::Running {
                inner,
                sleep: None,
                arm,
                deadline,
                ledger,
            },
            start,
            upstream,
        }
    }

    pub(super) fn expired(start: Instant, upstream: Option<Name>) -> Self {
        Self {
            kind: Kind::Expired,
            start,
            upstream,
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<DeadlineBody<B>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let (inner, sleep, arm, deadline) = match this.kind.as_mut().project() {
            KindProj::Running {
                inner,
                sleep,
                arm,
                deadline,
                ledger: _,
            } => (inner, sleep, *arm, *deadline),
            KindProj::Expired => {
                this.kind.set(Kind::Done);
                let mut e = Error::deadline_exceeded(Phase::Start, this.start.elapsed());
                e.set_upstream_if_none(this.upstream.as_ref());
                return Poll::Ready(Err(e.into()));
            }
            KindProj::Done => panic!("CallDeadline future polled after completion"),
        };

        // The inner future first: a response that is ready wins a tie with
        // the clock, and so does an inner layer's own error at the deadline
        // (a retry layer's says it was waiting, not that an attempt was in
        // flight).
        let result = inner.poll(cx);
        match result {
            Poll::Ready(Ok(response)) => {
                let upstream = this.upstream.take();
                let start = *this.start;
                this.kind.set(Kind::Done);
                return Poll::Ready(Ok(
                    response.map(|b| DeadlineBody::new(b, deadline, start, upstream))
                ));
            }
            Poll::Ready(Err(e)) => {
                this.kind.set(Kind::Done);
                let mut e: BoxError = e.into();
                if let Some(ours) = e.downcast_mut::<Error>() {
                    if ours.is_deadline_exceeded() {
                        ours.set_elapsed(this.start.elapsed());
                    }
                    ours.set_upstream_if_none(this.upstream.as_ref());
                }
                return Poll::Ready(Err(e));
            }
            Poll::Pending if !arm => return Poll::Pending,
            Poll::Pending => {}
        }

        let sleep =
            sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.instant())));
        ready!(sleep.as_mut().poll(cx));
        // Inner layers that wait (a retry's backoff, a service not ready)
        // end with their own error at the deadline, which won above: what
        // was cut here was an attempt in flight.
        this.kind.set(Kind::Done);
        let mut e = Error::deadline_exceeded(Phase::Attempt, this.start.elapsed());
        e.set_upstream_if_none(this.upstream.as_ref());
        Poll::Ready(Err(e.into()))
    }
}
