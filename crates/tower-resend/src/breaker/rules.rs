//! The breaker's rules, one small function per step, as the retry layer's
//! and the server's are: a call about to be made ([`on_call`]), a failure
//! of a call let through while closed ([`on_failed`]), a probe's end
//! ([`on_probed`]). Each says the next state; a call's also says what to
//! do with it, and its type admits only that.

use std::time::Duration;

use tokio::time::Instant;

use crate::vocab::{Refusal, Why};

/// The settings the rules use, already checked by the layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rules {
    /// The failure ratio that opens the circuit, in parts per million
    /// (1..=1 000 000): integer arithmetic, so that 10 of 100 is exactly 10 %.
    pub(crate) ratio_ppm: u32,
    /// The least number of calls in the window before the ratio counts (≥ 1).
    pub(crate) min_throughput: u32,
    /// How long the circuit stays open.
    pub(crate) break_duration: Duration,
    /// How many probes the half-open circuit lets through (≥ 1); that many
    /// must succeed to close it.
    pub(crate) probes: u32,
}

impl Rules {
    /// True when `counts` is enough traffic, failing often enough, to open.
    fn trips(&self, counts: Counts) -> bool {
        counts.calls >= self.min_throughput
            && u64::from(counts.failures) * 1_000_000
                >= u64::from(self.ratio_ppm) * u64::from(counts.calls)
    }

    /// The end of a break that starts `now`.
    fn until(&self, now: Instant) -> Instant {
        now.checked_add(self.break_duration)
            .unwrap_or_else(|| now + Duration::from_secs(86_400))
    }
}

/// What the sampling window holds: calls that ended, and how many of them
/// failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) calls: u32,
    pub(crate) failures: u32,
}

/// The state of the circuit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// Calls go through and are counted in the window.
    Closed,
    /// Calls fail at once until `until`.
    Open { until: Instant, why: Why },
    /// `in_flight` probes are out and `succeeded` have come back well.
    HalfOpen { in_flight: u32, succeeded: u32 },
}

impl State {
    /// The two low bits of the breaker's published tag.
    pub(crate) const fn kind(&self) -> u64 {
        match self {
            Self::Closed => CLOSED,
            Self::Open { .. } => OPEN,
            Self::HalfOpen { .. } => HALF_OPEN,
        }
    }
}

/// Tag kinds (the generation is in the bits above them).
pub(crate) const CLOSED: u64 = 0;
pub(crate) const OPEN: u64 = 1;
pub(crate) const HALF_OPEN: u64 = 2;
/// The kind's bits in a tag.
pub(crate) const KIND: u64 = 0b11;

/// What an attempt's result says about the upstream's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// It answered sanely (a success, or an answer about the request).
    Success,
    /// It looks unwell: counted against it.
    Failure,
    /// Not an observation of the upstream (nothing reached it, for reasons
    /// of our own, or the call was dropped): not counted either way.
    Ignored,
}

/// What to do with a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Let it through; count its outcome in the window.
    Call,
    /// Let it through as a probe.
    Probe,
    /// Fail it at once, without calling the upstream.
    Refuse(Refusal),
}

/// A call is about to be made at `now`.
///
/// Closed: it goes through. Open: it fails at once until the break is
/// over; the first call after it is the first probe. Half-open: up to
/// `probes` go through as probes at once, the rest fail at once.
pub(crate) fn on_call(r: &Rules, state: State, now: Instant) -> (State, Verdict) {
    match state {
        State::Closed => (state, Verdict::Call),
        State::Open { until, why } if now < until => (
            state,
            Verdict::Refuse(Refusal::Open {
                left: until - now,
                why,
            }),
        ),
        State::Open { .. } => (
            State::HalfOpen {
                in_flight: 1,
                succeeded: 0,
            },
            Verdict::Probe,
        ),
        State::HalfOpen {
            in_flight,
            succeeded,
        } if in_flight + succeeded < r.probes => (
            State::HalfOpen {
                in_flight: in_flight + 1,
                succeeded,
            },
            Verdict::Probe,
        ),
        State::HalfOpen { .. } => (
            state,
            Verdict::Refuse(Refusal::Probing {
                probes: r.probes,
                wait: r.break_duration,
            }),
        ),
    }
}

/// A call let through while closed failed at `now`, the window holding
/// `counts`: the circuit opens once the window holds enough calls, failing
/// often enough. Open or half-open, a late failure of such a call changes
/// nothing (it is no probe).
pub(crate) fn on_failed(r: &Rules, state: State, now: Instant, counts: Counts) -> State {
    match state {
        State::Closed if r.trips(counts) => State::Open {
            until: r.until(now),
            why: Why::Ratio {
                failures: counts.failures,
                calls: counts.calls,
            },
        },
        State::Closed | State::Open { .. } | State::HalfOpen { .. } => state,
    }
}

/// A probe ended at `now`, as `outcome` says: `probes` successes close the
/// circuit, one failure opens it again for a whole break, and one that told
/// nothing gives its place to another. Closed or open, a probe's outcome
/// changes nothing (the machine's generations keep late ones out).
pub(crate) fn on_probed(r: &Rules, state: State, now: Instant, outcome: Outcome) -> State {
    let State::HalfOpen {
        in_flight,
        succeeded,
    } = state
    else {
        return state;
    };
    let in_flight = in_flight.saturating_sub(1);
    match outcome {
        Outcome::Success if succeeded + 1 >= r.probes => State::Closed,
        Outcome::Success => State::HalfOpen {
            in_flight,
            succeeded: succeeded + 1,
        },
        Outcome::Failure => State::Open {
            until: r.until(now),
            why: Why::Probe,
        },
        Outcome::Ignored => State::HalfOpen {
            in_flight,
            succeeded,
        },
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::time::Duration;

    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    /// The layer's default rules.
    pub(in crate::breaker) fn defaults() -> Rules {
        Rules {
            ratio_ppm: 100_000,
            min_throughput: 100,
            break_duration: 5 * S,
            probes: 3,
        }
    }

    /// A step of the table.
    #[derive(Clone, Copy, Debug)]
    enum Step {
        Call,
        Failed(u32, u32),
        Probed(Outcome),
    }

    /// The step's rule: the next state, and for a call what to do.
    fn apply(r: &Rules, state: State, now: Instant, step: Step) -> (State, Option<Verdict>) {
        match step {
            Step::Call => {
                let (next, verdict) = on_call(r, state, now);
                (next, Some(verdict))
            }
            Step::Failed(failures, calls) => {
                (on_failed(r, state, now, Counts { calls, failures }), None)
            }
            Step::Probed(outcome) => (on_probed(r, state, now, outcome), None),
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_rules_row_by_row() {
        let r = defaults();
        let now = Instant::now();
        let open = |why| State::Open {
            until: now + 5 * S,
            why,
        };
        let tripped = |failures, calls| Why::Ratio { failures, calls };
        let half = |in_flight, succeeded| State::HalfOpen {
            in_flight,
            succeeded,
        };
        let refused_open = |left, why| Some(Verdict::Refuse(Refusal::Open { left, why }));
        let probing = Some(Verdict::Refuse(Refusal::Probing {
            probes: 3,
            wait: 5 * S,
        }));
        let (call, probe) = (Some(Verdict::Call), Some(Verdict::Probe));
        use Outcome::{Failure, Ignored, Success};
        use State::Closed;
        use Step::{Call, Failed, Probed};
        let z = Duration::ZERO;
        #[rustfmt::skip]
        let rows: &[(State, Duration, Step, State, Option<Verdict>)] = &[
            // Closed: calls go through.
            (Closed, z, Call, Closed, call),
            // Below the minimum throughput, even all failures do not open it.
            (Closed, z, Failed(99, 99), Closed, None),
            (Closed, z, Failed(1, 1), Closed, None),
            // At the minimum throughput, the ratio decides, boundary included.
            (Closed, z, Failed(9, 100), Closed, None),
            (Closed, z, Failed(10, 100), open(tripped(10, 100)), None),
            (Closed, z, Failed(100, 100), open(tripped(100, 100)), None),
            (Closed, z, Failed(13, 140), Closed, None),
            (Closed, z, Failed(14, 140), open(tripped(14, 140)), None),
            // Outcomes of probes cannot reach a closed circuit's generation;
            // if one did, it would change nothing.
            (Closed, z, Probed(Failure), Closed, None),
            // Open: calls fail at once with the time left.
            (open(Why::Probe), z, Call, open(Why::Probe), refused_open(5 * S, Why::Probe)),
            (open(tripped(10, 100)), 4999 * MS, Call, open(tripped(10, 100)), refused_open(MS, tripped(10, 100))),
            // ... until the break is over: the next call is the first probe.
            (open(Why::Probe), 5 * S, Call, half(1, 0), probe),
            (open(Why::Probe), 60 * S, Call, half(1, 0), probe),
            // Late outcomes of calls made before it opened change nothing.
            (open(Why::Probe), S, Failed(100, 100), open(Why::Probe), None),
            (open(Why::Probe), S, Probed(Success), open(Why::Probe), None),
            // Half-open: up to `probes` at once, the rest fail at once.
            (half(1, 0), z, Call, half(2, 0), probe),
            (half(2, 0), z, Call, half(3, 0), probe),
            (half(3, 0), z, Call, half(3, 0), probing),
            (half(1, 2), z, Call, half(1, 2), probing),
            (half(0, 2), z, Call, half(1, 2), probe),
            // A probe that succeeds counts; `probes` successes close it.
            (half(3, 0), z, Probed(Success), half(2, 1), None),
            (half(1, 2), z, Probed(Success), Closed, None),
            // One probe failure opens it again, for a whole break from now.
            (half(3, 2), z, Probed(Failure), open(Why::Probe), None),
            // A probe that told nothing (dropped, refused by our own
            // deadline) frees its place.
            (half(3, 0), z, Probed(Ignored), half(2, 0), None),
            // A late failure of a call made while closed is no probe.
            (half(3, 0), z, Failed(100, 100), half(3, 0), None),
        ];
        for (i, &(state, at, step, next, verdict)) in rows.iter().enumerate() {
            let got = apply(&r, state, now + at, step);
            // An open state's `until` is relative to the step's time.
            let next = match next {
                State::Open { why, .. } if !matches!(state, State::Open { .. }) => State::Open {
                    until: now + at + r.break_duration,
                    why,
                },
                other => other,
            };
            assert_eq!(
                got,
                (next, verdict),
                "row {i}: {state:?} + {step:?} at {at:?}"
            );
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn one_probe_closes_when_one_is_configured() {
        let r = Rules {
            probes: 1,
            ..defaults()
        };
        let now = Instant::now();
        let half = State::HalfOpen {
            in_flight: 1,
            succeeded: 0,
        };
        assert_eq!(
            on_call(&r, half, now).1,
            Verdict::Refuse(Refusal::Probing {
                probes: 1,
                wait: 5 * S
            })
        );
        assert_eq!(on_probed(&r, half, now, Outcome::Success), State::Closed);
    }
}
