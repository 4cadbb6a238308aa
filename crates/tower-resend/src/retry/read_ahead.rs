//! Small response bodies read before the response is returned, so that a
//! connection that breaks inside one is an attempt that failed — and, for a
//! replay-safe request, retried — rather than an error in the caller's hands.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::error::BoxError;

/// The default cap of [`ReadAheadLayer`]: 64 KiB.
pub const DEFAULT_READ_AHEAD: usize = 64 * 1024;

/// Reads the response body of an attempt before returning the response,
/// when a [`RetryLayer`](super::RetryLayer) above says the attempt may be
/// retried (a replay-safe request with retries allowed; it says so while it
/// calls the layers below, so they must call inner within their own `call`,
/// as tower-resend's do — behind a buffer's worker, nothing is read ahead):
/// up to the cap, whatever the body says of its length (a chunked HTTP/1.1
/// body and an HTTP/2 body without `content-length` too). A break inside a
/// body that ends within the cap (a reset connection, a truncated body)
/// then fails the attempt, and the retry layer retries it.
///
/// A body longer than the cap is handed on once the cap is reached: the
/// bytes read so far, then the rest as it comes; a break past the cap
/// reaches the caller while it reads. A body that declares a length over
/// the cap is not read at all, and neither are streams that are not meant
/// to end soon (gRPC, `text/event-stream`), nor requests the retry layer
/// did not mark. Place it below the retry layer and the attempt timeout
/// (so that the timeout covers the body too);
/// [`tower_resend::stack()`](crate::stack) does.
///
/// ```
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::{BodyExt, Full};
/// use tower_resend::retry::{ReadAheadLayer, ReplayBody, RetryLayer};
/// use tower::{service_fn, ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let svc = ServiceBuilder::new()
///     .layer(RetryLayer::new())
///     .layer(ReadAheadLayer::new(64 * 1024))
///     .service(service_fn(|_req: Request<ReplayBody<Full<Bytes>>>| async {
///         Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("read ahead"))))
///     }));
/// let resp = svc.oneshot(Request::get("http://up/").body(Full::new(Bytes::new())).unwrap()).await.unwrap();
/// assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "read ahead");
/// # }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ReadAheadLayer {
    cap: usize,
}

impl ReadAheadLayer {
    /// Reads marked bodies of at most `cap` bytes; 0 reads none.
    pub const fn new(cap: usize) -> Self {
        Self { cap }
    }
}

impl Default for ReadAheadLayer {
    /// [`DEFAULT_READ_AHEAD`] (64 KiB).
    fn default() -> Self {
        Self::new(DEFAULT_READ_AHEAD)
    }
}

impl<S> Layer<S> for ReadAheadLayer {
    type Service = ReadAheadService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReadAheadService {
            inner,
            cap: self.cap,
        }
    }
}

/// Middleware that reads small response bodies ahead; see
/// [`ReadAheadLayer`].
#[derive(Clone, Debug)]
pub struct ReadAheadService<S> {
    inner: S,
    cap: usize,
}

impl<S> ReadAheadService<S> {
    /// Wraps `inner`, reading marked bodies of at most `cap` bytes.
    pub const fn new(inner: S, cap: usize) -> Self {
        Self { inner, cap }
    }

    /// A [`ReadAheadLayer`] with the cap `cap`.
    pub const fn layer(cap: usize) -> ReadAheadLayer {
        ReadAheadLayer::new(cap)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ReadAheadService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    ResB: Body,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<ReadAheadBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // The retry layer above says, for the attempt it is calling,
        // whether it may retry a break in the body (a thread-local set for
        // the length of its synchronous call: no extension to look up).
        let cap = if crate::deadline::context::take_read_ahead() {
            self.cap
        } else {
            0
        };
        ResponseFuture {
            state: State::Calling {
                future: self.inner.call(req),
                cap,
            },
        }
    }
}

pin_project! {
    /// Response future of [`ReadAheadService`].
    pub struct ResponseFuture<F, B> {
        #[pin]
        state: State<F, B>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateProjReplace]
    enum State<F, B> {
        Calling { #[pin] future: F, cap: usize },
        // A body being read ahead.
        Reading { ahead: Pin<Box<Ahead<B>>> },
        Done,
    }
}

pin_project! {
    /// A body being read ahead, with its head and what was read of it.
    /// Boxed: most calls read nothing ahead, and inline it would make every
    /// call's future (moved through each layer above) larger by its size.
    struct Ahead<B> {
        head: Option<http::response::Parts>,
        #[pin]
        body: B,
        read: Read,
        // Read to the end, or to this many bytes (a body of unknown
        // length; past them, the rest is handed on as it comes). `None`: the
        // body declared its length, within the cap.
        cap: Option<usize>,
        // The body ended within the cap: it is all in `read`.
        ended: bool,
    }
}

/// What was read ahead of a body: its data (one chunk kept as it came,
/// without a copy; more are gathered) and its trailers.
#[derive(Default)]
struct Read {
    first: Option<Bytes>,
    rest: Option<BytesMut>,
    len: usize,
    trailers: Option<HeaderMap>,
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
                StateProj::Calling { future, cap } => {
                    let resp = ready!(future.poll(cx)).map_err(Into::into)?;
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
                            Some(frame) => a.read.push::<B>(frame.map_err(Into::into)?),
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
                    let body = ReadAheadBody {
                        inner: Inner::Read { ahead },
                    };
                    return Poll::Ready(Ok(Response::from_parts(head, body)));
                }
                StateProj::Done => return after_completion(),
            }
        }
    }
}

pin_project! {
    /// The response body of [`ReadAheadService`]: the inner body as it is,
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
        Streaming { #[pin] body: B },
        // Read ahead: what was read (and, if it did not end within the
        // cap, the rest of the body), in the box it was read into, so that
        // the response (moved by value through every layer) carries a
        // pointer.
        Read { ahead: Pin<Box<Ahead<B>>> },
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
    fn streaming(body: B) -> Self {
        Self {
            inner: Inner::Streaming { body },
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

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};
    use tower::{service_fn, ServiceExt};

    /// A body of `n` bytes declared, that sends `sent` of them, then fails.
    struct Breaks {
        declared: u64,
        sent: Option<Bytes>,
    }

    impl Body for Breaks {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(Some(match self.sent.take() {
                Some(b) => Ok(Frame::data(b)),
                None => Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
            }))
        }
        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.declared)
        }
    }

    /// Calls `svc` as a retry layer marks an attempt it may retry.
    async fn marked<S, B>(svc: S, body: B) -> Result<S::Response, S::Error>
    where
        S: tower::Service<Request<B>>,
    {
        let mut svc = svc;
        std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
        let fut = {
            let _attempt = crate::deadline::context::attempt(crate::deadline::context::Attempt {
                limit: None,
                read_ahead: true,
            });
            svc.call(Request::new(body))
        };
        fut.await
    }

    #[tokio::test]
    async fn a_marked_small_body_is_read_and_its_break_fails_the_attempt() {
        let svc = ReadAheadLayer::new(1024).layer(service_fn(|_: Request<()>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Breaks {
                declared: 20,
                sent: Some(Bytes::from_static(b"0123456789")),
            }))
        }));
        let err = marked(svc.clone(), ()).await.unwrap_err();
        assert!(
            err.to_string().contains("reset") || err.is::<std::io::Error>(),
            "{err}"
        );
        // Unmarked: the response goes out as it is, and the break reaches
        // whoever reads it.
        let resp = svc.oneshot(Request::new(())).await.unwrap();
        assert!(!resp.body().is_read_ahead());
        assert!(resp.into_body().collect().await.is_err());
    }

    #[tokio::test]
    async fn read_bodies_keep_their_bytes_and_large_or_streamed_ones_pass() {
        let svc =
            ReadAheadLayer::new(8).layer(service_fn(|req: Request<&'static str>| async move {
                Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                    *req.body(),
                ))))
            }));
        let small = marked(svc.clone(), "12345678").await.unwrap();
        assert!(small.body().is_read_ahead());
        assert_eq!(small.body().size_hint().exact(), Some(8));
        assert_eq!(
            small.into_body().collect().await.unwrap().to_bytes(),
            "12345678"
        );
        let large = marked(svc.clone(), "123456789").await.unwrap();
        assert!(!large.body().is_read_ahead());
        assert_eq!(
            large.into_body().collect().await.unwrap().to_bytes(),
            "123456789"
        );
        // A stream (no length known) is read ahead too, when it ends
        // within the cap.
        struct Stream(u8);
        impl Body for Stream {
            type Data = Bytes;
            type Error = std::convert::Infallible;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
                self.0 += 1;
                Poll::Ready(match self.0 {
                    1 => Some(Ok(Frame::data(Bytes::from_static(b"a")))),
                    2 => Some(Ok(Frame::data(Bytes::from_static(b"b")))),
                    _ => None,
                })
            }
        }
        let streamed = ReadAheadLayer::new(1 << 20).layer(service_fn(|_: Request<()>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Stream(0)))
        }));
        let resp = marked(streamed, ()).await.unwrap();
        assert!(resp.body().is_read_ahead());
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ab");
    }

    /// A body of unknown length: read to the cap; its break within the cap
    /// fails the attempt; past the cap, what was read comes first, then the
    /// rest as it comes (a break there reaches the reader); gRPC and
    /// server-sent events are not held back at all.
    #[tokio::test]
    async fn a_body_of_unknown_length_is_read_to_the_cap() {
        /// Sends its chunks, then fails; no length declared.
        struct Chunks(Vec<&'static str>);
        impl Body for Chunks {
            type Data = Bytes;
            type Error = std::io::Error;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
                if self.0.is_empty() {
                    return Poll::Ready(Some(Err(std::io::ErrorKind::ConnectionReset.into())));
                }
                let chunk = self.0.remove(0);
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(chunk.as_bytes())))))
            }
        }
        let svc = |chunks: Vec<&'static str>, ct: Option<&'static str>| {
            ReadAheadLayer::new(8).layer(service_fn(move |_: Request<()>| {
                let chunks = chunks.clone();
                async move {
                    let mut resp = Response::new(Chunks(chunks));
                    if let Some(ct) = ct {
                        resp.headers_mut()
                            .insert(http::header::CONTENT_TYPE, ct.parse().unwrap());
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                }
            }))
        };
        // Breaks after 5 bytes, within the cap: the attempt fails.
        assert!(marked(svc(vec!["01234"], None), ()).await.is_err());
        // Breaks after 12 bytes, past the cap: handed on at 9 bytes read,
        // the bytes in order, then the break.
        let resp = marked(svc(vec!["01234", "5678", "9ab"], None), ())
            .await
            .expect("handed on past the cap");
        assert!(!resp.body().is_read_ahead());
        assert_eq!(resp.body().size_hint().lower(), 9);
        let mut body = resp.into_body();
        let mut got = Vec::new();
        let err = loop {
            match body.frame().await {
                Some(Ok(f)) => got.extend_from_slice(&f.into_data().unwrap()),
                Some(Err(e)) => break e,
                None => panic!("the break is lost"),
            }
        };
        assert_eq!(got, b"0123456789ab");
        assert!(
            err.to_string().contains("reset") || err.is::<std::io::Error>(),
            "{err}"
        );
        // gRPC and event streams: handed on at once, the break to the reader.
        for ct in ["application/grpc+proto", "text/event-stream"] {
            let resp = marked(svc(vec!["01"], Some(ct)), ())
                .await
                .expect("not read ahead");
            assert!(!resp.body().is_read_ahead(), "{ct}");
        }
    }

    #[tokio::test]
    async fn several_chunks_and_trailers_are_kept() {
        struct Chunks(u8);
        impl Body for Chunks {
            type Data = Bytes;
            type Error = std::convert::Infallible;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
                self.0 += 1;
                Poll::Ready(match self.0 {
                    1 => Some(Ok(Frame::data(Bytes::from_static(b"ab")))),
                    2 => Some(Ok(Frame::data(Bytes::from_static(b"cd")))),
                    3 => {
                        let mut t = HeaderMap::new();
                        t.insert("x-sum", "1".parse().unwrap());
                        Some(Ok(Frame::trailers(t)))
                    }
                    _ => None,
                })
            }
            fn size_hint(&self) -> SizeHint {
                SizeHint::with_exact(4)
            }
        }
        let svc = ReadAheadLayer::new(4).layer(service_fn(|_: Request<()>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Chunks(0)))
        }));
        let resp = marked(svc, ()).await.unwrap();
        assert!(resp.body().is_read_ahead());
        let all = resp.into_body().collect().await.unwrap();
        assert_eq!(all.trailers().unwrap()["x-sum"], "1");
        assert_eq!(all.to_bytes(), "abcd");
    }
}
