//! What a run counts, per second of simulated time: written by the
//! callers, the transport and the instances, read once at the run's end.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::figures::Tally;

/// What the run counts, per second of simulated time from its start.
#[derive(Debug)]
pub(crate) struct Recorder {
    start: Instant,
    tally: Mutex<Tally>,
}

impl Recorder {
    pub(crate) fn new(start: Instant, seconds: usize) -> Self {
        Self {
            start,
            tally: Mutex::new(Tally::new(seconds)),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Tally, usize) -> R) -> R {
        let second = Instant::now()
            .saturating_duration_since(self.start)
            .as_secs() as usize;
        f(
            &mut self.tally.lock().unwrap_or_else(PoisonError::into_inner),
            second,
        )
    }

    /// A caller made a call.
    pub(crate) fn offered(&self) {
        self.with(|t, s| t.offered.bump(s));
    }

    /// An attempt reached the transport.
    pub(crate) fn sent(&self) {
        self.with(|t, s| t.sent.bump(s));
    }

    /// An attempt reached an instance able to take it (see
    /// [`Second::reached`](super::Second::reached)).
    pub(crate) fn reached(&self) {
        self.with(|t, s| t.reached.bump(s));
    }

    /// A call ended after `took`; `good` if 2xx within its deadline.
    pub(crate) fn ended(&self, took: Duration, good: bool) {
        self.with(|t, s| t.ended(s, took, good));
    }

    /// An instance finished `work`; `delivered` if a caller still waited.
    pub(crate) fn worked(&self, work: Duration, delivered: bool) {
        self.with(|t, s| t.worked(s, work, delivered));
    }

    /// An instance dropped a queued request whose deadline had passed.
    pub(crate) fn dropped(&self) {
        self.with(|t, _| t.dropped += 1);
    }

    /// An instance answered 503: its queue was full.
    pub(crate) fn full(&self) {
        self.with(|t, _| t.full += 1);
    }

    /// What was counted, taken out.
    pub(crate) fn take(&self) -> Tally {
        std::mem::take(&mut *self.tally.lock().unwrap_or_else(PoisonError::into_inner))
    }
}
