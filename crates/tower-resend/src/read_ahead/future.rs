use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, Response};
use http_body::{Body, Frame};
use pin_project_lite::pin_project;

use super::idle::Idle;
use super::ReadAheadBody;
use crate::error::BoxError;

pin_project! {
    /// Response future of [`ReadAhead`](super::ReadAhead).
    pub struct ResponseFuture<F, B> {
        #[pin]
        state: State<F, B>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateProjReplace]
    enum State<F, B> {
        Calling { #[pin] future: F, cap: usize, idle: Option<Duration> },
        // A body being read ahead.
        Reading { ahead: Pin<Box<Ahead<Idle<B>>>> },
        Done,
    }
}

pin_project! {
    /// A body being read ahead, with its head and what was read of it.
    /// Boxed: most calls read nothing ahead, and inline it would make every
    /// call's future (moved through each layer above) larger by its size.
    pub(super) struct Ahead<B> {
        head: Option<http::response::Parts>,
        #[pin]
        pub(super) body: B,
        pub(super) read: Read,
        // Read to the end, or to this many bytes (a body of unknown
        // length; past them, the rest is handed on as it comes). `None`: the
        // body declared its length, within the cap.
        cap: Option<usize>,
        // The body ended within the cap: it is all in `read`.
        pub(super) ended: bool,
    }
}

/// What was read ahead of a body: its data (one chunk kept as it came,
/// without a copy; more are gathered) and its trailers.
#[derive(Default)]
pub(super) struct Read {
    pub(super) first: Option<Bytes>,
    rest: Option<BytesMut>,
    len: usize,
    pub(super) trailers: Option<HeaderMap>,
}

impl Read {
    fn push<B: Body>(&mut self, frame: Frame<B::Data>) {
        match frame.into_data() {
            Ok(mut data) => {
                let chunk = data.copy_to_bytes(data.remaining());
                self.len = self.len.saturating_add(chunk.len());
                match (self.first.as_ref(), self.rest.as_mut()) {
                    (None, _) => self.first = Some(chunk),
                    (Some(f), None) => {
                        let mut buf = BytesMut::with_capacity(f.len() + chunk.len());
                        buf.extend_from_slice(f);
                        buf.extend_from_slice(&chunk);
                        self.rest = Some(buf);
                    }
                    (Some(_), Some(buf)) => buf.extend_from_slice(&chunk),
                }
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    self.trailers.get_or_insert_with(HeaderMap::new).extend(t);
                }
            }
        }
    }

    fn take_data(&mut self) -> Bytes {
        match (self.rest.take(), self.first.take()) {
            (Some(buf), _) => buf.freeze(),
            (None, Some(one)) => one,
            (None, None) => Bytes::new(),
        }
    }
}

impl<F, B> std::fmt::Debug for ResponseFuture<F, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// True for responses that are streams not meant to end soon, which a
/// read-ahead would hold back: gRPC and server-sent events.
fn is_stream(head: &HeaderMap) -> bool {
    head.get(http::header::CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.get(..16)
            .is_some_and(|p| p.eq_ignore_ascii_case(b"application/grpc"))
            || v.get(..17)
                .is_some_and(|p| p.eq_ignore_ascii_case(b"text/event-stream"))
    })
}

fn after_completion<T>() -> Poll<Result<T, BoxError>> {
    Poll::Ready(Err("read-ahead future polled after completion".into()))
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<ReadAheadBody<B>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Calling { future, cap, idle } => {
                    let resp = ready!(future.poll(cx)).map_err(Into::into)?;
                    let resp = resp.map(|body| Idle::new(body, *idle));
                    let cap = *cap;
                    let hint = resp.body().size_hint();
                    let pass = cap == 0
                        || resp.body().is_end_stream()
                        || hint.lower() > cap as u64
                        || (hint.exact().is_none() && is_stream(resp.headers()));
                    if pass {
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(resp.map(ReadAheadBody::streaming)));
                    }
                    let (head, body) = resp.into_parts();
                    let ahead = Box::pin(Ahead {
                        head: Some(head),
                        body,
                        read: Read::default(),
                        cap: hint.exact().is_none().then_some(cap),
                        ended: false,
                    });
                    this.state.set(State::Reading { ahead });
                }
                StateProj::Reading { ahead } => {
                    let mut a = ahead.as_mut().project();
                    while !*a.ended && a.cap.is_none_or(|cap| a.read.len <= cap) {
                        match ready!(a.body.as_mut().poll_frame(cx)) {
                            Some(frame) => a.read.push::<Idle<B>>(frame?),
                            None => *a.ended = true,
                        }
                    }
                    let Some(head) = a.head.take() else {
                        return after_completion();
                    };
                    // What was read, as one chunk, for the body to give first.
                    let data = a.read.take_data();
                    a.read.first = (!data.is_empty()).then_some(data);
                    let StateProjReplace::Reading { ahead } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        return after_completion();
                    };
                    // The whole body, or (past the cap) what was read, then
                    // the rest as it comes; in the box it was read into.
                    let body = ReadAheadBody::read(ahead);
                    return Poll::Ready(Ok(Response::from_parts(head, body)));
                }
                StateProj::Done => return after_completion(),
            }
        }
    }
}

impl<F, B> ResponseFuture<F, B> {
    pub(super) fn new(future: F, cap: usize, idle: Option<Duration>) -> Self {
        Self {
            state: State::Calling { future, cap, idle },
        }
    }
}
