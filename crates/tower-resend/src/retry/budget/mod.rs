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

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

mod grpc;
mod shard;
mod state;

use grpc::TokenBucket;
pub(crate) use shard::{shard, Padded, PerShard, SHARDS};
use state::{calls_per_sec, first_probe, Rate, State};

/// Within this of a whole token is a whole token: the decay of the
/// microseconds between the last deposit and a look would otherwise take k
/// deposits' worth of tokens down to k - 1.
const WHOLE: f64 = 1.0 - 1e-6;

/// The time over which "calls per second now" is averaged.
const NOW_SECONDS: f64 = 1.0;

/// How many seconds of the floor rate the floor bucket keeps.
const FLOOR_SECONDS: f64 = 5.0;

/// The most a [`RetryBudget`]'s balance keeps by default, as time of
/// deposits at the recent rate of calls: enough for a burst of failures to start
/// their retries at once, and no hoard. A balance of a whole window's deposits
/// (the share of the last ten seconds' calls, as Finagle's budget keeps)
/// lets a storm spend ten seconds' worth of retries in its first second:
/// measured at 10 000 callers, 2.4 attempts per call made in that second
/// against a ratio of 0.2 (`benches/storm.rs`).
pub const DEFAULT_BURST: Duration = Duration::from_millis(100);

/// The first rate of recovery tokens, per second, once a retry succeeds
/// after failures (see `give_back`).
const RECOVERY_START: f64 = 10.0;
/// The most recovery tokens per second.
const RECOVERY_MAX: f64 = 100.0;

/// Limits retries to a share of the calls, so that an outage costs the
/// upstream a little extra load instead of a multiple of it — and throttles
/// rather than fails, so that the calls still get through when it ends.
///
/// Every logical call deposits `ratio` tokens (0.2 by default: retries may be
/// at most about 20% of calls); every retry of a request that may have
/// reached the upstream withdraws one (a request that was not sent —
/// connection refused, REFUSED_STREAM — costs the upstream nothing and
/// spends none while the upstream otherwise answers; once it fails as a
/// whole, those sent free just before are charged: see the
/// [`retry`](crate::retry) module). The balance keeps no more than a tenth
/// of a second of deposits at the recent rate of calls (measured over
/// `window`, 10 s by default): retries go out at the rate calls come in,
/// a fifth of it, never a hoard at once, so that in no second does a
/// storm cost the upstream more than about 1.2 attempts per call made
/// (what the balance keeps on top: 1.21 in an outage's first second,
/// measured at 10 000 callers by `benches/storm.rs`). A floor of
/// `min_per_sec` retries per second (1 by default) tops the deposits up
/// to that rate, of which up to five seconds' worth is kept for a quiet
/// client: it lets a quiet client still retry (a call's two retries, and
/// then some), and probes an upstream that has been failing; a client
/// whose calls deposit as much has no floor on top of its deposits (one
/// token kept, at most). As the upstream
/// recovers, retries that succeed earn tokens back, evenly spaced, so
/// that calls held back by an outage drain within seconds: a client too
/// quiet for its deposits to release them.
///
/// The tokens go first to retries that must learn an outcome: a keyed call
/// whose attempt may have run and whose answer was lost (or that found its
/// key still running). On a server that keeps answers by key such a retry
/// costs a replay, not new work, and without it the caller cannot tell
/// whether its operation ran; while one waits for a token, other retries
/// (after an overloaded answer, say, when nothing ran) leave it the tokens.
///
/// A retry that finds no token does not fail at once: it waits for one,
/// within the call's deadline and the retry layer's
/// [`max_budget_wait`](super::RetryLayer::max_budget_wait); only a call
/// whose time cannot fit ends
/// [`BudgetExhausted`](crate::ErrorKind::BudgetExhausted).
///
/// Clones share the same balance: build one per upstream, and give it to the
/// layer once; every clone of the stack draws on it.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::retry::RetryBudget;
///
/// let budget = RetryBudget::new(0.1, 2.0, Duration::from_secs(10)).unwrap();
/// assert!(RetryBudget::new(-1.0, 1.0, Duration::from_secs(10)).is_err());
/// # let _ = budget;
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    calls: PerShard<AtomicU64>,
    ratio: f64,
    min_per_sec: f64,
    /// What the floor bucket holds at most: five seconds' worth, and at
    /// least one token when there is a floor at all.
    floor_cap: f64,
    window: Duration,
    /// The most the balance keeps, in seconds of deposits.
    burst: f64,
    state: Mutex<State>,
    /// Retries waiting for a token are woken when one is given back.
    returned: Arc<tokio::sync::Notify>,
    /// Outcome retries waiting for a token are woken when another retry
    /// left one to them.
    left_for_outcome: Arc<tokio::sync::Notify>,
    /// gRPC's `retryThrottling` instead of the share of calls: see
    /// [`RetryBudget::grpc_throttling`]. Read on the slow path only
    /// (`withdraw` and what follows a retry), never by `deposit`.
    bucket: Option<TokenBucket>,
}

/// Where a retry's token came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Token {
    /// The deposits of calls.
    Balance,
    /// The floor: a retry a quiet client may make, or a probe of an
    /// upstream that has been failing.
    Floor,
    /// Recovery: earned by retries that succeeded after failures.
    Recovery,
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
        Ok(Self::build(ratio, min_per_sec, window, DEFAULT_BURST))
    }

    /// The most the balance keeps, as time of deposits at the recent rate
    /// of calls: [`DEFAULT_BURST`] (100 ms) unless set, and always at least
    /// one token. A longer burst lets a burst of failures retry at once,
    /// and a storm spend that much more at its start: a burst as long as
    /// the window keeps every deposit of the window, as Finagle's budget
    /// does. Set it before the budget is shared: it starts a new balance.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resend::retry::RetryBudget;
    ///
    /// let budget = RetryBudget::new(0.2, 1.0, Duration::from_secs(10))
    ///     .unwrap()
    ///     .burst(Duration::from_secs(1));
    /// # let _ = budget;
    /// ```
    #[must_use]
    pub fn burst(self, burst: Duration) -> Self {
        let i = &self.inner;
        if i.bucket.is_some() {
            // gRPC's throttling keeps no balance of deposits.
            return self;
        }
        Self::build(i.ratio, i.min_per_sec, i.window, burst)
    }

    fn build(ratio: f64, min_per_sec: f64, window: Duration, burst: Duration) -> Self {
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
                burst: burst.as_secs_f64(),
                state: Mutex::new(State {
                    balance: 0.0,
                    rate: Rate::default(),
                    seen: 0.0,
                    now_rate: Rate::default(),
                    // A new client may retry at once.
                    floor: floor_cap,
                    floor_credit: 0.0,
                    calls_seen: 0,
                    last: Instant::now(),
                    floor_paused_until: Instant::now(),
                    probe_interval: first_probe(min_per_sec),
                    probing: false,
                    recovery_rate: 0.0,
                    recovery: 0.0,
                    outcome_waiting: 0,
                }),
                returned: Arc::new(tokio::sync::Notify::new()),
                left_for_outcome: Arc::new(tokio::sync::Notify::new()),
                bucket: None,
            }),
        }
    }

    /// Records one logical call. Lock-free: one relaxed atomic add, on this
    /// thread's shard.
    pub(crate) fn deposit(&self) {
        self.inner.calls.mine().fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one retry token, if there is one, and says where from.
    pub(crate) fn withdraw(&self) -> Option<Token> {
        self.withdraw_for(Want::Retry)
    }

    /// Takes one retry token for a retry that `wants` it, if there is one.
    ///
    /// The tokens go first to retries that must learn an outcome: a keyed
    /// call whose attempt may have run and whose answer was lost, or that
    /// found its key still running. Such a retry costs a server that keeps
    /// answers by key a replay, not new work, and without it the caller
    /// cannot tell whether its operation ran. While one of them waits for a
    /// token, every other retry (one after an overloaded answer, say, whose
    /// work never ran) leaves the token to it.
    pub(crate) fn withdraw_for(&self, wants: Want) -> Option<Token> {
        let i = &*self.inner;
        if let Some(bucket) = &i.bucket {
            return bucket.open().then_some(Token::Balance);
        }
        let now = Instant::now();
        let mut st = self.refilled(now);
        if wants == Want::Retry && st.outcome_waiting > 0 {
            if st.balance >= WHOLE || st.recovery >= WHOLE {
                i.left_for_outcome.notify_one();
            }
            return None;
        }
        if st.balance >= WHOLE {
            st.balance = (st.balance - 1.0).max(0.0);
            Some(Token::Balance)
        } else if st.recovery >= WHOLE {
            st.recovery = 0.0;
            Some(Token::Recovery)
        } else if st.floor + st.balance >= WHOLE && now >= st.floor_paused_until {
            // The floor tops the deposits up: what they lack of a token,
            // it gives.
            st.floor = (st.floor - (1.0 - st.balance).max(0.0)).max(0.0);
            st.balance = 0.0;
            Some(Token::Floor)
        } else {
            None
        }
    }

    /// The retry that held `token` ended, answered as `class`: a success,
    /// a final refusal, or "another attempt holds this key" (409) is the
    /// upstream answering as a well one does, and gives the token back; any
    /// other answer is a failed retry (of a probe, when the floor paid).
    pub(crate) fn settle(&self, token: Token, class: crate::vocab::Class) {
        use crate::vocab::Class;
        match class {
            Class::Success | Class::Rejected | Class::InProgress => self.give_back(),
            _ if token == Token::Floor => self.floor_failed(),
            _ => self.failed(),
        }
    }

    /// A retry paid for by the floor failed. While the floor still holds
    /// tokens, that is all: a quiet client's first retries go out at once,
    /// whatever they get. Once it is spent, the upstream is taken as still
    /// down: the floor is paused for the probe interval, which doubles (up
    /// to 30 s) until a retry succeeds; retries that fail together pause it
    /// once. So a long outage costs the upstream the floor's few tokens and
    /// then a probe now and then, not a retry a second.
    pub(crate) fn floor_failed(&self) {
        let i = &*self.inner;
        if i.bucket.is_some() {
            return;
        }
        let mut st = i.state.lock().unwrap_or_else(PoisonError::into_inner);
        if !st.probing && st.floor >= WHOLE {
            return;
        }
        let now = Instant::now();
        st.probing = true;
        st.floor = st.floor.min(1.0);
        if now >= st.floor_paused_until {
            st.floor_paused_until = now + st.probe_interval;
            st.probe_interval = (st.probe_interval * 2).min(Duration::from_secs(30));
        }
    }

    /// A retry succeeded: the upstream answers again. The floor is free
    /// again, and the budget recovers: it earns tokens at a rate that starts
    /// at 10 a second and doubles with each retry that succeeds, up to 100 a
    /// second (halved by each retry that fails), one at a time, evenly
    /// spaced, and faded out for a client whose calls deposit as much
    /// themselves (see `recovery_rate`). So the calls held back by an
    /// outage drain within seconds as the upstream comes back — a slow
    /// start, never a burst — and a failing upstream earns nothing. A retry
    /// waiting for a token is woken.
    pub(crate) fn give_back(&self) {
        if self.inner.bucket.is_none() {
            let i = &*self.inner;
            let mut st = i.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.floor_paused_until = st.last;
            st.probe_interval = first_probe(i.min_per_sec);
            st.probing = false;
            st.recovery_rate = (st.recovery_rate * 2.0).clamp(RECOVERY_START, RECOVERY_MAX);
        }
        self.inner.returned.notify_one();
    }

    /// A retry paid for by the deposits or by recovery failed: recovery
    /// slows to half (and stops below its first rate).
    pub(crate) fn failed(&self) {
        let i = &*self.inner;
        if i.bucket.is_some() {
            return;
        }
        let mut st = i.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.recovery_rate /= 2.0;
        if st.recovery_rate < RECOVERY_START {
            st.recovery_rate = 0.0;
        }
    }

    /// `n` retries went out free (refusals, while the upstream seemed to
    /// answer) and turned out to be an outage's (see `retry::streak`):
    /// their tokens are taken after the fact. The balance may go below
    /// zero for them, by a second of deposits at the recent rate at most,
    /// so that the calls' next deposits pay for them before another retry
    /// goes out, and an outage's first second costs the upstream no more
    /// than its later ones; a quiet client, whose retries the floor pays
    /// for, owes next to nothing.
    pub(crate) fn charge(&self, n: u32) {
        let i = &*self.inner;
        if i.bucket.is_some() || n == 0 {
            return;
        }
        let mut st = self.refilled(Instant::now());
        let second = i.ratio * calls_per_sec(&st, i.window.as_secs_f64(), i.burst);
        let lowest = (-second).min(st.balance);
        st.balance = (st.balance - f64::from(n)).max(lowest);
    }

    /// When a token is likely to be there again without any given back:
    /// the deposits' next whole token (at the rate calls have been coming),
    /// the floor's (once its pause ends), or recovery's; `None` if none
    /// refills.
    pub(crate) fn next_refill(&self) -> Option<Duration> {
        let i = &*self.inner;
        if i.bucket.is_some() {
            // Only successes refill it, and they are not timed.
            return None;
        }
        let st = i.state.lock().unwrap_or_else(PoisonError::into_inner);
        // The deposits, at the rate calls have been coming.
        let deposits = (i.ratio * st.rate.per_sec > 1e-9).then(|| {
            let missing = (1.0 - st.balance).max(0.0);
            Duration::from_secs_f64((missing / (i.ratio * st.rate.per_sec)).min(3600.0))
        });
        let floor = st.floor_refill(i).map(|refill| {
            let paused = st
                .floor_paused_until
                .saturating_duration_since(Instant::now());
            refill.max(paused)
        });
        let rate = st.recovery_per_sec(i.ratio);
        let recovery = (rate > 1e-9).then(|| {
            let missing = (1.0 - st.recovery).max(0.0);
            Duration::from_secs_f64((missing / rate).min(3600.0))
        });
        [deposits, floor, recovery].into_iter().flatten().min()
    }

    /// Resolves when a token is given back (the caller then tries
    /// [`withdraw`](Self::withdraw) again; it also wakes at
    /// [`next_refill`](Self::next_refill)).
    pub(crate) fn returned(&self) -> tokio::sync::futures::OwnedNotified {
        Arc::clone(&self.inner.returned).notified_owned()
    }

    /// An outcome retry waits for a token while the guard lives: other
    /// retries leave the tokens to it, and wake it when they do
    /// ([`left_for_outcome`](Self::left_for_outcome)).
    pub(crate) fn outcome_waits(&self) -> OutcomeWaiting {
        self.state().outcome_waiting += 1;
        OutcomeWaiting(self.clone())
    }

    /// Resolves when another retry left a token to a waiting outcome retry.
    pub(crate) fn left_for_outcome(&self) -> tokio::sync::futures::OwnedNotified {
        Arc::clone(&self.inner.left_for_outcome).notified_owned()
    }

    /// The state, brought to `now` with every shard's calls.
    fn refilled(&self, now: Instant) -> std::sync::MutexGuard<'_, State> {
        let i = &*self.inner;
        let mut st = self.state();
        let calls: u64 = i.calls.all().map(|c| c.load(Ordering::Relaxed)).sum();
        st.refill(i, now, calls);
        st
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a retry wants a token for: see [`RetryBudget::withdraw_for`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    /// To learn whether its operation ran: first in line.
    Outcome,
    /// Any other retry.
    Retry,
}

/// An outcome retry waiting for a token; see
/// [`RetryBudget::outcome_waits`].
pub(crate) struct OutcomeWaiting(RetryBudget);

impl Drop for OutcomeWaiting {
    fn drop(&mut self) {
        let mut st = self.0.state();
        st.outcome_waiting = st.outcome_waiting.saturating_sub(1);
    }
}

impl RetryBudget {
    /// A share of the calls, `ratio` (0 to 1), plus one a second at least,
    /// over a 10 s window: the hedge layer's budget for its backups.
    pub(crate) fn share(ratio: f64) -> Self {
        let ratio = if ratio.is_finite() {
            ratio.clamp(0.0, 1.0)
        } else {
            DEFAULT_HEDGE_SHARE
        };
        let window = Duration::from_secs(10);
        // Backups keep the window's share: a backup does not wait for a
        // token, and a slow stretch takes them in bursts.
        Self::build(ratio, 1.0, window, window)
    }
}

impl RetryBudget {
    /// No limit to speak of (a billion tokens a call): the hedge layer's
    /// share when a gRPC hedging policy hedges every call.
    #[cfg_attr(not(feature = "service-config"), allow(dead_code))]
    pub(crate) fn every_call() -> Self {
        Self::build(1e9, 0.0, Duration::from_secs(10), Duration::from_secs(10))
    }
}

/// The share of calls that may send a backup copy, by default.
pub(crate) const DEFAULT_HEDGE_SHARE: f64 = 0.1;

impl Default for RetryBudget {
    /// 20% of calls, 1 retry per second at least, over a 10 s window.
    fn default() -> Self {
        Self::build(0.2, 1.0, Duration::from_secs(10), DEFAULT_BURST)
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(b) = &self.inner.bucket {
            return b.fmt(f);
        }
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
        std::iter::from_fn(|| b.withdraw().map(|_| ()))
            .take(10_000)
            .count()
    }

    /// A budget that has seen a minute go by, so that its rate of calls is
    /// over its window, not over its age (see `calls_per_sec`).
    /// (It looks at the end too: calls made after are seen as made at once,
    /// not spread over the minute.)
    async fn aged(b: RetryBudget) -> RetryBudget {
        b.withdraw();
        tokio::time::advance(Duration::from_secs(60)).await;
        b.withdraw();
        b
    }

    /// `calls_per_sec` calls a second for `secs` seconds, every retry
    /// wanted taken: the retries each second.
    async fn retries_each_second(b: &RetryBudget, calls_per_sec: u32, secs: u32) -> Vec<usize> {
        let step = Duration::from_secs(1) / calls_per_sec;
        let mut seconds = Vec::new();
        for _ in 0..secs {
            let mut retries = 0;
            for _ in 0..calls_per_sec {
                b.deposit();
                retries += drain(b);
                tokio::time::advance(step).await;
            }
            seconds.push(retries);
        }
        seconds
    }

    /// A client making calls at a steady rate retries at a fifth of it, from
    /// its first second of failures to its last: no hoard of earlier
    /// deposits goes out at once, and no more than one floor token on top.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn retries_follow_the_rate_of_calls() {
        let b = RetryBudget::default();
        // Twenty quiet seconds at 50 calls a second, no retry wanted.
        let step = Duration::from_millis(20);
        for _ in 0..1000 {
            b.deposit();
            tokio::time::advance(step).await;
        }
        // Then every call fails and wants a retry: 10 a second, a fifth,
        // and no floor on top (its one token, once).
        let seconds = retries_each_second(&b, 50, 5).await;
        for (i, &n) in seconds.iter().enumerate() {
            let most = if i == 0 { 11 } else { 10 };
            assert!((9..=most).contains(&n), "second {i}: {seconds:?}");
        }
        // A new client may spend what it has deposited at once (and one
        // floor token: a hundred calls deposit faster than the floor).
        let new = RetryBudget::default();
        for _ in 0..100 {
            new.deposit();
        }
        assert_eq!(drain(&new), 21, "20 deposited, 1 of the floor");
    }

    /// A quiet client has the floor: five retries at once, then one a
    /// second, at most five kept.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_quiet_client_has_the_floor() {
        let b = RetryBudget::default();
        b.deposit();
        assert_eq!(drain(&b), 5);
        // One a second, five kept.
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(drain(&b), 2);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(drain(&b), 5);
        // At a call a second (a fifth of a token each): the floor tops the
        // deposits up to one a second, no more (just drained: none in the
        // first second).
        let seconds = retries_each_second(&b, 1, 10).await;
        let made: usize = seconds.iter().sum();
        assert!((9..=10).contains(&made), "{seconds:?}");
    }

    /// Calls made, one every `step`, until a retry finds a token.
    async fn calls_until_a_token(b: &RetryBudget, step: Duration) -> usize {
        let mut calls = 0;
        while b.withdraw().is_none() {
            b.deposit();
            calls += 1;
            tokio::time::advance(step).await;
        }
        calls
    }

    /// Retries sent free and charged after the fact: the balance owes
    /// them, a second of deposits at most, and the next retry waits until
    /// the calls have paid; a quiet client owes next to nothing.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn free_retries_charged_after_the_fact_are_paid_by_the_next_deposits() {
        // A minute of 50 calls a second: 10 tokens a second, one kept.
        let b = aged(RetryBudget::new(0.2, 0.0, Duration::from_secs(10)).unwrap()).await;
        let step = Duration::from_millis(20);
        for _ in 0..3000 {
            b.deposit();
            tokio::time::advance(step).await;
        }
        b.charge(4);
        // The 4 owed and the one kept: 15 calls pay it (3 tokens), 5 more
        // give the next token.
        let calls = calls_until_a_token(&b, step).await;
        assert!((18..=21).contains(&calls), "{calls} calls paid it");
        // At most a second of deposits is owed, whatever was sent free.
        drain(&b);
        b.charge(1_000);
        let calls = calls_until_a_token(&b, step).await;
        assert!((50..=60).contains(&calls), "{calls} calls paid it");
        // A quiet client (its first call in a minute) keeps its floor's
        // retry.
        let quiet = aged(RetryBudget::default()).await;
        quiet.deposit();
        quiet.charge(4);
        assert!(quiet.withdraw().is_some(), "the floor still pays");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn old_deposits_fade() {
        let b = RetryBudget::new(0.2, 0.0, Duration::from_secs(10)).unwrap();
        for _ in 0..1000 {
            b.deposit();
        }
        assert!(b.withdraw().is_some()); // takes the deposits into account now
        tokio::time::advance(Duration::from_secs(60)).await;
        // 199 tokens left a minute ago; e^-6 of them remain.
        let left = drain(&b);
        assert!(left <= 1, "{left}");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn clones_share_the_balance_and_zero_means_none() {
        let b = aged(RetryBudget::new(0.5, 0.0, Duration::from_secs(10)).unwrap()).await;
        let c = b.clone();
        for _ in 0..400 {
            c.deposit();
        }
        // Half of 40 calls a second over the window, a tenth of a second's
        // worth kept: two.
        assert_eq!(drain(&b), 2);
        assert_eq!(drain(&c), 0);
        let none = RetryBudget::new(0.0, 0.0, Duration::from_secs(1)).unwrap();
        none.deposit();
        assert!(none.withdraw().is_none());
    }

    /// While a retry that must learn its outcome waits, other retries leave
    /// the tokens to it (and wake it); once it has one, they take the rest.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_waiting_outcome_retry_is_first_in_line() {
        let b = aged(RetryBudget::new(0.5, 0.0, Duration::from_secs(10)).unwrap()).await;
        assert_eq!(b.withdraw_for(Want::Outcome), None);
        let waiting = b.outcome_waits();
        let woken = b.left_for_outcome();
        for _ in 0..400 {
            b.deposit();
        }
        // Two tokens: an overload retry leaves them, and wakes the waiter.
        assert_eq!(b.withdraw_for(Want::Retry), None);
        woken.await;
        assert_eq!(b.withdraw_for(Want::Outcome), Some(Token::Balance));
        drop(waiting);
        assert_eq!(b.withdraw_for(Want::Retry), Some(Token::Balance));
        assert_eq!(b.withdraw_for(Want::Retry), None);
    }

    /// k tokens in the balance are k retries, whatever microseconds of
    /// decay pass between the deposits and the withdrawal. (At a ratio of
    /// 1 and a 10 s window, a tenth of a second of 101 k calls is 1.01 k,
    /// once the budget has seen its window.)
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_balance_of_k_tokens_is_k_retries() {
        for k in [1usize, 2, 7] {
            let b = aged(RetryBudget::new(1.0, 0.0, Duration::from_secs(10)).unwrap()).await;
            for _ in 0..101 * k {
                b.deposit();
            }
            tokio::time::advance(Duration::from_micros(300)).await;
            assert_eq!(drain(&b), k, "{k}");
        }
    }

    /// A retry that succeeds after failures starts recovery: tokens at 10 a
    /// second, doubling with each success up to 100, one at a time; a
    /// failure halves the rate, and below the first rate stops it.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn successes_start_a_paced_recovery() {
        let b = RetryBudget::new(0.2, 0.0, Duration::from_secs(10)).unwrap();
        assert!(b.withdraw().is_none());
        let waiter = b.returned();
        b.give_back();
        waiter.await;
        // 10 a second: the next in 100 ms, and never two at once.
        assert_eq!(b.next_refill(), Some(Duration::from_millis(100)));
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(drain(&b), 1);
        // Each success doubles the rate: 20, 40, 80, then 100 at most.
        for next_us in [50_000, 25_000, 12_500, 10_000, 10_000] {
            b.give_back();
            assert_eq!(b.next_refill(), Some(Duration::from_micros(next_us)));
        }
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(b.withdraw(), Some(Token::Recovery));
        // Failures halve it: 50, 25, 12.5, then stopped.
        for _ in 0..3 {
            b.failed();
            assert!(b.next_refill().is_some());
        }
        b.failed();
        assert_eq!(b.next_refill(), None);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(drain(&b), 0);
    }

    /// A probe the floor paid for that fails pauses the floor, for twice as
    /// long each time; retries failing together pause it once; a success
    /// frees it.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn failed_probes_pause_the_floor_longer_each_time() {
        let b = RetryBudget::new(0.0, 1.0, Duration::from_secs(10)).unwrap();
        // The floor's five tokens go out at once, failing or not.
        for _ in 0..4 {
            assert_eq!(b.withdraw(), Some(Token::Floor));
            b.floor_failed();
        }
        assert_eq!(b.withdraw(), Some(Token::Floor));
        b.floor_failed();
        b.floor_failed();
        // Spent: paused for 1 s; and while probing, it holds one at most.
        assert_eq!(b.withdraw(), None);
        assert_eq!(b.next_refill(), Some(Duration::from_secs(1)));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(b.withdraw(), Some(Token::Floor));
        b.floor_failed();
        tokio::time::advance(Duration::from_millis(1999)).await;
        assert_eq!(b.withdraw(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.withdraw(), Some(Token::Floor));
        // A success frees the floor (no longer paused), and starts
        // recovery.
        b.floor_failed();
        assert_eq!(b.withdraw(), None);
        b.give_back();
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(b.withdraw(), Some(Token::Recovery));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(b.withdraw(), Some(Token::Recovery));
        assert_eq!(b.withdraw(), Some(Token::Floor));
    }

    /// A quiet client (no deposits to speak of) whose retries fail now and
    /// then is not paused while its floor holds tokens: three calls of two
    /// retries each (the first failing, the second succeeding) all go out
    /// without waiting. Before, the first failure paused the floor for 1 s.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_quiet_clients_failed_retries_do_not_pause_the_floor() {
        let b = RetryBudget::default();
        for call in 0..2 {
            b.deposit();
            assert_eq!(b.withdraw(), Some(Token::Floor), "call {call}");
            b.floor_failed();
            assert_eq!(b.withdraw(), Some(Token::Floor), "call {call}");
            b.give_back();
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        // The floor's last token; once it is spent and failed, the floor
        // pauses, but the successes have started recovery: the next token
        // is a recovery one, about 50 ms away (20 a second after two
        // successes, a little less for the three calls' own deposits), not
        // the floor's second.
        b.deposit();
        assert_eq!(b.withdraw(), Some(Token::Floor));
        b.floor_failed();
        assert_eq!(b.withdraw(), None);
        let next = b.next_refill().expect("a refill");
        assert!(next <= Duration::from_millis(60), "{next:?}");
        tokio::time::advance(next).await;
        assert_eq!(b.withdraw(), Some(Token::Recovery));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_next_refill_follows_the_floor() {
        let b = RetryBudget::new(0.0, 2.0, Duration::from_secs(10)).unwrap();
        assert_eq!(drain(&b), 10);
        let next = b.next_refill().unwrap();
        assert!(next <= Duration::from_millis(500), "{next:?}");
        tokio::time::advance(next).await;
        assert_eq!(drain(&b), 1);
        let none = RetryBudget::new(0.2, 0.0, Duration::from_secs(10)).unwrap();
        assert_eq!(none.next_refill(), None);
    }

    /// gRPC's retry throttling: a retry or hedge finds a token while more
    /// than half the tokens are left; failed attempts take one, successes
    /// give `ratio` back, up to the maximum.
    #[test]
    fn grpc_throttling_opens_above_half_its_tokens() {
        let b = RetryBudget::grpc_throttling(10_000, 100);
        assert_eq!(b.withdraw(), Some(Token::Balance));
        // Withdrawals take nothing.
        assert_eq!(b.tokens(), Some(10_000));
        for _ in 0..4 {
            b.failed_attempt();
            assert!(b.withdraw().is_some());
        }
        b.failed_attempt(); // 5 of 10 left: not more than half
        assert_eq!(b.withdraw(), None);
        b.succeeded(); // 5.1
        assert!(b.withdraw().is_some());
        for _ in 0..100 {
            b.succeeded();
        }
        assert_eq!(b.tokens(), Some(10_000));
        for _ in 0..20 {
            b.failed_attempt();
        }
        assert_eq!(b.tokens(), Some(0));
        // The other kind of budget ignores the gRPC calls.
        let other = RetryBudget::new(0.0, 0.0, Duration::from_secs(1)).unwrap();
        other.failed_attempt();
        other.succeeded();
        assert_eq!(other.tokens(), None);
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
