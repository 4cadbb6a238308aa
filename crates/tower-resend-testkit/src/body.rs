//! Response bodies and reading request bodies.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;

/// The error a broken response body fails with.
#[derive(Debug)]
pub(crate) struct BodyBroken;

impl fmt::Display for BodyBroken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tower-resend-testkit: response body deliberately broken")
    }
}

impl std::error::Error for BodyBroken {}

/// A response body: whole, or broken after some bytes.
#[derive(Debug)]
pub(crate) enum ReplyBody {
    /// The whole body; `None` once sent (or if empty).
    Full(Option<Bytes>),
    /// Sends `sent`, lets the connection flush, then breaks.
    Broken {
        sent: Option<Bytes>,
        stage: BreakStage,
        /// HTTP/2: end the stream short of the declared length instead of
        /// failing (a failure would reset the stream and may discard the
        /// not yet written head).
        h2: bool,
    },
    /// Sends `sent`, then nothing, ever.
    Stalled(Option<Bytes>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BreakStage {
    /// Not yet yielded to the connection after the data.
    Flush,
    /// Break on the next poll.
    Break,
    /// Done.
    Done,
}

impl ReplyBody {
    pub(crate) fn full(body: Bytes) -> ReplyBody {
        ReplyBody::Full(if body.is_empty() { None } else { Some(body) })
    }

    pub(crate) fn stalled(sent: Bytes) -> ReplyBody {
        ReplyBody::Stalled(Some(sent))
    }

    pub(crate) fn broken(sent: Bytes, h2: bool) -> ReplyBody {
        ReplyBody::Broken {
            sent: if sent.is_empty() { None } else { Some(sent) },
            stage: BreakStage::Flush,
            h2,
        }
    }
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = BodyBroken;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyBroken>>> {
        match self.get_mut() {
            ReplyBody::Full(body) => Poll::Ready(body.take().map(|b| Ok(Frame::data(b)))),
            ReplyBody::Stalled(sent) => match sent.take() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => Poll::Pending,
            },
            ReplyBody::Broken { sent, stage, h2 } => {
                if let Some(sent) = sent.take() {
                    return Poll::Ready(Some(Ok(Frame::data(sent))));
                }
                match *stage {
                    BreakStage::Flush => {
                        // Hand control back once so the connection writes out
                        // the head and the data before the body breaks (HTTP/1
                        // flushes when the body is pending; a body error would
                        // otherwise drop the connection with them unwritten).
                        *stage = BreakStage::Break;
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                    BreakStage::Break => {
                        *stage = BreakStage::Done;
                        if *h2 {
                            Poll::Ready(None)
                        } else {
                            Poll::Ready(Some(Err(BodyBroken)))
                        }
                    }
                    BreakStage::Done => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReplyBody::Full(body) => body.is_none(),
            ReplyBody::Broken { stage, .. } => *stage == BreakStage::Done,
            ReplyBody::Stalled(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ReplyBody::Full(body) => {
                SizeHint::with_exact(body.as_ref().map_or(0, |b| b.len() as u64))
            }
            ReplyBody::Broken { .. } | ReplyBody::Stalled(_) => SizeHint::default(),
        }
    }
}

/// Why a request body was not read in full.
#[derive(Debug)]
pub(crate) enum ReadFailure {
    /// Over the limit; the bytes up to the limit.
    TooLarge(Bytes),
    /// The client's side failed (reset, disconnect); the bytes read so far.
    Failed(Bytes),
}

/// Gathers a body's chunks, copying only when there is more than one.
#[derive(Default)]
struct Gather {
    first: Option<Bytes>,
    rest: Option<BytesMut>,
    len: usize,
}

impl Gather {
    fn push(&mut self, chunk: Bytes) {
        self.len += chunk.len();
        if let Some(rest) = &mut self.rest {
            rest.extend_from_slice(&chunk);
        } else if let Some(first) = self.first.take() {
            let mut rest = BytesMut::with_capacity(first.len() + chunk.len());
            rest.extend_from_slice(&first);
            rest.extend_from_slice(&chunk);
            self.rest = Some(rest);
        } else {
            self.first = Some(chunk);
        }
    }

    fn finish(self) -> Bytes {
        match (self.first, self.rest) {
            (_, Some(rest)) => rest.freeze(),
            (Some(first), None) => first,
            (None, None) => Bytes::new(),
        }
    }
}

/// Reads a request body in full, up to `limit` bytes. Trailers are ignored.
pub(crate) async fn read_body(mut body: Incoming, limit: usize) -> Result<Bytes, ReadFailure> {
    if body.is_end_stream() {
        return Ok(Bytes::new());
    }
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadFailure::TooLarge(Bytes::new()));
    }
    let mut gathered = Gather::default();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => {
                tracing::debug!(%error, "tower-resend-testkit: request body failed");
                return Err(ReadFailure::Failed(gathered.finish()));
            }
        };
        let Ok(mut chunk) = frame.into_data() else {
            continue;
        };
        let room = limit - gathered.len;
        if chunk.len() > room {
            gathered.push(chunk.split_to(room));
            return Err(ReadFailure::TooLarge(gathered.finish()));
        }
        if !chunk.is_empty() {
            gathered.push(chunk);
        }
    }
    Ok(gathered.finish())
}
