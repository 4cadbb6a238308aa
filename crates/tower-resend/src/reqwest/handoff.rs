//! The transport of a [`ResendMiddleware`](super::ResendMiddleware)'s stack:
//! each attempt is handed back to the call that is running the stack, which
//! sends it on (to `next`, or to the client) and hands the answer back.
//!
//! A `reqwest_middleware::Next` borrows the client and the rest of the chain
//! for one call only, so no transport built once can hold it. The stack is
//! built once (its retry budget and circuit breaker are shared by every
//! call), and its transport is this: the call puts a channel in the request's
//! extensions, and [`Handoff`] sends each attempt down it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body as _;
use tokio::sync::{mpsc, oneshot};
use tower_service::Service;

use crate::body::ReplayBody;
use crate::error::{BoxError, Error};

/// What an attempt comes back with: the response, or what went wrong.
pub(super) type Reply = Result<Response<::reqwest::Body>, BoxError>;

/// One attempt, handed to the call running the stack.
pub(super) type Job = (::reqwest::Request, oneshot::Sender<Reply>);

/// The request extension that leads an attempt back to its call.
#[derive(Clone)]
pub(super) struct Dispatch(pub(super) mpsc::UnboundedSender<Job>);

/// A request extension holding a body reqwest had in memory: every attempt
/// gets it as it is (a reference count, no copy, no cap), and the body that
/// goes through the stack is empty.
#[derive(Clone)]
pub(super) struct Buffered(pub(super) Bytes);

/// Takes the bytes of a body reqwest holds in memory (`.body(bytes)`,
/// `.json()`, `.form()`), leaving `body` empty; `None` for a streamed body,
/// which stays where it is.
pub(super) fn take_buffered(body: &mut ::reqwest::Body) -> Option<Bytes> {
    let len = body.as_bytes()?.len();
    // A body in memory yields all its bytes in one frame, at once, without
    // looking at the context (reqwest moves them out: no copy).
    let mut cx = Context::from_waker(Waker::noop());
    let bytes = match Pin::new(&mut *body).poll_frame(&mut cx) {
        Poll::Ready(Some(Ok(frame))) => frame.into_data().unwrap_or_default(),
        _ => Bytes::new(),
    };
    if bytes.len() == len && body.is_end_stream() {
        Some(bytes)
    } else {
        // Not what reqwest does today; never send part of a body.
        let mut whole = bytes.to_vec();
        whole.extend_from_slice(body.as_bytes().unwrap_or_default());
        *body = ::reqwest::Body::default();
        Some(whole.into())
    }
}

/// The transport of a [`ResendMiddleware`](super::ResendMiddleware)'s
/// stack: it hands every attempt back to the call running the stack, which
/// sends it through `next` (or the client of
/// [`send_with`](super::RequestBuilderExt::send_with)).
///
/// It appears in the bounds of [`ResendMiddleware::new`](super::ResendMiddleware::new);
/// it cannot be made outside resend, and a request that does not come from
/// a `ResendMiddleware` call fails, not sent.
#[derive(Clone)]
pub struct Handoff {
    _private: (),
}

impl Handoff {
    pub(super) const fn new() -> Self {
        Self { _private: () }
    }
}

impl fmt::Debug for Handoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handoff").finish_non_exhaustive()
    }
}

impl Service<Request<ReplayBody<::reqwest::Body>>> for Handoff {
    type Response = Response<::reqwest::Body>;
    type Error = BoxError;
    type Future = HandoffFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReplayBody<::reqwest::Body>>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let Some(Dispatch(jobs)) = parts.extensions.remove::<Dispatch>() else {
            return HandoffFuture::failed(Error::connect(
                "a request reached tower-resend's reqwest handoff without a ResendMiddleware call"
                    .into(),
            ));
        };
        let body = match parts.extensions.remove::<Buffered>() {
            Some(Buffered(bytes)) => ::reqwest::Body::from(bytes),
            None if body.is_end_stream() => ::reqwest::Body::default(),
            // Streamed: the first attempt reads the caller's body and keeps
            // a copy up to the replay cap; later ones replay that copy.
            None => ::reqwest::Body::wrap(body),
        };
        let req = match ::reqwest::Request::try_from(Request::from_parts(parts, body)) {
            Ok(req) => req,
            // No reqwest request, so nothing was sent.
            Err(e) => return HandoffFuture::failed(Error::connect(Box::new(e))),
        };
        let (tx, rx) = oneshot::channel();
        if jobs.send((req, tx)).is_err() {
            return HandoffFuture::failed(Error::connect(
                "the call running this attempt has ended".into(),
            ));
        }
        HandoffFuture {
            state: State::Waiting(rx),
        }
    }
}

/// Response future of [`Handoff`]: the answer of the attempt, once the call
/// running the stack has it.
pub struct HandoffFuture {
    state: State,
}

enum State {
    Waiting(oneshot::Receiver<Reply>),
    Failed(Option<Error>),
}

impl HandoffFuture {
    fn failed(e: Error) -> Self {
        Self {
            state: State::Failed(Some(e)),
        }
    }
}

impl Future for HandoffFuture {
    type Output = Reply;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            State::Waiting(rx) => Pin::new(rx).poll(cx).map(|reply| {
                // The call dropped the attempt before it answered (it had a
                // newer one): the request may have gone out.
                reply.unwrap_or_else(|_| Err("the attempt was abandoned before it answered".into()))
            }),
            State::Failed(e) => Poll::Ready(Err(e.take().map_or_else(
                || "handoff future polled after completion".into(),
                Into::into,
            ))),
        }
    }
}

impl fmt::Debug for HandoffFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandoffFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_in_memory_is_taken_whole_and_a_stream_is_left() {
        let mut body = ::reqwest::Body::from("amount=100");
        assert_eq!(take_buffered(&mut body).unwrap(), "amount=100");
        assert!(body.is_end_stream());

        let mut empty = ::reqwest::Body::default();
        assert_eq!(take_buffered(&mut empty).unwrap(), "");

        let mut streamed = ::reqwest::Body::wrap(String::from("chunks"));
        assert!(take_buffered(&mut streamed).is_none());
        assert!(!streamed.is_end_stream());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_request_from_elsewhere_is_not_sent() {
        let req = Request::get("http://up.invalid/x")
            .body(ReplayBody::new(::reqwest::Body::default(), 0))
            .unwrap();
        let err = Error::from_box(Handoff::new().call(req).await.unwrap_err());
        assert!(err.is_not_sent(), "{err}");
    }
}
