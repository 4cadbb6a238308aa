//! Which instance an attempt goes to: power of two choices over those in
//! service that the call has not used, by fewest requests in flight,
//! drawn at random (no scan of a large fleet: the cost of a pick does not
//! grow with it); under a limit, among those with room for it.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Instance, Moment, Place, Roster, Sent, Unpicked};

/// Random draws a pick makes over a large fleet before it looks over the
/// whole of it (which it does only when most of the fleet is used, set
/// aside or refused); a fleet this small is looked over at once.
const DRAWS: usize = 16;

impl Roster {
    /// The instance for an attempt of a call that has used `used`: two
    /// drawn at random among those in service it has not used, the one
    /// with fewer requests in flight (an instance set aside whose probe is
    /// due is taken as it is drawn); if the call has used them all, the one
    /// in service with the fewest failures (then any, the least failing:
    /// when every instance is set aside, calls still go somewhere). With
    /// circuits (a stack's breaker over the fleet), an instance whose
    /// circuit refuses is passed over; when every one refuses, the call is
    /// refused as its circuit said. Under a limit, an instance with as many
    /// attempts in flight as its limit is passed over; when every one the
    /// call could use is, the call is refused: at capacity.
    pub(crate) fn pick(&self, used: &[u64], rng: &mut fastrand::Rng) -> Result<Sent, Unpicked> {
        let view = self.view.load();
        let (all, circuits) = (&view.instances, &view.circuits);
        // Under a total limit, a place in it first: the whole fleet at it
        // is refused before any pick (and the place is given back if no
        // instance is picked).
        let total = match view.settings.total {
            None => None,
            Some(cfg) => Some(Place::take(&self.total, cfg).ok_or(Unpicked::AtCapacity)?),
        };
        let mut moment = self.moment_of(view.settings);
        // A call is a probe on its first attempt only: a retry, after an
        // attempt that failed (maybe a probe refused), goes to an instance
        // in service, so that no call bears two probes' risk.
        moment.probe_room &= used.is_empty();
        let mut refused: Vec<u64> = Vec::new();
        let mut refusal = None;
        let mut full = false;
        loop {
            let chosen = match choose(all, used, &refused, moment, rng) {
                Ok(chosen) => chosen,
                Err(Miss::Full) => return Err(Unpicked::AtCapacity),
                Err(Miss::Nothing) => break,
            };
            let pass = match &circuits {
                None => None,
                Some(c) => match c.admit(chosen.id, &chosen.base.authority) {
                    Ok(pass) => Some(pass),
                    Err(why) => {
                        refused.push(chosen.id);
                        refusal = Some(why);
                        continue;
                    }
                },
            };
            // (Another pick may have taken its last place since it was
            // chosen: it is passed over as if it had been full then.)
            if !chosen.load.take_place(moment.limit.is_some()) {
                refused.push(chosen.id);
                full = true;
                continue;
            }
            if !moment.takes(&chosen) {
                // A probe: counted against the fleet's share of them.
                self.probes.record(Self::epoch(moment.now), false);
            }
            return Ok(Sent {
                instance: chosen,
                pass,
                at: moment.now,
                limit: moment.limit,
                total,
            });
        }
        if full {
            return Err(Unpicked::AtCapacity);
        }
        Err(refusal.map_or(Unpicked::Empty, Unpicked::Refused))
    }
}

/// Why [`choose`] found no instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Miss {
    /// None is left that the call could use.
    Nothing,
    /// Those left that the call could use are at their limit.
    Full,
}

/// Two at random among the instances that take attempts now (in
/// service, or set aside with a probe due) that the call has not used, no
/// circuit `refused`, with room under their limit, the one with fewer
/// requests in flight; a due probe is taken as it is found. Over a fleet of
/// more than [`DRAWS`] instances, by random draws (the cost does not grow
/// with the fleet); over a small one, or when the draws found none, over
/// every instance; then, when none is left, [`look_over`].
///
/// When the draws found only instances at their limit, the fleet is taken
/// as at capacity without a look over it: a fleet of which a share `s` has
/// room passes every one of the draws over with a chance of `(1 - s)^16`
/// (1 % at a quarter), so it refuses a few calls with room left somewhere
/// only when three quarters of it are full, where a scan would cost every
/// refused call the whole fleet.
fn choose(
    all: &[Arc<Instance>],
    used: &[u64],
    refused: &[u64],
    m: Moment,
    rng: &mut fastrand::Rng,
) -> Result<Arc<Instance>, Miss> {
    if all.is_empty() {
        return Err(Miss::Nothing);
    }
    let full = Cell::new(false);
    // An instance at its limit is passed over, and says so to its limit
    // (which grows only when it binds).
    let room = |i: &Instance| {
        let room = m.room(i);
        if !room {
            i.load.passed_over();
            full.set(true);
        }
        room
    };
    let usable = |i: &Instance| !used.contains(&i.id) && !refused.contains(&i.id);
    let open = |i: &Instance| usable(i) && room(i);
    if all.len() > DRAWS {
        match draw(all, &usable, &room, m, rng) {
            Ok(i) => return Ok(i),
            Err(Miss::Full) => return Err(Miss::Full),
            Err(Miss::Nothing) => {}
        }
    }
    let found = every(all, &open, m, rng).or_else(|| look_over(all, used, refused, &room, m));
    match found {
        Some(i) => Ok(i),
        None if full.get() => Err(Miss::Full),
        None => Err(Miss::Nothing),
    }
}

/// [`choose`] by [`DRAWS`] random draws of instances the call can use
/// (`usable`) with `room` under their limit; [`Miss::Full`] when every
/// draw found one at its limit, [`Miss::Nothing`] when they found none
/// otherwise.
fn draw(
    all: &[Arc<Instance>],
    usable: &dyn Fn(&Instance) -> bool,
    room: &dyn Fn(&Instance) -> bool,
    m: Moment,
    rng: &mut fastrand::Rng,
) -> Result<Arc<Instance>, Miss> {
    let mut first: Option<&Arc<Instance>> = None;
    let mut at_limit = 0;
    for _ in 0..DRAWS {
        let i = &all[rng.usize(..all.len())];
        if !usable(i) {
            continue;
        }
        if !room(i) {
            at_limit += 1;
            continue;
        }
        if !m.takes(i) {
            if m.probe_room && i.health.take_probe(m.now, m.probe_every) {
                return Ok(Arc::clone(i));
            }
            continue;
        }
        match first {
            None => first = Some(i),
            Some(a) if a.id == i.id => {}
            Some(a) => return Ok(Arc::clone(less_busy(a, i))),
        }
    }
    match first {
        Some(i) => Ok(Arc::clone(i)),
        None if at_limit == DRAWS => Err(Miss::Full),
        None => Err(Miss::Nothing),
    }
}

/// [`choose`] over every instance: a due probe first, else two distinct
/// at random among those that take attempts.
fn every(
    all: &[Arc<Instance>],
    open: &dyn Fn(&Instance) -> bool,
    m: Moment,
    rng: &mut fastrand::Rng,
) -> Option<Arc<Instance>> {
    let n = all.len();
    let start = rng.usize(..n);
    let in_order = || {
        (0..n)
            .map(move |k| &all[(start + k) % n])
            .filter(|i| open(i))
    };
    let mut taking = 0;
    for i in in_order() {
        if m.takes(i) {
            taking += 1;
        } else if m.probe_room && i.health.take_probe(m.now, m.probe_every) {
            return Some(Arc::clone(i));
        }
    }
    let nth = |k: usize| in_order().filter(|i| m.takes(i)).nth(k);
    match taking {
        0 => None,
        1 => nth(0).cloned(),
        _ => {
            let a = rng.usize(..taking);
            let b = (a + 1 + rng.usize(..taking - 1)) % taking;
            match (nth(a), nth(b)) {
                (Some(a), Some(b)) => Some(Arc::clone(less_busy(a, b))),
                (a, b) => a.or(b).cloned(),
            }
        }
    }
}

/// Of two, the one with fewer requests in flight (the first on a tie).
fn less_busy<'a>(a: &'a Arc<Instance>, b: &'a Arc<Instance>) -> &'a Arc<Instance> {
    if b.in_flight() < a.in_flight() {
        b
    } else {
        a
    }
}

/// The whole fleet looked over, when random draws found nothing: the one
/// taking attempts that the call has not used, fewest in flight; else the
/// one with the fewest failures among those not refused, in service first;
/// only those with `room` under their limit.
fn look_over(
    all: &[Arc<Instance>],
    used: &[u64],
    refused: &[u64],
    room: &dyn Fn(&Instance) -> bool,
    m: Moment,
) -> Option<Arc<Instance>> {
    let open = || all.iter().filter(|i| !refused.contains(&i.id) && room(i));
    if let Some(fresh) = open()
        .filter(|i| !used.contains(&i.id) && m.takes(i))
        .min_by_key(|i| i.in_flight())
    {
        return Some(Arc::clone(fresh));
    }
    let fewest_failures =
        |i: &&Arc<Instance>| (i.health.in_a_row.load(Ordering::Relaxed), i.in_flight());
    open()
        .filter(|i| m.takes(i))
        .min_by_key(fewest_failures)
        .or_else(|| open().min_by_key(fewest_failures))
        .cloned()
}
