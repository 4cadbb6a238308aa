//! A retry budget shared by every clone of a stack.
//!
//! Written here rather than taken from tower: tower's `TpsBudget` locks a
//! mutex on every deposit (that is, on the success path of every call) and
//! panics on out-of-range settings; its default reserve of 100 retries would
//! also let an outage double the load before the ratio bites. Here a deposit
//! is one relaxed atomic add; all the arithmetic happens when a retry is
//! wanted, which is the slow path by definition. The deposit counter is
//! sharded by thread, so calls on different cores do not contend for one
//! cache line; a withdrawal sums the shards.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How many seconds of the floor rate the floor bucket keeps.
const FLOOR_SECONDS: f64 = 5.0;

/// Limits retries to a share of the calls, so that an outage costs the
/// upstream a little extra load instead of a multiple of it.
///
/// Every logical call deposits `ratio` tokens (0.2 by default: retries may be
/// at most about 20% of calls); every retry withdraws one. Deposits fade with
/// time (an exponential decay with time constant `window`, 10 s by default),
/// so the balance reflects recent traffic, not all traffic since start.
/// A floor of `min_per_sec` retries per second (1 by default), of which up to
/// five seconds' worth is kept, lets a quiet client still retry (a call's
/// two retries, and then some).
///
/// Clones share the same balance: build one per upstream, and give it to the
/// layer once; every clone of the stack draws on it.
///
/// ```
/// use std::time::Duration;
/// use resend::retry::RetryBudget;
///
/// let budget = RetryBudget::new(0.1, 2.0, Duration::from_secs(10)).unwrap();
/// assert!(RetryBudget::new(-1.0, 1.0, Duration::from_secs(10)).is_err());
/// # let _ = budget;
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

/// Deposit shards: enough for the cores a service typically runs on; threads
/// beyond that share shards, which is still correct.
const SHARDS: usize = 8;

/// One deposit counter on its own cache line.
#[repr(align(128))]
#[derive(Default)]
struct Shard(AtomicU64);

thread_local! {
    /// This thread's shard, given out round-robin on first use.
    static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn shard() -> usize {
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

struct Inner {
    calls: [Shard; SHARDS],
    ratio: f64,
    min_per_sec: f64,
    /// What the floor bucket holds at most: five seconds' worth, and at
    /// least one token when there is a floor at all.
    floor_cap: f64,
    window: Duration,
    state: Mutex<State>,
}

struct State {
    balance: f64,
    floor: f64,
    calls_seen: u64,
    last: Instant,
}

/// Why a retry budget's settings were refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidBudget {
    reason: &'static str,
}

impl fmt::Display for InvalidBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid retry budget: {}", self.reason)
    }
}

impl std::error::Error for InvalidBudget {}

impl RetryBudget {
    /// A budget allowing retries of `ratio` of the calls, plus `min_per_sec`
    /// retries per second, with deposits fading over `window`.
    ///
    /// `ratio` and `min_per_sec` must be finite and non-negative, `window` at
    /// least one millisecond.
    pub fn new(ratio: f64, min_per_sec: f64, window: Duration) -> Result<Self, InvalidBudget> {
        let bad = |reason| Err(InvalidBudget { reason });
        if !ratio.is_finite() || ratio < 0.0 {
            return bad("ratio must be a finite number, zero or more");
        }
        if !min_per_sec.is_finite() || min_per_sec < 0.0 {
            return bad("min_per_sec must be a finite number, zero or more");
        }
        if window < Duration::from_millis(1) {
            return bad("window must be at least 1 ms");
        }
        Ok(Self::build(ratio, min_per_sec, window))
    }

    fn build(ratio: f64, min_per_sec: f64, window: Duration) -> Self {
        let floor_cap = if min_per_sec > 0.0 {
            (min_per_sec * FLOOR_SECONDS).max(1.0)
        } else {
            0.0
        };
        Self {
            inner: Arc::new(Inner {
                calls: Default::default(),
                ratio,
                min_per_sec,
                floor_cap,
                window,
                state: Mutex::new(State {
                    balance: 0.0,
                    // A new client may retry at once.
                    floor: floor_cap,
                    calls_seen: 0,
                    last: Instant::now(),
                }),
            }),
        }
    }

    /// Records one logical call. Lock-free: one relaxed atomic add, on this
    /// thread's shard.
    pub(crate) fn deposit(&self) {
        self.inner.calls[shard()].0.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one retry token, if there is one.
    pub(crate) fn withdraw(&self) -> bool {
        let i = &*self.inner;
        let mut st = i.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let dt = now.saturating_duration_since(st.last).as_secs_f64();
        st.last = now;
        let calls: u64 = i.calls.iter().map(|s| s.0.load(Ordering::Relaxed)).sum();
        let new_calls = calls.saturating_sub(st.calls_seen);
        st.calls_seen = calls;
        let decay = (-dt / i.window.as_secs_f64()).exp();
        // Calls since the last look count as if made now: a slight
        // overestimate, bounded by one window's traffic.
        st.balance = st.balance * decay + new_calls as f64 * i.ratio;
        st.floor = (st.floor + dt * i.min_per_sec).min(i.floor_cap);
        if st.balance >= 1.0 {
            st.balance -= 1.0;
            true
        } else if st.floor >= 1.0 {
            st.floor -= 1.0;
            true
        } else {
            false
        }
    }
}

impl Default for RetryBudget {
    /// 20% of calls, 1 retry per second at least, over a 10 s window.
    fn default() -> Self {
        Self::build(0.2, 1.0, Duration::from_secs(10))
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("ratio", &self.inner.ratio)
            .field("min_per_sec", &self.inner.min_per_sec)
            .field("window", &self.inner.window)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(b: &RetryBudget) -> usize {
        std::iter::from_fn(|| b.withdraw().then_some(()))
            .take(10_000)
            .count()
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn retries_are_a_share_of_calls_plus_a_floor() {
        let b = RetryBudget::default();
        for _ in 0..100 {
            b.deposit();
        }
        // 20% of 100 calls, plus the floor's five seconds' worth.
        assert_eq!(drain(&b), 25);
        // The floor refills at one per second, and holds at most five.
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(drain(&b), 2);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(drain(&b), 5);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn old_deposits_fade() {
        let b = RetryBudget::new(0.2, 0.0, Duration::from_secs(10)).unwrap();
        for _ in 0..1000 {
            b.deposit();
        }
        assert!(b.withdraw()); // takes the deposits into account now
        tokio::time::advance(Duration::from_secs(60)).await;
        // 199 tokens left a minute ago; e^-6 of them remain.
        let left = drain(&b);
        assert!(left <= 1, "{left}");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn clones_share_the_balance_and_zero_means_none() {
        let b = RetryBudget::new(0.5, 0.0, Duration::from_secs(10)).unwrap();
        let c = b.clone();
        for _ in 0..4 {
            c.deposit();
        }
        assert_eq!(drain(&b), 2);
        assert_eq!(drain(&c), 0);
        let none = RetryBudget::new(0.0, 0.0, Duration::from_secs(1)).unwrap();
        none.deposit();
        assert!(!none.withdraw());
    }

    #[test]
    fn bad_settings_are_refused_with_a_reason() {
        assert!(RetryBudget::new(f64::NAN, 1.0, Duration::from_secs(1)).is_err());
        assert!(RetryBudget::new(0.2, f64::INFINITY, Duration::from_secs(1)).is_err());
        let e = RetryBudget::new(0.2, 1.0, Duration::ZERO).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid retry budget: window must be at least 1 ms"
        );
    }
}
