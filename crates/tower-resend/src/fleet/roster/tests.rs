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

/// A call is a probe on its first attempt only: its retry, after an
/// attempt that failed (a probe refused, say), goes to an instance in
/// service, so that no call is refused by two instances set aside in a
/// row. (At 10 000 callers with a third of the fleet gone, calls made
/// probes on every attempt ended refused, some 30 a second, every second
/// the instances were gone.)
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_retry_is_not_made_a_probe() {
    let r = roster(3, Outliers::default().consecutive(1));
    let all = r.instances();
    let (a, b) = (Arc::clone(&all[0]), Arc::clone(&all[1]));
    assert!(r.failed(&a));
    tokio::time::advance(Duration::from_millis(500)).await;
    let mut rng = fastrand::Rng::with_seed(4);
    for _ in 0..200 {
        let sent = r.pick(&[b.id], &mut rng).unwrap();
        assert_ne!(sent.instance.id, a.id, "a retry probed");
    }
    // A first attempt takes the probe that is due.
    let probes = (0..200)
        .filter(|_| r.pick(&[], &mut rng).unwrap().instance.id == a.id)
        .count();
    assert_eq!(probes, 1);
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
    fn keep(&self, _: &[(u64, &Authority)]) {}

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

/// The roster of `n` instances under an adaptive limit, outliers off.
fn limited(n: usize) -> Roster {
    let r = roster_of(n, Outliers::default().off());
    r.set_limit(InstanceLimit::adaptive());
    r
}

/// Each instance of `r` sheds one of the attempts `held` (an overloaded
/// answer): its limit becomes half of what it had in flight.
fn shed_one_each(r: &Roster, held: &mut Vec<Sent>) {
    for i in r.instances().iter() {
        if let Some(at) = held.iter().position(|s| s.instance.id == i.id) {
            let sent = held.swap_remove(at);
            r.ended(&sent, Class::Overloaded, true, None);
        }
    }
}

/// No limit binds until an instance sheds; then an instance at its limit
/// is passed over, and when every one is, the pick is refused: at
/// capacity. An attempt that ends gives its place back.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn under_a_limit_an_instance_at_it_is_passed_over_and_a_full_fleet_refuses() {
    let r = limited(3);
    let mut rng = fastrand::Rng::with_seed(11);
    let mut held: Vec<Sent> = (0..30).map(|_| r.pick(&[], &mut rng).unwrap()).collect();
    let all = r.instances();
    assert!(all.iter().all(|i| i.limit().is_none()));
    let before: Vec<u32> = all.iter().map(|i| i.in_flight()).collect();
    shed_one_each(&r, &mut held);
    for (i, had) in all.iter().zip(&before) {
        assert_eq!(i.limit(), Some(had / 2), "{}", i.base.authority);
    }
    // Every instance has more in flight than its limit now.
    assert!(matches!(r.pick(&[], &mut rng), Err(Unpicked::AtCapacity)));
    assert!(!r.has_other(&[]), "no other instance can take an attempt");
    // The first instance's attempts end: it takes attempts up to its
    // limit, and nothing goes to the others.
    held.retain(|s| s.instance.id != all[0].id);
    let room = all[0].limit().unwrap();
    for _ in 0..room {
        let sent = r.pick(&[], &mut rng).unwrap();
        assert_eq!(sent.instance.id, all[0].id);
        held.push(sent);
    }
    assert!(matches!(r.pick(&[], &mut rng), Err(Unpicked::AtCapacity)));
    // A retry that has used the first instance is refused too: the
    // instances it could use are all at their limit.
    assert!(matches!(
        r.pick(&[all[0].id], &mut rng),
        Err(Unpicked::AtCapacity)
    ));
}

/// A fleet with no limit set, or one whose limit does not bind, takes
/// any number of attempts in flight.
#[test]
fn without_a_binding_limit_nothing_is_refused() {
    for r in [roster_of(3, Outliers::default()), limited(3)] {
        let mut rng = fastrand::Rng::with_seed(12);
        let held: Vec<Sent> = (0..10_000)
            .map(|_| r.pick(&[], &mut rng).unwrap())
            .collect();
        assert_eq!(held.len(), 10_000);
        assert!(r.instances().iter().all(|i| i.limit().is_none()));
    }
}

/// Over a large fleet the pick does not look the fleet over to refuse:
/// when its draws find only instances at their limit, the fleet is at
/// capacity; with half of it with room, a pick finds one.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_large_fleet_at_capacity_is_refused_by_its_draws() {
    let r = limited(200);
    let all = r.instances();
    let mut rng = fastrand::Rng::with_seed(13);
    // Each instance sheds its only attempt: a limit of one.
    let mut held = Vec::new();
    while held.len() < all.len() {
        let sent = r.pick(&[], &mut rng).unwrap();
        if sent.instance.in_flight() == 1 {
            held.push(sent);
        }
    }
    shed_one_each(&r, &mut held);
    assert!(all.iter().all(|i| i.limit() == Some(1)));
    // One attempt at each (the last few places are found past refusals:
    // with nearly the whole fleet full, most draws find only full ones).
    let mut held = Vec::new();
    let mut refused = 0;
    while held.len() < all.len() {
        match r.pick(&[], &mut rng) {
            Ok(sent) => held.push(sent),
            Err(Unpicked::AtCapacity) => refused += 1,
            Err(other) => panic!("{other:?}"),
        }
    }
    assert!(all.iter().all(|i| i.in_flight() == 1));
    assert!(refused > 0);
    for _ in 0..100 {
        assert!(matches!(r.pick(&[], &mut rng), Err(Unpicked::AtCapacity)));
    }
    // Half of them free again: every pick goes to one of those (and ends).
    held.retain(|s| s.instance.id % 2 == 0);
    for _ in 0..1000 {
        let sent = r.pick(&[], &mut rng).unwrap();
        assert_eq!(sent.instance.id % 2, 1);
    }
}

/// Under a total limit, the fleet's attempts in flight, wherever they
/// are, bind: answers of the fleet as a whole surely slower than its
/// fastest cut the total (to what it served, at most halved); beyond it a
/// pick is refused though every instance has room, and gives its places
/// back; an attempt that ends gives one back. An instance's overloaded
/// answer cuts nothing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_total_limit_refuses_past_it_though_instances_have_room() {
    let r = roster_of(3, Outliers::default().off());
    r.set_total(InstanceLimit::adaptive());
    let mut rng = fastrand::Rng::with_seed(14);
    let mut held: Vec<Sent> = (0..30).map(|_| r.pick(&[], &mut rng).unwrap()).collect();
    // Sheds say nothing to the total.
    for sent in held.drain(20..) {
        r.ended(&sent, Class::Overloaded, true, None);
    }
    assert_eq!(r.total_limit(), None);
    assert_eq!(r.total.in_flight(), 20);
    // A window of answers in 10 ms: the fleet's fastest.
    tokio::time::advance(Duration::from_millis(100)).await;
    let window: Vec<Sent> = (0..12).map(|_| r.pick(&[], &mut rng).unwrap()).collect();
    tokio::time::advance(Duration::from_millis(10)).await;
    for sent in window {
        r.ended(&sent, Class::Success, true, None);
    }
    assert_eq!(r.total_limit(), None);
    // Then a window of attempts that ran out of time after 500 ms: cut
    // to half of the most in flight (32).
    tokio::time::advance(Duration::from_millis(100)).await;
    let window: Vec<Sent> = (0..12).map(|_| r.pick(&[], &mut rng).unwrap()).collect();
    tokio::time::advance(Duration::from_millis(500)).await;
    for sent in window {
        r.ended(&sent, Class::Unknown, false, Some(TimedOut::Attempt));
    }
    assert_eq!(r.total_limit(), Some(16));
    // No instance has a limit of its own.
    assert!(r.instances().iter().all(|i| i.limit().is_none()));
    for _ in 0..10 {
        assert!(matches!(r.pick(&[], &mut rng), Err(Unpicked::AtCapacity)));
    }
    let at_instances: u32 = r.instances().iter().map(|i| i.in_flight()).sum();
    assert_eq!((r.total.in_flight(), at_instances), (20, 20));
    // Down to 15 in flight: one more is let in, and the next refused.
    held.truncate(15);
    held.push(r.pick(&[], &mut rng).unwrap());
    assert!(matches!(r.pick(&[], &mut rng), Err(Unpicked::AtCapacity)));
    held.clear();
    let at_instances: u32 = r.instances().iter().map(|i| i.in_flight()).sum();
    assert_eq!((r.total.in_flight(), at_instances), (0, 0));
}

/// The fleet fails as a whole when the instances in service fail as
/// much as an outlier would (half their recent attempts), as its outlier
/// detection lets every instance back; not with one instance of ten gone.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_fleet_fails_as_a_whole_when_its_instances_fail_as_an_outlier_would() {
    let r = roster(10, Outliers::default());
    let all = r.instances();
    for i in all.iter().cycle().take(90) {
        r.succeeded(i);
    }
    for _ in 0..10 {
        r.failed(&all[0]);
    }
    assert!(!r.failing(), "one instance of ten");
    for i in all.iter().cycle().take(80) {
        r.failed(i);
    }
    assert!(r.failing(), "every instance");
    // Off with the comparison of an outlier against the rest.
    let off = roster(10, Outliers::default().others_failing_below(1.0));
    for i in off.instances().iter().cycle().take(100) {
        off.failed(i);
    }
    assert!(!off.failing());
}

/// A refusal (a failure not sent) sets an instance aside at once, as
/// gRPC's subchannel fails on one failed connection; other failures count
/// to `consecutive`. Off, or with `not_sent_at_once(false)`, it counts as
/// one of them.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_sets_an_instance_aside_at_once() {
    let r = roster(3, Outliers::default());
    let all = r.instances();
    assert!(!r.failed(&all[0]), "one failure of five");
    assert!(r.refused(&all[1]), "one refusal");
    let one_of_five = roster(3, Outliers::default().not_sent_at_once(false));
    assert!(!one_of_five.refused(&one_of_five.instances()[0]));
    let off = roster(3, Outliers::default().off());
    for _ in 0..10 {
        assert!(!off.refused(&off.instances()[0]));
    }
}

/// The fleet's probes are at most a share of its attempts (5 %), at least
/// one every `probe_every` over its two-second window: with 25 of 60
/// instances aside, all due, not 25 probes at once but what the share
/// allows; the window past, more.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn probes_are_a_share_of_the_fleets_attempts() {
    let r = roster(60, Outliers::default());
    let all = r.instances();
    for i in all[25..].iter().cycle().take(100) {
        r.succeeded(i);
    }
    for i in &all[..25] {
        assert!(r.refused(i));
    }
    let aside: Vec<u64> = all[..25].iter().map(|i| i.id).collect();
    let mut rng = fastrand::Rng::with_seed(6);
    let probes = |r: &Roster, rng: &mut fastrand::Rng| {
        (0..2000)
            .filter(|_| aside.contains(&r.pick(&[], rng).unwrap().instance.id))
            .count()
    };
    tokio::time::advance(Duration::from_millis(500)).await;
    // 125 attempts in the window: 6.25 probes by the share, 4 by the floor.
    assert_eq!(probes(&r, &mut rng), 7);
    assert_eq!(probes(&r, &mut rng), 0, "the share is spent");
    // Two seconds on, the window holds no attempts: the floor's 4.
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(probes(&r, &mut rng), 4);
}
