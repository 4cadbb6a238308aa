//! [`ReplayBody`]: a stream body that can be sent again. This file holds
//! the public type and what a transport sees of it; `shared.rs` the state
//! its clones share (the copy, the rest of the original, who may read it) and
//! how one clone reads through it.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, TryLockError};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};

use crate::error::BoxError;

#[cfg(test)]
use super::error::{Reason, ReplayError};
use super::shared::{lock, Cursor, Reader, Rest, State};

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

/// How many bytes of a request body [`ReplayBody`] keeps by default: 64 KiB.
pub const DEFAULT_REPLAY_CAP: usize = 64 * 1024;

/// A request body that can be sent again.
///
/// A retry layer wraps the caller's body once with [`new`](Self::new), keeps
/// that value without reading it, and sends [`try_clone`](Self::try_clone) to
/// each attempt. The first attempt streams the original body and keeps a copy
/// of what it read; a later attempt replays that copy, the same frames and
/// the same allocations (cloning a [`Bytes`] copies no data), and then goes
/// on with the rest of the original body if the earlier attempt stopped
/// before the end (a server that answered `503` before reading it all).
///
/// # The cap
///
/// The copy holds at most `cap` bytes. A body that grows past it is still
/// streamed whole by the attempt reading it, but the copy is dropped and the
/// body is no longer replayable: [`is_capped`](Self::is_capped) turns true
/// and [`try_clone`](Self::try_clone) returns `None`. A clone never sends
/// part of a body as if it were the whole: a clone that can no longer finish
/// (its data was dropped at the cap, the original failed, or a newer clone
/// took the original over) fails with a [`ReplayError`](super::ReplayError) instead of ending.
/// Trailers count toward the cap loosely, as the bytes of their names and
/// values.
///
/// # Empty bodies
///
/// A body that is already at its end when wrapped (`is_end_stream()`) costs
/// nothing: no allocation, no lock, and every clone is free. Any other body
/// costs one shared, locked state (an `Arc`) and one box for the original,
/// which lets whichever clone reads on poll it, `Unpin` or not; a clone is a
/// reference count bump.
///
/// # Several clones alive at once
///
/// Clones are meant to be used in the order [`try_clone`](Self::try_clone)
/// makes them, and the newest one that needs the rest of the original body
/// takes it over. Any clone replays what was copied so far; an *older* clone that then
/// needs the original after a newer clone has read from it fails with a
/// [`ReplayError`](super::ReplayError) (its attempt has been superseded), and if it was waiting on
/// the original it is woken so that it fails promptly rather than hang. So a
/// transport that drops an earlier attempt's body late neither blocks nor
/// corrupts the next attempt, and a clone made early (before the previous
/// attempt ran) still replays everything that attempt read.
///
/// # Example
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use tower_resend::body::{ReplayBody, DEFAULT_REPLAY_CAP};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let body = ReplayBody::new(Full::new(Bytes::from_static(b"hello")), DEFAULT_REPLAY_CAP);
///
/// // The first attempt streams the original body...
/// let first = body.try_clone().expect("nothing read yet");
/// assert_eq!(first.collect().await.unwrap().to_bytes(), "hello");
///
/// // ...and the next one sends the same bytes again.
/// let second = body.try_clone().expect("under the cap");
/// assert_eq!(second.collect().await.unwrap().to_bytes(), "hello");
///
/// // A body larger than the cap streams once, then cannot be sent again.
/// let big = ReplayBody::new(Full::new(Bytes::from(vec![7u8; 100])), 10);
/// let first = big.try_clone().unwrap();
/// assert_eq!(first.collect().await.unwrap().to_bytes().len(), 100);
/// assert!(big.is_capped());
/// assert!(big.try_clone().is_none());
/// # }
/// ```
pub struct ReplayBody<B> {
    inner: Inner<B>,
}

enum Inner<B> {
    /// The body was at its end when wrapped: nothing to read or replay.
    Empty,
    /// Passed through once, never replayed (an outer layer retries).
    Direct(Pin<Box<B>>),
    /// A reader over the shared copy and the rest of the original. Boxed:
    /// the body is moved with its request many times inside hyper (into
    /// its dispatch channel, its futures), and a 16-byte body keeps a
    /// `Request` under the 256 bytes past which every such copy costs more
    /// (measured with the callgrind bench: 40 bytes cost ~600 instructions
    /// per call in hyper's own moves).
    Shared(Box<Reader<B>>),
}

impl<B> ReplayBody<B>
where
    B: Body,
{
    /// Wraps `body`, keeping up to `cap` bytes of it for replays
    /// ([`DEFAULT_REPLAY_CAP`] is a sound choice).
    ///
    /// An empty body (already at its end) is dropped and costs nothing.
    pub fn new(body: B, cap: usize) -> Self {
        if body.is_end_stream() {
            return Self {
                inner: Inner::Empty,
            };
        }
        let state = State {
            rest: Rest::Reading(Box::pin(body)),
            frames: Vec::new(),
            frames_read: 0,
            data_read: 0,
            weight: 0,
            cap,
            capped: false,
            last_generation: 0,
            owner: 0,
            owner_waker: None,
        };
        Self {
            inner: Inner::Shared(Box::new(Reader {
                shared: Arc::new(Mutex::new(state)),
                cursor: Cursor::new(0),
            })),
        }
    }

    /// Wraps `body` to be sent once and never replayed: no copy is kept.
    pub fn once(body: B) -> Self {
        if body.is_end_stream() {
            return Self {
                inner: Inner::Empty,
            };
        }
        Self {
            inner: Inner::Direct(Box::pin(body)),
        }
    }

    /// A body for the next attempt, replaying from the start. None when the
    /// body is not replayable: it has grown past the cap, or the original
    /// stream failed.
    ///
    /// Each clone is newer than all before it (see [Several clones alive at
    /// once](Self#several-clones-alive-at-once)).
    pub fn try_clone(&self) -> Option<Self> {
        let reader = match &self.inner {
            Inner::Empty => {
                return Some(Self {
                    inner: Inner::Empty,
                })
            }
            Inner::Direct(_) => return None,
            Inner::Shared(reader) => reader,
        };
        let mut state = lock(&reader.shared);
        if state.capped || matches!(state.rest, Rest::Failed) {
            return None;
        }
        state.last_generation += 1;
        Some(Self {
            inner: Inner::Shared(Box::new(Reader {
                shared: Arc::clone(&reader.shared),
                cursor: Cursor::new(state.last_generation),
            })),
        })
    }

    /// True once the body is known not to be replayable (over the cap).
    ///
    /// A body whose original stream failed is not replayable either, yet is
    /// not capped: [`try_clone`](Self::try_clone) tells both apart from a
    /// replayable body.
    pub fn is_capped(&self) -> bool {
        match &self.inner {
            Inner::Empty | Inner::Direct(_) => false,
            Inner::Shared(reader) => lock(&reader.shared).capped,
        }
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match &mut self.get_mut().inner {
            Inner::Empty => Poll::Ready(None),
            Inner::Direct(body) => match body.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(
                    frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
                ))),
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            Inner::Shared(reader) => reader.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Empty => true,
            Inner::Direct(body) => body.is_end_stream(),
            Inner::Shared(reader) => reader.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Empty => SizeHint::with_exact(0),
            Inner::Direct(body) => body.size_hint(),
            Inner::Shared(reader) => reader.size_hint(),
        }
    }
}

impl<B> fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("ReplayBody");
        let reader = match &self.inner {
            Inner::Empty => return d.field("empty", &true).finish(),
            Inner::Direct(_) => return d.field("passthrough", &true).finish(),
            Inner::Shared(reader) => reader,
        };
        d.field("generation", &reader.cursor.generation)
            .field("pos", &reader.cursor.pos);
        let state = match reader.shared.try_lock() {
            Ok(state) => state,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return d.finish_non_exhaustive(),
        };
        let rest = match state.rest {
            Rest::Reading(_) => "reading",
            Rest::Complete => "complete",
            Rest::Failed => "failed",
        };
        d.field("original", &rest)
            .field("kept_frames", &state.frames.len())
            .field("kept_bytes", &state.weight)
            .field("cap", &state.cap)
            .field("capped", &state.capped)
            .finish()
    }
}
