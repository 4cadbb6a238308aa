//! The breaker's rules: a pure state machine fed with events and the time.
//!
//! Nothing here reads a clock, takes a lock or touches an atomic: the
//! [`rules`] function says, for a state, the time and an event, what the next
//! state is and what to do with the call; [`Machine`] adds the generation
//! that tells a late outcome from a current one. The shared breaker
//! (`shared.rs`) feeds it under a lock and counts the window around it.

use std::time::Duration;

use tokio::time::Instant;

use crate::vocab::{Class, Refusal, Why};

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

/// Something the breaker must take into account.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// A call is about to be made.
    Call,
    /// A call let through while closed, in `generation`, failed; `counts`
    /// is the window with it.
    Failed { generation: u64, counts: Counts },
    /// A probe let through in `generation` ended.
    Probed { generation: u64, outcome: Outcome },
}

/// What to do with the call (for [`Event::Call`]); outcomes get
/// [`Action::Nothing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Let it through; count its outcome in the window.
    Call,
    /// Let it through as a probe.
    Probe,
    /// Fail it at once, without calling the upstream.
    Refuse(Refusal),
    /// Nothing to do.
    Nothing,
}

/// The rules of the breaker, row by row: the next state and what to do.
pub(crate) fn rules(r: &Rules, state: State, now: Instant, event: Event) -> (State, Action) {
    use Action::{Call, Nothing, Probe, Refuse};
    use State::{Closed, HalfOpen, Open};
    match (state, event) {
        // Closed: calls go through; a failure opens the circuit once the
        // window holds enough calls, failing often enough.
        (Closed, Event::Call) => (Closed, Call),
        (Closed, Event::Failed { counts, .. }) if r.trips(counts) => {
            let why = Why::Ratio {
                failures: counts.failures,
                calls: counts.calls,
            };
            (
                Open {
                    until: r.until(now),
                    why,
                },
                Nothing,
            )
        }
        (Closed, _) => (Closed, Nothing),

        // Open: calls fail at once until the break is over; the first call
        // after it is the first probe.
        (Open { until, why }, Event::Call) if now < until => (
            state,
            Refuse(Refusal::Open {
                left: until - now,
                why,
            }),
        ),
        (Open { .. }, Event::Call) => (
            HalfOpen {
                in_flight: 1,
                succeeded: 0,
            },
            Probe,
        ),
        // Late outcomes of calls let through before it opened.
        (Open { .. }, _) => (state, Nothing),

        // Half-open: `probes` calls go through, the rest fail at once; one
        // probe failure opens it again, `probes` successes close it.
        (
            HalfOpen {
                in_flight,
                succeeded,
            },
            Event::Call,
        ) if in_flight + succeeded < r.probes => (
            HalfOpen {
                in_flight: in_flight + 1,
                succeeded,
            },
            Probe,
        ),
        (HalfOpen { .. }, Event::Call) => (
            state,
            Refuse(Refusal::Probing {
                probes: r.probes,
                wait: r.break_duration,
            }),
        ),
        (HalfOpen { succeeded, .. }, Event::Probed { outcome, .. }) => match outcome {
            Outcome::Success if succeeded + 1 >= r.probes => (Closed, Nothing),
            Outcome::Success => (
                HalfOpen {
                    in_flight: in_flight_less_one(state),
                    succeeded: succeeded + 1,
                },
                Nothing,
            ),
            Outcome::Failure => (
                Open {
                    until: r.until(now),
                    why: Why::Probe,
                },
                Nothing,
            ),
            // A probe that told nothing gives its place to another.
            Outcome::Ignored => (
                HalfOpen {
                    in_flight: in_flight_less_one(state),
                    succeeded,
                },
                Nothing,
            ),
        },
        // A late failure of a call let through while it was closed.
        (HalfOpen { .. }, Event::Failed { .. }) => (state, Nothing),
    }
}

fn in_flight_less_one(state: State) -> u32 {
    match state {
        State::HalfOpen { in_flight, .. } => in_flight.saturating_sub(1),
        _ => 0,
    }
}

/// A change of state, for the tracing event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// It opened for `break_duration`.
    Opened { why: Why, break_duration: Duration },
    /// The break is over: probes go out.
    HalfOpened { probes: u32 },
    /// The probes came back well.
    Closed,
}

impl Change {
    /// The state it changed to, as the state-change metric names it.
    pub(crate) const fn state(&self) -> &'static str {
        match self {
            Self::Opened { .. } => "open",
            Self::HalfOpened { .. } => "half_open",
            Self::Closed => "closed",
        }
    }
}

/// The rules with their memory: the state, and a generation that changes
/// with every change of state, so that an outcome can be told to belong to
/// the state its call was let through in.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Machine {
    rules: Rules,
    state: State,
    generation: u64,
}

impl Machine {
    /// A closed circuit.
    pub(crate) const fn new(rules: Rules) -> Self {
        Self {
            rules,
            state: State::Closed,
            generation: 0,
        }
    }

    /// Takes `event` into account at `now`: what to do with the call, and
    /// the change of state it made, if any. An outcome of another
    /// generation than the current one is of a state that has passed, and
    /// is ignored.
    pub(crate) fn step(&mut self, now: Instant, event: Event) -> (Action, Option<Change>) {
        let current = match event {
            Event::Call => true,
            Event::Failed { generation, .. } | Event::Probed { generation, .. } => {
                generation == self.generation
            }
        };
        if !current {
            return (Action::Nothing, None);
        }
        let (next, action) = rules(&self.rules, self.state, now, event);
        let change = match (self.state, next) {
            (State::Closed, State::Open { why, .. })
            | (State::HalfOpen { .. }, State::Open { why, .. }) => Some(Change::Opened {
                why,
                break_duration: self.rules.break_duration,
            }),
            (State::Open { .. }, State::HalfOpen { .. }) => Some(Change::HalfOpened {
                probes: self.rules.probes,
            }),
            (State::HalfOpen { .. }, State::Closed) => Some(Change::Closed),
            _ => None,
        };
        if change.is_some() {
            self.generation = self.generation.wrapping_add(1);
        }
        self.state = next;
        (action, change)
    }

    /// The state.
    pub(crate) const fn state(&self) -> State {
        self.state
    }

    /// The generation of the current state.
    #[cfg(test)]
    pub(crate) const fn generation(&self) -> u64 {
        self.generation
    }

    /// The state's kind and generation in one word, as the breaker
    /// publishes it for the lock-free closed path.
    pub(crate) const fn tag(&self) -> u64 {
        (self.generation << 2) | self.state.kind()
    }
}

/// A set of [`Class`]es: those counted as failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Classes(u8);

impl Classes {
    /// Unknown (5xx, timeouts, resets), Overloaded (429, 503) and NotSent
    /// (refused or timed-out connections).
    pub(crate) const DEFAULT: Self =
        Self(bit(Class::Unknown) | bit(Class::Overloaded) | bit(Class::NotSent));

    /// The set of `classes`, without Success and Rejected, which never count.
    pub(crate) fn of(classes: impl IntoIterator<Item = Class>) -> Self {
        let never = bit(Class::Success) | bit(Class::Rejected);
        Self(classes.into_iter().fold(0, |set, c| set | bit(c)) & !never)
    }

    pub(crate) const fn contains(self, class: Class) -> bool {
        self.0 & bit(class) != 0
    }
}

const fn bit(class: Class) -> u8 {
    match class {
        Class::Success => 1,
        Class::Rejected => 1 << 1,
        Class::NotSent => 1 << 2,
        Class::NotProcessed => 1 << 3,
        Class::Overloaded => 1 << 4,
        Class::InProgress => 1 << 5,
        Class::Unknown => 1 << 6,
    }
}

/// What an attempt's class says about the upstream: a failure when it is
/// one of the `failing` classes, else a success (it answered sanely: a
/// rejection is about the request, not about the upstream).
pub(crate) fn verdict(class: Class, failing: Classes) -> Outcome {
    if failing.contains(class) {
        Outcome::Failure
    } else {
        Outcome::Success
    }
}

/// False for an error that says nothing about the upstream: the call's
/// deadline had passed before the attempt, so nothing was sent, or an inner
/// breaker refused it.
pub(crate) fn observes_upstream(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(ours) = e.downcast_ref::<crate::error::Error>() {
            return match ours.kind() {
                crate::error::ErrorKind::CircuitOpen => false,
                crate::error::ErrorKind::DeadlineExceeded => {
                    ours.phase() != Some(crate::error::Phase::Start)
                }
                _ => true,
            };
        }
        next = e.source();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    fn defaults() -> Rules {
        Rules {
            ratio_ppm: 100_000,
            min_throughput: 100,
            break_duration: 5 * S,
            probes: 3,
        }
    }

    fn counts(failures: u32, calls: u32) -> Counts {
        Counts { calls, failures }
    }

    fn failed(failures: u32, calls: u32) -> Event {
        Event::Failed {
            generation: 0,
            counts: counts(failures, calls),
        }
    }

    fn probed(outcome: Outcome) -> Event {
        Event::Probed {
            generation: 0,
            outcome,
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
        let refused_open = |left, why| Action::Refuse(Refusal::Open { left, why });
        let probing = Action::Refuse(Refusal::Probing {
            probes: 3,
            wait: 5 * S,
        });
        use Action::{Call, Nothing, Probe};
        use Outcome::{Failure, Ignored, Success};
        use State::Closed;
        #[rustfmt::skip]
        let rows: &[(State, Duration, Event, State, Action)] = &[
            // Closed: calls go through.
            (Closed, Duration::ZERO, Event::Call, Closed, Call),
            // Below the minimum throughput, even all failures do not open it.
            (Closed, Duration::ZERO, failed(99, 99), Closed, Nothing),
            (Closed, Duration::ZERO, failed(1, 1), Closed, Nothing),
            // At the minimum throughput, the ratio decides, boundary included.
            (Closed, Duration::ZERO, failed(9, 100), Closed, Nothing),
            (Closed, Duration::ZERO, failed(10, 100), open(tripped(10, 100)), Nothing),
            (Closed, Duration::ZERO, failed(100, 100), open(tripped(100, 100)), Nothing),
            (Closed, Duration::ZERO, failed(13, 140), Closed, Nothing),
            (Closed, Duration::ZERO, failed(14, 140), open(tripped(14, 140)), Nothing),
            // Outcomes of probes cannot reach a closed circuit's generation;
            // if one did, it would change nothing.
            (Closed, Duration::ZERO, probed(Failure), Closed, Nothing),
            // Open: calls fail at once with the time left.
            (open(Why::Probe), Duration::ZERO, Event::Call, open(Why::Probe), refused_open(5 * S, Why::Probe)),
            (open(tripped(10, 100)), 4999 * MS, Event::Call, open(tripped(10, 100)), refused_open(MS, tripped(10, 100))),
            // ... until the break is over: the next call is the first probe.
            (open(Why::Probe), 5 * S, Event::Call, half(1, 0), Probe),
            (open(Why::Probe), 60 * S, Event::Call, half(1, 0), Probe),
            // Late outcomes of calls made before it opened change nothing.
            (open(Why::Probe), S, failed(100, 100), open(Why::Probe), Nothing),
            (open(Why::Probe), S, probed(Success), open(Why::Probe), Nothing),
            // Half-open: up to `probes` at once, the rest fail at once.
            (half(1, 0), Duration::ZERO, Event::Call, half(2, 0), Probe),
            (half(2, 0), Duration::ZERO, Event::Call, half(3, 0), Probe),
            (half(3, 0), Duration::ZERO, Event::Call, half(3, 0), probing),
            (half(1, 2), Duration::ZERO, Event::Call, half(1, 2), probing),
            (half(0, 2), Duration::ZERO, Event::Call, half(1, 2), Probe),
            // A probe that succeeds counts; `probes` successes close it.
            (half(3, 0), Duration::ZERO, probed(Success), half(2, 1), Nothing),
            (half(1, 2), Duration::ZERO, probed(Success), Closed, Nothing),
            // One probe failure opens it again, for a whole break from now.
            (half(3, 2), Duration::ZERO, probed(Failure), open(Why::Probe), Nothing),
            // A probe that told nothing (dropped, refused by our own
            // deadline) frees its place.
            (half(3, 0), Duration::ZERO, probed(Ignored), half(2, 0), Nothing),
            // A late failure of a call made while closed is no probe.
            (half(3, 0), Duration::ZERO, failed(100, 100), half(3, 0), Nothing),
        ];
        for (i, &(state, at, event, next, action)) in rows.iter().enumerate() {
            let got = rules(&r, state, now + at, event);
            // An open state's `until` is relative to the event's time.
            let next = match next {
                State::Open { why, .. } if !matches!(state, State::Open { .. }) => State::Open {
                    until: now + at + r.break_duration,
                    why,
                },
                other => other,
            };
            assert_eq!(
                got,
                (next, action),
                "row {i}: {state:?} + {event:?} at {at:?}"
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
            rules(&r, half, now, Event::Call).1,
            Action::Refuse(Refusal::Probing {
                probes: 1,
                wait: 5 * S
            })
        );
        assert_eq!(
            rules(&r, half, now, probed(Outcome::Success)),
            (State::Closed, Action::Nothing)
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_machine_ignores_outcomes_of_past_states_and_reports_changes() {
        let mut m = Machine::new(defaults());
        let t0 = Instant::now();
        assert_eq!(m.step(t0, Event::Call), (Action::Call, None));
        assert_eq!(m.tag() & KIND, CLOSED);
        let g0 = m.generation();
        let trip = Event::Failed {
            generation: g0,
            counts: counts(57, 100),
        };
        let (_, change) = m.step(t0, trip);
        assert_eq!(
            change,
            Some(Change::Opened {
                why: Why::Ratio {
                    failures: 57,
                    calls: 100
                },
                break_duration: 5 * S
            })
        );
        assert_eq!(m.tag() & KIND, OPEN);
        let g1 = m.generation();
        assert_ne!(g0, g1);
        // The break is over: the first call is a probe, in a new generation.
        let (action, change) = m.step(t0 + 5 * S, Event::Call);
        assert_eq!(action, Action::Probe);
        assert_eq!(change, Some(Change::HalfOpened { probes: 3 }));
        let g2 = m.generation();
        // A call let through while closed fails late: no probe failure.
        assert_eq!(m.step(t0 + 5 * S, trip), (Action::Nothing, None));
        let stale = Event::Probed {
            generation: g1,
            outcome: Outcome::Failure,
        };
        assert_eq!(m.step(t0 + 5 * S, stale), (Action::Nothing, None));
        assert_eq!(m.tag() & KIND, HALF_OPEN);
        // Three probes succeed: closed, in a new generation.
        let ok = Event::Probed {
            generation: g2,
            outcome: Outcome::Success,
        };
        m.step(t0 + 5 * S, Event::Call);
        m.step(t0 + 5 * S, Event::Call);
        assert_eq!(m.step(t0 + 5 * S, ok).1, None);
        assert_eq!(m.step(t0 + 5 * S, ok).1, None);
        assert_eq!(m.step(t0 + 5 * S, ok).1, Some(Change::Closed));
        assert_eq!(m.state(), State::Closed);
        assert_ne!(m.generation(), g2);
        // The probes' generation is past: another success changes nothing.
        assert_eq!(m.step(t0 + 5 * S, ok), (Action::Nothing, None));
    }

    #[test]
    fn what_counts_as_a_failure_row_by_row() {
        let d = Classes::DEFAULT;
        let rows = [
            (Class::Success, Outcome::Success),
            (Class::Rejected, Outcome::Success),
            (Class::NotProcessed, Outcome::Success),
            (Class::InProgress, Outcome::Success),
            (Class::Unknown, Outcome::Failure),
            (Class::Overloaded, Outcome::Failure),
            (Class::NotSent, Outcome::Failure),
        ];
        for (class, outcome) in rows {
            assert_eq!(verdict(class, d), outcome, "{class}");
        }
        // Configurable, but Success and Rejected never count.
        let only_5xx = Classes::of([Class::Unknown, Class::Rejected, Class::Success]);
        assert_eq!(verdict(Class::Unknown, only_5xx), Outcome::Failure);
        assert_eq!(verdict(Class::Overloaded, only_5xx), Outcome::Success);
        assert_eq!(verdict(Class::Rejected, only_5xx), Outcome::Success);
        assert_eq!(verdict(Class::Success, only_5xx), Outcome::Success);
    }

    #[test]
    fn errors_of_our_own_making_are_no_observation() {
        use crate::error::Error;
        use crate::error::Phase;
        let expired = Error::deadline_exceeded(Phase::Start, Duration::ZERO);
        assert!(!observes_upstream(&expired));
        let open = Error::circuit_open(
            Refusal::Open {
                left: S,
                why: Why::Probe,
            },
            None,
        );
        assert!(!observes_upstream(&open));
        // Timeouts, cut attempts, connect failures and foreign errors are.
        assert!(observes_upstream(&Error::attempt_timeout(S)));
        assert!(observes_upstream(&Error::deadline_exceeded(
            Phase::Attempt,
            S
        )));
        assert!(observes_upstream(&Error::connect_timeout(S)));
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(observes_upstream(&reset));
    }
}
