//! A limit on the attempts in flight at each instance
//! (`FleetLayer::limit`), on loopback: an instance whose answers slow down
//! gets a limit while the others do not; when every instance is at its
//! limit a call fails at once, not sent, with its advice; and with no
//! overload no limit binds and no call is refused. The same of a total
//! limit (`FleetLayer::limit_total`) where they share a case.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::classify::Class;
use tower_resend::fleet::{FleetLayer, InstanceLimit, Outliers};
use tower_resend::retry::Attempts;
use tower_resend::{ErrorKind, RetryAdvice};
use tower_resend_testkit::{Reply, Script, TestServer};

use super::{base, server};

const MS: Duration = Duration::from_millis(1);

fn request(method: Method, n: usize) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(format!("http://inventory/items/{n}"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// The fleet of `servers` under an adaptive limit, outliers as given.
fn limited(servers: &[&TestServer], outliers: Outliers) -> FleetLayer {
    FleetLayer::fixed(servers.iter().map(|s| base(s)))
        .unwrap()
        .outliers(outliers)
        .limit(InstanceLimit::adaptive())
}

/// The stack over `fleet`, no retry budget (every call may make its
/// attempts).
fn stack_over(
    fleet: &FleetLayer,
) -> tower_resend::stack::Stack<
    tower_resend::connect::HyperClient,
    tower_resend::classify::HttpClassifier,
    tower_resend::breaker::NoBreaker,
    FleetLayer,
> {
    tower_resend::stack()
        .name("inventory")
        .no_budget()
        .seed(7)
        .fleet(fleet.clone())
        .service(tower_resend::hyper_client(Duration::from_secs(1)))
}

/// What `callers` callers, each calling GET after GET until `until`, got:
/// calls answered 200 in one attempt, and calls refused at capacity (any
/// other end fails the test).
async fn load<S, RB>(stack: S, callers: usize, until: Instant) -> (usize, usize)
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = http::Response<RB>,
            Error = tower_resend::Error,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    RB: Send + 'static,
{
    let mut set = JoinSet::new();
    for t in 0..callers {
        let stack = stack.clone();
        set.spawn(async move {
            let (mut ok, mut refused) = (0, 0);
            let mut n = t;
            while Instant::now() < until {
                match stack.clone().oneshot(request(Method::GET, n)).await {
                    Ok(resp) => {
                        assert_eq!(resp.status(), StatusCode::OK, "call {n}");
                        let made = resp.extensions().get::<Attempts>().map(Attempts::len);
                        assert_eq!(made, Some(1), "call {n}");
                        ok += 1;
                    }
                    // Refused: back when its advice says (a caller that
                    // came back at once would spin on the paused clock).
                    Err(e) if e.kind() == ErrorKind::AtCapacity => {
                        refused += 1;
                        if let RetryAdvice::After(wait) = e.retry_advice() {
                            tokio::time::sleep(wait).await;
                        }
                    }
                    Err(e) => panic!("call {n}: {e}"),
                }
                n += callers;
            }
            (ok, refused)
        });
    }
    let (mut ok, mut refused) = (0, 0);
    while let Some(done) = set.join_next().await {
        let (o, r) = done.expect("the caller");
        ok += o;
        refused += r;
    }
    (ok, refused)
}

/// Every `every`, until `until`, each instance's limit, then the fleet's
/// total limit: the lowest each had (`None`: none ever bound).
async fn watch(fleet: FleetLayer, every: Duration, until: Instant) -> Vec<Option<u32>> {
    let mut lowest = vec![None::<u32>; fleet.limits().len() + 1];
    while Instant::now() < until {
        let limits = fleet.limits().into_iter().map(|(_, l)| l);
        for (low, limit) in lowest.iter_mut().zip(limits.chain([fleet.total_limit()])) {
            if let Some(l) = limit {
                *low = Some(low.map_or(l, |low| low.min(l)));
            }
        }
        tokio::time::sleep(every).await;
    }
    lowest
}

/// Three instances answering in 10 ms, 30 callers; after two seconds A
/// answers in 80 ms. No limit binds before; then A's comes down (the
/// limit cut to what it served), while B's and C's never bind, nor the
/// fleet's total, and no call is refused: the others take what A no
/// longer can.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_instance_that_slows_gets_a_limit_and_the_others_do_not() {
    let slow = Arc::new(AtomicBool::new(false));
    let now_slow = Arc::clone(&slow);
    let a = server(Script::from_fn(move |_| {
        let ms = if now_slow.load(SeqCst) { 80 } else { 10 };
        Reply::ok().delay(ms * MS)
    }))
    .await;
    let b = server(Script::new().otherwise(Reply::ok().delay(10 * MS))).await;
    let c = server(Script::new().otherwise(Reply::ok().delay(10 * MS))).await;
    let fleet = limited(&[&a, &b, &c], Outliers::default()).limit_total(InstanceLimit::adaptive());
    let stack = stack_over(&fleet);
    let start = Instant::now();
    let end = start + Duration::from_secs(4);
    let calls = tokio::spawn(load(stack, 30, end));

    let before = watch(fleet.clone(), 20 * MS, start + Duration::from_secs(2)).await;
    assert_eq!(before, [None, None, None, None], "no limit binds at 10 ms");
    let (at_a, at_b) = (a.arrival_count(), b.arrival_count());
    slow.store(true, SeqCst);
    let after = watch(fleet.clone(), 20 * MS, end).await;
    let (ok, refused) = calls.await.unwrap();
    let summary = format!(
        "lowest limits after A slowed {after:?}; {ok} calls, {refused} refused; \
         arrivals after A slowed: A {}, B {}",
        a.arrival_count() - at_a,
        b.arrival_count() - at_b
    );
    eprintln!("{summary}");
    let Some(limit_a) = after[0] else {
        panic!("A's limit came down: {summary}");
    };
    assert!(limit_a <= 10, "{summary}");
    assert_eq!(after[1..], [None, None, None], "{summary}");
    assert_eq!(refused, 0, "{summary}");
    assert!(
        (a.arrival_count() - at_a) * 4 < b.arrival_count() - at_b,
        "A, slow and limited, takes a small share: {summary}"
    );
}

/// Every instance sheds a first call (503): each limit comes down to one.
/// Three slow calls then fill the fleet, one at each instance, and the
/// next call, a GET or a POST, fails at once: at capacity, not sent,
/// nothing processed, advised to come back after a second, nothing
/// reaching any instance. Once the slow calls end, calls go through
/// again.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_instance_at_its_limit_a_call_fails_at_once_not_sent() {
    let shed = Arc::new(AtomicBool::new(true));
    let script = || {
        let shed = Arc::clone(&shed);
        Script::from_fn(move |_| {
            if shed.load(SeqCst) {
                Reply::status(503)
            } else {
                Reply::ok().delay(Duration::from_secs(2))
            }
        })
    };
    let servers = [
        server(script()).await,
        server(script()).await,
        server(script()).await,
    ];
    let [a, b, c] = &servers;
    let fleet = limited(&[a, b, c], Outliers::default().off());
    let stack = stack_over(&fleet);
    let arrivals = || servers.iter().map(TestServer::arrival_count).sum::<usize>();

    // One call, three attempts, each at another instance, each shed.
    let resp = stack
        .clone()
        .oneshot(request(Method::GET, 0))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(arrivals(), 3);
    let limits: Vec<Option<u32>> = fleet.limits().into_iter().map(|(_, l)| l).collect();
    assert_eq!(limits, [Some(1), Some(1), Some(1)]);

    // Three slow calls, one at each instance.
    shed.store(false, SeqCst);
    let mut slow = JoinSet::new();
    for n in 1..=3 {
        slow.spawn(stack.clone().oneshot(request(Method::GET, n)));
    }
    while arrivals() < 6 {
        tokio::time::sleep(MS).await;
    }
    assert!(servers.iter().all(|s| s.arrival_count() == 2));

    for method in [Method::GET, Method::POST] {
        let start = Instant::now();
        let e = stack
            .clone()
            .oneshot(request(method.clone(), 4))
            .await
            .unwrap_err();
        assert_eq!(start.elapsed(), Duration::ZERO, "{method}: at once");
        assert_eq!(e.kind(), ErrorKind::AtCapacity, "{method}: {e}");
        assert!(e.is_not_sent(), "{method}");
        assert!(e.nothing_processed(), "{method}");
        assert_eq!(e.retry_advice(), RetryAdvice::After(Duration::from_secs(1)));
        assert_eq!(e.attempts(), 1, "{method}: not retried");
        let history = e.history().expect("the call's history");
        assert_eq!(
            history.iter().map(|a| a.class()).collect::<Vec<_>>(),
            [Class::NotSent]
        );
        assert_eq!(
            e.to_string(),
            "inventory: at capacity: the fleet has as many attempts in flight as its \
             limits allow (at every instance the call could use, or in all), this one was \
             not sent"
        );
        assert_eq!(arrivals(), 6, "{method}: nothing reached an instance");
    }

    while let Some(done) = slow.join_next().await {
        assert_eq!(done.unwrap().unwrap().status(), StatusCode::OK);
    }
    let resp = stack.oneshot(request(Method::GET, 5)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

/// A hedged call over a fleet at capacity: its backup, refused at once,
/// calls for no other (a backup now would be refused too), and the first
/// copy's answer ends the call.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backup_refused_at_capacity_calls_for_no_other() {
    let a = server(
        Script::new()
            .then(Reply::status(503))
            .otherwise(Reply::ok().delay(Duration::from_secs(1))),
    )
    .await;
    let fleet = limited(&[&a], Outliers::default().off());
    let stack = tower_resend::stack()
        .max_attempts(1)
        .hedge(10 * MS)
        .hedge_copies(4)
        .hedge_share(1.0)
        .fleet(fleet.clone())
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    // (Shed through a stack of one attempt, no hedge, over the same fleet.)
    let once = tower_resend::stack()
        .max_attempts(1)
        .fleet(fleet.clone())
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let shed = once.oneshot(request(Method::GET, 0)).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(fleet.limits()[0].1, Some(1));
    let start = Instant::now();
    let resp = stack.oneshot(request(Method::GET, 1)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    let attempts = resp.extensions().get::<Attempts>().unwrap();
    // Two copies: the first, and one backup refused at capacity; not four.
    assert_eq!(attempts.hedges(), 1, "{attempts}");
    assert_eq!(a.arrival_count(), 2);
}

/// No overload: three instances whose answers take 1 to 61 ms whatever
/// their load, with a long tail (a mean of 21 ms, a deviation of 18), under
/// 3, 30 and 100 callers. No limit ever binds, per instance or total, and
/// no call is refused: the success path is as it was. (A window's few
/// answers that happen to be slow are noise, not a queue: it is judged by
/// what they surely show.)
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn under_no_overload_the_limit_never_refuses() {
    let script = |seed: u64| {
        let n = Arc::new(AtomicU64::new(seed));
        Script::from_fn(move |_| {
            // u in [0, 1), spread by a counter (the same every run);
            // 1 ms + u² · 60 ms.
            let k = n.fetch_add(1, SeqCst).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            let u = k as f64 / (1u64 << 24) as f64;
            Reply::ok().delay(MS + MS.mul_f64(60.0 * u * u))
        })
    };
    for (callers, secs) in [(3, 20), (30, 10), (100, 5)] {
        let a = server(script(1)).await;
        let b = server(script(2)).await;
        let c = server(script(3)).await;
        let fleet =
            limited(&[&a, &b, &c], Outliers::default()).limit_total(InstanceLimit::adaptive());
        let stack = stack_over(&fleet);
        let end = Instant::now() + Duration::from_secs(secs);
        let calls = tokio::spawn(load(stack, callers, end));
        let lowest = watch(fleet.clone(), 10 * MS, end).await;
        let (ok, refused) = calls.await.unwrap();
        eprintln!("{callers} callers: {ok} calls, {refused} refused, lowest limits {lowest:?}");
        assert_eq!(refused, 0, "{callers} callers");
        assert_eq!(lowest, [None, None, None, None], "{callers} callers");
        let least = callers * secs as usize * 1000 / 61;
        assert!(ok > least, "{callers} callers: {ok} calls");
    }
}

/// An instance as a queue: one worker, `work` a request, first come first
/// served, and the work goes on for a caller that has gone (what turns an
/// overload into a metastable failure).
fn queue(work: Duration) -> Script {
    let free = Arc::new(std::sync::Mutex::new(None::<Instant>));
    Script::from_fn(move |arrival| {
        let mut free = free.lock().unwrap();
        let start = free.map_or(arrival.at, |f| f.max(arrival.at));
        *free = Some(start + work);
        Reply::ok().delay(start + work - arrival.at)
    })
}

/// What calls arriving at `per_second` for `secs` through `stack` got:
/// answered 200, refused at capacity, failed otherwise (timed out).
async fn arrivals<S, RB>(stack: S, per_second: u32, secs: u64) -> (usize, usize, usize)
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = http::Response<RB>,
            Error = tower_resend::Error,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    RB: Send + 'static,
{
    let mut calls = JoinSet::new();
    let mut every = tokio::time::interval(Duration::from_secs(1) / per_second);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for n in 0..(u64::from(per_second) * secs) as usize {
        every.tick().await;
        calls.spawn(stack.clone().oneshot(request(Method::GET, n)));
    }
    let (mut ok, mut refused, mut failed) = (0, 0, 0);
    while let Some(done) = calls.join_next().await {
        match done.expect("the call") {
            Ok(resp) if resp.status() == StatusCode::OK => ok += 1,
            Err(e) if e.kind() == ErrorKind::AtCapacity => refused += 1,
            _ => failed += 1,
        }
    }
    (ok, refused, failed)
}

/// Three instances that each serve one request at a time in 10 ms (300 a
/// second in all), 400 calls a second arriving for 5 s, each attempt given
/// 200 ms. Without a limit the queues grow past the callers' patience and
/// the instances work for callers that have gone: few calls get their
/// answer. With a limit per instance, or a total one, the calls the fleet
/// cannot serve fail at once, not sent, and the instances serve the
/// others in time.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_fleet_over_its_capacity_serves_its_callers_in_time() {
    let mut got = Vec::new();
    for limit in ["none", "per instance", "total"] {
        let servers = [
            server(queue(10 * MS)).await,
            server(queue(10 * MS)).await,
            server(queue(10 * MS)).await,
        ];
        let mut fleet = FleetLayer::fixed(servers.iter().map(base)).unwrap();
        match limit {
            "per instance" => fleet = fleet.limit(InstanceLimit::adaptive()),
            "total" => fleet = fleet.limit_total(InstanceLimit::adaptive()),
            _ => {}
        }
        let stack = tower_resend::stack()
            .name("inventory")
            .attempt_timeout(200 * MS)
            .total(Duration::from_millis(600))
            .seed(7)
            .fleet(fleet)
            .service(tower_resend::hyper_client(Duration::from_secs(1)));
        let (ok, refused, failed) = arrivals(stack, 400, 5).await;
        let served: usize = servers.iter().map(TestServer::arrival_count).sum();
        eprintln!(
            "limit {limit}: {ok} answered, {refused} refused at capacity, {failed} failed; \
             {served} attempts reached an instance, {} for callers that had gone",
            served - ok
        );
        got.push((ok, refused, failed, served));
    }
    let without = got[0];
    for with in &got[1..] {
        // With a limit: near the fleet's capacity answered (1 500 in 5 s),
        // little work for callers that had gone.
        assert!(with.0 >= 1_300, "{with:?}");
        assert!(with.3 - with.0 <= 150, "{with:?}");
        // Without it: fewer than half of that.
        assert!(without.0 * 2 < with.0, "{without:?} against {with:?}");
    }
}
