//! Upstreams are fleets: three loopback instances of one upstream, one of
//! them bad. Retries and hedged copies go to another instance than the
//! ones the call used, the bad one is set aside, and its 503s hold back
//! no call.
#![allow(clippy::print_stderr)]

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::fleet::{FleetLayer, Outliers};
use tower_resend::retry::Attempts;
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
    const TASKS: usize = 20;
    let mut set = JoinSet::new();
    for t in 0..TASKS {
        let (stack, method) = (stack.clone(), method.clone());
        set.spawn(async move {
            let mut out = Vec::new();
            for n in (t..calls).step_by(TASKS) {
                let mut req = Request::builder()
                    .method(method.clone())
                    .uri(format!("http://inventory/items/{n}"))
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .unwrap();
                if method == Method::POST {
                    req.extensions_mut()
                        .insert(IdempotencyKey::new(format!("order-{n}")).unwrap());
                }
                let start = Instant::now();
                let resp = stack.clone().oneshot(req).await;
                let resp = resp.unwrap_or_else(|e| panic!("call {n}: {e:?}"));
                assert_eq!(resp.status(), StatusCode::OK, "call {n}");
                out.push(start.elapsed());
            }
            out
        });
    }
    let mut latencies = Vec::new();
    while let Some(done) = set.join_next().await {
        latencies.extend(done.expect("the task"));
    }
    latencies.sort();
    latencies
}

fn p99(sorted: &[Duration]) -> Duration {
    sorted[(sorted.len() - 1) * 99 / 100]
}

/// The fleet of three, A answering 503 to everything and B and C 200,
/// and the stack over it.
async fn one_bad(
    outliers: Outliers,
) -> (
    [TestServer; 3],
    tower_resend::stack::Stack<tower_resend::connect::HyperClient>,
) {
    let a = server(Script::new().otherwise(Reply::status(503))).await;
    let b = server(Script::new().otherwise(Reply::ok())).await;
    let c = server(Script::new().otherwise(Reply::ok())).await;
    let fleet = FleetLayer::fixed([base(&a), base(&b), base(&c)])
        .unwrap()
        .outliers(outliers);
    let stack = tower_resend::stack()
        .name("inventory")
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
    let a = server(Script::new().otherwise(Reply::ok().delay(Duration::from_secs(1)))).await;
    let b = server(Script::new().otherwise(Reply::ok())).await;
    let c = server(Script::new().otherwise(Reply::ok())).await;
    let fleet = FleetLayer::fixed([base(&a), base(&b), base(&c)]).unwrap();
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
