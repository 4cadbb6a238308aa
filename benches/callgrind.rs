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
//!   extension that tower-resend's DeadlineLayer writes), `deadline`, `attempt`, `both` (deadline + attempt),
//!   `tower_retry` (tower's retry with a clone-and-retry policy between two
//!   timeouts), `tower_retry_ext` (the same after writing a `Deadline` on
//!   the request and a small history on the response), `stack` (the full `tower_resend::stack()`);
//! - on loopback against tower-resend-testkit: `loop_bare` (hyper-util's client),
//!   `loop_tower` (that client under tower's Timeout: one timer per call),
//!   `loop_tower_retry` and `loop_tower_retry_ext` (that client under
//!   `tower_retry`, without and with the per-call writes), `loop_stack`
//!   (the full stack over `tower_resend::hyper_client`).
#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_resend::{AttemptTimeoutLayer, DeadlineLayer};
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
    for i in 0..n {
        let req = Request::get(uri.clone()).body(Body::new()).unwrap();
        match which {
            "stack" => {
                let r = resend.clone().oneshot(req).await.unwrap();
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
        let d = || DeadlineLayer::new(Duration::from_secs(10));
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
            "loop_bare" => loopback("bare", n).await,
            "loop_tower" => loopback("tower", n).await,
            "loop_stack" => loopback("stack", n).await,
            "loop_tower_retry" => loopback("tower_retry", n).await,
            "loop_tower_retry_ext" => loopback("tower_retry_ext", n).await,
            other => panic!("unknown variant {other:?}"),
        }
    });
}
