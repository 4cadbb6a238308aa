//! The pacing rules: what the answers said of each quota, and when the
//! next call may go. Pure functions of the state and of `now` (tokio's
//! clock); the layer's service keeps the state under a lock around them.
//! Times are kept as nanoseconds from the quotas' origin: a call's
//! arithmetic is then on integers (one division), where on `Instant`s and
//! `Duration`s it took a third of the layer's instructions.

use std::time::Duration;

use tokio::time::Instant;

use super::{Form, Reading};

/// At most this many quotas (policies, partitions) are kept per layer: a
/// peer that names more is not followed, and they are counted as ignored.
pub(crate) const MAX_QUOTAS: usize = 16;

/// A wait is taken only when it leaves the call at least this much of its
/// deadline for the attempt itself (the retry layer's least useful
/// attempt); else the call is refused at once.
pub(crate) const MIN_LEFT: Duration = crate::retry::DEFAULT_MIN_ATTEMPT;

/// The most a stated reset may be late by: whole seconds, rounded up.
const ROUNDING: Duration = Duration::from_secs(1);

/// What one quota is known to hold now.
#[derive(Debug)]
pub(crate) struct Bucket {
    pub(crate) policy: Box<str>,
    pub(crate) partition: Option<Box<[u8]>>,
    /// Each call spends one of it (not a quota of tokens, which a call
    /// spends an unknown number of: those only hold calls back once spent).
    calls: bool,
    /// What may still be sent before `reset_at`: the last answer's count,
    /// less the calls sent or reserved since.
    pub(crate) left: u64,
    /// When the quota is whole again (nanoseconds from the origin).
    reset_at: u64,
    /// `left` and `reset_at` are what [`roll`](Self::roll) assumed, not
    /// what an answer said.
    assumed: bool,
    /// Its size, stated (or the most ever seen left of it).
    limit: Option<u64>,
    peak: u64,
    /// Its window, stated (`w`), else the longest reset seen; at most the
    /// reader's cap.
    window: Option<Duration>,
    span: Duration,
    /// The pace's next slot (a GCRA's theoretical arrival time).
    tat: u64,
    /// Below this, the quota is near its end (see [`low`](Self::low)),
    /// kept as each answer changes it.
    low: u64,
}

impl Bucket {
    /// Past its reset, the quota is whole again: its size (stated, or the
    /// most seen), until the next reset, one window on; an answer then
    /// says what it really holds.
    fn roll(&mut self, now: u64) {
        if now < self.reset_at {
            return;
        }
        self.left = self.limit.unwrap_or(self.peak).max(1);
        self.assumed = true;
        // The pace starts again with the window.
        self.tat = self.tat.min(now);
        let window = nanos(self.window.unwrap_or(self.span).max(Duration::from_secs(1)));
        // Whole windows after the last reset, so that the next one falls
        // where the upstream's does.
        let windows = (now - self.reset_at) / window + 1;
        self.reset_at = windows
            .checked_mul(window)
            .and_then(|d| self.reset_at.checked_add(d))
            .filter(|at| *at > now)
            .unwrap_or(now.saturating_add(window));
    }

    /// Below this, the quota is near its end: a tenth of it and ten calls,
    /// or half of a quota of tokens (which calls spend by amounts they do
    /// not know).
    fn low(&self) -> u64 {
        let size = self.limit.unwrap_or(self.peak);
        let low = if self.calls {
            (size / 10).max(10)
        } else {
            size / 2
        };
        low.max(1)
    }

    /// Whether the answer to a call sent at `sent`, stating a reset
    /// `reset` from now, may tell of a window before this one. Its window
    /// ends no earlier than `sent + reset` less a second (the answer was
    /// made after the call went; a reset in whole seconds is rounded up),
    /// and the window before this one ended by this one's reset less its
    /// window (this one's reset is never early): unless the first is past
    /// the second, the answer may be of the window before. Only a window
    /// stated (`w`) says where the one before ended, and one of a second
    /// or less cannot be told apart so: other answers are taken.
    fn may_be_before(&self, sent: u64, reset: Duration) -> bool {
        let Some(window) = self.window.filter(|w| *w > ROUNDING) else {
            return false;
        };
        let ends_after = sent
            .saturating_add(nanos(reset))
            .checked_sub(nanos(ROUNDING));
        let before_ended = self.reset_at.checked_sub(nanos(window));
        matches!((ends_after, before_ended), (Some(a), Some(b)) if a < b)
    }

    /// The pace's interval for a call at `at`: the time left after the
    /// pace's next slot (or `at`, if later) spread over the calls left.
    fn interval(&self, at: u64) -> u64 {
        self.reset_at.saturating_sub(self.tat.max(at)) / self.left.max(1)
    }
}

/// What a call may do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Go now; it spends its place.
    Go,
    /// Wait until then: for its place in the pace, taken already
    /// (`reserved`), or for a reset, after which it asks again.
    Wait { until: Instant, reserved: bool },
    /// No room before the deadline: not sent, to come back after this.
    Refuse(Duration),
}

/// Every quota the answers stated, and the Retry-After of a 429 or a 403.
#[derive(Debug)]
pub(crate) struct Quotas {
    /// Where the buckets' times start.
    origin: Instant,
    pub(crate) buckets: Vec<Bucket>,
    /// A 429's (or a 403's) Retry-After: nothing goes before it.
    pub(crate) blocked_until: Option<Instant>,
    /// A call took one of the last places of a quota (see
    /// [`quiet_for`](Self::quiet_for)): from now on, every answer is read.
    pub(crate) near_end: bool,
}

/// What one answer changed, to be counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Observed {
    /// Quotas not followed: more than [`MAX_QUOTAS`].
    pub(crate) ignored: u64,
    /// Quotas whose reading was left out: the answer may tell of the
    /// window before the one the layer holds (see `Bucket::may_be_before`).
    pub(crate) stale: u64,
}

impl Quotas {
    /// No quota known yet; times kept from `origin`.
    pub(crate) fn new(origin: Instant) -> Self {
        Self {
            origin,
            buckets: Vec::new(),
            blocked_until: None,
            near_end: false,
        }
    }

    /// `at` in nanoseconds from the origin (0 before it).
    pub(crate) fn ns(&self, at: Instant) -> u64 {
        nanos(at.saturating_duration_since(self.origin))
    }

    /// When `b` is whole again.
    pub(crate) fn reset_at(&self, b: &Bucket) -> Instant {
        self.origin + Duration::from_nanos(b.reset_at)
    }

    /// May a call whose deadline `deadline()` gives go at `now` (`t`: the
    /// same in nanoseconds from the origin)? With `burst`, that many calls
    /// more than the pace may go at once. The deadline is looked up only
    /// when the call would wait: most calls go at once, and need none.
    pub(crate) fn admit(
        &mut self,
        now: Instant,
        t: u64,
        deadline: impl Fn() -> Option<Instant>,
        burst: u32,
    ) -> Admit {
        // A wait must leave the attempt some time; no wait needs none (the
        // deadline, if it is that near, is the deadline layer's to keep).
        let fits =
            |until: Instant| until <= now || deadline().is_none_or(|d| until + MIN_LEFT <= d);
        let at = |ns: u64| now + Duration::from_nanos(ns.saturating_sub(t));
        let wait_for = |until: Instant| {
            if fits(until) {
                Admit::Wait {
                    until,
                    reserved: false,
                }
            } else {
                Admit::Refuse(until.saturating_duration_since(now))
            }
        };
        match self.blocked_until {
            Some(until) if until > now => return wait_for(until),
            Some(_) => self.blocked_until = None,
            None => {}
        }
        // A spent quota holds the call until its reset (the latest of
        // them); else its place is the latest any quota's pace gives.
        let mut spent: Option<u64> = None;
        let mut slot = t;
        for b in &mut self.buckets {
            b.roll(t);
            if b.left == 0 {
                spent = spent.max(Some(b.reset_at));
            } else if b.calls && b.tat > t {
                // (A pace behind `now` leaves the slot at `now`.)
                let tolerance = b.interval(t).saturating_mul(u64::from(burst));
                slot = slot.max(b.tat.saturating_sub(tolerance));
            }
        }
        if let Some(reset) = spent {
            return wait_for(at(reset));
        }
        if slot > t && !fits(at(slot)) {
            return Admit::Refuse(Duration::from_nanos(slot - t));
        }
        for b in self.buckets.iter_mut().filter(|b| b.calls) {
            b.tat = b.tat.max(slot).saturating_add(b.interval(slot));
            b.left -= 1;
            self.near_end |= b.left < b.low;
        }
        if slot > t {
            Admit::Wait {
                until: at(slot),
                reserved: true,
            }
        } else {
            Admit::Go
        }
    }

    /// What an answer read at `now`, to a call sent at `sent` (in
    /// nanoseconds from the origin), says, while
    /// `pending` other calls are out (sent, or waiting for their place)
    /// and not yet answered: they spend the quota too. Values past `cap`
    /// are held to it.
    pub(crate) fn observe(
        &mut self,
        reading: &Reading,
        now: Instant,
        sent: u64,
        pending: u64,
        cap: Duration,
    ) -> Observed {
        let mut seen = Observed::default();
        let t = self.ns(now);
        for q in &reading.quotas {
            let reset_at = t.saturating_add(nanos(q.reset.min(cap)));
            let left = q.remaining.saturating_sub(pending);
            let window = q.window.map(|w| w.min(cap));
            let found = self
                .buckets
                .iter()
                .position(|b| *b.policy == *q.policy && b.partition == q.partition);
            let b = match found {
                Some(i) => &mut self.buckets[i],
                None if self.buckets.len() >= MAX_QUOTAS => {
                    seen.ignored += 1;
                    continue;
                }
                None => {
                    self.buckets.push(Bucket {
                        policy: q.policy.clone(),
                        partition: q.partition.clone(),
                        calls: counts_calls(q.form, &q.policy),
                        left,
                        reset_at,
                        assumed: false,
                        limit: None,
                        peak: 0,
                        window: None,
                        span: Duration::ZERO,
                        tat: t,
                        low: 1,
                    });
                    let last = self.buckets.len() - 1;
                    &mut self.buckets[last]
                }
            };
            // In the window an answer already told of (its reset within
            // the second that integer resets round to), an answer that
            // comes late says more is left than one that came before it
            // did: the lower count holds. A reset in whole seconds is
            // rounded up (never early), so the earliest said is the
            // nearest to the truth. Else (a new window, or one only
            // assumed) the answer says it.
            let near = |a: u64, b: u64| a.abs_diff(b) <= nanos(ROUNDING);
            if b.may_be_before(sent, q.reset.min(cap)) {
                // An answer that may tell of the window before this one
                // (its reset less than a second from this one's in a
                // short window) would make the quota whole again too
                // early. Later answers tell of this window.
                seen.stale += 1;
                continue;
            }
            if !b.assumed && t < b.reset_at && near(reset_at, b.reset_at) {
                b.left = b.left.min(left);
                b.reset_at = b.reset_at.min(reset_at);
            } else {
                b.left = left;
                b.reset_at = reset_at;
                b.assumed = false;
                // (The places taken stay; none past the new reset.)
                b.tat = b.tat.min(reset_at);
            }
            b.limit = q.limit.or(b.limit);
            b.peak = b.peak.max(q.remaining);
            b.window = window.or(b.window);
            b.span = b.span.max(q.reset.min(cap));
            b.low = b.low();
        }
        if let Some(wait) = reading.retry_after {
            let until = now + wait.min(cap);
            self.blocked_until = self.blocked_until.max(Some(until));
        }
        seen
    }
}

/// The longest the layer goes without reading an answer while every quota
/// is far from spent.
pub(crate) const REREAD: Duration = Duration::from_millis(100);

impl Quotas {
    /// How long the layer may go without reading the answers' fields at
    /// `now`, counting its own calls against the last reading: while every
    /// quota is far from spent (a tenth of it and ten calls left, or half
    /// of a quota of tokens, which calls spend by amounts they do not
    /// know), a tenth of the time to the nearest reset and [`REREAD`] at
    /// most; else none, and every answer is read.
    pub(crate) fn quiet_for(&self, now: Instant) -> Duration {
        if self.blocked_until.is_some_and(|until| until > now) {
            return Duration::ZERO;
        }
        let (t, mut quiet) = (self.ns(now), nanos(REREAD));
        for b in &self.buckets {
            if b.assumed || t >= b.reset_at || b.left < b.low {
                return Duration::ZERO;
            }
            quiet = quiet.min((b.reset_at - t) / 10);
        }
        Duration::from_nanos(quiet)
    }
}

/// `d` in nanoseconds, at most `u64::MAX` (584 years).
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Each call spends one of a quota of requests; the model APIs' quotas of
/// tokens are spent by an amount the call does not know before its answer.
pub(crate) fn counts_calls(form: Form, policy: &str) -> bool {
    !matches!(form, Form::ModelDuration | Form::ModelTime) || policy == "requests"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::{Form, Quota};

    const CAP: Duration = Duration::from_secs(300);

    /// An answer in the IETF fields: 20 calls a 2 s window, `remaining`
    /// left, the reset in `t` whole seconds.
    fn ietf(remaining: u64, t: u64) -> Reading {
        Reading {
            quotas: vec![Quota {
                form: Form::Ietf,
                policy: "default".into(),
                partition: None,
                limit: Some(20),
                remaining,
                reset: Duration::from_secs(t),
                window: Some(Duration::from_secs(2)),
            }],
            retry_after: None,
            doubted: Vec::new(),
        }
    }

    /// A call sent just before a reset, its answer read after the layer
    /// went past the reset: `t=1` tells of the window before (its last
    /// second), and would bring the next reset forward by a second (a
    /// second in which the layer took the quota as whole: 429s when two
    /// processes shared it); `t=2` tells of the new one, and is taken.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_answer_of_the_window_before_is_left_out() {
        let start = Instant::now();
        let mut q = Quotas::new(start);
        let seen = q.observe(&ietf(19, 2), start, 0, 0, CAP);
        assert_eq!(seen, Observed::default());
        tokio::time::advance(Duration::from_millis(1_950)).await;
        let sent = q.ns(Instant::now());
        tokio::time::advance(Duration::from_millis(100)).await;
        // Past the reset: the quota is taken as whole, until one window on.
        let now = Instant::now();
        let _ = q.admit(now, q.ns(now), || None, 0);
        assert_eq!(q.reset_at(&q.buckets[0]), start + Duration::from_secs(4));

        let seen = q.observe(&ietf(0, 1), now, sent, 0, CAP);
        assert_eq!(seen.stale, 1);
        assert_eq!(q.reset_at(&q.buckets[0]), start + Duration::from_secs(4));
        assert!(q.buckets[0].left > 0, "{:?}", q.buckets[0]);

        let seen = q.observe(&ietf(17, 2), now, sent, 0, CAP);
        assert_eq!(seen.stale, 0);
        assert_eq!(q.buckets[0].left, 17);
    }
}
