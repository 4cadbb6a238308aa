use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use tower::Layer;

use super::*;
use crate::vocab::RetryInCharge;
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
    let mut req = Request::new(body);
    RetryInCharge::USUAL.mark(req.extensions_mut());
    svc.oneshot(req).await
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
    let svc = ReadAheadLayer::new(8).layer(service_fn(|req: Request<&'static str>| async move {
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(*req.body()))))
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
