use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use crate::error::BoxError;

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
/// took the original over) fails with a [`ReplayError`] instead of ending.
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
/// [`ReplayError`] (its attempt has been superseded), and if it was waiting on
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
/// use resend::retry::{ReplayBody, DEFAULT_REPLAY_CAP};
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

/// One handle on the shared state, with its own position in the body.
struct Reader<B> {
    shared: Arc<Mutex<State<B>>>,
    cursor: Cursor,
}

/// Where one reader is in the body.
struct Cursor {
    /// 0 for the value `new` returns, then 1, 2, … in `try_clone` order.
    generation: u64,
    /// Index (in `State::frames` order) of the next frame this reader yields.
    pos: usize,
    /// Data bytes this reader has yielded, for `size_hint`.
    yielded: u64,
    /// This reader returned an error: it ends here.
    done: bool,
}

struct State<B> {
    rest: Rest<B>,
    /// The frames read from the original so far, in order; emptied when the
    /// body goes over the cap or fails.
    frames: Vec<Recorded>,
    /// How many frames were read from the original, kept or not.
    frames_read: usize,
    /// How many data bytes were read from the original, kept or not.
    data_read: u64,
    /// What counts toward the cap: data bytes and, loosely, trailers.
    weight: usize,
    cap: usize,
    capped: bool,
    /// The generation `try_clone` gave last.
    last_generation: u64,
    /// The newest generation that has read from the original: older readers
    /// may no longer.
    owner: u64,
    /// The owner's waker while it waits on the original, to wake it when a
    /// newer reader takes over.
    owner_waker: Option<Waker>,
}

enum Rest<B> {
    /// The unread rest of the original body.
    Reading(Pin<Box<B>>),
    /// The original ended; `frames` holds all of it (unless capped).
    Complete,
    /// The original failed (or panicked while polled): not replayable.
    Failed,
}

enum Recorded {
    Data(Bytes),
    Trailers(HeaderMap),
}

/// Locks the shared state. A panic while it was held can only have come from
/// the original body (polled, asked for its size, or dropped under the
/// lock): that body can no longer be trusted, so it counts as failed.
fn lock<B>(shared: &Mutex<State<B>>) -> MutexGuard<'_, State<B>> {
    match shared.lock() {
        Ok(guard) => guard,
        Err(poisoned) => {
            let mut guard = poisoned.into_inner();
            guard.rest = Rest::Failed;
            guard.frames = Vec::new();
            guard.owner_waker = None;
            shared.clear_poison();
            guard
        }
    }
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
    pub(crate) fn passthrough(body: B) -> Self {
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

impl<B> Reader<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.cursor.done {
            return Poll::Ready(None);
        }
        let mut superseded = None;
        let poll = {
            let mut guard = lock(&self.shared);
            self.cursor.poll_locked(&mut guard, cx, &mut superseded)
        };
        // Woken outside the lock: the woken task may poll its body at once.
        if let Some(waker) = superseded {
            waker.wake();
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        let cursor = &self.cursor;
        if cursor.done {
            return true;
        }
        let state = lock(&self.shared);
        if cursor.pos < state.frames_read {
            return false;
        }
        match &state.rest {
            Rest::Complete => true,
            // An error is still to come.
            Rest::Failed => false,
            Rest::Reading(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let cursor = &self.cursor;
        if cursor.done {
            return SizeHint::with_exact(0);
        }
        let state = lock(&self.shared);
        if cursor.pos < state.frames_read && cursor.pos >= state.frames.len() {
            // An error is still to come.
            return SizeHint::default();
        }
        // Kept data this reader has not yielded yet.
        let ahead = state.data_read.saturating_sub(cursor.yielded);
        match &state.rest {
            Rest::Complete => SizeHint::with_exact(ahead),
            Rest::Failed => SizeHint::default(),
            Rest::Reading(body) => {
                let rest = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(ahead.saturating_add(rest.lower()));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(ahead.saturating_add(upper));
                }
                hint
            }
        }
    }
}

impl Cursor {
    fn new(generation: u64) -> Self {
        Self {
            generation,
            pos: 0,
            yielded: 0,
            done: false,
        }
    }

    fn poll_locked<B>(
        &mut self,
        state: &mut State<B>,
        cx: &mut Context<'_>,
        superseded: &mut Option<Waker>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        // Replay what was kept.
        if let Some(recorded) = state.frames.get(self.pos) {
            self.pos += 1;
            let frame = match recorded {
                Recorded::Data(data) => {
                    self.yielded += data.len() as u64;
                    Frame::data(data.clone())
                }
                Recorded::Trailers(trailers) => Frame::trailers(trailers.clone()),
            };
            return Poll::Ready(Some(Ok(frame)));
        }
        if self.pos < state.frames_read {
            // This reader is behind, and the copy it needs was dropped.
            let reason = match state.rest {
                Rest::Failed => Reason::Failed,
                _ => Reason::Capped,
            };
            return self.fail(reason);
        }

        // Caught up: read on from the original.
        let body = match &mut state.rest {
            Rest::Complete => return Poll::Ready(None),
            Rest::Failed => return self.fail(Reason::Failed),
            Rest::Reading(body) => body,
        };
        if body.is_end_stream() {
            state.rest = Rest::Complete;
            state.owner_waker = None;
            return Poll::Ready(None);
        }
        if self.generation < state.owner {
            return self.fail(Reason::Superseded);
        }
        if self.generation > state.owner {
            state.owner = self.generation;
            *superseded = state.owner_waker.take();
        }
        let frame = match body.as_mut().poll_frame(cx) {
            Poll::Pending => {
                match &state.owner_waker {
                    Some(waker) if waker.will_wake(cx.waker()) => {}
                    _ => state.owner_waker = Some(cx.waker().clone()),
                }
                return Poll::Pending;
            }
            Poll::Ready(None) => {
                state.rest = Rest::Complete;
                state.owner_waker = None;
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Err(e))) => {
                state.rest = Rest::Failed;
                state.frames = Vec::new();
                state.owner_waker = None;
                self.done = true;
                return Poll::Ready(Some(Err(e.into())));
            }
            Poll::Ready(Some(Ok(frame))) => frame,
        };
        state.owner_waker = None;
        // For `Bytes` this is a reference count bump, not a copy.
        let frame = frame.map_data(|mut data| data.copy_to_bytes(data.remaining()));
        state.frames_read += 1;
        self.pos += 1;
        let (recorded, weight) = if let Some(data) = frame.data_ref() {
            state.data_read += data.len() as u64;
            self.yielded += data.len() as u64;
            (Some(Recorded::Data(data.clone())), data.len())
        } else if let Some(trailers) = frame.trailers_ref() {
            let weight = trailers
                .iter()
                .map(|(name, value)| name.as_str().len() + value.len())
                .sum();
            (Some(Recorded::Trailers(trailers.clone())), weight)
        } else {
            // No other kind of frame exists in http-body 1; one that cannot
            // be kept makes the body not replayable, like one over the cap.
            (None, usize::MAX)
        };
        if !state.capped {
            state.weight = state.weight.saturating_add(weight);
            match recorded {
                Some(recorded) if state.weight <= state.cap => state.frames.push(recorded),
                _ => {
                    tracing::debug!(
                        cap = state.cap,
                        "request body grew past the replay cap: it will not be sent again"
                    );
                    state.capped = true;
                    state.frames = Vec::new();
                }
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn fail(&mut self, reason: Reason) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.done = true;
        Poll::Ready(Some(Err(Box::new(ReplayError { reason }))))
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

/// Why a [`ReplayBody`] clone could not send the whole body.
///
/// A clone that cannot finish fails with this error (boxed, so look for it
/// with `downcast_ref`) rather than end early: a receiver must never take a
/// part of the body for the whole. Errors of the original body itself are
/// passed on as they are, boxed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayError {
    reason: Reason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    /// The copy this clone needed was dropped at the cap.
    Capped,
    /// The original body failed while another clone was reading it.
    Failed,
    /// A newer clone has taken the rest of the original over.
    Superseded,
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.reason {
            Reason::Capped => "request body cannot be sent again: it grew past the replay cap",
            Reason::Failed => "request body cannot be sent again: the original body failed",
            Reason::Superseded => {
                "request body cannot be sent again: a newer attempt is sending it"
            }
        })
    }
}

impl std::error::Error for ReplayError {}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::marker::PhantomPinned;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use http::HeaderValue;
    use http_body_util::{BodyExt, Empty, Full};
    use pin_project_lite::pin_project;
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn stays_two_words() {
        // A request is moved many times inside hyper's client; a larger body
        // took `Request<ReplayBody<Empty<Bytes>>>` past 256 bytes, where each
        // of those moves costs more (BENCHMARKS.md, loopback instructions).
        assert!(std::mem::size_of::<ReplayBody<Empty<Bytes>>>() <= 16);
        assert!(std::mem::size_of::<http::Request<ReplayBody<Empty<Bytes>>>>() <= 256);
    }

    enum Step {
        Data(Bytes),
        Trailers(HeaderMap),
        Fail(&'static str),
        /// Returns `Pending` once, without waking anyone.
        Pending,
        Panic,
    }

    pin_project! {
        /// A body that plays a script. `!Unpin`, to show that none is needed.
        struct Script {
            steps: VecDeque<Step>,
            #[pin]
            _pin: PhantomPinned,
        }
    }

    impl Script {
        fn new(steps: impl IntoIterator<Item = Step>) -> Self {
            Self {
                steps: steps.into_iter().collect(),
                _pin: PhantomPinned,
            }
        }

        fn chunks<I: IntoIterator<Item = Vec<u8>>>(chunks: I) -> Self {
            Self::new(chunks.into_iter().map(|c| Step::Data(Bytes::from(c))))
        }
    }

    impl Body for Script {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            match self.project().steps.pop_front() {
                None => Poll::Ready(None),
                Some(Step::Data(data)) => Poll::Ready(Some(Ok(Frame::data(data)))),
                Some(Step::Trailers(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
                Some(Step::Fail(msg)) => Poll::Ready(Some(Err(msg.into()))),
                Some(Step::Pending) => Poll::Pending,
                Some(Step::Panic) => panic!("the original body panicked"),
            }
        }

        fn is_end_stream(&self) -> bool {
            self.steps.is_empty()
        }
    }

    type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

    fn poll<B>(body: &mut ReplayBody<B>) -> Polled
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        Pin::new(body).poll_frame(&mut Context::from_waker(Waker::noop()))
    }

    fn next_data<B>(body: &mut ReplayBody<B>) -> Bytes
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        match poll(body) {
            Poll::Ready(Some(Ok(frame))) => frame.into_data().expect("a data frame"),
            other => panic!("expected data, got {other:?}"),
        }
    }

    fn next_error<B>(body: &mut ReplayBody<B>) -> BoxError
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        match poll(body) {
            Poll::Ready(Some(Err(e))) => e,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    fn replay_reason(e: &BoxError) -> Reason {
        e.downcast_ref::<ReplayError>()
            .expect("a ReplayError")
            .reason
    }

    /// Reads to the end (skipping `Pending`s the script plays): the data
    /// frames and the trailers.
    fn read_all<B>(body: &mut ReplayBody<B>) -> Result<(Vec<Bytes>, Option<HeaderMap>), BoxError>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        let mut data = Vec::new();
        let mut trailers = None;
        for _ in 0..10_000 {
            match poll(body) {
                Poll::Pending => {}
                Poll::Ready(None) => return Ok((data, trailers)),
                Poll::Ready(Some(Err(e))) => return Err(e),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(d) => data.push(d),
                    Err(frame) => trailers = frame.into_trailers().ok(),
                },
            }
        }
        panic!("body did not end");
    }

    fn concat(chunks: &[Bytes]) -> Vec<u8> {
        chunks.iter().flat_map(|c| c.iter().copied()).collect()
    }

    fn script_of_sizes(sizes: &[usize]) -> (Script, Vec<u8>) {
        let chunks: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        let all = chunks.concat();
        (Script::chunks(chunks), all)
    }

    #[test]
    fn full_body_is_replayed_from_the_same_allocation() {
        let original = Bytes::from(vec![42u8; 1000]);
        let ptr = original.as_ptr();
        let body = ReplayBody::new(Full::new(original), DEFAULT_REPLAY_CAP);
        assert_eq!(body.size_hint().exact(), Some(1000));

        let mut first = body.try_clone().unwrap();
        assert_eq!(first.size_hint().exact(), Some(1000));
        let a = next_data(&mut first);
        assert_eq!(a.as_ptr(), ptr);
        assert!(matches!(poll(&mut first), Poll::Ready(None)));
        assert!(first.is_end_stream());

        let mut second = body.try_clone().unwrap();
        assert!(!second.is_end_stream());
        assert_eq!(second.size_hint().exact(), Some(1000));
        let b = next_data(&mut second);
        assert_eq!(b.as_ptr(), ptr, "replayed without a copy");
        assert_eq!(a, b);
        assert!(second.is_end_stream());
        assert!(matches!(poll(&mut second), Poll::Ready(None)));
        assert!(!body.is_capped());
    }

    #[test]
    fn many_chunks_under_the_cap_are_replayed_byte_for_byte() {
        let sizes: Vec<usize> = (0..100).map(|i| (i * 7) % 50).collect();
        let (script, all) = script_of_sizes(&sizes);
        let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);

        let (first, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
        let (second, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
        assert_eq!(concat(&first), all);
        assert_eq!(first, second, "same frames, same boundaries");
        let (third, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
        assert_eq!(concat(&third), all);
    }

    #[test]
    fn a_partly_read_attempt_is_replayed_then_the_rest_streamed() {
        let (script, all) = script_of_sizes(&[3, 4, 5, 6, 7]);
        let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);

        let mut first = body.try_clone().unwrap();
        next_data(&mut first);
        next_data(&mut first);
        drop(first);

        let mut second = body.try_clone().unwrap();
        assert_eq!(second.size_hint().lower(), 7, "kept bytes are counted");
        let (chunks, _) = read_all(&mut second).unwrap();
        assert_eq!(chunks.len(), 5);
        assert_eq!(concat(&chunks), all);

        let (chunks, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
        assert_eq!(concat(&chunks), all);
    }

    #[test]
    fn over_the_cap_streams_once_and_is_not_replayable() {
        let (script, all) = script_of_sizes(&[4, 4, 4]);
        let body = ReplayBody::new(script, 10);
        let mut first = body.try_clone().unwrap();
        next_data(&mut first);
        next_data(&mut first);
        assert!(!body.is_capped());
        assert!(body.try_clone().is_some(), "8 bytes kept, under the cap");

        let (rest, _) = read_all(&mut first).unwrap();
        assert_eq!(
            concat(&rest),
            all[8..],
            "the attempt in progress streams on"
        );
        assert!(body.is_capped());
        assert!(body.try_clone().is_none());
    }

    #[test]
    fn a_clone_made_before_the_cap_fails_instead_of_sending_half() {
        let (script, _) = script_of_sizes(&[4, 4, 4]);
        let body = ReplayBody::new(script, 10);
        let mut first = body.try_clone().unwrap();
        let mut early = body.try_clone().unwrap();
        read_all(&mut first).unwrap();
        let e = next_error(&mut early);
        assert_eq!(replay_reason(&e), Reason::Capped);
        assert!(matches!(poll(&mut early), Poll::Ready(None)));
    }

    #[test]
    fn exactly_at_the_cap_is_replayable_one_more_byte_is_not() {
        for (cap, replayable) in [(12, true), (11, false)] {
            let (script, all) = script_of_sizes(&[4, 4, 4]);
            let body = ReplayBody::new(script, cap);
            let (first, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
            assert_eq!(concat(&first), all);
            assert_eq!(body.is_capped(), !replayable, "cap {cap}");
            match body.try_clone() {
                Some(mut again) => {
                    assert!(replayable);
                    assert_eq!(concat(&read_all(&mut again).unwrap().0), all);
                }
                None => assert!(!replayable),
            }
        }
    }

    #[test]
    fn an_error_of_the_original_reaches_the_attempt_and_ends_replays() {
        let body = ReplayBody::new(
            Script::new([Step::Data(Bytes::from_static(b"ab")), Step::Fail("boom")]),
            DEFAULT_REPLAY_CAP,
        );
        let mut early = body.try_clone().unwrap();
        let mut first = body.try_clone().unwrap();
        assert_eq!(next_data(&mut first), "ab");
        assert_eq!(next_error(&mut first).to_string(), "boom");
        assert!(first.is_end_stream());
        assert!(matches!(poll(&mut first), Poll::Ready(None)));

        assert!(body.try_clone().is_none());
        assert!(!body.is_capped(), "failed, not capped");
        // A clone made before the failure cannot finish either.
        let e = next_error(&mut early);
        assert_eq!(replay_reason(&e), Reason::Failed);
    }

    #[test]
    fn a_panic_of_the_original_makes_the_body_not_replayable() {
        let body = ReplayBody::new(
            Script::new([Step::Data(Bytes::from_static(b"ab")), Step::Panic]),
            DEFAULT_REPLAY_CAP,
        );
        let mut early = body.try_clone().unwrap();
        let mut first = body.try_clone().unwrap();
        assert_eq!(next_data(&mut first), "ab");
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| poll(&mut first)));
        assert!(panicked.is_err());
        assert!(body.try_clone().is_none());
        assert_eq!(replay_reason(&next_error(&mut early)), Reason::Failed);
    }

    #[test]
    fn trailers_are_replayed() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let body = ReplayBody::new(
            Script::new([
                Step::Data(Bytes::from_static(b"payload")),
                Step::Trailers(trailers.clone()),
            ]),
            DEFAULT_REPLAY_CAP,
        );
        for _ in 0..3 {
            let (data, got) = read_all(&mut body.try_clone().unwrap()).unwrap();
            assert_eq!(concat(&data), b"payload");
            assert_eq!(got.as_ref(), Some(&trailers));
        }
    }

    #[test]
    fn trailers_count_toward_the_cap() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        // 7 data bytes + 12 for the trailer's name and value.
        for (cap, replayable) in [(19, true), (18, false)] {
            let body = ReplayBody::new(
                Script::new([
                    Step::Data(Bytes::from_static(b"payload")),
                    Step::Trailers(trailers.clone()),
                ]),
                cap,
            );
            let (_, got) = read_all(&mut body.try_clone().unwrap()).unwrap();
            assert_eq!(got.as_ref(), Some(&trailers), "streamed either way");
            assert_eq!(body.try_clone().is_some(), replayable, "cap {cap}");
        }
    }

    #[test]
    fn an_empty_body_costs_nothing() {
        let from_full = ReplayBody::new(Full::new(Bytes::new()), DEFAULT_REPLAY_CAP);
        let from_empty = ReplayBody::new(Empty::<Bytes>::new(), 0);
        for body in [&from_full.try_clone().unwrap(), &from_full] {
            assert!(matches!(body.inner, Inner::Empty), "no shared state");
        }
        assert!(matches!(from_empty.inner, Inner::Empty));

        for _ in 0..3 {
            let mut clone = from_empty.try_clone().unwrap();
            assert!(matches!(clone.inner, Inner::Empty));
            assert!(clone.is_end_stream());
            assert_eq!(clone.size_hint().exact(), Some(0));
            assert!(matches!(poll(&mut clone), Poll::Ready(None)));
        }
        assert!(!from_empty.is_capped(), "even with a cap of 0");
        assert_eq!(format!("{from_empty:?}"), "ReplayBody { empty: true }");
    }

    #[test]
    fn a_late_dropped_attempt_is_superseded_by_the_next() {
        let (script, all) = script_of_sizes(&[1, 2, 3, 4, 5]);
        let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
        let mut first = body.try_clone().unwrap();
        next_data(&mut first);
        next_data(&mut first);

        // The transport still holds `first` while the next attempt runs and
        // reads past it.
        let mut second = body.try_clone().unwrap();
        for _ in 0..3 {
            next_data(&mut second);
        }

        // `first` may still be polled: it replays what was kept, then cannot
        // read the original on, and says so rather than end.
        assert_eq!(next_data(&mut first).len(), 3);
        assert!(!first.is_end_stream());
        let e = next_error(&mut first);
        assert_eq!(replay_reason(&e), Reason::Superseded);
        assert!(first.is_end_stream());
        assert!(matches!(poll(&mut first), Poll::Ready(None)));

        let (rest, _) = read_all(&mut second).unwrap();
        assert_eq!(concat(&rest), all[6..]);

        // A third attempt still replays everything.
        let (chunks, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
        assert_eq!(concat(&chunks), all);
    }

    #[test]
    fn an_older_clone_replays_what_a_newer_one_read() {
        let (script, all) = script_of_sizes(&[1, 2, 3, 4, 5]);
        let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
        // Made in this order, read in the other: the older one may replay
        // all that was kept, but not read the original on.
        let mut older = body.try_clone().unwrap();
        let mut newer = body.try_clone().unwrap();
        next_data(&mut newer);
        next_data(&mut newer);
        assert_eq!(next_data(&mut older).len(), 1);
        assert_eq!(next_data(&mut older).len(), 2);
        assert_eq!(replay_reason(&next_error(&mut older)), Reason::Superseded);
        let (rest, _) = read_all(&mut newer).unwrap();
        assert_eq!(concat(&rest), all[3..]);
    }

    #[test]
    fn an_older_clone_still_alive_at_the_end_replays_the_whole_body() {
        let (script, all) = script_of_sizes(&[1, 2, 3]);
        let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
        let mut first = body.try_clone().unwrap();
        next_data(&mut first);
        let mut second = body.try_clone().unwrap();
        assert_eq!(concat(&read_all(&mut second).unwrap().0), all);
        // Everything was kept, so the late one needs nothing of the original.
        assert_eq!(concat(&read_all(&mut first).unwrap().0), all[1..]);
    }

    #[test]
    fn an_early_clone_replays_what_the_attempt_before_it_read() {
        // Like tower's retry, which clones the request before sending it.
        let (script, all) = script_of_sizes(&[5, 6, 7]);
        let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
        let mut first = body.try_clone().unwrap();
        let mut second = body.try_clone().unwrap();
        assert_eq!(concat(&read_all(&mut first).unwrap().0), all);
        assert_eq!(concat(&read_all(&mut second).unwrap().0), all);
    }

    #[derive(Default)]
    struct CountWakes(AtomicUsize);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_waiting_clone_is_woken_when_a_newer_one_takes_over() {
        let body = ReplayBody::new(
            Script::new([
                Step::Data(Bytes::from_static(b"a")),
                Step::Pending,
                Step::Data(Bytes::from_static(b"b")),
                Step::Data(Bytes::from_static(b"c")),
            ]),
            DEFAULT_REPLAY_CAP,
        );
        let wakes = Arc::new(CountWakes::default());
        let waker = Waker::from(Arc::clone(&wakes));
        let mut first = body.try_clone().unwrap();
        assert_eq!(next_data(&mut first), "a");
        let polled = Pin::new(&mut first).poll_frame(&mut Context::from_waker(&waker));
        assert!(polled.is_pending());
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);

        let mut second = body.try_clone().unwrap();
        assert_eq!(next_data(&mut second), "a");
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            0,
            "replaying takes nothing over"
        );
        assert_eq!(next_data(&mut second), "b");
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            1,
            "the older clone was woken"
        );
        // Woken, it replays what was kept, then may not read the original on.
        assert_eq!(next_data(&mut first), "b");
        assert_eq!(replay_reason(&next_error(&mut first)), Reason::Superseded);
        assert_eq!(next_data(&mut second), "c");
        assert!(matches!(poll(&mut second), Poll::Ready(None)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn clones_read_on_two_threads_at_once_never_mix_bodies() {
        let sizes: Vec<usize> = (1..=64).collect();
        for _ in 0..50 {
            let (script, all) = script_of_sizes(&sizes);
            let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
            let older = body.try_clone().unwrap();
            let newer = body.try_clone().unwrap();
            let older = tokio::spawn(older.collect());
            let newer = tokio::spawn(newer.collect());
            let newer = newer
                .await
                .unwrap()
                .expect("the newest clone always finishes");
            assert_eq!(newer.to_bytes(), all);
            match older.await.unwrap() {
                Ok(whole) => assert_eq!(whole.to_bytes(), all),
                Err(e) => assert_eq!(replay_reason(&e), Reason::Superseded),
            }
            assert_eq!(
                body.try_clone()
                    .unwrap()
                    .collect()
                    .await
                    .unwrap()
                    .to_bytes(),
                all
            );
        }
    }

    #[test]
    fn debug_does_not_need_a_debug_body() {
        let body = ReplayBody::new(Script::chunks([vec![1, 2, 3]]), 10);
        let mut clone = body.try_clone().unwrap();
        next_data(&mut clone);
        let shown = format!("{clone:?}");
        assert!(shown.contains("kept_bytes: 3"), "{shown}");
        assert!(shown.contains("capped: false"), "{shown}");
    }

    proptest! {
        #[test]
        fn replays_exactly_the_body_or_nothing(
            sizes in proptest::collection::vec(0usize..200, 0..30),
            cap in 0usize..3000,
        ) {
            let (script, all) = script_of_sizes(&sizes);
            let body = ReplayBody::new(script, cap);
            let (first, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
            prop_assert_eq!(concat(&first), all.clone());
            if all.len() <= cap {
                prop_assert!(!body.is_capped());
                let mut again = body.try_clone().expect("replayable");
                prop_assert_eq!(again.size_hint().exact(), Some(all.len() as u64));
                prop_assert_eq!(concat(&read_all(&mut again).unwrap().0), all);
            } else {
                prop_assert!(body.is_capped());
                prop_assert!(body.try_clone().is_none());
            }
        }
    }
}
