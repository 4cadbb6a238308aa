//! Upstreams are fleets: three loopback instances of one upstream, one of
//! them bad. Retries and hedged copies go to another instance than the
//! ones the call used, the bad one is set aside, and its 503s hold back
//! no call.
#![allow(clippy::print_stderr)]

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;
// What a fleet makes of its bases: a path kept, what it cannot honour
// refused at build, every instance named when all of them fail.
#[path = "fleet/bases.rs"]
mod bases;
// A limit on the attempts in flight at each instance: one that slows gets
// one, a fleet at capacity refuses at once, no overload refuses nothing.
#[path = "fleet/limit.rs"]
mod limit;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::classify::Class;
use tower_resend::fleet::{FleetLayer, Outliers};
use tower_resend::retry::{Attempts, RetryBudget};
use tower_resend::IdempotencyKey;
use tower_resend_testkit::{Reply, Script, TestServer};

async fn server(script: Script) -> TestServer {
    TestServer::start(script)
        .await
        .expect("start the test server")
}

fn base(s: &TestServer) -> String {
    format!("http://{}", s.addr())
}

/// Three instances: A follows `a`, B and C answer `others`.
async fn three(a: Script, others: Reply) -> [TestServer; 3] {
    [
        server(a).await,
        server(Script::new().otherwise(others.clone())).await,
        server(Script::new().otherwise(others)).await,
    ]
}

/// The fleet of `servers`, setting instances aside by `outliers`.
fn fleet_of(servers: &[TestServer], outliers: Outliers) -> FleetLayer {
    FleetLayer::fixed(servers.iter().map(base))
        .unwrap()
        .outliers(outliers)
}

/// Arrivals at `s` that were the call's second attempt (or copy).
fn second_attempts(s: &TestServer) -> usize {
    s.arrivals()
        .iter()
        .filter(|a| {
            a.headers
                .get("resend-previous-attempts")
                .is_some_and(|v| v == "1")
        })
        .count()
}

/// `calls` calls of `method`, 20 at a time, through `stack`; their sorted
/// latencies (every call must succeed).
async fn run<S, RB>(stack: S, method: Method, calls: usize) -> Vec<Duration>
where
    S: tower::Service<Request<Full<Bytes>>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Error: std::fmt::Debug + Send,
    S::Future: Send,
    RB: Send + 'static,
{
    let request = move |n: usize| {
        let mut req = Request::builder()
            .method(method.clone())
            .uri(format!("http://inventory/items/{n}"))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        if req.method() == Method::POST {
            req.extensions_mut()
                .insert(IdempotencyKey::new(format!("order-{n}")).unwrap());
        }
        req
    };
    let ok =
        |n: usize, resp: &http::Response<RB>| assert_eq!(resp.status(), StatusCode::OK, "call {n}");
    common::in_parallel(stack, calls, request, ok)
        .await
        .into_iter()
        .map(|(took, ())| took)
        .collect()
}

fn p99(sorted: &[Duration]) -> Duration {
    sorted[(sorted.len() - 1) * 99 / 100]
}

/// The fleet of three, A answering 503 to everything and B and C 200,
/// and the stack over it. Its retry budget allows half the calls a retry:
/// with ejection off, a third of the calls meet A, more than the default
/// budget's fifth, and the budget's pacing is not what these tests are
/// about (ejection, on by default, is what keeps a bad instance's share of
/// retries small; see `tests/retry.rs` for the budget).
async fn one_bad(
    outliers: Outliers,
) -> (
    [TestServer; 3],
    tower_resend::stack::Stack<
        tower_resend::connect::HyperClient,
        tower_resend::classify::HttpClassifier,
        tower_resend::breaker::NoBreaker,
        FleetLayer,
    >,
) {
    let servers = three(Script::new().otherwise(Reply::status(503)), Reply::ok()).await;
    let fleet = fleet_of(&servers, outliers);
    let [a, b, c] = servers;
    let budget = RetryBudget::new(0.5, 1.0, Duration::from_secs(10)).expect("a budget");
    let stack = tower_resend::stack()
        .name("inventory")
        .budget(budget)
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    ([a, b, c], stack)
}

/// A answers 503 to everything, B and C 200, and A is never set aside:
/// every call succeeds, no second attempt goes back to A, B and C share
/// the second attempts (none starved), and no call waits out A's
/// overload floor.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_bad_instance_no_call_goes_back_to_it_and_none_is_starved() {
    let ([a, b, c], stack) = one_bad(Outliers::default().off()).await;
    for method in [Method::GET, Method::POST] {
        let latencies = run(stack.clone(), method.clone(), 1000).await;
        // A third of the calls retry, paced by the retry budget; none waits
        // out A's overload floor (a second at least).
        let p99 = p99(&latencies);
        assert!(p99 < Duration::from_millis(500), "{method}: p99 {p99:?}");
    }
    let (second_b, second_c) = (second_attempts(&b), second_attempts(&c));
    let summary = format!(
        "arrivals A {}, B {}, C {}; second attempts A {}, B {second_b}, C {second_c}",
        a.arrival_count(),
        b.arrival_count(),
        c.arrival_count(),
        second_attempts(&a)
    );
    eprintln!("{summary}");
    assert_eq!(second_attempts(&a), 0, "{summary}");
    // Each attempt's record names the instance that answered it.
    let a_addr = a.addr().to_string();
    for n in 0..30 {
        let req = Request::get(format!("http://inventory/{n}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = stack.clone().oneshot(req).await.unwrap();
        let history = resp.extensions().get::<Attempts>().unwrap();
        let servers: Vec<String> = history
            .iter()
            .map(|at| at.server().expect("named").to_string())
            .collect();
        assert_ne!(servers.last(), Some(&a_addr), "{history}");
        if servers.len() == 2 {
            assert_eq!(servers[0], a_addr, "{history}");
            assert!(history.to_string().contains(&format!("from {a_addr}")));
        }
    }
    let seconds = second_b + second_c;
    assert!(seconds >= 300, "{summary}");
    for share in [second_b, second_c] {
        assert!(
            share * 100 >= seconds * 40 && share * 100 <= seconds * 60,
            "{summary}"
        );
    }
}

/// The same with outlier detection on (its defaults): A is set aside
/// after its first failures in a row, and sees under 5 % of all attempts.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_bad_instance_is_set_aside() {
    let ([a, b, c], stack) = one_bad(Outliers::default()).await;
    for method in [Method::GET, Method::POST] {
        let latencies = run(stack.clone(), method.clone(), 1000).await;
        let p99 = p99(&latencies);
        assert!(p99 < Duration::from_millis(100), "{method}: p99 {p99:?}");
    }
    let (at_a, at_b, at_c) = (a.arrival_count(), b.arrival_count(), c.arrival_count());
    let summary = format!("arrivals A {at_a}, B {at_b}, C {at_c}");
    eprintln!("{summary}");
    assert_eq!(second_attempts(&a), 0, "{summary}");
    assert!(at_a * 100 < (at_a + at_b + at_c) * 5, "{summary}");
}

/// Every instance answers 503: calls still try every instance (no "no
/// healthy instance" error), and no more than the share of the fleet is
/// set aside at once (here one of three).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn when_every_instance_is_bad_calls_still_try() {
    let servers = [
        server(Script::new().otherwise(Reply::status(503))).await,
        server(Script::new().otherwise(Reply::status(503))).await,
        server(Script::new().otherwise(Reply::status(503))).await,
    ];
    let fleet = FleetLayer::fixed(servers.iter().map(base)).unwrap();
    // (No retry budget: every call makes its three attempts.)
    let stack = tower_resend::stack()
        .no_budget()
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    for n in 0..20 {
        let req = Request::get(format!("http://upstream/{n}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        // The last answer, a 503 after every attempt, not a refusal to try.
        let resp = stack.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        let attempts = resp.extensions().get::<Attempts>().unwrap();
        assert_eq!(attempts.len(), 3, "{attempts}");
    }
    let arrivals: Vec<usize> = servers.iter().map(TestServer::arrival_count).collect();
    // Two of three always in service: at least two instances kept getting
    // attempts.
    assert!(
        arrivals.iter().filter(|&&n| n >= 10).count() >= 2,
        "{arrivals:?}"
    );
}

/// A hedged copy goes to another instance than the first copy: A stalls
/// a second on every call, B and C answer at once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hedged_copy_goes_to_another_instance() {
    let servers = three(
        Script::new().otherwise(Reply::ok().delay(Duration::from_secs(1))),
        Reply::ok(),
    )
    .await;
    let fleet = fleet_of(&servers, Outliers::default());
    let [a, _b, _c] = servers;
    let stack = tower_resend::stack()
        .hedge(Duration::from_millis(10))
        .hedge_share(1.0)
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let latencies = run(stack, Method::GET, 300).await;
    assert!(
        p99(&latencies) < Duration::from_millis(50),
        "p99 {:?}",
        p99(&latencies)
    );
    // A's calls were hedged elsewhere: no copy after the first reached A.
    assert_eq!(second_attempts(&a), 0);
}

/// GETs, `calls` of them, 10 at a time: how many attempts each took.
async fn gets<S, RB>(stack: &S, calls: usize) -> Vec<u32>
where
    S: tower::Service<Request<Full<Bytes>>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Error: std::fmt::Debug + Send,
    S::Future: Send,
    RB: http_body::Body + Send + 'static,
    RB::Data: Send,
    RB::Error: std::fmt::Debug,
{
    let mut set = JoinSet::new();
    for t in 0..10 {
        let stack = stack.clone();
        set.spawn(async move {
            let mut out = Vec::new();
            for n in (t..calls).step_by(10) {
                let req = Request::get(format!("http://upstream/{n}"))
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                let resp = stack.clone().oneshot(req).await;
                let resp = resp.unwrap_or_else(|e| panic!("call {n}: {e:?}"));
                assert_eq!(resp.status(), StatusCode::OK, "call {n}");
                let made = resp.extensions().get::<Attempts>().map_or(0, Attempts::len);
                let body = http_body_util::BodyExt::collect(resp.into_body()).await;
                let body = body
                    .unwrap_or_else(|e| panic!("call {n}: {e:?}"))
                    .to_bytes();
                assert_eq!(&body[..], b"whole body", "call {n}");
                out.push(made);
            }
            out
        });
    }
    let mut made = Vec::new();
    while let Some(done) = set.join_next().await {
        made.extend(done.expect("the task"));
    }
    made
}

fn whole() -> Reply {
    Reply::ok().body("whole body")
}

/// A accepts connections and never answers: with a 100 ms attempt timeout
/// every call succeeds within one extra attempt; once A's timeouts reach
/// the threshold no call goes to A for its pause, and A, answering again,
/// is back in use after it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_black_hole_is_set_aside_and_let_back() {
    let answering = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let now = std::sync::Arc::clone(&answering);
    let a = server(Script::from_fn(move |_| {
        if now.load(std::sync::atomic::Ordering::SeqCst) {
            whole()
        } else {
            Reply::never()
        }
    }))
    .await;
    let b = server(Script::new().otherwise(whole())).await;
    let c = server(Script::new().otherwise(whole())).await;
    let pause = Duration::from_secs(10);
    let fleet = FleetLayer::fixed([base(&a), base(&b), base(&c)])
        .unwrap()
        .outliers(Outliers::default().consecutive(3).pause(pause, 4 * pause));
    let stack = tower_resend::stack()
        .attempt_timeout(Duration::from_millis(100))
        .total(Duration::from_secs(2))
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));

    let made = gets(&stack, 200).await;
    assert!(made.iter().all(|&n| n <= 2), "{made:?}");
    let set_aside_at = a.arrival_count();
    assert!(set_aside_at >= 3, "A was tried: {set_aside_at}");
    let start = Instant::now();
    let made = gets(&stack, 200).await;
    assert!(start.elapsed() < pause);
    assert!(made.iter().all(|&n| n == 1), "{made:?}");
    assert_eq!(
        a.arrival_count(),
        set_aside_at,
        "nothing sent to A in its pause"
    );

    answering.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(pause).await;
    gets(&stack, 200).await;
    assert!(
        a.arrival_count() > set_aside_at + 20,
        "A is back: {}",
        a.arrival_count()
    );
}

/// A sends a 200 head and resets the connection mid-body: a GET that got
/// it fails over to another instance and gets the whole body.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_reset_after_the_head_fails_over() {
    let servers = three(
        Script::new().otherwise(Reply::ok().reset_mid_stream("whole")),
        whole(),
    )
    .await;
    let fleet = fleet_of(&servers, Outliers::default().off());
    let [a, _b, _c] = servers;
    let stack = tower_resend::stack()
        .no_budget()
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let made = gets(&stack, 100).await;
    assert!(a.arrival_count() > 10, "A was tried: {}", a.arrival_count());
    assert_eq!(made.iter().filter(|&&n| n == 2).count(), a.arrival_count());
}

/// An instance killed halfway: 100 callers for 2 s over three instances,
/// one dropped at 1 s. No call fails; a call whose attempt found the
/// killed instance refusing connections went on to another at once (no
/// wait, and, as the decision table's row test shows, no retry token).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_killed_instance_costs_no_call() {
    let servers = three(Script::new().otherwise(whole()), whole()).await;
    let fleet = fleet_of(&servers, Outliers::default());
    let [a, _b, _c] = servers;
    let stack = tower_resend::stack()
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let start = Instant::now();
    let mut set = JoinSet::new();
    for t in 0..100 {
        let stack = stack.clone();
        set.spawn(async move {
            let (mut calls, mut refused) = (0, 0);
            while start.elapsed() < Duration::from_secs(2) {
                let req = Request::get(format!("http://upstream/{t}"))
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                let resp = stack.clone().oneshot(req).await;
                let resp = resp.unwrap_or_else(|e| panic!("caller {t}: {e:?}"));
                assert_eq!(resp.status(), StatusCode::OK);
                let history = resp.extensions().get::<Attempts>().unwrap();
                let mut it = history.iter();
                if it.next().is_some_and(|a| a.class() == Class::NotSent) {
                    // Refused: the next attempt went at once, elsewhere.
                    assert_eq!(it.next().map(|a| a.waited()), Some(Duration::ZERO));
                    refused += 1;
                }
                calls += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (calls, refused)
        });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let served_by_a = a.arrival_count();
    drop(a);
    let (mut calls, mut refused) = (0, 0);
    while let Some(done) = set.join_next().await {
        let (c, r) = done.expect("no call failed");
        calls += c;
        refused += r;
    }
    eprintln!("{calls} calls, {refused} refused by the killed instance first");
    assert!(served_by_a > 0);
    assert!(calls > 100 * 50, "{calls} calls");
}

/// A fleet from a resolver: spread over the addresses it answers, and an
/// address gone from its answer unused after the next refresh.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_resolved_fleet_follows_its_answers() {
    let a = server(Script::new().otherwise(whole())).await;
    let b = server(Script::new().otherwise(whole())).await;
    let answer = std::sync::Arc::new(std::sync::Mutex::new(vec![a.addr(), b.addr()]));
    let resolver = std::sync::Arc::clone(&answer);
    let every = Duration::from_secs(5);
    let fleet = FleetLayer::resolved(
        http::uri::Scheme::HTTP,
        move || {
            let addrs = resolver.lock().unwrap().clone();
            async move { Ok(addrs) }
        },
        every,
    )
    .await
    .unwrap();
    let stack = tower_resend::stack()
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    gets(&stack, 200).await;
    let (at_a, at_b) = (a.arrival_count(), b.arrival_count());
    assert!(at_a >= 60 && at_b >= 60, "spread: A {at_a}, B {at_b}");

    *answer.lock().unwrap() = vec![b.addr()];
    tokio::time::sleep(every + Duration::from_millis(1)).await;
    gets(&stack, 200).await;
    assert_eq!(
        a.arrival_count(),
        at_a,
        "A, gone from the answer, is unused"
    );
    assert_eq!(b.arrival_count(), at_b + 200);
}

/// `FleetLayer::dns` resolves a real name (`localhost`) before the first
/// call, and a name that resolves to nothing is an error, not an empty
/// fleet.
#[tokio::test(flavor = "current_thread")]
async fn dns_resolves_before_the_first_call() {
    let every = Duration::from_secs(60);
    let fleet = FleetLayer::dns(http::uri::Scheme::HTTP, "localhost", 8080, every)
        .await
        .unwrap();
    let svc = tower::Layer::layer(
        &fleet,
        tower::service_fn(|_: Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(()))
        }),
    );
    assert!(!svc.addresses().is_empty());
    assert!(svc.addresses().iter().all(|a| a.port_u16() == Some(8080)));
    let none = FleetLayer::dns(http::uri::Scheme::HTTP, "no-such-host.invalid", 80, every).await;
    assert!(none.is_err());
}

/// The stack's circuit breaker over a fleet works per instance: A answers
/// 503 to everything, and with outlier detection off its own circuit
/// opens, so calls stop going there, while B and C keep answering and the
/// upstream as a whole is never refused. With every instance failing,
/// every circuit opens and calls fail at once, not sent.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_circuit_breaker_works_per_instance() {
    use tower_resend::breaker::CircuitBreakerLayer;

    let breaker = || {
        CircuitBreakerLayer::new()
            .min_throughput(10)
            .break_duration(Duration::from_secs(30))
    };
    let servers = three(Script::new().otherwise(Reply::status(503)), whole()).await;
    let fleet = fleet_of(&servers, Outliers::default().off());
    let [a, b, c] = servers;
    let stack = tower_resend::stack()
        .no_budget()
        .circuit_breaker_with(breaker())
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let made = gets(&stack, 300).await;
    assert!(made.iter().all(|&n| n <= 2), "{made:?}");
    let at_a = a.arrival_count();
    // A's circuit opened after its first failures; the others carry on.
    assert!((1..=30).contains(&at_a), "A: {at_a}");
    assert!(b.arrival_count() + c.arrival_count() >= 300);

    // Every instance failing: each opens its own circuit, then calls are
    // refused at once.
    let servers = [
        server(Script::new().otherwise(Reply::status(503))).await,
        server(Script::new().otherwise(Reply::status(503))).await,
        server(Script::new().otherwise(Reply::status(503))).await,
    ];
    let fleet = fleet_of(&servers, Outliers::default().off());
    let stack = tower_resend::stack()
        .no_budget()
        .circuit_breaker_with(breaker())
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let mut refused = 0;
    for n in 0..60 {
        let req = Request::get(format!("http://upstream/{n}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        if let Err(e) = stack.clone().oneshot(req).await {
            assert_eq!(e.kind(), tower_resend::ErrorKind::CircuitOpen, "{e}");
            assert!(e.is_not_sent());
            refused += 1;
        }
    }
    let sent: usize = servers.iter().map(TestServer::arrival_count).sum();
    assert!(refused >= 40, "refused {refused}, sent {sent}");
    assert!(sent <= 3 * 12, "sent {sent}");
}
