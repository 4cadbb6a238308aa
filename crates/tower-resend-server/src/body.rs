//! The response body of this crate's middleware: the inner service's own
//! body, a buffered body (a stored or generated response), or a buffered
//! prefix followed by the rest of a stream.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use tower_resend::BoxError;

pin_project! {
    /// Request and response body of [`InboundDeadline`](crate::InboundDeadline) and
    /// [`Idempotency`](crate::Idempotency): the handler's body as it is, or
    /// bytes the middleware holds (a stored response replayed, a 504), or
    /// both (bytes already read, then the rest of the handler's body).
    #[derive(Debug)]
    pub struct MaybeBuffered<B> {
        prefix: Option<Bytes>,
        #[pin]
        rest: Option<B>,
    }
}

impl<B> MaybeBuffered<B> {
    /// The handler's body, passed through.
    pub const fn inner(body: B) -> Self {
        Self {
            prefix: None,
            rest: Some(body),
        }
    }

    /// A body of `bytes` only.
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        Self {
            prefix: (!bytes.is_empty()).then_some(bytes),
            rest: None,
        }
    }

    /// `prefix`, then the rest of `body`.
    pub(crate) fn chain(prefix: Bytes, body: B) -> Self {
        Self {
            prefix: (!prefix.is_empty()).then_some(prefix),
            rest: Some(body),
        }
    }

    /// An empty body.
    pub const fn empty() -> Self {
        Self {
            prefix: None,
            rest: None,
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
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.as_ref().is_none_or(Body::is_end_stream)
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

/// Reads `body` until it ends or more than `cap` bytes have come. Returns the
/// bytes and whether the body ended (`false`: the cap was passed, and the
/// body still holds the rest).
pub(crate) async fn read_capped<B>(body: &mut B, cap: usize) -> Result<(Bytes, bool), BoxError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    use http_body_util::BodyExt;

    let mut buf = bytes::BytesMut::new();
    let mut first: Option<Bytes> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(Into::into)?;
        let Ok(data) = frame.into_data() else {
            // Trailers: nothing to keep for a buffered body.
            continue;
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
            return Ok((bytes, false));
        }
    }
    Ok((first.unwrap_or_else(|| buf.freeze()), true))
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
        let (bytes, done) = read_capped(&mut body, 25).await.unwrap();
        assert!(!done);
        assert_eq!(bytes.len(), 30);
        let rest = MaybeBuffered::chain(bytes, body)
            .collect()
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(rest.len(), 100);
        let mut small = Full::new(Bytes::from("hello"));
        assert_eq!(
            read_capped(&mut small, 5).await.unwrap(),
            (Bytes::from("hello"), true)
        );
    }
}
