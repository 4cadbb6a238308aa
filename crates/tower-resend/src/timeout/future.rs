use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::error::{BoxError, Error, Phase};

pin_project! {
    /// Response future of [`AttemptTimeout`](super::AttemptTimeout).
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        inner: Option<F>,
        // Created only if the inner future is not ready at once, and boxed:
        // inline, its 112 bytes took the whole stack's future past 256
        // bytes, where each of its moves through the layers costs more
        // (measured with the callgrind bench).
        sleep: Option<Pin<Box<Sleep>>>,
        // When the attempt began: read when it was sent, or (under a retry
        // layer, which checked the deadline as it sent it) when it first
        // waits.
        start: Option<Instant>,
        deadline: Option<Instant>,
        per_attempt: Duration,
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn new(
        inner: F,
        start: Option<Instant>,
        deadline: Option<Instant>,
        per_attempt: Duration,
    ) -> Self {
        Self {
            inner: Some(inner),
            sleep: None,
            start,
            deadline,
            per_attempt,
        }
    }

    /// The deadline passed before the attempt began: nothing is sent.
    pub(super) fn expired() -> Self {
        Self {
            inner: None,
            sleep: None,
            start: None,
            deadline: None,
            per_attempt: Duration::ZERO,
        }
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let Some(inner) = this.inner.as_mut().as_pin_mut() else {
            return Poll::Ready(Err(
                Error::deadline_exceeded(Phase::Start, Duration::ZERO).into()
            ));
        };
        if let Poll::Ready(result) = inner.poll(cx) {
            return Poll::Ready(result.map_err(Into::into));
        }
        let start = *this.start.get_or_insert_with(Instant::now);
        let own = start + *this.per_attempt;
        // The deadline, where it is the tighter limit.
        let by_deadline = this.deadline.filter(|d| *d <= own);
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(by_deadline.unwrap_or(own))));
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        // Drop the attempt now: its connection is released, not kept waiting.
        this.inner.set(None);
        let e = if by_deadline.is_some() {
            // The deadline was the tighter limit; an enclosing deadline
            // layer fills in how long the whole call took.
            Error::deadline_exceeded(Phase::Attempt, start.elapsed())
        } else {
            Error::attempt_timeout(*this.per_attempt)
        };
        Poll::Ready(Err(e.into()))
    }
}
