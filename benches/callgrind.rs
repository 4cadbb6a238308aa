//! Instruction counts of one successful call, for `valgrind --tool=callgrind`:
//! repeatable whatever else the machine is doing, unlike wall-clock timings.
//!
//! ```sh
//! cargo bench -p tower-resend-benches --bench callgrind --no-run
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.stack <bench binary> stack 5000
//! ```
//! Variants, each run N times on a current-thread runtime:
//! - in process, over a service that answers at once: `bare`, `tower`
//!   (tower's Timeout), `tower_ext` (the same after writing the `Deadline`
//!   extension that tower-resend's CallDeadlineLayer writes), `deadline`, `attempt`, `both` (deadline + attempt),
//!   `tower_retry` (tower's retry with a clone-and-retry policy between two
//!   timeouts), `tower_retry_ext` (the same after writing a `Deadline` on
//!   the request and a small history on the response), `stack` (the full `tower_resend::stack()`),
//!   `fleet_3` and `fleet_10000` (`stack().fleet(..)` over that many
//!   instances: run them under `--tool=cachegrind --cache-sim=yes` for the
//!   cache misses a large fleet adds);
//! - on loopback against tower-resend-testkit: `loop_bare` (hyper-util's client),
//!   `loop_tower` (that client under tower's Timeout: one timer per call),
//!   `loop_tower_retry` and `loop_tower_retry_ext` (that client under
//!   `tower_retry`, without and with the per-call writes), `loop_stack`
//!   (the full stack over `tower_resend::hyper_client`), `loop_stack_no_read_ahead`
//!   (the same with `read_ahead(0)`);
//! - diagnostics: `sizes` prints the size of the service, its future and its
//!   response as the stack's layers are added one by one (every layer moves
//!   its inner future and the response by value: their size is a cost of
//!   every call), and `ablate` times the same partial stacks, N calls each,
//!   interleaved over 7 rounds (medians, wall clock).
#![allow(missing_docs, clippy::unwrap_used, clippy::print_stderr)]

use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_resend::{deadline::CallDeadlineLayer, timeout::AttemptTimeoutLayer};
use tower_resend_benches::{carried, variants, Body, CloneAndRetry, Instant200};

async fn run<S>(svc: S, n: usize)
where
    S: Service<Request<Body>> + Clone,
    S::Error: std::fmt::Debug,
{
    for _ in 0..n {
        let req = Request::get("http://upstream/quote")
            .body(Body::new())
            .unwrap();
        std::hint::black_box(svc.clone().oneshot(req).await.unwrap());
    }
}

async fn loopback(which: &str, n: usize) {
    let server = tower_resend_testkit::TestServer::start(tower_resend_testkit::Script::new())
        .await
        .unwrap();
    let uri = server.uri("/quote");
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.set_nodelay(true);
    let bare = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, Body>(http);
    let resend = tower_resend::stack()
        .name("bench")
        .service(tower_resend::hyper_client(Duration::from_secs(2)));
    let no_read_ahead = tower_resend::stack()
        .name("bench")
        .read_ahead(0)
        .service(tower_resend::hyper_client(Duration::from_secs(2)));
    for i in 0..n {
        let req = Request::get(uri.clone()).body(Body::new()).unwrap();
        match which {
            "stack" => {
                let r = resend.clone().oneshot(req).await.unwrap();
                r.into_body().collect().await.unwrap();
            }
            "stack_no_read_ahead" => {
                let r = no_read_ahead.clone().oneshot(req).await.unwrap();
                r.into_body().collect().await.unwrap();
            }
            "tower" => {
                let svc = ServiceBuilder::new()
                    .timeout(Duration::from_secs(5))
                    .service(bare.clone());
                let r = svc.oneshot(req).await.unwrap();
                r.into_body().collect().await.unwrap();
            }
            "tower_retry" | "tower_retry_ext" => {
                let retried = ServiceBuilder::new()
                    .timeout(Duration::from_secs(10))
                    .retry(CloneAndRetry { left: 2 })
                    .timeout(Duration::from_secs(5))
                    .service(bare.clone());
                let r = if which == "tower_retry" {
                    retried.oneshot(req).await.unwrap()
                } else {
                    ServiceBuilder::new()
                        .map_request(carried::deadline)
                        .map_response(carried::history)
                        .service(retried)
                        .oneshot(req)
                        .await
                        .unwrap()
                };
                r.into_body().collect().await.unwrap();
            }
            _ => {
                let r = bare.clone().oneshot(req).await.unwrap();
                r.into_body().collect().await.unwrap();
            }
        }
        if i % 1000 == 0 {
            server.take_arrivals();
        }
    }
}

/// `tower_resend::stack().fleet(..)` over `n` instances, `http://10.a.b.c:80`.
fn fleet_stack(n: usize) -> impl Service<Request<Body>, Error = tower_resend::Error> + Clone {
    let addresses =
        (0..n).map(|i| format!("http://10.{}.{}.{}:80", i >> 16, (i >> 8) & 255, i & 255));
    let fleet = tower_resend::fleet::FleetLayer::fixed(addresses).unwrap();
    tower_resend::stack().fleet(fleet).service(Instant200)
}

fn main() {
    let variant = std::env::args().nth(1).unwrap_or_default();
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let d = || CallDeadlineLayer::new(Duration::from_secs(10));
        let a = || AttemptTimeoutLayer::new(Duration::from_secs(5));
        match variant.as_str() {
            "bare" => run(Instant200, n).await,
            "tower" => run(variants::tower_timeout(), n).await,
            "tower_ext" => run(variants::tower_timeout_ext(), n).await,
            "deadline" => run(ServiceBuilder::new().layer(d()).service(Instant200), n).await,
            "attempt" => run(ServiceBuilder::new().layer(a()).service(Instant200), n).await,
            "both" => run(variants::resend_deadline_attempt(), n).await,
            "tower_retry" => run(variants::tower_retry(), n).await,
            "tower_retry_ext" => run(variants::tower_retry_ext(), n).await,
            "stack" => run(variants::stack(), n).await,
            "stack_throttled" => run(variants::stack_throttled(), n).await,
            "stack_paced" => run(variants::stack_paced(), n).await,
            "stack_quota_unpaced" => run(variants::stack_quota_unpaced(), n).await,
            // `stack().fleet(..)` over 3 or 10 000 instances: with
            // `--tool=cachegrind --cache-sim=yes`, the cache misses a pick
            // over a large fleet adds.
            "fleet_3" => run(fleet_stack(3), n).await,
            "fleet_10000" => run(fleet_stack(10_000), n).await,
            "sizes" => {
                use tower_resend::hedge::HedgeLayer;
                use tower_resend::read_ahead::ReadAheadLayer;
                fn size<S: Service<Request<Body>>>(name: &str, s: &S) {
                    eprintln!(
                        "{name}: service {} future {} response {}",
                        std::mem::size_of_val(s),
                        std::mem::size_of::<S::Future>(),
                        std::mem::size_of::<S::Response>()
                    );
                }
                size("tower_retry_ext", &variants::tower_retry_ext());
                size("stack", &variants::stack());
                size("bare", &Instant200);
                let ra = ReadAheadLayer::new(64 * 1024).layer(Instant200);
                size("read_ahead", &ra);
                let at = a().layer(ra.clone());
                size("+attempt", &at);
                let hd = tower_resend::deadline::DeadlineHeaderLayer::new().layer(at.clone());
                size("+header", &hd);
                let hg = HedgeLayer::new(Duration::ZERO)
                    .max_copies(1)
                    .layer(hd.clone());
                size("+hedge", &hg);
                let rt = tower_resend::retry::RetryLayer::new().layer(hg.clone());
                size("+retry", &rt);
                let dl = d().layer(rt.clone());
                size("+deadline", &dl);
            }
            "retry" => run(tower_resend::retry::RetryLayer::new().layer(Instant200), n).await,
            "retry_ra" => {
                let ra = tower_resend::read_ahead::ReadAheadLayer::new(64 * 1024).layer(Instant200);
                run(tower_resend::retry::RetryLayer::new().layer(ra), n).await
            }
            "ablate" => {
                use tower_resend::hedge::HedgeLayer;
                use tower_resend::read_ahead::ReadAheadLayer;
                async fn time<S>(svc: &S, n: usize) -> f64
                where
                    S: Service<Request<Body>> + Clone,
                    S::Error: std::fmt::Debug,
                {
                    let t = tokio::time::Instant::now();
                    run(svc.clone(), n).await;
                    t.elapsed().as_nanos() as f64 / n as f64
                }
                let retry = tower_resend::retry::RetryLayer::new().layer(Instant200);
                let ra = ReadAheadLayer::new(64 * 1024).layer(Instant200);
                let retry_ra = tower_resend::retry::RetryLayer::new().layer(ra.clone());
                let at = a().layer(ra.clone());
                let retry_at = tower_resend::retry::RetryLayer::new().layer(at.clone());
                let hd = tower_resend::deadline::DeadlineHeaderLayer::new().layer(at.clone());
                let hg = HedgeLayer::new(Duration::ZERO)
                    .max_copies(1)
                    .layer(hd.clone());
                let rt = tower_resend::retry::RetryLayer::new().layer(hg.clone());
                let dl = d().layer(rt.clone());
                let stack = variants::stack();
                let tower = variants::tower_retry_ext();
                let names = [
                    "bare",
                    "tower_ext",
                    "retry",
                    "retry+ra",
                    "retry+ra+at",
                    "retry+..+hedge+header",
                    "+deadline",
                    "stack",
                ];
                let mut t = vec![Vec::new(); names.len()];
                for _ in 0..7 {
                    t[0].push(time(&Instant200, n).await);
                    t[1].push(time(&tower, n).await);
                    t[2].push(time(&retry, n).await);
                    t[3].push(time(&retry_ra, n).await);
                    t[4].push(time(&retry_at, n).await);
                    t[5].push(time(&rt, n).await);
                    t[6].push(time(&dl, n).await);
                    t[7].push(time(&stack, n).await);
                }
                for (name, mut v) in names.iter().zip(t) {
                    v.sort_by(f64::total_cmp);
                    eprintln!("{name:<24} {:7.1} ns", v[v.len() / 2]);
                }
            }
            "loop_bare" => loopback("bare", n).await,
            "loop_tower" => loopback("tower", n).await,
            "loop_stack" => loopback("stack", n).await,
            "loop_stack_no_read_ahead" => loopback("stack_no_read_ahead", n).await,
            "loop_tower_retry" => loopback("tower_retry", n).await,
            "loop_tower_retry_ext" => loopback("tower_retry_ext", n).await,
            other => panic!("unknown variant {other:?}"),
        }
    });
}
