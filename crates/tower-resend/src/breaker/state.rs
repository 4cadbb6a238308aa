//! The breaker's rules: a pure state machine fed with events and the time.
//!
//! Nothing here reads a clock, takes a lock or touches an atomic: the rules
//! (`rules.rs`, one function per step: a call, a failure, a probe's end)
//! say what the next state is and what to do with the call; [`Machine`]
//! adds the generation that tells a late outcome from a current one. The
//! shared breaker (`shared.rs`) feeds it under a lock and counts the window
//! around it.

use std::time::Duration;

use tokio::time::Instant;

use super::rules::{on_call, on_failed, on_probed, Verdict};
pub(crate) use super::rules::{Counts, Outcome, Rules, State, CLOSED, KIND};
#[cfg(test)]
use super::rules::{HALF_OPEN, OPEN};
use crate::vocab::{Class, Why};

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

    /// A call is about to be made at `now`: what to do with it, and the
    /// change of state it made, if any.
    pub(crate) fn call(&mut self, now: Instant) -> (Verdict, Option<Change>) {
        let (next, verdict) = on_call(&self.rules, self.state, now);
        (verdict, self.become_(next))
    }

    /// A call let through while closed, in `generation`, failed at `now`,
    /// the window holding `counts`: the change of state it made, if any.
    /// An outcome of another generation than the current one is of a state
    /// that has passed, and is ignored.
    pub(crate) fn failed(
        &mut self,
        now: Instant,
        generation: u64,
        counts: Counts,
    ) -> Option<Change> {
        self.outcome(generation, |r, state| on_failed(r, state, now, counts))
    }

    /// A probe let through in `generation` ended at `now`, as `outcome`
    /// says: the change of state it made, if any (an outcome of a past
    /// generation is ignored).
    pub(crate) fn probed(
        &mut self,
        now: Instant,
        generation: u64,
        outcome: Outcome,
    ) -> Option<Change> {
        self.outcome(generation, |r, state| on_probed(r, state, now, outcome))
    }

    /// An outcome of `generation`, its rule `rule`: ignored when its
    /// generation has passed.
    fn outcome(
        &mut self,
        generation: u64,
        rule: impl FnOnce(&Rules, State) -> State,
    ) -> Option<Change> {
        if generation != self.generation {
            return None;
        }
        let next = rule(&self.rules, self.state);
        self.become_(next)
    }

    /// Moves to `next`: the change, if the state's kind changed (a new
    /// generation).
    fn become_(&mut self, next: State) -> Option<Change> {
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
        change
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
pub(crate) fn outcome_of(class: Class, failing: Classes) -> Outcome {
    if failing.contains(class) {
        Outcome::Failure
    } else {
        Outcome::Success
    }
}

/// False for an error that says nothing about the upstream: the call's
/// deadline had passed before the attempt, so nothing was sent, an inner
/// breaker refused it, or a fleet below found every instance at its limit.
pub(crate) fn observes_upstream(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(ours) = e.downcast_ref::<crate::error::Error>() {
            return match ours.kind() {
                crate::error::ErrorKind::CircuitOpen
                | crate::error::ErrorKind::AtCapacity
                | crate::error::ErrorKind::QuotaSpent => false,
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
    use crate::vocab::Refusal;

    const S: Duration = Duration::from_secs(1);

    use super::super::rules::tests::defaults;

    fn counts(failures: u32, calls: u32) -> Counts {
        Counts { calls, failures }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_machine_ignores_outcomes_of_past_states_and_reports_changes() {
        let mut m = Machine::new(defaults());
        let t0 = Instant::now();
        assert_eq!(m.call(t0), (Verdict::Call, None));
        assert_eq!(m.tag() & KIND, CLOSED);
        let g0 = m.generation();
        let change = m.failed(t0, g0, counts(57, 100));
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
        let (verdict, change) = m.call(t0 + 5 * S);
        assert_eq!(verdict, Verdict::Probe);
        assert_eq!(change, Some(Change::HalfOpened { probes: 3 }));
        let g2 = m.generation();
        // A call let through while closed fails late: no probe failure.
        assert_eq!(m.failed(t0 + 5 * S, g0, counts(57, 100)), None);
        assert_eq!(m.probed(t0 + 5 * S, g1, Outcome::Failure), None);
        assert_eq!(m.tag() & KIND, HALF_OPEN);
        // Three probes succeed: closed, in a new generation.
        m.call(t0 + 5 * S);
        m.call(t0 + 5 * S);
        assert_eq!(m.probed(t0 + 5 * S, g2, Outcome::Success), None);
        assert_eq!(m.probed(t0 + 5 * S, g2, Outcome::Success), None);
        assert_eq!(
            m.probed(t0 + 5 * S, g2, Outcome::Success),
            Some(Change::Closed)
        );
        assert_eq!(m.state(), State::Closed);
        assert_ne!(m.generation(), g2);
        // The probes' generation is past: another success changes nothing.
        assert_eq!(m.probed(t0 + 5 * S, g2, Outcome::Success), None);
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
            assert_eq!(outcome_of(class, d), outcome, "{class}");
        }
        // Configurable, but Success and Rejected never count.
        let only_5xx = Classes::of([Class::Unknown, Class::Rejected, Class::Success]);
        assert_eq!(outcome_of(Class::Unknown, only_5xx), Outcome::Failure);
        assert_eq!(outcome_of(Class::Overloaded, only_5xx), Outcome::Success);
        assert_eq!(outcome_of(Class::Rejected, only_5xx), Outcome::Success);
        assert_eq!(outcome_of(Class::Success, only_5xx), Outcome::Success);
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
