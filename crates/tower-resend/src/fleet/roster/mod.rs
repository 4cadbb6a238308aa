//! The instances of one upstream, how each is doing, and which one an
//! attempt goes to: power of two choices over those in service that the
//! call has not used, by fewest requests in flight, drawn at random (no
//! scan of the fleet: the cost of a pick does not grow with it); instances
//! that keep failing set aside, probed, and let back, as
//! [`Outliers`](super::Outliers) says; with a limit
//! ([`InstanceLimit`](super::InstanceLimit)), instances at it passed over.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use super::base::Base;
use super::limit::{signal, total_signal, InstanceLimit, TimedOut};
use super::outliers::{
    degraded, nanos, probe_room, sets_aside, FleetRecent, Health, Outliers, Recent, BIN,
};
use crate::classify::Class;
use crate::vocab::{Circuits, Elsewhere, Pass, Refusal};

mod load;
mod pick;

use load::{Load, Place};

/// One instance: where it is, and how it is doing.
///
/// Laid out for the pick (`repr(C)`): what a draw reads (its id, whether
/// it is aside, its attempts in flight) in its first 48 bytes, so that
/// over a fleet of thousands, where every instance drawn is a cache miss,
/// a draw reads one or two lines, not one per field.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Instance {
    pub(crate) id: u64,
    health: Health,
    /// Its attempts in flight, and its limit on them (used when the fleet
    /// has one).
    load: Load,
    /// Its recent attempts and failures.
    recent: Recent,
    pub(crate) base: Base,
}

impl Instance {
    pub(crate) fn new(id: u64, base: Base) -> Self {
        Self {
            id,
            base,
            health: Health::default(),
            load: Load::default(),
            recent: Recent::default(),
        }
    }

    pub(crate) fn in_flight(&self) -> u32 {
        self.load.in_flight()
    }

    /// Its limit on attempts in flight now: `None` while none binds.
    pub(crate) fn limit(&self) -> Option<u32> {
        self.load.limit()
    }
}

/// The fleet: its instances (replaced whole when discovery changes them)
/// and the rules that set them aside.
pub(crate) struct Roster {
    /// What a pick reads: one load, no lock, no count written that every
    /// thread's picks share (a read lock's count, an `Arc`'s), so the cost
    /// of a pick does not grow with the threads picking.
    view: ArcSwap<View>,
    next_id: AtomicU64,
    /// Where the instances' clocks start.
    origin: Instant,
    /// The whole fleet's recent attempts and failures.
    recent: FleetRecent,
    /// The probes of instances set aside, recently (as attempts).
    probes: Recent,
    /// This process's attempts in flight to the whole fleet, and their
    /// limit (used when the fleet has a total limit).
    total: Arc<Load>,
}

/// What a pick reads of the fleet, replaced whole when any of it changes
/// (discovery, the settings, the circuits: rare, and never on a call's
/// path).
#[derive(Clone)]
struct View {
    instances: Arc<[Arc<Instance>]>,
    settings: Settings,
    /// The instances' circuits, under a stack with a circuit breaker.
    circuits: Option<Arc<dyn Circuits>>,
}

/// How the fleet treats its instances: when it sets them aside, and the
/// limit on what each has in flight, if any. Set when the fleet is built,
/// read once a pick.
#[derive(Clone, Copy, Debug)]
struct Settings {
    outliers: Outliers,
    limit: Option<InstanceLimit>,
    /// The limit on the attempts in flight to the whole fleet, if any.
    total: Option<InstanceLimit>,
}

impl std::fmt::Debug for Roster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Roster")
            .field("instances", &self.instances())
            .field("settings", &self.settings())
            .finish_non_exhaustive()
    }
}

/// An attempt sent to an instance: counted in flight until it ends, and
/// let through its circuit, if it has one.
pub(crate) struct Sent {
    pub(crate) instance: Arc<Instance>,
    pub(crate) pass: Option<Box<dyn Pass>>,
    /// When it was sent, on the instances' clock.
    at: u64,
    /// The limit it was sent under, when the fleet has one.
    limit: Option<InstanceLimit>,
    /// Its place under the fleet's total limit, when the fleet has one.
    total: Option<Place>,
}

impl std::fmt::Debug for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sent")
            .field("instance", &self.instance.base.authority)
            .finish_non_exhaustive()
    }
}

/// Why no instance was picked.
#[derive(Debug)]
pub(crate) enum Unpicked {
    /// The fleet has none.
    Empty,
    /// Every instance's circuit refused; the last said this.
    Refused(Refusal),
    /// Every instance the call could use (whose circuit would let it
    /// through) has as many attempts in flight as its limit, or the fleet
    /// as many as its total limit.
    AtCapacity,
}

impl Drop for Sent {
    fn drop(&mut self) {
        self.instance.load.give_back();
    }
}

/// What a pick needs of the moment: the time, whether the instances set
/// aside are let back, whether the fleet's probes leave room for another,
/// and the limit on attempts in flight, if any.
#[derive(Clone, Copy, Debug)]
struct Moment {
    now: u64,
    degraded: bool,
    probe_room: bool,
    probe_every: Duration,
    limit: Option<InstanceLimit>,
}

impl Moment {
    /// `i` takes attempts now: in service, or its probe is due (taken).
    fn takes(&self, i: &Instance) -> bool {
        !i.health.aside(self.now) || self.degraded
    }

    /// `i` has room for another attempt under its limit (always, when the
    /// fleet has none).
    fn room(&self, i: &Instance) -> bool {
        self.limit.is_none() || i.load.room()
    }
}

impl Roster {
    pub(crate) fn new(outliers: Outliers) -> Self {
        Self {
            view: ArcSwap::from_pointee(View {
                instances: Arc::from(Vec::new()),
                settings: Settings {
                    outliers,
                    limit: None,
                    total: None,
                },
                circuits: None,
            }),
            next_id: AtomicU64::new(1),
            origin: Instant::now(),
            recent: FleetRecent::default(),
            probes: Recent::default(),
            total: Arc::default(),
        }
    }

    fn settings(&self) -> Settings {
        self.view.load().settings
    }

    fn outliers(&self) -> Outliers {
        self.settings().outliers
    }

    /// The view made again by `change`, from the latest (a change made at
    /// once elsewhere is not lost: it is made again on it).
    fn change(&self, change: impl Fn(&mut View)) {
        self.view.rcu(|view| {
            let mut next = View::clone(view);
            change(&mut next);
            next
        });
    }

    pub(crate) fn set_outliers(&self, outliers: Outliers) {
        self.change(|v| v.settings.outliers = outliers);
    }

    /// Each instance's attempts in flight limited by `limit` from now.
    pub(crate) fn set_limit(&self, limit: InstanceLimit) {
        self.change(|v| v.settings.limit = Some(limit));
    }

    /// The attempts in flight to the whole fleet limited by `limit` from
    /// now.
    pub(crate) fn set_total(&self, limit: InstanceLimit) {
        self.change(|v| v.settings.total = Some(limit));
    }

    /// The limit on the attempts in flight to the whole fleet now: `None`
    /// while none binds.
    pub(crate) fn total_limit(&self) -> Option<u32> {
        self.total.limit()
    }

    pub(crate) fn instances(&self) -> Arc<[Arc<Instance>]> {
        Arc::clone(&self.view.load().instances)
    }

    /// The fleet is now `bases`: instances already known keep their
    /// state (and id), new ones start fresh, the others leave, and their
    /// state with them (their circuits too).
    pub(crate) fn set(&self, bases: &[Base]) {
        let old = self.instances();
        let next: Arc<[Arc<Instance>]> = bases
            .iter()
            .map(|base| {
                old.iter()
                    .find(|i| i.base == *base)
                    .cloned()
                    .unwrap_or_else(|| {
                        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                        Arc::new(Instance::new(id, base.clone()))
                    })
            })
            .collect();
        if let Some(circuits) = self.circuits() {
            circuits.keep(&Self::ids(&next));
        }
        self.change(|v| v.instances = Arc::clone(&next));
    }

    /// Nanoseconds since the origin, plus one (0 means "none" in the
    /// instances' clocks).
    fn now(&self) -> u64 {
        nanos(Instant::now().saturating_duration_since(self.origin)).saturating_add(1)
    }

    fn epoch(now: u64) -> u64 {
        now / nanos(BIN)
    }

    fn moment(&self) -> Moment {
        self.moment_of(self.settings())
    }

    /// The moment under settings `s`.
    fn moment_of(&self, s: Settings) -> Moment {
        let now = self.now();
        let o = s.outliers;
        let epoch = Self::epoch(now);
        let probes = self.probes.ratio(epoch).attempts;
        // Nothing failed and no probe went out: the fleet is not degraded
        // and has room for a probe, read without the shards of its
        // answers (which every thread's calls write).
        let quiet = self.recent.failed(epoch).failures == 0 && probes == 0 && o.others_below > 0.0;
        let fleet = (!quiet).then(|| self.recent.ratio(epoch));
        Moment {
            now,
            degraded: fleet.is_some_and(|f| degraded(&o, f)),
            probe_room: fleet.is_none_or(|f| probe_room(&o, probes, f)),
            probe_every: o.probe_every,
            limit: s.limit,
        }
    }

    /// Over a stack with a circuit breaker: the circuits of the instances.
    pub(crate) fn set_circuits(&self, circuits: Arc<dyn Circuits>) {
        circuits.keep(&Self::ids(&self.instances()));
        self.change(|v| v.circuits = Some(Arc::clone(&circuits)));
    }

    /// Each instance's id and authority, for its circuit.
    fn ids(instances: &[Arc<Instance>]) -> Vec<(u64, &http::uri::Authority)> {
        instances
            .iter()
            .map(|i| (i.id, &*i.base.authority))
            .collect()
    }

    fn circuits(&self) -> Option<Arc<dyn Circuits>> {
        self.view.load().circuits.clone()
    }

    /// The attempt `sent` ended, classified as `class`, `answered` (a
    /// response) or not, and `timed_out` if it ran out of time: what it
    /// says of its instance's health (a failure not sent, overloaded, or
    /// whose outcome is unknown, an attempt timeout, says "this instance")
    /// and, under a limit, of its load.
    pub(crate) fn ended(
        &self,
        sent: &Sent,
        class: Class,
        answered: bool,
        timed_out: Option<TimedOut>,
    ) {
        let now = self.now();
        let instance = &sent.instance;
        match class {
            Class::NotSent => {
                self.failed_at(instance, now, true);
            }
            Class::Overloaded | Class::Unknown => {
                self.failed_at(instance, now, false);
            }
            Class::Success | Class::Rejected | Class::NotProcessed | Class::InProgress => {
                self.succeeded_at(instance, now);
            }
        }
        let took = Duration::from_nanos(now.saturating_sub(sent.at));
        if let Some(cfg) = &sent.limit {
            let says = signal(class, answered, timed_out, took);
            instance.load.ended(cfg, sent.at, now, says);
        }
        if let Some(total) = &sent.total {
            let says = total_signal(class, answered, timed_out, took);
            total.load.ended(&total.cfg, sent.at, now, says);
        }
    }

    /// `instance` answered well: back in service at once if it was set
    /// aside (a probe that answered), its failures forgotten.
    #[cfg(test)]
    pub(crate) fn succeeded(&self, instance: &Instance) {
        self.succeeded_at(instance, self.now());
    }

    fn succeeded_at(&self, instance: &Instance, now: u64) {
        let epoch = Self::epoch(now);
        instance.recent.record(epoch, false);
        self.recent.record(epoch, false);
        instance.health.success();
    }

    /// `instance` failed in a way that says "this instance": it is set
    /// aside as [`Outliers`] says. True if it was.
    #[cfg(test)]
    pub(crate) fn failed(&self, instance: &Instance) -> bool {
        self.failed_at(instance, self.now(), false)
    }

    /// `instance` refused an attempt (not sent): set aside at once, as
    /// [`Outliers`] says. True if it was.
    #[cfg(test)]
    pub(crate) fn refused(&self, instance: &Instance) -> bool {
        self.failed_at(instance, self.now(), true)
    }

    /// The same, for a failure that was not sent (`not_sent`: a refused
    /// connection or stream).
    fn failed_at(&self, instance: &Instance, now: u64, not_sent: bool) -> bool {
        let epoch = Self::epoch(now);
        instance.recent.record(epoch, true);
        self.recent.record(epoch, true);
        let Some((in_a_row, probation)) = instance.health.failure(now) else {
            return false;
        };
        let o = self.outliers();
        let at_once = probation || (not_sent && o.not_sent_at_once);
        if in_a_row < o.consecutive && !at_once {
            return false;
        }
        // (The rarer path: the fleet is looked over.)
        let others = self.recent.ratio(epoch).less(instance.recent.ratio(epoch));
        let all = self.instances();
        let aside = all.iter().filter(|i| i.health.aside(now)).count();
        if !sets_aside(&o, in_a_row, at_once, others, aside, all.len()) {
            return false;
        }
        instance.health.set_aside(&o, now);
        true
    }
}

impl Elsewhere for Roster {
    fn has_other(&self, used: &[u64]) -> bool {
        let m = self.moment();
        self.instances()
            .iter()
            .any(|i| !used.contains(&i.id) && m.takes(i) && m.room(i))
    }

    fn failing(&self) -> bool {
        self.moment().degraded
    }

    fn len(&self) -> usize {
        self.instances().len()
    }

    fn authorities(&self) -> Vec<Arc<http::uri::Authority>> {
        self.instances()
            .iter()
            .map(|i| Arc::clone(&i.base.authority))
            .collect()
    }
}

#[cfg(test)]
mod tests;
