//! The state [`ReplayBody`](super::ReplayBody)'s clones share, and how one
//! clone reads through it: the kept copy first, then the rest of the
//! original, which only the newest clone that needs it may read.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use super::error::{Reason, ReplayError};
use crate::error::BoxError;

/// One handle on the shared state, with its own position in the body.
pub(super) struct Reader<B> {
    pub(super) shared: Arc<Mutex<State<B>>>,
    pub(super) cursor: Cursor,
}

/// Where one reader is in the body.
pub(super) struct Cursor {
    /// 0 for the value `new` returns, then 1, 2, … in `try_clone` order.
    pub(super) generation: u64,
    /// Index (in `State::frames` order) of the next frame this reader yields.
    pub(super) pos: usize,
    /// Data bytes this reader has yielded, for `size_hint`.
    yielded: u64,
    /// This reader returned an error: it ends here.
    done: bool,
}

pub(super) struct State<B> {
    pub(super) rest: Rest<B>,
    /// The frames read from the original so far, in order; emptied when the
    /// body goes over the cap or fails.
    pub(super) frames: Vec<Recorded>,
    /// How many frames were read from the original, kept or not.
    pub(super) frames_read: usize,
    /// How many data bytes were read from the original, kept or not.
    pub(super) data_read: u64,
    /// What counts toward the cap: data bytes and, loosely, trailers.
    pub(super) weight: usize,
    pub(super) cap: usize,
    pub(super) capped: bool,
    /// The generation `try_clone` gave last.
    pub(super) last_generation: u64,
    /// The newest generation that has read from the original: older readers
    /// may no longer.
    pub(super) owner: u64,
    /// The owner's waker while it waits on the original, to wake it when a
    /// newer reader takes over.
    pub(super) owner_waker: Option<Waker>,
}

pub(super) enum Rest<B> {
    /// The unread rest of the original body.
    Reading(Pin<Box<B>>),
    /// The original ended; `frames` holds all of it (unless capped).
    Complete,
    /// The original failed (or panicked while polled): not replayable.
    Failed,
}

pub(super) enum Recorded {
    Data(Bytes),
    Trailers(HeaderMap),
}

/// Locks the shared state. A panic while it was held can only have come from
/// the original body (polled, asked for its size, or dropped under the
/// lock): that body can no longer be trusted, so it counts as failed.
pub(super) fn lock<B>(shared: &Mutex<State<B>>) -> MutexGuard<'_, State<B>> {
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

impl<B> Reader<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    pub(super) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
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

    pub(super) fn is_end_stream(&self) -> bool {
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

    pub(super) fn size_hint(&self) -> SizeHint {
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
    pub(super) fn new(generation: u64) -> Self {
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
