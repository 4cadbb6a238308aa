//! Loopback throughput: the full resend stack over hyper-util against a bare
//! hyper-util client, in the same run, against resend-testkit's server on
//! 127.0.0.1 answering 200 at once. Each iteration is a batch of requests
//! sent by 16 concurrent tasks; each response body is read in full.
//!
//! `cargo bench -p resend --bench loopback`
#![allow(missing_docs)] // criterion's macros make undocumented functions

use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use http::Request;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use resend_benches::send_batch;
use resend_testkit::{Script, TestServer};
use tower::Service;

const CONCURRENCY: usize = 16;
const PER_TASK: usize = 64;

/// `iters` batches through clones of `svc`; the time they took.
async fn batches<S, B>(svc: S, uri: http::Uri, iters: u64) -> Duration
where
    S: Service<Request<Empty<Bytes>>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: http_body::Body + Send,
    B::Error: std::fmt::Debug,
    B::Data: Send,
{
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        total += send_batch(svc.clone(), uri.clone(), CONCURRENCY, PER_TASK).await;
    }
    total
}

fn loopback(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let server = rt
        .block_on(TestServer::start(Script::new()))
        .expect("server");
    let uri = server.uri("/quote");

    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let bare = Client::builder(TokioExecutor::new()).build::<_, Empty<Bytes>>(http);
    let stack = resend::stack()
        .name("bench")
        .service(resend::hyper_client(Duration::from_secs(2)));

    let mut group = c.benchmark_group("loopback");
    group.throughput(Throughput::Elements((CONCURRENCY * PER_TASK) as u64));
    group.sample_size(30);
    group.bench_function("bare_hyper_util", |b| {
        b.iter_custom(|iters| {
            let t = rt.block_on(batches(bare.clone(), uri.clone(), iters));
            server.take_arrivals();
            t
        });
    });
    group.bench_function("resend_stack", |b| {
        b.iter_custom(|iters| {
            let t = rt.block_on(batches(stack.clone(), uri.clone(), iters));
            server.take_arrivals();
            t
        });
    });
    group.finish();
    drop(server);
}

criterion_group!(benches, loopback);
criterion_main!(benches);
