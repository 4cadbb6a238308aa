//! The instances of one upstream, how each is doing, and which one an
//! attempt goes to: power of two choices over those in service that the
//! call has not used, by fewest requests in flight; instances that keep
//! failing set aside (outlier detection) for a pause that grows while they
//! keep failing, never more than a share of the fleet at once.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use super::base::Base;
use crate::vocab::{Circuits, Elsewhere, Pass, Refusal};

/// When an instance that keeps failing is set aside, and for how long.
///
/// As Envoy's outlier detection: after `consecutive` failures in a row
/// that say "this instance" (not sent, reset, overloaded, a 5xx, an attempt
/// timeout), the instance is ejected for `base_pause`, doubled by each
/// ejection that follows without a success between (up to `max_pause`);
/// at most `max_share` of the fleet is ejected at once (at least one
/// instance, never all). An instance back from a pause is on probation: one
/// failure before its first success sets it aside again.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outliers {
    consecutive: u32,
    base_pause: Duration,
    max_pause: Duration,
    max_share: f64,
}

impl Default for Outliers {
    /// 5 failures in a row; a 10 s pause, up to 5 minutes; half the fleet.
    fn default() -> Self {
        Self {
            consecutive: 5,
            base_pause: Duration::from_secs(10),
            max_pause: Duration::from_secs(300),
            max_share: 0.5,
        }
    }
}

impl Outliers {
    /// Sets an instance aside after `n` failures in a row (at least 1).
    #[must_use]
    pub fn consecutive(mut self, n: u32) -> Self {
        self.consecutive = n.max(1);
        self
    }

    /// The first pause of an ejected instance, and the longest one.
    #[must_use]
    pub fn pause(mut self, base: Duration, max: Duration) -> Self {
        self.base_pause = base;
        self.max_pause = max.max(base);
        self
    }

    /// At most this share of the instances (0 to 1) set aside at once; at
    /// least one, and never all of them.
    #[must_use]
    pub fn max_share(mut self, share: f64) -> Self {
        self.max_share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            Self::default().max_share
        };
        self
    }

    /// Never sets an instance aside.
    #[must_use]
    pub fn off(mut self) -> Self {
        self.consecutive = u32::MAX;
        self
    }
}

/// One instance: where it is, and how it is doing.
#[derive(Debug)]
pub(crate) struct Instance {
    pub(crate) id: u64,
    pub(crate) base: Base,
    in_flight: AtomicU32,
    health: Mutex<Health>,
}

#[derive(Debug, Default)]
struct Health {
    /// Failures in a row.
    failures: u32,
    /// Set aside until then.
    ejected_until: Option<Instant>,
    /// Ejections since its last success: each doubles the pause.
    ejections: u32,
    /// Back from a pause, and not yet answered well.
    probation: bool,
}

impl Instance {
    pub(crate) fn new(id: u64, base: Base) -> Self {
        Self {
            id,
            base,
            in_flight: AtomicU32::new(0),
            health: Mutex::default(),
        }
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ejected_at(&self, now: Instant) -> bool {
        self.health().ejected_until.is_some_and(|t| t > now)
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

impl Roster {
    pub(crate) fn new(outliers: Outliers) -> Self {
        Self {
            instances: RwLock::new(Arc::from(Vec::new())),
            outliers: RwLock::new(outliers),
            next_id: AtomicU64::new(1),
            circuits: RwLock::new(None),
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
    /// state (and id), new ones start fresh, the others leave.
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
        *self
            .instances
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::from(next);
    }

    /// The instance for an attempt of a call that has used `used`: two
    /// picked at random among those in service it has not used, the one
    /// with fewer requests in flight; if it has used them all, the one in
    /// service with the fewest failures (then any, the least failing: when
    /// every instance is set aside, calls still go somewhere). With
    /// circuits (a stack's breaker over the fleet), an instance whose
    /// circuit refuses is passed over; when every one refuses, the call is
    /// refused as its circuit said.
    pub(crate) fn pick(&self, used: &[u64], rng: &mut fastrand::Rng) -> Result<Sent, Unpicked> {
        let all = self.instances();
        let circuits = self.circuits();
        let now = Instant::now();
        let mut refused: Vec<u64> = Vec::new();
        let mut refusal = None;
        while let Some(chosen) = choose(&all, used, &refused, now, rng) {
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

    /// `instance` answered well: its failures are forgotten.
    pub(crate) fn succeeded(&self, instance: &Instance) {
        let now = Instant::now();
        let mut h = instance.health();
        if h.ejected_until.is_some_and(|t| t <= now) {
            h.ejected_until = None;
        }
        h.failures = 0;
        h.ejections = 0;
        h.probation = false;
    }

    /// `instance` failed in a way that says "this instance": it is set
    /// aside once its failures in a row reach the threshold (or at once,
    /// on probation), if the fleet can spare it. True if it was.
    pub(crate) fn failed(&self, instance: &Instance) -> bool {
        let now = Instant::now();
        let outliers = self.outliers();
        let threshold = {
            let mut h = instance.health();
            if h.ejected_until.is_some_and(|t| t > now) {
                return false;
            }
            if h.ejected_until.take().is_some() {
                // Back from a pause: on probation.
                h.probation = true;
            }
            h.failures = h.failures.saturating_add(1);
            h.probation || h.failures >= outliers.consecutive
        };
        if !threshold || !self.can_eject(now, outliers.max_share) {
            return false;
        }
        let mut h = instance.health();
        let doubling = 1u32 << h.ejections.min(16);
        let pause = outliers
            .base_pause
            .saturating_mul(doubling)
            .min(outliers.max_pause);
        h.ejected_until = Some(now + pause);
        h.ejections = h.ejections.saturating_add(1);
        h.failures = 0;
        true
    }

    /// Another instance may be set aside now: fewer than the share are.
    fn can_eject(&self, now: Instant, max_share: f64) -> bool {
        let all = self.instances();
        let n = all.len();
        let share = (n as f64 * max_share).floor() as usize;
        let max = share.max(1).min(n.saturating_sub(1));
        let ejected = all.iter().filter(|i| i.ejected_at(now)).count();
        ejected < max
    }
}

/// Two at random among the instances in service that the call has not
/// used (and that no circuit `refused`), the one with fewer requests in
/// flight; when there are none, the one with the fewest failures among
/// those not refused, in service first.
fn choose(
    all: &[Arc<Instance>],
    used: &[u64],
    refused: &[u64],
    now: Instant,
    rng: &mut fastrand::Rng,
) -> Option<Arc<Instance>> {
    let fresh: Vec<&Arc<Instance>> = all
        .iter()
        .filter(|i| !used.contains(&i.id) && !refused.contains(&i.id) && !i.ejected_at(now))
        .collect();
    match fresh.len() {
        0 => {
            let open: Vec<&Arc<Instance>> =
                all.iter().filter(|i| !refused.contains(&i.id)).collect();
            let in_service: Vec<&Arc<Instance>> = open
                .iter()
                .copied()
                .filter(|i| !i.ejected_at(now))
                .collect();
            let pool = if in_service.is_empty() {
                open
            } else {
                in_service
            };
            pool.into_iter()
                .min_by_key(|i| (i.health().failures, i.in_flight()))
                .cloned()
        }
        1 => Some(Arc::clone(fresh[0])),
        n => {
            let a = rng.usize(..n);
            let b = (a + 1 + rng.usize(..n - 1)) % n;
            let (a, b) = (fresh[a], fresh[b]);
            Some(Arc::clone(if b.in_flight() < a.in_flight() {
                b
            } else {
                a
            }))
        }
    }
}

impl Elsewhere for Roster {
    fn has_other(&self, used: &[u64]) -> bool {
        let now = Instant::now();
        self.instances()
            .iter()
            .any(|i| !used.contains(&i.id) && !i.ejected_at(now))
    }
}

#[cfg(test)]
mod tests {
    use http::uri::Authority;

    use super::*;

    fn roster(n: u16, outliers: Outliers) -> Roster {
        let r = Roster::new(outliers);
        let addrs: Vec<_> = (0..n)
            .map(|i| Base::parse(&format!("http://10.0.0.{i}:80")).unwrap())
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
        assert!(a.ejected_at(Instant::now()));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!a.ejected_at(Instant::now()));
        // A success ends probation and the doubling.
        r.succeeded(a);
        assert!(!r.failed(a));
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
