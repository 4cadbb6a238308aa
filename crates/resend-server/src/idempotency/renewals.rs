//! Wakes the keyed requests whose handler waits, so that their leases are
//! renewed: one task per layer, ticking while there are any, rather than a
//! timer per request. (A tokio timer costs a request ~1,200 instructions:
//! its insertion into the timer wheel, its removal, and the driver's work
//! while one is armed; a request registers here under a lock, twice.)
//!
//! The ticker runs on the runtime of the request that started it. A
//! registration that finds no ticker (outside a runtime, or the runtime it
//! ran on has ended) keeps time with a timer of its own. A layer shared by
//! two runtimes, one of which ends while a handler of the other waits
//! without waking, leaves that handler unrenewed until it wakes: its lease
//! may then expire, as a crashed holder's does.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::Waker;
use std::time::Duration;

/// The wakers of the waiting handlers of one layer, and its ticker.
#[derive(Debug, Default)]
pub(crate) struct Renewals {
    inner: Mutex<Inner>,
    /// Set while a ticker task runs: it clears it as it ends, however it
    /// ends (a runtime shut down drops it).
    ticking: AtomicBool,
}

#[derive(Debug, Default)]
struct Inner {
    wakers: Vec<Option<Waker>>,
    /// Indices of `wakers` that hold none.
    free: Vec<usize>,
    live: usize,
    /// How often the ticker wakes them: the shortest asked for.
    period: Option<Duration>,
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Renewals {
    /// Registers `waker`, to be woken at least every `period` until it is
    /// unregistered: its ticket. `None` outside a tokio runtime (nothing
    /// could tick), or with 2^32 registered.
    pub(crate) fn register(self: &Arc<Self>, waker: &Waker, period: Duration) -> Option<Ticket> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let mut inner = lock(&self.inner);
        let i = match inner.free.pop() {
            Some(i) => i,
            None => {
                inner.wakers.push(None);
                inner.wakers.len() - 1
            }
        };
        let Some(ticket) = u32::try_from(i + 1).ok().and_then(NonZeroU32::new) else {
            inner.free.push(i);
            return None;
        };
        inner.wakers[i] = Some(waker.clone());
        inner.live += 1;
        inner.period = Some(inner.period.map_or(period, |p| p.min(period)));
        // (Under the lock, as the ticker's decision to stop is.)
        if !self.ticking.swap(true, Ordering::AcqRel) {
            let ending = Ending(Some(Arc::downgrade(self)));
            runtime.spawn(tick(Arc::downgrade(self), ending));
        }
        Some(Ticket(ticket))
    }

    /// The waker of a registration, polled by another task now.
    pub(crate) fn update(&self, ticket: Ticket, waker: &Waker) {
        if let Some(Some(w)) = lock(&self.inner).wakers.get_mut(ticket.index()) {
            w.clone_from(waker);
        }
    }

    pub(crate) fn unregister(&self, ticket: Ticket) {
        let i = ticket.index();
        let mut inner = lock(&self.inner);
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
}

/// A registration: its index, plus one (so that an `Option` of it takes no
/// more room than it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ticket(NonZeroU32);

impl Ticket {
    fn index(self) -> usize {
        self.0.get() as usize - 1
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

/// The ticker: every period, wakes every registered handler; ends once
/// none is left (or the layer is gone).
async fn tick(renewals: Weak<Renewals>, mut ending: Ending) {
    loop {
        let period = {
            let Some(r) = renewals.upgrade() else { return };
            let mut inner = lock(&r.inner);
            if inner.live == 0 {
                // Stopping, under the lock a registration takes: the next
                // one starts another ticker.
                inner.period = None;
                r.ticking.store(false, Ordering::Release);
                ending.0 = None;
                return;
            }
            inner.period.unwrap_or(Duration::from_secs(1))
        };
        tokio::time::sleep(period).await;
        let Some(r) = renewals.upgrade() else { return };
        // Woken once the lock is let go: registrations do not wait on them.
        let wakers: Vec<Waker> = lock(&r.inner).wakers.iter().flatten().cloned().collect();
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
