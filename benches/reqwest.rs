//! Loopback throughput over reqwest, in the same run, against
//! tower-resend-testkit's server on 127.0.0.1 answering 200 at once:
//!
//! - `bare_reqwest`: a reqwest client alone (as `tower_resend::reqwest::client_builder`
//!   sets it up);
//! - `resend_stack`: the full tower-resend stack (deadline, key layer, retries with
//!   3 attempts in all, deadline header, attempt timeout) over that client;
//! - `reqwest_middleware_retry`: the same client under reqwest-middleware with
//!   reqwest-retry's `RetryTransientMiddleware`, exponential backoff, 2
//!   retries (3 attempts in all, as tower-resend's default).
//!
//! Each iteration is a batch of requests sent by 16 concurrent tasks; each
//! response body is read in full.
//!
//! `cargo bench -p tower-resend-benches --bench reqwest`
#![allow(missing_docs)] // criterion's macros make undocumented functions

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use http::Request;
use http_body_util::{BodyExt, Empty};
use reqwest_middleware::ClientBuilder;
use reqwest_retry::policies::ExponentialBackoff;
use reqwest_retry::RetryTransientMiddleware;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::reqwest::{client_builder, ReqwestService};
use tower_resend_testkit::{Script, TestServer};

const CONCURRENCY: usize = 16;
const PER_TASK: usize = 64;

/// Runs `CONCURRENCY * PER_TASK` calls of `call`, `iters` times, and returns
/// the time it took.
async fn batches<F, Fut>(call: F, iters: u64) -> Duration
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let start = Instant::now();
    for _ in 0..iters {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..CONCURRENCY {
            let call = call.clone();
            tasks.spawn(async move {
                for _ in 0..PER_TASK {
                    call().await;
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("task");
        }
    }
    start.elapsed()
}

fn over_reqwest(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let server = rt
        .block_on(TestServer::start(Script::new()))
        .expect("server");
    let uri = server.uri("/quote");
    let url = uri.to_string();

    let client = rt.block_on(async {
        client_builder(Duration::from_secs(2))
            .no_proxy()
            .build()
            .expect("client")
    });
    let stack = tower_resend::stack()
        .name("bench")
        .service(ReqwestService::new(client.clone()));
    let middleware = ClientBuilder::new(client.clone())
        .with(RetryTransientMiddleware::new_with_policy(
            ExponentialBackoff::builder().build_with_max_retries(2),
        ))
        .build();

    let mut group = c.benchmark_group("reqwest");
    group.throughput(Throughput::Elements((CONCURRENCY * PER_TASK) as u64));
    group.sample_size(20);
    group.bench_function("bare_reqwest", |b| {
        b.iter_custom(|iters| {
            let (client, url) = (client.clone(), url.clone());
            let call = move || {
                let (client, url) = (client.clone(), url.clone());
                async move {
                    let resp = client.get(url).send().await.expect("answered");
                    resp.bytes().await.expect("body");
                }
            };
            let t = rt.block_on(batches(call, iters));
            server.take_arrivals();
            t
        });
    });
    group.bench_function("resend_stack", |b| {
        b.iter_custom(|iters| {
            let (stack, uri) = (stack.clone(), uri.clone());
            let call = move || {
                let (stack, uri) = (stack.clone(), uri.clone());
                async move {
                    let req = Request::get(uri)
                        .body(Empty::<Bytes>::new())
                        .expect("request");
                    let resp = stack.oneshot(req).await.expect("answered");
                    resp.into_body().collect().await.expect("body");
                }
            };
            let t = rt.block_on(batches(call, iters));
            server.take_arrivals();
            t
        });
    });
    group.bench_function("reqwest_middleware_retry", |b| {
        b.iter_custom(|iters| {
            let (middleware, url) = (middleware.clone(), url.clone());
            let call = move || {
                let (middleware, url) = (middleware.clone(), url.clone());
                async move {
                    let resp = middleware.get(url).send().await.expect("answered");
                    resp.bytes().await.expect("body");
                }
            };
            let t = rt.block_on(batches(call, iters));
            server.take_arrivals();
            t
        });
    });
    group.finish();
    drop(server);
}

criterion_group!(benches, over_reqwest);
criterion_main!(benches);
