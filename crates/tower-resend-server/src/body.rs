//! The response body of this crate's middleware: the inner service's own
//! body, a buffered body (a stored or generated response, with its trailers),
//! or a buffered prefix followed by the rest of a stream.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use tower_resend::BoxError;

pin_project! {
    /// Request and response body of [`InboundDeadline`](crate::InboundDeadline) and
    /// [`Idempotency`](crate::Idempotency): the handler's body as it is, or
    /// bytes the middleware holds (a stored response replayed, a 504), or
    /// both (bytes already read, then the rest of the handler's body). A
    /// buffered body may end with trailers (a gRPC response's `grpc-status`).
    #[derive(Debug)]
    pub struct MaybeBuffered<B> {
        prefix: Option<Bytes>,
        #[pin]
        rest: Option<B>,
        // Boxed: rare (gRPC), and the body is moved with every response
        // through every layer (80 bytes rather than 168 beside a small
        // body).
        trailers: Option<Box<HeaderMap>>,
    }
}

impl<B> MaybeBuffered<B> {
    /// The handler's body, passed through.
    pub const fn inner(body: B) -> Self {
        Self {
            prefix: None,
            rest: Some(body),
            trailers: None,
        }
    }

    /// A body of `bytes` only.
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        Self {
            prefix: (!bytes.is_empty()).then_some(bytes),
            rest: None,
            trailers: None,
        }
    }

    /// A body of `bytes`, then `trailers` (if any).
    pub fn with_trailers(bytes: impl Into<Bytes>, trailers: Option<HeaderMap>) -> Self {
        Self::with_boxed_trailers(bytes, trailers.map(Box::new))
    }

    /// [`with_trailers`](Self::with_trailers), with trailers in a box
    /// already (as [`read_capped`] reads them).
    pub(crate) fn with_boxed_trailers(
        bytes: impl Into<Bytes>,
        trailers: Option<Box<HeaderMap>>,
    ) -> Self {
        Self {
            trailers,
            ..Self::full(bytes)
        }
    }

    /// `prefix`, then the rest of `body`.
    pub(crate) fn chain(prefix: Bytes, body: B) -> Self {
        Self {
            prefix: (!prefix.is_empty()).then_some(prefix),
            rest: Some(body),
            trailers: None,
        }
    }

    /// An empty body.
    pub const fn empty() -> Self {
        Self {
            prefix: None,
            rest: None,
            trailers: None,
        }
    }
}

impl MaybeBuffered<MaybeBuffered<http_body_util::Empty<bytes::Bytes>>> {
    /// A buffered body made by a layer over a service whose own body is
    /// always empty (a refusal, a replay, a problem), as one buffered body
    /// of any type: its bytes and trailers, wherever they were.
    pub(crate) fn flatten<X>(self) -> MaybeBuffered<X> {
        let Self {
            prefix,
            rest,
            trailers,
        } = self;
        let (prefix, trailers) = match rest {
            None => (prefix, trailers),
            Some(inner) => {
                let bytes = match (prefix, inner.prefix) {
                    (Some(a), Some(b)) => Some([a, b].concat().into()),
                    (a, b) => a.or(b),
                };
                (bytes, trailers.or(inner.trailers))
            }
        };
        MaybeBuffered {
            prefix,
            rest: None,
            trailers,
        }
    }
}

impl<B> Default for MaybeBuffered<B> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<B> Body for MaybeBuffered<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if let Some(prefix) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        match this.rest.as_pin_mut() {
            Some(rest) => rest.poll_frame(cx).map_err(Into::into),
            None => Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(*t)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        match &self.rest {
            Some(rest) => {
                let h = rest.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(h.lower() + prefix);
                if let Some(upper) = h.upper() {
                    out.set_upper(upper + prefix);
                }
                out
            }
            None => SizeHint::with_exact(prefix),
        }
    }
}

/// What [`read_capped`] read of a body.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Read {
    /// The bytes: all of them, or the first ones past the cap.
    pub(crate) bytes: Bytes,
    /// Whether the body ended (`false`: the cap was passed, and the body
    /// still holds the rest).
    pub(crate) whole: bool,
    /// The trailers it ended with, if any (boxed: rare, and a `Read` is
    /// moved with the response it was read from).
    pub(crate) trailers: Option<Box<HeaderMap>>,
}

/// Reads `body` until it ends or more than `cap` bytes have come: the
/// bytes, whether it ended, and its trailers.
pub(crate) async fn read_capped<B>(body: &mut B, cap: usize) -> Result<Read, BoxError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    use http_body_util::BodyExt;

    let mut buf = bytes::BytesMut::new();
    let mut first: Option<Bytes> = None;
    let mut trailers: Option<Box<HeaderMap>> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(Into::into)?;
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers.get_or_insert_with(Box::default).extend(t);
                }
                continue;
            }
        };
        if first.is_none() && buf.is_empty() {
            first = Some(data);
        } else {
            if let Some(f) = first.take() {
                buf.extend_from_slice(&f);
            }
            buf.extend_from_slice(&data);
        }
        let len = first.as_ref().map_or(buf.len(), Bytes::len);
        if len > cap {
            let bytes = first.unwrap_or_else(|| buf.freeze());
            return Ok(Read {
                bytes,
                whole: false,
                trailers,
            });
        }
    }
    Ok(Read {
        bytes: first.unwrap_or_else(|| buf.freeze()),
        whole: true,
        trailers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn prefix_then_rest() {
        let body = MaybeBuffered::chain(Bytes::from("ab"), Full::new(Bytes::from("cd")));
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all, "abcd");
        let full = MaybeBuffered::<Full<Bytes>>::full("xyz");
        assert_eq!(full.size_hint().exact(), Some(3));
        assert_eq!(full.collect().await.unwrap().to_bytes(), "xyz");
    }

    /// A body of `n` chunks of ten bytes.
    pub(crate) struct Chunks(pub(crate) usize);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if self.0 == 0 {
                return Poll::Ready(None);
            }
            self.0 -= 1;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"0123456789")))))
        }
    }

    #[tokio::test]
    async fn read_capped_stops_past_the_cap() {
        let mut body = Chunks(10);
        let read = read_capped(&mut body, 25).await.unwrap();
        assert!(!read.whole);
        assert_eq!(read.bytes.len(), 30);
        let rest = MaybeBuffered::chain(read.bytes, body)
            .collect()
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(rest.len(), 100);
        let mut small = Full::new(Bytes::from("hello"));
        let read = read_capped(&mut small, 5).await.unwrap();
        assert_eq!((read.bytes, read.whole), (Bytes::from("hello"), true));
    }

    /// A gRPC response's trailers are read with its body, and a buffered
    /// body gives them back after its bytes.
    #[tokio::test]
    async fn trailers_are_read_and_given_back() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let frames = [
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"msg"))),
            Ok(Frame::trailers(trailers.clone())),
        ];
        let mut body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        let read = read_capped(&mut body, 1024).await.unwrap();
        assert_eq!(read.bytes, "msg");
        assert!(read.whole);
        assert_eq!(read.trailers.as_deref(), Some(&trailers));

        let again = MaybeBuffered::<Full<Bytes>>::with_boxed_trailers(read.bytes, read.trailers);
        let collected = again.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "msg");
    }
}
