//! An upstream of three instances on loopback: the stack with a fleet
//! beside tower's `p2c::Balance` (pending requests) over the same three.
//!
//! 1. The success path, like for like: the stack (retries, deadlines, a
//!    fleet) against tower's balancer under tower's retry between two
//!    timeouts writing what resend writes per call, behind the `Buffer` a
//!    `Balance` needs to be cloned; interleaved rounds, the median of the
//!    per-round ratios.
//! 2. One bad instance (A answers 503, B and C 200), 1,000 GETs, 3
//!    attempts at most: successes, attempts per call, and the share of
//!    attempts sent to A.
//!
//! `cargo bench -p tower-resend-benches --bench fleet`
//! (`RESEND_BENCH_ROUNDS=n` sets the rounds of part 1, default 21)
#![allow(missing_docs, clippy::print_stdout)]

use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Uri};
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::discover::ServiceList;
use tower::load::{CompleteOnResponse, PendingRequestsDiscover};
use tower::{Service, ServiceExt};
use tower_resend::fleet::FleetLayer;
use tower_resend_benches::{carried, median, send_batch, Bare, CloneAndRetry, To};
use tower_resend_testkit::{Reply, Script, TestServer};

const CONCURRENCY: usize = 16;
const PER_TASK: usize = 1024;

type Body = Empty<Bytes>;

fn bare() -> Bare {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(http)
}

fn authority(s: &TestServer) -> Authority {
    s.addr().to_string().parse().expect("an authority")
}

/// tower's p2c balancer over three instances, by pending requests.
type Balanced = Balance<PendingRequestsDiscover<ServiceList<Vec<To>>>, Request<Body>>;

/// tower's balancer over the three, behind a `Buffer` so that it clones.
fn balanced(
    servers: &[TestServer; 3],
) -> Buffer<Request<Body>, <Balanced as Service<Request<Body>>>::Future> {
    let client = bare();
    let list: Vec<To> = servers
        .iter()
        .map(|s| To {
            authority: authority(s),
            client: client.clone(),
        })
        .collect();
    let discover =
        PendingRequestsDiscover::new(ServiceList::new(list), CompleteOnResponse::default());
    Buffer::new(Balance::new(discover), 1024)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        success_path().await;
        one_bad_instance().await;
    });
}

async fn success_path() {
    let servers = [
        TestServer::start(Script::new()).await.expect("server"),
        TestServer::start(Script::new()).await.expect("server"),
        TestServer::start(Script::new()).await.expect("server"),
    ];
    let uri: Uri = "http://upstream/quote".parse().expect("a URI");
    let tower_side = tower::ServiceBuilder::new()
        .map_request(carried::deadline)
        .map_response(carried::history)
        .timeout(Duration::from_secs(10))
        .retry(CloneAndRetry { left: 2 })
        .timeout(Duration::from_secs(5))
        .service(balanced(&servers));
    let fleet =
        FleetLayer::fixed(servers.iter().map(|s| format!("http://{}", s.addr()))).expect("a fleet");
    let stack = tower_resend::stack()
        .name("bench")
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(2)));
    let rate = |took: Duration| (CONCURRENCY * PER_TASK) as f64 / took.as_secs_f64();
    // Warm both: connections, allocator, caches.
    send_batch(tower_side.clone(), uri.clone(), CONCURRENCY, PER_TASK).await;
    send_batch(stack.clone(), uri.clone(), CONCURRENCY, PER_TASK).await;
    let rounds: usize = std::env::var("RESEND_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(21);
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let (a, b) = if round % 2 == 0 {
            let a = rate(send_batch(stack.clone(), uri.clone(), CONCURRENCY, PER_TASK).await);
            let b = rate(send_batch(tower_side.clone(), uri.clone(), CONCURRENCY, PER_TASK).await);
            (a, b)
        } else {
            let b = rate(send_batch(tower_side.clone(), uri.clone(), CONCURRENCY, PER_TASK).await);
            let a = rate(send_batch(stack.clone(), uri.clone(), CONCURRENCY, PER_TASK).await);
            (a, b)
        };
        for s in &servers {
            s.take_arrivals();
        }
        ours.push(a);
        theirs.push(b);
        ratios.push(a / b);
    }
    println!(
        "success path, three instances: {rounds} rounds of {} requests, concurrency {CONCURRENCY}",
        CONCURRENCY * PER_TASK
    );
    println!(
        "tower Balance (pending requests) + Buffer + retry + timeouts + writes: median {:.0} req/s",
        median(theirs)
    );
    println!(
        "tower_resend::stack().fleet(..)                                      : median {:.0} req/s",
        median(ours)
    );
    println!(
        "stack / tower, per-round ratio                                        : median {:.3}",
        median(ratios)
    );
}

async fn one_bad_instance() {
    const CALLS: usize = 1000;
    println!();
    println!("one bad instance of three (A: 503), {CALLS} GETs, 16 at a time, 3 attempts at most:");
    println!("| client | successes | attempts per call | share of attempts to A |");
    println!("|---|---|---|---|");
    for which in ["tower Balance + retry", "tower_resend::stack().fleet(..)"] {
        let servers = [
            TestServer::start(Script::new().otherwise(Reply::status(503)))
                .await
                .expect("server"),
            TestServer::start(Script::new()).await.expect("server"),
            TestServer::start(Script::new()).await.expect("server"),
        ];
        let ok = if which == "tower Balance + retry" {
            let svc = tower::ServiceBuilder::new()
                .retry(CloneAndRetry { left: 2 })
                .service(balanced(&servers));
            count_ok(svc, CALLS).await
        } else {
            let fleet = FleetLayer::fixed(servers.iter().map(|s| format!("http://{}", s.addr())))
                .expect("a fleet");
            let stack = tower_resend::stack()
                .fleet(fleet)
                .service(tower_resend::hyper_client(Duration::from_secs(2)));
            count_ok(stack, CALLS).await
        };
        let arrivals: Vec<usize> = servers.iter().map(TestServer::arrival_count).collect();
        let all: usize = arrivals.iter().sum();
        println!(
            "| {which} | {ok} of {CALLS} | {:.2} | {:.1} % |",
            all as f64 / CALLS as f64,
            100.0 * arrivals[0] as f64 / all as f64
        );
    }
}

/// Sends `calls` GETs through clones of `svc`, 16 at a time: how many got
/// a 200.
async fn count_ok<S, B>(svc: S, calls: usize) -> usize
where
    S: Service<Request<Body>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: Send + 'static,
{
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..16 {
        let svc = svc.clone();
        tasks.spawn(async move {
            let mut ok = 0;
            for _ in (t..calls).step_by(16) {
                let req = Request::get("http://upstream/quote")
                    .body(Body::new())
                    .expect("a request");
                if let Ok(resp) = svc.clone().oneshot(req).await {
                    ok += usize::from(resp.status() == 200);
                }
            }
            ok
        });
    }
    let mut ok = 0;
    while let Some(done) = tasks.join_next().await {
        ok += done.expect("a task");
    }
    ok
}
