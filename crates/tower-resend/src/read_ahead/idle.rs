//! A limit on how long a response body may send nothing.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::error::{BoxError, Error, Phase};

pin_project! {
    /// A response body that fails after `idle` without a frame; see
    /// [`ReadAheadLayer::idle_timeout`](crate::read_ahead::ReadAheadLayer::idle_timeout).
    #[derive(Debug)]
    pub(super) struct Idle<B> {
        #[pin]
        inner: B,
        idle: Option<Duration>,
        // Set on the first read that has to wait: a body that is all there
        // (the common small answer) never sets a timer. Boxed: the response
        // goes up through every layer by value, and a `Sleep` is 112 bytes.
        timer: Option<Pin<Box<Sleep>>>,
    }
}

impl<B> Idle<B> {
    pub(super) fn new(inner: B, idle: Option<Duration>) -> Self {
        Self {
            inner,
            idle,
            timer: None,
        }
    }
}

impl<B> Body for Idle<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, BoxError>>> {
        let this = self.project();
        if let Poll::Ready(frame) = this.inner.poll_frame(cx) {
            if let (Some(idle), Some(timer)) = (*this.idle, this.timer.as_mut()) {
                timer.as_mut().reset(Instant::now() + idle);
            }
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let Some(idle) = *this.idle else {
            return Poll::Pending;
        };
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
        ready!(timer.as_mut().poll(cx));
        let e = Error::attempt_timeout(idle).with_phase(Phase::Body);
        Poll::Ready(Some(Err(e.into())))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
