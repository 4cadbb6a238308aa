//! Which instance an attempt goes to: power of two choices over those in
//! service that the call has not used, by fewest requests in flight,
//! drawn at random (no scan of a large fleet: the cost of a pick does not
//! grow with it).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Instance, Moment, Roster, Sent, Unpicked};

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
    /// refused as its circuit said.
    pub(crate) fn pick(&self, used: &[u64], rng: &mut fastrand::Rng) -> Result<Sent, Unpicked> {
        let all = self.instances();
        let circuits = self.circuits();
        let moment = self.moment();
        let mut refused: Vec<u64> = Vec::new();
        let mut refusal = None;
        while let Some(chosen) = choose(&all, used, &refused, moment, rng) {
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
            chosen.in_flight.fetch_add(1, Ordering::Relaxed);
            return Ok(Sent {
                instance: chosen,
                pass,
            });
        }
        Err(refusal.map_or(Unpicked::Empty, Unpicked::Refused))
    }
}

/// Two at random among the instances that take attempts now (in
/// service, or set aside with a probe due) that the call has not used and
/// no circuit `refused`, the one with fewer requests in flight; a due
/// probe is taken as it is found. Over a fleet of more than [`DRAWS`]
/// instances, by random draws (the cost does not grow with the fleet);
/// over a small one, or when the draws found none, over every instance;
/// then, when none is left, [`look_over`].
fn choose(
    all: &[Arc<Instance>],
    used: &[u64],
    refused: &[u64],
    m: Moment,
    rng: &mut fastrand::Rng,
) -> Option<Arc<Instance>> {
    if all.is_empty() {
        return None;
    }
    let open = |i: &Instance| !used.contains(&i.id) && !refused.contains(&i.id);
    if all.len() > DRAWS {
        if let Some(i) = draw(all, &open, m, rng) {
            return Some(i);
        }
    }
    every(all, &open, m, rng).or_else(|| look_over(all, used, refused, m))
}

/// [`choose`] by [`DRAWS`] random draws; `None` when they found none.
fn draw(
    all: &[Arc<Instance>],
    open: &dyn Fn(&Instance) -> bool,
    m: Moment,
    rng: &mut fastrand::Rng,
) -> Option<Arc<Instance>> {
    let mut first: Option<&Arc<Instance>> = None;
    for _ in 0..DRAWS {
        let i = &all[rng.usize(..all.len())];
        if !open(i) {
            continue;
        }
        if !m.takes(i) {
            if i.health.take_probe(m.now, m.probe_every) {
                return Some(Arc::clone(i));
            }
            continue;
        }
        match first {
            None => first = Some(i),
            Some(a) if a.id == i.id => {}
            Some(a) => return Some(Arc::clone(less_busy(a, i))),
        }
    }
    first.cloned()
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
        } else if i.health.take_probe(m.now, m.probe_every) {
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
/// one with the fewest failures among those not refused, in service first.
fn look_over(
    all: &[Arc<Instance>],
    used: &[u64],
    refused: &[u64],
    m: Moment,
) -> Option<Arc<Instance>> {
    let open = || all.iter().filter(|i| !refused.contains(&i.id));
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
