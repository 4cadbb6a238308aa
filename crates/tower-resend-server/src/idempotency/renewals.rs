//! Wakes the keyed requests whose handler waits, so that their leases are
//! renewed: one task per layer, ticking while there are any, rather than a
//! timer per request. (A tokio timer costs a request ~1,200 instructions:
//! its insertion into the timer wheel, its removal, and the driver's work
//! while one is armed.) A request registers with the shard of the thread
//! it runs on, so that the workers of a runtime do not hand the same lock
//! and lines back and forth (on two cores that cost a waiting request
//! more than the rest of its registration); it tells when a renewal is due
//! by the ticks counted, without reading a clock.
//!
//! The ticker runs on the runtime of the request that started it. A
//! registration that finds no ticker (outside a runtime, or the runtime it
//! ran on has ended) keeps time with a timer of its own. A layer shared by
//! two runtimes, one of which ends while a handler of the other waits
//! without waking, leaves that handler unrenewed until it wakes: its lease
//! may then expire, as a crashed holder's does.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::Waker;
use std::time::Duration;

/// Shards of the registry: a power of two, more than the workers of most
/// runtimes on the machines this runs on.
const SHARDS: usize = 16;
const SHARD_BITS: u32 = SHARDS.trailing_zeros();

/// The wakers of the waiting handlers of one layer, and its ticker.
#[derive(Debug, Default)]
pub(crate) struct Renewals {
    shards: [Shard; SHARDS],
    /// Set while a ticker task runs: it clears it as it ends, however it
    /// ends (a runtime shut down drops it).
    ticking: AtomicBool,
    /// The ticks so far (wrapping): a registration's renewal is due two
    /// ticks after it was made or last renewed.
    ticks: AtomicU32,
}

/// A shard, on cache lines of its own (two: some cores fetch lines in
/// pairs).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(Mutex<Inner>);

#[derive(Debug, Default)]
struct Inner {
    wakers: Vec<Option<Waker>>,
    /// Indices of `wakers` that hold none.
    free: Vec<usize>,
    live: usize,
    /// How often the ticker wakes them: the shortest asked for.
    period: Option<Duration>,
}

fn lock(shard: &Shard) -> MutexGuard<'_, Inner> {
    shard.0.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The shard of the calling thread: threads are dealt shards in turn as
/// they first register, so that a runtime's workers get shards of their
/// own.
fn this_threads_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.with(|s| *s)
}

impl Renewals {
    /// Registers `waker`, to be woken at least every `period` until it is
    /// unregistered: its ticket. `None` if no ticker runs and none can be
    /// started (outside a tokio runtime), or with 2^28 registered on one
    /// shard.
    pub(crate) fn register(self: &Arc<Self>, waker: &Waker, period: Duration) -> Option<Ticket> {
        let shard = this_threads_shard();
        let mut inner = lock(&self.shards[shard]);
        let i = match inner.free.pop() {
            Some(i) => i,
            None => {
                inner.wakers.push(None);
                inner.wakers.len() - 1
            }
        };
        let Some(ticket) = Ticket::new(shard, i) else {
            inner.free.push(i);
            return None;
        };
        // (Under the shard's lock, which the ticker holds, with every
        // other, as it decides to stop. Read before it is written, so that
        // the line stays shared while a ticker runs.)
        if !self.ticking.load(Ordering::Acquire) {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                inner.free.push(i);
                return None;
            };
            if !self.ticking.swap(true, Ordering::AcqRel) {
                let ending = Ending(Some(Arc::downgrade(self)));
                runtime.spawn(tick(Arc::downgrade(self), ending));
            }
        }
        // (Set only once the registration is sure: a ticker started above
        // reads it under this lock, after it is let go.)
        if inner.period.is_none_or(|p| period < p) {
            inner.period = Some(period);
        }
        inner.wakers[i] = Some(waker.clone());
        inner.live += 1;
        Some(ticket)
    }

    /// The waker of a registration, polled by another task now.
    pub(crate) fn update(&self, ticket: Ticket, waker: &Waker) {
        let (shard, i) = ticket.place();
        if let Some(Some(w)) = lock(&self.shards[shard]).wakers.get_mut(i) {
            w.clone_from(waker);
        }
    }

    pub(crate) fn unregister(&self, ticket: Ticket) {
        let (shard, i) = ticket.place();
        let mut inner = lock(&self.shards[shard]);
        if inner.wakers.get_mut(i).and_then(Option::take).is_some() {
            inner.free.push(i);
            inner.live -= 1;
        }
    }

    /// Whether a ticker runs (a registration without one must keep time
    /// itself).
    pub(crate) fn is_ticking(&self) -> bool {
        self.ticking.load(Ordering::Acquire)
    }

    /// The ticks so far (wrapping): one per period of the ticker.
    pub(crate) fn ticks(&self) -> u32 {
        self.ticks.load(Ordering::Acquire)
    }
}

/// Whether tick `due` has come, `now` being the ticks so far (both
/// wrapping).
pub(crate) fn has_come(due: u32, now: u32) -> bool {
    now.wrapping_sub(due) < 1 << 31
}

/// A registration: its shard in the low bits, its index plus one above
/// them (so that an `Option` of it takes no more room than it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ticket(NonZeroU32);

impl Ticket {
    fn new(shard: usize, i: usize) -> Option<Self> {
        let above = u32::try_from(i + 1)
            .ok()
            .filter(|n| n >> (32 - SHARD_BITS) == 0)?;
        NonZeroU32::new(above << SHARD_BITS | shard as u32).map(Self)
    }

    fn place(self) -> (usize, usize) {
        let n = self.0.get();
        (
            (n & (SHARDS as u32 - 1)) as usize,
            (n >> SHARD_BITS) as usize - 1,
        )
    }
}

/// Clears `ticking` if the ticker's task is dropped before it stops
/// itself: made before the task is spawned, so that a task dropped before
/// it first ran (its runtime ended) clears it too.
struct Ending(Option<Weak<Renewals>>);

impl Drop for Ending {
    fn drop(&mut self) {
        if let Some(r) = self.0.take().and_then(|w| w.upgrade()) {
            r.ticking.store(false, Ordering::Release);
        }
    }
}

/// The ticker: every period, counts a tick and wakes every registered
/// handler; ends once none is left (or the layer is gone).
async fn tick(renewals: Weak<Renewals>, mut ending: Ending) {
    loop {
        let period = {
            let Some(r) = renewals.upgrade() else { return };
            // Every shard locked (in order: a registration locks one), so
            // that none registers unseen while it decides to stop.
            let mut shards: Vec<MutexGuard<'_, Inner>> = r.shards.iter().map(lock).collect();
            if shards.iter().all(|s| s.live == 0) {
                // The next registration starts another ticker.
                for s in &mut shards {
                    s.period = None;
                }
                r.ticking.store(false, Ordering::Release);
                ending.0 = None;
                return;
            }
            shards
                .iter()
                .filter_map(|s| s.period)
                .min()
                .unwrap_or(Duration::from_secs(1))
        };
        tokio::time::sleep(period).await;
        let Some(r) = renewals.upgrade() else { return };
        r.ticks.fetch_add(1, Ordering::AcqRel);
        // Woken once each lock is let go: registrations do not wait on them.
        let mut wakers: Vec<Waker> = Vec::new();
        for shard in &r.shards {
            wakers.extend(lock(shard).wakers.iter().flatten().cloned());
        }
        for waker in wakers {
            waker.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn paused_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// Registrations made on two threads sit on two shards; the ticker
    /// wakes both every tick, counts its ticks, and keeps ticking while
    /// either shard holds one.
    #[test]
    fn every_shard_is_woken_and_keeps_the_ticker_going() {
        let renewals = Arc::new(Renewals::default());
        let here = Arc::new(Count(AtomicUsize::new(0)));
        let there = Arc::new(Count(AtomicUsize::new(0)));
        let rt = paused_runtime();
        let period = Duration::from_millis(100);
        let a = rt.block_on(async { renewals.register(&Waker::from(here.clone()), period) });
        let a = a.unwrap();
        // Another thread, outside the runtime: the running ticker serves it.
        let b = std::thread::scope(|s| {
            s.spawn(|| renewals.register(&Waker::from(there.clone()), period))
                .join()
                .unwrap()
        })
        .unwrap();
        assert_ne!(a.place().0, b.place().0, "one shard per thread");
        let t0 = renewals.ticks();
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(250)).await });
        assert_eq!(renewals.ticks().wrapping_sub(t0), 2);
        assert_eq!(here.0.load(Ordering::Relaxed), 2);
        assert_eq!(there.0.load(Ordering::Relaxed), 2);
        renewals.unregister(a);
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
        assert!(renewals.is_ticking(), "the other shard still holds one");
        assert_eq!(there.0.load(Ordering::Relaxed), 4);
        assert_eq!(here.0.load(Ordering::Relaxed), 2);
        renewals.unregister(b);
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
        assert!(!renewals.is_ticking());
    }

    /// A registration refused (no runtime, no ticker) leaves no trace: the
    /// ticker a later one starts ticks at that one's period.
    #[test]
    fn a_refused_registration_does_not_set_the_period() {
        let renewals = Arc::new(Renewals::default());
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        assert!(renewals
            .register(&waker, Duration::from_millis(10))
            .is_none());
        let rt = paused_runtime();
        let t = rt.block_on(async { renewals.register(&waker, Duration::from_secs(1)) });
        let t = t.unwrap();
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(500)).await });
        assert_eq!(renewals.ticks(), 0, "ticked at the refused one's 10 ms");
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(600)).await });
        assert_eq!(renewals.ticks(), 1);
        renewals.unregister(t);
    }

    #[test]
    fn due_ticks_survive_the_wrap() {
        assert!(has_come(5, 5) && has_come(5, 7) && !has_come(7, 5));
        assert!(has_come(u32::MAX, 1) && !has_come(1, u32::MAX));
        let t = Ticket::new(3, 41).unwrap();
        assert_eq!(t.place(), (3, 41));
        assert!(Ticket::new(0, (1 << 28) - 2).is_some());
        assert!(Ticket::new(0, (1 << 28) - 1).is_none());
    }

    /// The ticker wakes what is registered every period, stops once nothing
    /// is, and a runtime that ends ends it: a registration then sees no
    /// ticker (and keeps time itself) until one in a live runtime starts
    /// another.
    #[test]
    fn the_ticker_wakes_stops_and_is_started_again() {
        let renewals = Arc::new(Renewals::default());
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let rt = paused_runtime();
        let ticket = rt.block_on(async {
            let ticket = renewals
                .register(&waker, Duration::from_millis(100))
                .unwrap();
            assert!(renewals.is_ticking());
            tokio::time::sleep(Duration::from_millis(350)).await;
            ticket
        });
        assert_eq!(count.0.load(Ordering::Relaxed), 3);
        renewals.unregister(ticket);
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(250)).await });
        assert!(!renewals.is_ticking(), "nothing registered: stopped");
        assert_eq!(count.0.load(Ordering::Relaxed), 3);

        // Registered, then its runtime ends.
        let ticket = rt.block_on(async { renewals.register(&waker, Duration::from_millis(100)) });
        assert!(ticket.is_some() && renewals.is_ticking());
        drop(rt);
        assert!(!renewals.is_ticking(), "the runtime ended: no ticker");
        // Outside a runtime nothing can tick.
        assert!(renewals
            .register(&waker, Duration::from_millis(100))
            .is_none());
        let rt = paused_runtime();
        rt.block_on(async {
            let again = renewals
                .register(&waker, Duration::from_millis(100))
                .unwrap();
            assert!(renewals.is_ticking());
            let before = count.0.load(Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert!(count.0.load(Ordering::Relaxed) > before);
            renewals.unregister(again);
        });
    }
}
