//! The triggers, scripted in simulated time: what state each instance is in
//! at an instant, how slow its work is, and what the fleet's DNS name
//! answers.

use std::net::{Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::time::Duration;

use tokio::time::Instant;

/// A short trigger, at [`Model::warm_up`](super::Model::warm_up) from the
/// start of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// A third of the instances refuse every request for 10 s (they went
    /// away; what they had queued, they finish).
    ThirdDown,
    /// As [`Scenario::ThirdDown`], for 3 s: issue 46's three-instance case
    /// (one of three down 3 s), beside its real-clock run in the
    /// `three_down` bench. Not in [`Scenario::ALL`] (the storm's tables).
    ThirdDownShort,
    /// Every instance's work takes 4 times as long for 5 s (a slow
    /// dependency, a garbage collection, a noisy neighbour).
    SlowX4,
    /// Every instance refuses every request for 5 s.
    FullOutage,
    /// One instance in a hundred (at least one) takes requests and never
    /// answers them, for 10 s.
    BlackHole,
    /// Half the fleet replaced one instance at a time over 20 s (a rolling
    /// deploy): each old instance stops (refuses) at the moment its new one
    /// enters the DNS answer, which clients read every
    /// [`Model::refresh`](super::Model::refresh).
    Churn,
}

impl Scenario {
    /// Every scenario, in the tables' order.
    pub const ALL: [Scenario; 5] = [
        Scenario::ThirdDown,
        Scenario::SlowX4,
        Scenario::FullOutage,
        Scenario::BlackHole,
        Scenario::Churn,
    ];

    /// Its name in tables, pictures and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::ThirdDown => "third-down-10s",
            Scenario::ThirdDownShort => "third-down-3s",
            Scenario::SlowX4 => "slow-x4-5s",
            Scenario::FullOutage => "outage-5s",
            Scenario::BlackHole => "black-hole-10s",
            Scenario::Churn => "churn-half-20s",
        }
    }

    /// The scenario of that name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .chain([Scenario::ThirdDownShort])
            .find(|s| s.name() == name)
    }

    /// How long the trigger lasts.
    pub fn length(self) -> Duration {
        Duration::from_secs(match self {
            Scenario::ThirdDown | Scenario::BlackHole => 10,
            Scenario::ThirdDownShort => 3,
            Scenario::SlowX4 | Scenario::FullOutage => 5,
            Scenario::Churn => 20,
        })
    }
}

/// What an instance does with a request that reaches it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum State {
    /// Queues it (or answers 503 when the queue is full); work started now
    /// takes `slow` times its drawn time.
    Up { slow: f64 },
    /// Refuses it at once: `REFUSED_STREAM`, nothing done.
    Refusing,
    /// Takes it and never answers.
    BlackHole,
}

/// A scenario laid out over a fleet, from a start instant.
#[derive(Clone, Debug)]
pub(crate) struct Script {
    start: Instant,
    scenario: Scenario,
    from: Duration,
    to: Duration,
    /// Instances in the fleet before the trigger.
    instances: usize,
}

impl Script {
    pub(crate) fn new(
        start: Instant,
        scenario: Scenario,
        warm_up: Duration,
        instances: usize,
    ) -> Self {
        Self {
            start,
            scenario,
            from: warm_up,
            to: warm_up + scenario.length(),
            instances,
        }
    }

    /// Every instance that ever serves: the fleet, and the new half of a
    /// fleet being replaced.
    pub(crate) fn slots(&self) -> usize {
        match self.scenario {
            Scenario::Churn => self.instances + self.replaced(),
            _ => self.instances,
        }
    }

    fn replaced(&self) -> usize {
        (self.instances / 2).max(1)
    }

    /// The instances the trigger touches, besides churn's.
    fn touched(&self) -> Range<usize> {
        match self.scenario {
            Scenario::ThirdDown | Scenario::ThirdDownShort => 0..self.instances / 3,
            Scenario::BlackHole => 0..(self.instances / 100).max(1),
            Scenario::SlowX4 | Scenario::FullOutage => 0..self.instances,
            Scenario::Churn => 0..self.replaced(),
        }
    }

    /// When churn replaces the `j`-th old instance: evenly over the
    /// trigger, the first at its start.
    fn replaced_at(&self, j: usize) -> Duration {
        let step = self.scenario.length() / self.replaced() as u32;
        self.from + step * j as u32
    }

    fn since(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.start)
    }

    /// What instance `i` does with a request at `now`.
    pub(crate) fn state(&self, i: usize, now: Instant) -> State {
        let t = self.since(now);
        let during = t >= self.from && t < self.to;
        let touched = self.touched().contains(&i);
        match self.scenario {
            Scenario::ThirdDown | Scenario::ThirdDownShort | Scenario::FullOutage
                if during && touched =>
            {
                State::Refusing
            }
            Scenario::BlackHole if during && touched => State::BlackHole,
            Scenario::SlowX4 if during => State::Up { slow: 4.0 },
            Scenario::Churn if touched && t >= self.replaced_at(i) => State::Refusing,
            Scenario::Churn if i >= self.instances => {
                if t >= self.replaced_at(i - self.instances) {
                    State::Up { slow: 1.0 }
                } else {
                    State::Refusing
                }
            }
            _ => State::Up { slow: 1.0 },
        }
    }

    /// The instances the fleet's DNS name answers at `now`.
    pub(crate) fn resolve(&self, now: Instant) -> Vec<usize> {
        let t = self.since(now);
        if self.scenario != Scenario::Churn {
            return (0..self.instances).collect();
        }
        let gone = (0..self.replaced())
            .filter(|&j| t >= self.replaced_at(j))
            .count();
        (gone..self.instances)
            .chain(self.instances..self.instances + gone)
            .collect()
    }
}

/// Instance `i`'s address: `10.x.y.z:80`.
pub(crate) fn address(i: usize) -> SocketAddr {
    let [_, b, c, d] = (i as u32).to_be_bytes();
    SocketAddr::from((Ipv4Addr::new(10, b, c, d), 80))
}

/// The instance an authority names, if it names one of [`address`]'s.
pub(crate) fn instance_of(authority: &http::uri::Authority) -> Option<usize> {
    let ip: Ipv4Addr = authority.host().parse().ok()?;
    let [a, b, c, d] = ip.octets();
    (a == 10).then(|| u32::from_be_bytes([0, b, c, d]) as usize)
}
