//! Why a circuit breaker opened, and why it refused a call.

use std::time::Duration;

/// Why the circuit opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    /// `failures` of the window's `calls` failed.
    Ratio { failures: u32, calls: u32 },
    /// A half-open probe failed.
    Probe,
}

/// Why a call was refused, and for how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The circuit is open for `left` more.
    Open { left: Duration, why: Why },
    /// The circuit is half-open and all of its `probes` are out; come back
    /// after `wait` (a break's length: the probes either close it sooner or
    /// open it again).
    Probing { probes: u32, wait: Duration },
}

/// `failures` of `calls` in whole per cent, rounded.
pub(crate) fn percent(failures: u32, calls: u32) -> u64 {
    let calls = u64::from(calls.max(1));
    (u64::from(failures) * 100 + calls / 2) / calls
}

/// The circuits of a fleet's instances, one each: the stack's circuit
/// breaker, over a fleet, works per instance.
pub(crate) trait Circuits: Send + Sync {
    /// Lets an attempt to instance `id` (at `authority`) through: a pass to
    /// settle with its outcome; or why its circuit refuses it.
    fn admit(&self, id: u64, authority: &http::uri::Authority) -> Result<Box<dyn Pass>, Refusal>;

    /// The fleet is now the instances `live` (each id, and its
    /// authority): each gets its circuit now if it has none, so that an
    /// attempt only looks its circuit up; the circuits of the others go
    /// (an instance that leaves takes its state with it).
    fn keep(&self, live: &[(u64, &http::uri::Authority)]);
}

/// An attempt let through an instance's circuit. Dropped unsettled (the
/// attempt was dropped), it counts as nothing, and a probe's place is
/// given back.
pub(crate) trait Pass: Send {
    /// Settles with the attempt's `class`, and its error if it failed with
    /// one (an error that says nothing of the instance counts as nothing).
    fn settle(
        self: Box<Self>,
        class: super::Class,
        error: Option<&(dyn std::error::Error + 'static)>,
    );
}
