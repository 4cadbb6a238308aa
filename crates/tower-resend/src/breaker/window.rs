//! The sampling window: calls and failures over the last `window`, in a
//! fixed number of buckets, counted with atomics so that the closed
//! circuit's success path takes no lock. An upstream's window (one that
//! every thread's calls count in) keeps its successes in the calling
//! thread's lane, so that the success path writes no count that every
//! thread shares either; a fleet's instance has one lane.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::state::Counts;
use crate::retry::{shard, Padded, SHARDS};

/// Buckets in a window: the window slides by a tenth of its length.
pub(crate) const BUCKETS: u32 = 10;

/// One slice of the window: the epoch it counts (0: none yet) and its counts.
#[derive(Debug, Default)]
struct Bucket {
    epoch: AtomicU64,
    calls: AtomicU32,
    failures: AtomicU32,
}

/// Calls and failures over the last `BUCKETS` epochs of `bucket_ms` each.
///
/// An outcome is counted in the bucket of the epoch its call began in (the
/// instant the call had to read anyway). A bucket that comes round again
/// for a newer epoch is zeroed under a small lock, taken once per bucket
/// per epoch; counting into the bucket of the current epoch is one relaxed
/// atomic add. The counts are a sample, not a ledger: an outcome that races
/// with its bucket being recycled (a call that began a whole window ago)
/// may be lost or land in the newer epoch, which moves a ratio over a
/// hundred calls by less than one of them.
#[derive(Debug)]
pub(crate) struct Window {
    /// The failures' lane (and, with one lane, every call's), then one for
    /// each thread shard's successes.
    lanes: Box<[Padded<Lane>]>,
    bucket_ms: u64,
    origin: Instant,
    recycle: Mutex<()>,
}

/// The buckets of one lane.
type Lane = [Bucket; BUCKETS as usize];

impl Window {
    /// A window of `length` (at least `BUCKETS` ms) from `origin`;
    /// `sharded` for one that every thread's calls count in (an
    /// upstream's: a lane per thread shard), else one lane (an instance's
    /// of a fleet, where the threads' calls spread over the instances).
    pub(crate) fn new(length: Duration, origin: Instant, sharded: bool) -> Self {
        let ms = u64::try_from(length.as_millis()).unwrap_or(u64::MAX);
        let lanes = if sharded { 1 + SHARDS } else { 1 };
        Self {
            lanes: (0..lanes).map(|_| Padded::default()).collect(),
            bucket_ms: (ms / u64::from(BUCKETS)).max(1),
            origin,
            recycle: Mutex::new(()),
        }
    }

    /// The epoch of `now` (1 for the first bucket's length after the origin).
    #[inline]
    pub(crate) fn epoch(&self, now: Instant) -> u64 {
        let d = now.saturating_duration_since(self.origin);
        let ms = d
            .as_secs()
            .saturating_mul(1000)
            .saturating_add(u64::from(d.subsec_millis()));
        ms / self.bucket_ms + 1
    }

    /// Every bucket of every lane.
    fn buckets(&self) -> impl Iterator<Item = &Bucket> {
        self.lanes.iter().flat_map(|l| &l.0)
    }

    /// Counts one call that began in `epoch`, failed or not.
    #[inline]
    pub(crate) fn record(&self, epoch: u64, failed: bool) {
        // A failure in the first lane; a success in this thread's, if the
        // window has lanes for them.
        let lane = match self.lanes.len() {
            1 => 0,
            _ if failed => 0,
            n => 1 + shard() % (n - 1),
        };
        // `BUCKETS` is non-zero and the index is below it.
        let b = &self.lanes[lane].0[(epoch % u64::from(BUCKETS)) as usize];
        if b.epoch.load(Ordering::Acquire) != epoch && !self.claim(b, epoch) {
            return;
        }
        b.calls.fetch_add(1, Ordering::Relaxed);
        if failed {
            b.failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Makes `b` count `epoch`, zeroing what it held of an older one; false
    /// when it already counts a newer epoch (the outcome is too old).
    #[cold]
    fn claim(&self, b: &Bucket, epoch: u64) -> bool {
        let _recycling = self.recycle.lock().unwrap_or_else(PoisonError::into_inner);
        let held = b.epoch.load(Ordering::Acquire);
        if held > epoch {
            return false;
        }
        if held < epoch {
            b.calls.store(0, Ordering::Relaxed);
            b.failures.store(0, Ordering::Relaxed);
            b.epoch.store(epoch, Ordering::Release);
        }
        true
    }

    /// The counts of the window that ends with epoch `now`.
    pub(crate) fn counts(&self, now: u64) -> Counts {
        let oldest = now.saturating_sub(u64::from(BUCKETS) - 1);
        let mut c = Counts::default();
        for b in self.buckets() {
            let epoch = b.epoch.load(Ordering::Acquire);
            if epoch != 0 && (oldest..=now).contains(&epoch) {
                c.calls = c.calls.saturating_add(b.calls.load(Ordering::Relaxed));
                c.failures = c
                    .failures
                    .saturating_add(b.failures.load(Ordering::Relaxed));
            }
        }
        c
    }

    /// Forgets everything: the circuit closed and starts afresh.
    pub(crate) fn clear(&self) {
        let _recycling = self.recycle.lock().unwrap_or_else(PoisonError::into_inner);
        for b in self.buckets() {
            b.epoch.store(0, Ordering::Release);
            b.calls.store(0, Ordering::Relaxed);
            b.failures.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn counts(failures: u32, calls: u32) -> Counts {
        Counts { calls, failures }
    }

    /// An upstream's window counts every thread's successes (each in its
    /// lane) with the failures, and slides and clears them alike.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_upstreams_window_counts_every_threads_calls() {
        let t0 = Instant::now();
        let w = Window::new(30 * S, t0, true);
        let e = w.epoch(t0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| (0..10).for_each(|_| w.record(e, false)));
            }
        });
        w.record(e, true);
        assert_eq!(w.counts(e), counts(1, 31));
        assert_eq!(w.counts(w.epoch(t0 + 30 * S)), counts(0, 0));
        w.clear();
        assert_eq!(w.counts(e), counts(0, 0));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn counts_slide_with_the_window() {
        let t0 = Instant::now();
        // 30 s in ten buckets of 3 s.
        let w = Window::new(30 * S, t0, false);
        assert_eq!(w.epoch(t0), 1);
        assert_eq!(w.epoch(t0 + 2999 * Duration::from_millis(1)), 1);
        assert_eq!(w.epoch(t0 + 3 * S), 2);

        for _ in 0..5 {
            w.record(w.epoch(t0), false);
        }
        w.record(w.epoch(t0 + S), true);
        assert_eq!(w.counts(w.epoch(t0 + S)), counts(1, 6));
        // Ten seconds on: all still inside the 30 s.
        let e10 = w.epoch(t0 + 10 * S);
        w.record(e10, true);
        assert_eq!(w.counts(e10), counts(2, 7));
        // 30 s on, the first bucket has slid out.
        assert_eq!(w.counts(w.epoch(t0 + 30 * S)), counts(1, 1));
        assert_eq!(w.counts(w.epoch(t0 + 27 * S)), counts(2, 7));
        // A bucket that comes round again starts from zero.
        let e30 = w.epoch(t0 + 30 * S);
        w.record(e30, false);
        assert_eq!(w.counts(e30), counts(1, 2));
        // An outcome of a call begun a whole window ago is not counted.
        w.record(w.epoch(t0), true);
        assert_eq!(w.counts(e30), counts(1, 2));
        // Cleared: nothing.
        w.clear();
        assert_eq!(w.counts(e30), counts(0, 0));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_tiny_window_still_has_buckets() {
        let t0 = Instant::now();
        let w = Window::new(Duration::ZERO, t0, false);
        w.record(w.epoch(t0), true);
        assert_eq!(w.counts(w.epoch(t0)), counts(1, 1));
        assert_eq!(w.counts(w.epoch(t0 + S)), counts(0, 0));
    }
}
