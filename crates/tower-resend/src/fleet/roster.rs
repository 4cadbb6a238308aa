//! The instances of one upstream, how each is doing, and which one an
//! attempt goes to: power of two choices over those in service that the
//! call has not used, by fewest requests in flight, drawn at random (no
//! scan of the fleet: the cost of a pick does not grow with it); instances
//! that keep failing set aside, probed, and let back, as
//! [`Outliers`](super::Outliers) says.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use tokio::time::Instant;

use super::base::Base;
use super::outliers::{degraded, nanos, sets_aside, Health, Outliers, Recent, BIN};
use crate::vocab::{Circuits, Elsewhere, Pass, Refusal};

/// Random draws a pick makes over a large fleet before it looks over the
/// whole of it (which it does only when most of the fleet is used, set
/// aside or refused); a fleet this small is looked over at once.
const DRAWS: usize = 16;

/// One instance: where it is, and how it is doing.
#[derive(Debug)]
pub(crate) struct Instance {
    pub(crate) id: u64,
    pub(crate) base: Base,
    in_flight: AtomicU32,
    health: Health,
}

impl Instance {
    pub(crate) fn new(id: u64, base: Base) -> Self {
        Self {
            id,
            base,
            in_flight: AtomicU32::new(0),
            health: Health::default(),
        }
    }

    pub(crate) fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// The fleet: its instances (replaced whole when discovery changes them)
/// and the rules that set them aside.
pub(crate) struct Roster {
    instances: RwLock<Arc<[Arc<Instance>]>>,
    outliers: RwLock<Outliers>,
    next_id: AtomicU64,
    /// The instances' circuits, under a stack with a circuit breaker.
    circuits: RwLock<Option<Arc<dyn Circuits>>>,
    /// Where the instances' clocks start.
    origin: Instant,
    /// The whole fleet's recent attempts and failures.
    recent: Recent,
}

impl std::fmt::Debug for Roster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Roster")
            .field("instances", &self.instances())
            .field("outliers", &self.outliers())
            .finish_non_exhaustive()
    }
}

/// An attempt sent to an instance: counted in flight until it ends, and
/// let through its circuit, if it has one.
pub(crate) struct Sent {
    pub(crate) instance: Arc<Instance>,
    pub(crate) pass: Option<Box<dyn Pass>>,
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
}

impl Drop for Sent {
    fn drop(&mut self) {
        self.instance.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a pick needs of the moment: the time, and whether the instances set
/// aside are let back.
#[derive(Clone, Copy, Debug)]
struct Moment {
    now: u64,
    degraded: bool,
    probe_every: std::time::Duration,
}

impl Moment {
    /// `i` takes attempts now: in service, or its probe is due (taken).
    fn takes(&self, i: &Instance) -> bool {
        !i.health.aside(self.now) || self.degraded
    }
}

impl Roster {
    pub(crate) fn new(outliers: Outliers) -> Self {
        Self {
            instances: RwLock::new(Arc::from(Vec::new())),
            outliers: RwLock::new(outliers),
            next_id: AtomicU64::new(1),
            circuits: RwLock::new(None),
            origin: Instant::now(),
            recent: Recent::default(),
        }
    }

    fn outliers(&self) -> Outliers {
        *self.outliers.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn set_outliers(&self, outliers: Outliers) {
        *self
            .outliers
            .write()
            .unwrap_or_else(PoisonError::into_inner) = outliers;
    }

    pub(crate) fn instances(&self) -> Arc<[Arc<Instance>]> {
        Arc::clone(
            &self
                .instances
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// The fleet is now `bases`: instances already known keep their
    /// state (and id), new ones start fresh, the others leave, and their
    /// state with them (their circuits too).
    pub(crate) fn set(&self, bases: &[Base]) {
        let old = self.instances();
        let next: Vec<Arc<Instance>> = bases
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
            let live: Vec<u64> = next.iter().map(|i| i.id).collect();
            circuits.retain(&live);
        }
        *self
            .instances
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::from(next);
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
        let now = self.now();
        let o = self.outliers();
        Moment {
            now,
            degraded: degraded(&o, self.recent.ratio(Self::epoch(now))),
            probe_every: o.probe_every,
        }
    }

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

    /// Over a stack with a circuit breaker: the circuits of the instances.
    pub(crate) fn set_circuits(&self, circuits: Arc<dyn Circuits>) {
        *self
            .circuits
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(circuits);
    }

    fn circuits(&self) -> Option<Arc<dyn Circuits>> {
        self.circuits
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// `instance` answered well: back in service at once if it was set
    /// aside (a probe that answered), its failures forgotten.
    pub(crate) fn succeeded(&self, instance: &Instance) {
        let epoch = Self::epoch(self.now());
        instance.health.recent.record(epoch, false);
        self.recent.record(epoch, false);
        instance.health.success();
    }

    /// `instance` failed in a way that says "this instance": it is set
    /// aside as [`Outliers`] says. True if it was.
    pub(crate) fn failed(&self, instance: &Instance) -> bool {
        let now = self.now();
        let epoch = Self::epoch(now);
        instance.health.recent.record(epoch, true);
        self.recent.record(epoch, true);
        let Some((in_a_row, probation)) = instance.health.failure(now) else {
            return false;
        };
        let o = self.outliers();
        if in_a_row < o.consecutive && !probation {
            return false;
        }
        // (The rarer path: the fleet is looked over.)
        let others = self
            .recent
            .ratio(epoch)
            .less(instance.health.recent.ratio(epoch));
        let all = self.instances();
        let aside = all.iter().filter(|i| i.health.aside(now)).count();
        if !sets_aside(&o, in_a_row, probation, others, aside, all.len()) {
            return false;
        }
        instance.health.set_aside(&o, now);
        true
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

impl Elsewhere for Roster {
    fn has_other(&self, used: &[u64]) -> bool {
        let m = self.moment();
        self.instances()
            .iter()
            .any(|i| !used.contains(&i.id) && m.takes(i))
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
mod tests {
    use std::time::Duration;

    use http::uri::Authority;

    use super::*;

    fn roster(n: u16, outliers: Outliers) -> Roster {
        roster_of(usize::from(n), outliers)
    }

    /// A roster of `n` instances, `http://10.x.y.z:80`.
    fn roster_of(n: usize, outliers: Outliers) -> Roster {
        let r = Roster::new(outliers);
        let addrs: Vec<_> = (0..n)
            .map(|i| {
                let (a, b) = (i / 256, i % 256);
                Base::parse(&format!("http://10.0.{a}.{b}:80")).unwrap()
            })
            .collect();
        r.set(&addrs);
        r
    }

    #[test]
    fn a_call_goes_where_it_has_not_been_and_every_instance_gets_its_share() {
        let r = roster(3, Outliers::default());
        let mut rng = fastrand::Rng::with_seed(7);
        let ids: Vec<u64> = r.instances().iter().map(|i| i.id).collect();
        let mut second = [0u32; 3];
        for _ in 0..3000 {
            let used = [ids[0]];
            let sent = r.pick(&used, &mut rng).unwrap();
            assert_ne!(sent.instance.id, ids[0]);
            second[ids.iter().position(|&i| i == sent.instance.id).unwrap()] += 1;
        }
        // The two others share the retries, neither starved.
        assert_eq!(second[0], 0);
        assert!((1200..=1800).contains(&second[1]), "{second:?}");
        assert!((1200..=1800).contains(&second[2]), "{second:?}");
        // Used them all: still an instance.
        assert!(r.pick(&ids, &mut rng).is_ok());
    }

    #[test]
    fn the_less_busy_of_two_is_chosen() {
        let r = roster(2, Outliers::default());
        let mut rng = fastrand::Rng::with_seed(1);
        let busy = r.pick(&[], &mut rng).unwrap();
        for _ in 0..20 {
            let next = r.pick(&[], &mut rng).unwrap();
            assert_ne!(next.instance.id, busy.instance.id);
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn failing_instances_are_set_aside_for_a_growing_pause_within_the_share() {
        let outliers = Outliers::default()
            .consecutive(3)
            .pause(Duration::from_secs(10), Duration::from_secs(60));
        let r = roster(3, outliers);
        let all = r.instances();
        let (a, b) = (&all[0], &all[1]);
        assert!(!r.failed(a) && !r.failed(a));
        assert!(r.failed(a), "the third failure in a row ejects");
        assert!(!r.has_other(&[all[1].id, all[2].id]));
        // Half of three is one: B cannot be set aside while A is.
        for _ in 0..5 {
            assert!(!r.failed(b));
        }
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..100 {
            assert_ne!(r.pick(&[], &mut rng).unwrap().instance.id, a.id);
        }
        // Back after its pause, on probation: one failure sets it aside
        // again, for twice as long.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(r.has_other(&[all[1].id, all[2].id]));
        assert!(r.failed(a));
        tokio::time::advance(Duration::from_secs(19)).await;
        assert!(a.health.aside(r.now()));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!a.health.aside(r.now()));
        // A success ends probation and the doubling.
        r.succeeded(a);
        assert!(!r.failed(a));
    }

    /// An instance set aside gets a probe every `probe_every`, and the
    /// first that answers well brings it back at once.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_instance_set_aside_comes_back_at_its_first_good_probe() {
        let r = roster(3, Outliers::default().consecutive(1));
        let a = Arc::clone(&r.instances()[0]);
        assert!(r.failed(&a));
        let mut rng = fastrand::Rng::with_seed(4);
        let picks = |r: &Roster, rng: &mut fastrand::Rng, n| {
            (0..n)
                .filter(|_| r.pick(&[], rng).unwrap().instance.id == a.id)
                .count()
        };
        assert_eq!(picks(&r, &mut rng, 200), 0, "aside, no probe due");
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(picks(&r, &mut rng, 200), 1, "one probe");
        // The probe failed: still aside, the next probe 500 ms later.
        assert!(!r.failed(&a));
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(picks(&r, &mut rng, 200), 1);
        // It answered well: in service again, long before its 10 s pause.
        r.succeeded(&a);
        assert!(picks(&r, &mut rng, 300) > 50);
    }

    /// An outlier is one against the rest: when the others fail as much,
    /// no more is set aside, and what was aside is let back.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn when_the_others_fail_too_nothing_is_an_outlier() {
        let r = roster(4, Outliers::default().consecutive(2));
        let all = r.instances();
        // A fails alone: set aside.
        for i in &all[1..] {
            for _ in 0..5 {
                r.succeeded(i);
            }
        }
        assert!(!r.failed(&all[0]));
        assert!(r.failed(&all[0]));
        let mut rng = fastrand::Rng::with_seed(5);
        let to_a = |r: &Roster, rng: &mut fastrand::Rng| {
            (0..300)
                .filter(|_| r.pick(&[], rng).unwrap().instance.id == all[0].id)
                .count()
        };
        assert_eq!(to_a(&r, &mut rng), 0);
        // Now every instance fails, over the next second: the fleet is
        // degraded, and A is let back.
        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..20 {
            for i in &all[1..] {
                r.failed(i);
            }
        }
        assert!(
            to_a(&r, &mut rng) > 30,
            "let back while the fleet is degraded"
        );
        // Degraded, no instance is an outlier: none is newly set aside.
        let aside = |r: &Roster| all.iter().filter(|i| i.health.aside(r.now())).count();
        let before = aside(&r);
        for _ in 0..5 {
            for i in &all[1..] {
                assert!(!r.failed(i));
            }
        }
        assert_eq!(aside(&r), before);
    }

    /// Wherever the bad instance is in a large fleet, it is set aside,
    /// and picks draw at random rather than scan.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_bad_instance_of_two_thousand_is_set_aside_wherever_it_is() {
        let r = roster_of(2000, Outliers::default());
        let all = r.instances();
        let mut rng = fastrand::Rng::with_seed(9);
        for bad in [0, 1000, 1999] {
            let bad = &all[bad];
            for _ in 0..2000 {
                let sent = r.pick(&[], &mut rng).unwrap();
                if sent.instance.id == bad.id {
                    r.failed(bad);
                } else {
                    r.succeeded(&sent.instance);
                }
            }
            for _ in 0..5 {
                r.failed(bad);
            }
            assert!(bad.health.aside(r.now()), "instance {}", bad.base.authority);
            let to_bad = (0..4000)
                .filter(|_| r.pick(&[], &mut rng).unwrap().instance.id == bad.id)
                .count();
            assert_eq!(to_bad, 0);
            r.succeeded(bad);
        }
    }

    #[test]
    fn when_every_instance_is_set_aside_calls_still_go_somewhere() {
        let r = roster(1, Outliers::default().consecutive(1));
        let only = &r.instances()[0];
        assert!(!r.failed(only), "the last instance is never set aside");
        let mut rng = fastrand::Rng::with_seed(1);
        assert!(r.pick(&[only.id], &mut rng).is_ok());
        assert!(matches!(
            Roster::new(Outliers::default()).pick(&[], &mut rng),
            Err(Unpicked::Empty)
        ));
    }

    #[test]
    fn a_new_list_keeps_the_instances_it_still_names() {
        let r = roster(2, Outliers::default());
        let before: Vec<u64> = r.instances().iter().map(|i| i.id).collect();
        let b = r.instances()[1].base.clone();
        r.set(&[b, Base::parse("http://10.0.0.9:80").unwrap()]);
        let after: Vec<u64> = r.instances().iter().map(|i| i.id).collect();
        assert_eq!(after[0], before[1]);
        assert!(!before.contains(&after[1]));
        // The same host and port under another path is another instance.
        r.set(&[Base::parse("http://10.0.0.9:80/api").unwrap()]);
        assert!(!after.contains(&r.instances()[0].id));
    }

    /// Circuits that refuse the instances listed in `open`.
    struct Refusing(Vec<u64>);

    struct Passed;

    impl Pass for Passed {
        fn settle(
            self: Box<Self>,
            _: crate::vocab::Class,
            _: Option<&(dyn std::error::Error + 'static)>,
        ) {
        }
    }

    impl Circuits for Refusing {
        fn retain(&self, _: &[u64]) {}

        fn admit(&self, id: u64, _: &Authority) -> Result<Box<dyn Pass>, Refusal> {
            if self.0.contains(&id) {
                Err(Refusal::Probing {
                    probes: 1,
                    wait: Duration::from_secs(1),
                })
            } else {
                Ok(Box::new(Passed))
            }
        }
    }

    #[test]
    fn an_instance_whose_circuit_refuses_is_passed_over() {
        let r = roster(3, Outliers::default());
        let ids: Vec<u64> = r.instances().iter().map(|i| i.id).collect();
        r.set_circuits(Arc::new(Refusing(vec![ids[0]])));
        let mut rng = fastrand::Rng::with_seed(2);
        for _ in 0..100 {
            assert_ne!(r.pick(&[], &mut rng).unwrap().instance.id, ids[0]);
        }
        // Even when the call has used the others.
        let sent = r.pick(&ids[1..], &mut rng).unwrap();
        assert_ne!(sent.instance.id, ids[0]);
        // Every circuit refusing: the call is refused as they said.
        r.set_circuits(Arc::new(Refusing(ids.clone())));
        assert!(matches!(
            r.pick(&[], &mut rng),
            Err(Unpicked::Refused(Refusal::Probing { .. }))
        ));
    }
}
