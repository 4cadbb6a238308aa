//! Counts that every call writes, one per thread shard: calls on
//! different cores add to different cache lines, and a read sums the
//! shards. The budget's deposits, the throttle's accepts, a fleet's
//! answers and an upstream circuit's successes are counted so.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Shards: enough for the cores a service typically runs on; threads
/// beyond that share shards, which is still correct.
pub(crate) const SHARDS: usize = 8;

thread_local! {
    /// This thread's shard, given out round-robin on first use.
    static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's shard.
pub(crate) fn shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    SHARD.with(|s| {
        let mut i = s.get();
        if i == usize::MAX {
            i = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
            s.set(i);
        }
        i
    })
}

/// A `T` on cache lines of its own (as crossbeam's `CachePadded`).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

/// A `T` per shard, each on cache lines of its own.
#[derive(Debug, Default)]
pub(crate) struct PerShard<T>([Padded<T>; SHARDS]);

impl<T> PerShard<T> {
    /// This thread's.
    pub(crate) fn mine(&self) -> &T {
        &self.0[shard()].0
    }

    /// Every shard's.
    pub(crate) fn all(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|p| &p.0)
    }
}
