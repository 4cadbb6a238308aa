//! The `ShedLayer`'s cost on the success path, in process, beside what a
//! user would otherwise stack for a bound on concurrent work: tower's
//! `ConcurrencyLimit` under `LoadShed` (which refuses at capacity, without
//! a queue and without telling retries from first attempts). Interleaved
//! rounds; the median of per-round ratios to the bare service.
//!
//! `cargo bench -p tower-resend-benches --bench shed`
//! (`RESEND_BENCH_ROUNDS=n` sets the rounds, default 21)
#![allow(missing_docs, clippy::print_stdout)]

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tokio::time::Instant;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_resend_benches::median;
use tower_resend_server::{AdaptiveLimit, ShedLayer};

const CALLS: u32 = 50_000;

fn handler() -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    service_fn(|_: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
    })
}

async fn per_call<S, R>(svc: &S) -> f64
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<R>> + Clone,
    S::Error: std::fmt::Debug,
{
    let start = Instant::now();
    for _ in 0..CALLS {
        let req = Request::get("http://server/work")
            .body(Full::default())
            .expect("valid request");
        let resp = svc.clone().oneshot(req).await;
        std::hint::black_box(resp.expect("answered"));
    }
    start.elapsed().as_nanos() as f64 / f64::from(CALLS)
}

fn main() {
    let rounds: usize = std::env::var("RESEND_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(21);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let bare = handler();
        let tower_shed = ServiceBuilder::new()
            .load_shed()
            .concurrency_limit(64)
            .service(handler());
        let ours = ServiceBuilder::new()
            .layer(ShedLayer::new(64))
            .service(handler());
        let adaptive = ServiceBuilder::new()
            .layer(ShedLayer::adaptive(AdaptiveLimit::new()))
            .service(handler());
        const NAMES: [&str; 4] = [
            "bare service_fn",
            "tower LoadShed + ConcurrencyLimit(64)",
            "ShedLayer::new(64)",
            "ShedLayer::adaptive(AdaptiveLimit::new())",
        ];
        let mut ns: Vec<Vec<f64>> = vec![Vec::new(); NAMES.len()];
        for round in 0..rounds + 2 {
            for k in 0..NAMES.len() {
                let i = (round + k) % NAMES.len();
                let t = match i {
                    0 => per_call(&bare).await,
                    1 => per_call(&tower_shed).await,
                    2 => per_call(&ours).await,
                    _ => per_call(&adaptive).await,
                };
                // The first two rounds warm up.
                if round >= 2 {
                    ns[i].push(t);
                }
            }
        }
        println!("| variant | ns per call (median of {rounds}) | over bare |");
        println!("|---|---|---|");
        let bare_ns = median(ns[0].clone());
        for (name, v) in NAMES.iter().zip(&ns) {
            let m = median(v.clone());
            println!("| {name} | {m:.0} | +{:.0} ns |", m - bare_ns);
        }
    });
}
