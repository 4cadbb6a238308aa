use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::future::Ahead;
use super::idle::Idle;
use crate::error::BoxError;

pin_project! {
    /// The response body of [`ReadAhead`](super::ReadAhead): the inner body as it is,
    /// the bytes (and trailers) read ahead, or the bytes read ahead of a
    /// body longer than the cap followed by the rest of it.
    pub struct ReadAheadBody<B> {
        #[pin]
        inner: Inner<B>,
    }
}

pin_project! {
    #[project = InnerProj]
    enum Inner<B> {
        Streaming { #[pin] body: Idle<B> },
        // Read ahead: what was read (and, if it did not end within the
        // cap, the rest of the body), in the box it was read into, so that
        // the response (moved by value through every layer) carries a
        // pointer.
        Read { ahead: Pin<Box<Ahead<Idle<B>>>> },
    }
}

impl<B> std::fmt::Debug for ReadAheadBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAheadBody")
            .field("read_ahead", &self.is_read_ahead())
            .finish_non_exhaustive()
    }
}

impl<B> ReadAheadBody<B> {
    pub(super) fn streaming(body: Idle<B>) -> Self {
        Self {
            inner: Inner::Streaming { body },
        }
    }

    pub(super) fn read(ahead: Pin<Box<Ahead<Idle<B>>>>) -> Self {
        Self {
            inner: Inner::Read { ahead },
        }
    }

    /// True when the whole body was read ahead (it can no longer fail).
    pub fn is_read_ahead(&self) -> bool {
        matches!(&self.inner, Inner::Read { ahead } if ahead.ended)
    }
}

fn forward<B>(
    body: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match ready!(body.poll_frame(cx)) {
        Some(Ok(frame)) => Poll::Ready(Some(Ok(
            frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
        ))),
        Some(Err(e)) => Poll::Ready(Some(Err(e.into()))),
        None => Poll::Ready(None),
    }
}

impl<B> Body for ReadAheadBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().inner.project() {
            InnerProj::Streaming { body } => forward(body, cx),
            InnerProj::Read { ahead } => {
                let a = ahead.as_mut().project();
                if let Some(d) = a.read.first.take() {
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                if *a.ended {
                    return Poll::Ready(a.read.trailers.take().map(|t| Ok(Frame::trailers(t))));
                }
                forward(a.body, cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Streaming { body } => body.is_end_stream(),
            Inner::Read { ahead } => {
                ahead.read.first.is_none()
                    && if ahead.ended {
                        ahead.read.trailers.is_none()
                    } else {
                        ahead.body.is_end_stream()
                    }
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Streaming { body } => body.size_hint(),
            Inner::Read { ahead } => {
                let read = ahead.read.first.as_ref().map_or(0, |d| d.len() as u64);
                if ahead.ended {
                    return SizeHint::with_exact(read);
                }
                let rest = ahead.body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(read));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(read));
                }
                hint
            }
        }
    }
}
