//! Loopback throughput of the full tower-resend stack over hyper-util as a ratio to
//! a bare hyper-util client, measured in interleaved rounds so that drift on a
//! shared machine hits both sides alike: each round sends one batch through
//! each client, alternating which goes first; the median of the per-round
//! ratios is reported. References measured alongside: hyper-util under
//! tower's `Timeout` (one timer per call and nothing else), under tower's
//! retry between two timeouts, and under that making the writes resend
//! makes per call (a `Deadline` on the request, a history on the response).
//!
//! `cargo bench -p tower-resend-benches --bench loopback_ratio`
//! (`RESEND_BENCH_ROUNDS=n` sets the rounds, default 21)
#![allow(missing_docs, clippy::print_stdout)]

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::Service;
use tower_resend_benches::{carried, median, send_batch, CloneAndRetry};
use tower_resend_testkit::{Script, TestServer};

const CONCURRENCY: usize = 16;
const PER_TASK: usize = 1024;

/// One batch through clones of `svc`; requests per second.
async fn batch<S, B>(svc: S, uri: http::Uri) -> f64
where
    S: Service<Request<Empty<Bytes>>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: http_body::Body + Send,
    B::Error: std::fmt::Debug,
    B::Data: Send,
{
    let took = send_batch(svc, uri, CONCURRENCY, PER_TASK).await;
    (CONCURRENCY * PER_TASK) as f64 / took.as_secs_f64()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let server = TestServer::start(Script::new()).await.expect("server");
        let uri = server.uri("/quote");
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        let bare = Client::builder(TokioExecutor::new()).build::<_, Empty<Bytes>>(http);
        let stack = tower_resend::stack()
            .name("bench")
            .service(tower_resend::hyper_client(Duration::from_secs(2)));
        // References: the same client under tower's Timeout (one timer per
        // call and nothing else); under tower's retry between two timeouts
        // with a clone-and-retry policy; and that again writing what resend
        // carries per call (a `Deadline` on the request, a history on the
        // response), for a like-for-like comparison.
        let timed = tower::ServiceBuilder::new()
            .timeout(Duration::from_secs(5))
            .service(bare.clone());
        let retried = tower::ServiceBuilder::new()
            .timeout(Duration::from_secs(10))
            .retry(CloneAndRetry { left: 2 })
            .timeout(Duration::from_secs(5))
            .service(bare.clone());
        let carried = tower::ServiceBuilder::new()
            .map_request(carried::deadline)
            .map_response(carried::history)
            .service(retried.clone());
        const NAMES: [&str; 5] = [
            "bare hyper-util",
            "tower Timeout",
            "tower retry + 2 timeouts",
            "  the same + tower-resend's writes",
            "resend stack",
        ];
        let run = |which: usize| {
            let uri = uri.clone();
            let (bare, timed, retried, carried, stack) = (
                bare.clone(),
                timed.clone(),
                retried.clone(),
                carried.clone(),
                stack.clone(),
            );
            async move {
                match which {
                    0 => batch(bare, uri).await,
                    1 => batch(timed, uri).await,
                    2 => batch(retried, uri).await,
                    3 => batch(carried, uri).await,
                    _ => batch(stack, uri).await,
                }
            }
        };
        // Warm every client: connections, allocator, caches.
        for which in 0..NAMES.len() {
            run(which).await;
        }
        let rounds: usize = std::env::var("RESEND_BENCH_ROUNDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(21);
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); NAMES.len()];
        let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); NAMES.len()];
        for round in 0..rounds {
            // Rotate which client goes first.
            let mut got = [0.0; NAMES.len()];
            for k in 0..NAMES.len() {
                let which = (round + k) % NAMES.len();
                got[which] = run(which).await;
            }
            server.take_arrivals();
            for (which, rate) in got.iter().enumerate() {
                rates[which].push(*rate);
                ratios[which].push(rate / got[0]);
            }
        }
        let show = |v: &[f64]| {
            v.iter()
                .map(|r| format!("{r:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!(
            "rounds: {rounds}, each {} requests per client, concurrency {CONCURRENCY}",
            CONCURRENCY * PER_TASK
        );
        for (which, name) in NAMES.iter().enumerate() {
            println!(
                "{name:<29}: median {:>8.0} req/s",
                median(rates[which].clone())
            );
        }
        for (which, name) in NAMES.iter().enumerate().skip(1) {
            println!(
                "{name:<29}: / bare, median {:.3} ({})",
                median(ratios[which].clone()),
                show(&ratios[which])
            );
        }
        // resend against tower's retry making the same writes, round by round.
        let like: Vec<f64> = rates[4].iter().zip(&rates[3]).map(|(s, c)| s / c).collect();
        println!(
            "resend stack / tower retry + writes: median {:.3} ({})",
            median(like.clone()),
            show(&like)
        );
    });
}
