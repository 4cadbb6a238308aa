use crate::name::Name;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use super::Deadline;
use crate::error::{BoxError, Error, Phase};

pin_project! {
    /// A response body that is read under the call's deadline.
    ///
    /// Returned by [`CallDeadline`](super::CallDeadline). Reading it
    /// after the deadline has passed fails with
    /// [`ErrorKind::DeadlineExceeded`](crate::ErrorKind) (phase
    /// [`Body`](crate::Phase::Body)); an error of the inner body (a connection
    /// reset mid-body) becomes a tower-resend [`Error`] of kind
    /// [`Transport`](crate::ErrorKind::Transport) with the original as its source.
    #[derive(Debug)]
    pub struct DeadlineBody<B> {
        #[pin]
        inner: B,
        // Boxed and made only when a read has to wait: the response travels
        // through every layer by value, and an inline `Sleep` is 112 bytes.
        sleep: Option<Pin<Box<Sleep>>>,
        deadline: Deadline,
        start: Instant,
        upstream: Option<Name>,
        failed: bool,
    }
}

impl<B> DeadlineBody<B> {
    pub(super) fn new(
        inner: B,
        deadline: Deadline,
        start: Instant,
        upstream: Option<Name>,
    ) -> Self {
        Self {
            inner,
            sleep: None,
            deadline,
            start,
            upstream,
            failed: false,
        }
    }

    /// The deadline this body is read under.
    pub fn deadline(&self) -> Deadline {
        self.deadline
    }

    /// The inner body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// Unwraps the inner body, dropping the deadline.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B> Body for DeadlineBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if *this.failed {
            return Poll::Ready(None);
        }
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => {
                *this.failed = true;
                let e: BoxError = e.into();
                let mut e = if e.is::<Error>() {
                    Error::from_box(e)
                } else {
                    Error::transport(e).with_phase(Phase::Body)
                };
                e.set_upstream_if_none(this.upstream.as_ref());
                return Poll::Ready(Some(Err(e.into())));
            }
            Poll::Ready(Some(Ok(frame))) => return Poll::Ready(Some(Ok(frame))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => {}
        }
        let deadline = this.deadline.instant();
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        *this.failed = true;
        let mut e = Error::deadline_exceeded(Phase::Body, this.start.elapsed());
        e.set_upstream_if_none(this.upstream.as_ref());
        Poll::Ready(Some(Err(e.into())))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
