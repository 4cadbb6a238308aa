//! Loopback throughput of the full resend stack over hyper-util as a ratio to
//! a bare hyper-util client, measured in interleaved rounds so that drift on a
//! shared machine hits both sides alike: each round sends one batch through
//! each client, alternating which goes first; the median of the per-round
//! ratios is reported. hyper-util under tower's `Timeout` (one timer per
//! call and nothing else) is measured alongside, as a reference.
//!
//! `cargo bench -p resend-benches --bench loopback_ratio`
#![allow(missing_docs, clippy::print_stdout)]

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use resend::retry::ReplayBody;
use resend_benches::send_batch;
use resend_testkit::{Script, TestServer};
use tower::Service;

const CONCURRENCY: usize = 16;
const PER_TASK: usize = 256;
const ROUNDS: usize = 15;

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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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
        let stack =
            resend::stack().name("bench").service(
                resend::hyper_client::<ReplayBody<Empty<Bytes>>>(Duration::from_secs(2)),
            );
        // A reference: the same client under tower's Timeout, one timer per call.
        let timed = tower::ServiceBuilder::new()
            .timeout(Duration::from_secs(5))
            .service(bare.clone());
        // Warm all three: connections, allocator, caches.
        batch(bare.clone(), uri.clone()).await;
        batch(timed.clone(), uri.clone()).await;
        batch(stack.clone(), uri.clone()).await;
        let (mut b, mut t, mut s) = (Vec::new(), Vec::new(), Vec::new());
        let (mut stack_ratio, mut timer_ratio) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            // Rotate which client goes first.
            let mut got = [0.0; 3];
            for k in 0..3 {
                let which = (round + k) % 3;
                got[which] = match which {
                    0 => batch(bare.clone(), uri.clone()).await,
                    1 => batch(timed.clone(), uri.clone()).await,
                    _ => batch(stack.clone(), uri.clone()).await,
                };
            }
            server.take_arrivals();
            b.push(got[0]);
            t.push(got[1]);
            s.push(got[2]);
            timer_ratio.push(got[1] / got[0]);
            stack_ratio.push(got[2] / got[0]);
        }
        let show = |v: &[f64]| {
            v.iter()
                .map(|r| format!("{r:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!(
            "rounds: {ROUNDS}, each {} requests per client, concurrency {CONCURRENCY}",
            CONCURRENCY * PER_TASK
        );
        println!(
            "bare hyper-util           : median {:>8.0} req/s",
            median(b)
        );
        println!(
            "hyper-util + tower Timeout: median {:>8.0} req/s",
            median(t)
        );
        println!(
            "resend stack              : median {:>8.0} req/s",
            median(s)
        );
        println!(
            "tower Timeout / bare      : median {:.3} ({})",
            median(timer_ratio.clone()),
            show(&timer_ratio)
        );
        println!(
            "resend stack / bare       : median {:.3} ({})",
            median(stack_ratio.clone()),
            show(&stack_ratio)
        );
    });
}
