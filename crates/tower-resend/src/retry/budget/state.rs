//! What a budget holds between two looks, and how it refills: the rates
//! of calls, the balance of deposits (a burst of them at most), the floor
//! and recovery. The arithmetic of [`RetryBudget`](super::RetryBudget),
//! under its lock; the budget's calls (take a token, settle it, wait for
//! one) are in `mod.rs`.

use std::time::Duration;

use tokio::time::Instant;

use super::{Inner, NOW_SECONDS, RECOVERY_START, WHOLE};

/// The most credit the deposits give the floor, in seconds of it.
const FLOOR_CREDIT_SECONDS: f64 = 1.0;

/// What a budget holds between two looks.
pub(super) struct State {
    pub(super) balance: f64,
    /// Calls per second, averaged over the window (see `seen`).
    pub(super) rate: Rate,
    /// How much of a window the budget has seen, `1 - e^(-age/window)`:
    /// a new budget's average is over its age, not over a window of which
    /// most has not happened (the bias correction of an average that
    /// starts at zero).
    pub(super) seen: f64,
    /// Calls per second now: averaged over the last second or so, for the
    /// floor and recovery, which are for a client whose calls do not
    /// come fast enough to pay for its retries themselves.
    pub(super) now_rate: Rate,
    pub(super) floor: f64,
    /// What the deposits gave beyond the floor's rate, a second's worth
    /// at most: the floor refills only once it is spent (see `refill`).
    pub(super) floor_credit: f64,
    pub(super) calls_seen: u64,
    pub(super) last: Instant,
    /// The floor is not drawn on until then: a retry it paid for failed
    /// (the upstream is still down), so it probes, no faster.
    pub(super) floor_paused_until: Instant,
    /// The pause after the next failed probe: doubled by each, reset by a
    /// success.
    pub(super) probe_interval: Duration,
    /// A retry the floor paid for failed, and none has succeeded since: the
    /// floor holds one token at most (one probe at a time, never a burst).
    pub(super) probing: bool,
    /// Recovery: tokens per second earned by retries that succeed (0: not
    /// recovering), and the bucket they fill (at most one token, so that
    /// they come evenly spaced, never in a burst).
    pub(super) recovery_rate: f64,
    pub(super) recovery: f64,
    /// Retries of keyed calls waiting for a token to learn their outcome
    /// (see [`RetryBudget::withdraw_for`]): while any waits, other retries
    /// leave the tokens to them.
    pub(super) outcome_waiting: u32,
}

impl State {
    /// Brings the state to `now`, with `calls` made in all so far: the
    /// rates, the balance (capped at a burst of deposits), the floor and
    /// recovery refilled for the time since the last look.
    pub(super) fn refill(&mut self, i: &Inner, now: Instant, calls: u64) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        let new_calls = calls.saturating_sub(self.calls_seen) as f64;
        self.calls_seen = calls;
        let window = i.window.as_secs_f64();
        self.rate.add(new_calls, dt, window);
        let decay = (-dt / window).exp();
        self.seen = self.seen * decay + (1.0 - decay);
        self.now_rate.add(new_calls, dt, NOW_SECONDS);
        let cap = (i.ratio * calls_per_sec(self, window, i.burst) * i.burst).max(1.0);
        // No decay of the balance itself: the cap bounds what is kept, and
        // falls with the rate when calls stop.
        self.balance = (self.balance + new_calls * i.ratio).min(cap);
        // The floor: `min_per_sec`, and five seconds of it kept for a quiet
        // client; one token at most for a client whose deposits come as
        // fast (no burst on top of theirs), or while probing.
        let floor_cap = if self.probing || i.ratio * self.now_rate.per_sec >= i.min_per_sec {
            i.floor_cap.min(1.0)
        } else {
            i.floor_cap
        };
        // The floor tops the deposits up to `min_per_sec`, never adds to
        // them: what they give beyond it is credit (a second's worth at
        // most) that the floor's refill spends first. A client whose calls
        // deposit a retry a second or more has no floor on top (measured
        // at 10 000 callers, the floor on top made the storm's worst
        // second 1.21 attempts per call made, not 1.20); a second after
        // its calls stop (an outage holding them), the floor probes again.
        self.floor_credit += new_calls * i.ratio - dt * i.min_per_sec;
        self.floor_credit = self.floor_credit.min(i.min_per_sec * FLOOR_CREDIT_SECONDS);
        if self.floor_credit < 0.0 {
            self.floor -= self.floor_credit;
            self.floor_credit = 0.0;
        }
        self.floor = self.floor.min(floor_cap);
        self.recovery = (self.recovery + dt * recovery_rate(self, i.ratio)).min(1.0);
    }

    /// When the floor holds a token again, with no deposit: once its
    /// credit is spent, at `min_per_sec` (`None` without a floor).
    pub(super) fn floor_refill(&self, i: &Inner) -> Option<Duration> {
        (i.min_per_sec > 0.0).then(|| {
            // (The floor tops the deposits up.)
            let have = self.floor + self.balance;
            let missing = if have >= WHOLE {
                0.0
            } else {
                1.0 - have + self.floor_credit
            };
            Duration::from_secs_f64((missing / i.min_per_sec).min(3600.0))
        })
    }

    /// Recovery's tokens per second now (see `recovery_rate`).
    pub(super) fn recovery_per_sec(&self, ratio: f64) -> f64 {
        recovery_rate(self, ratio)
    }
}

/// Calls per second, a moving average over a time constant.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Rate {
    pub(super) per_sec: f64,
}

impl Rate {
    /// `calls` more, made over the `dt` seconds since the last look,
    /// averaged over `over` seconds. The calls are taken as spread over
    /// `dt`, not made now: what is left of them after the decay, on
    /// average (a whole call for calls a moment ago; for calls spread
    /// over a quiet hour, the last `over` seconds' worth).
    fn add(&mut self, calls: f64, dt: f64, over: f64) {
        let decay = (-dt / over).exp();
        let x = dt / over;
        let fresh = if x > 0.01 { (1.0 - decay) / x } else { 1.0 };
        self.per_sec = self.per_sec * decay + calls * fresh / over;
    }
}

/// The recent rate of calls, over the budget's age while it is younger
/// than a window; at its start, as if its calls so far came within one
/// burst (so a new client may spend all it has deposited).
pub(super) fn calls_per_sec(st: &State, window: f64, burst: f64) -> f64 {
    st.rate.per_sec / st.seen.max(burst / window).max(1e-9)
}

/// Recovery's tokens per second now: its rate, faded out as the deposits'
/// own rate nears recovery's first (10 a second: 50 calls a second at the
/// default ratio). Recovery is for a client whose calls are too few to
/// release the retries an outage held back (a hundred calls at once, then
/// none); a busier client's deposits release them, at a fifth of its
/// calls, and recovery on top would send more than that in the seconds
/// after a storm (measured: 1.46 attempts per call made in the second the
/// storm ended, 1.19 without).
fn recovery_rate(st: &State, ratio: f64) -> f64 {
    st.recovery_rate * (1.0 - ratio * st.now_rate.per_sec / RECOVERY_START).max(0.0)
}

/// The first pause of the floor after a failed probe: one floor period.
pub(super) fn first_probe(min_per_sec: f64) -> Duration {
    if min_per_sec > 0.0 {
        Duration::from_secs_f64((1.0 / min_per_sec).min(30.0))
    } else {
        Duration::from_secs(1)
    }
}
