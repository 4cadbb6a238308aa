//! In-process overhead of resend's layers on one successful call, against
//! tower's own middleware in the same run.
//!
//! `cargo bench -p resend --bench overhead`
#![allow(missing_docs)] // criterion's macros make undocumented functions

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{Request, Response};
use http_body_util::Empty;
use resend::{AttemptTimeoutLayer, DeadlineLayer};
use tower::{Service, ServiceBuilder, ServiceExt};

type Body = Empty<bytes::Bytes>;

/// An upstream that answers at once.
#[derive(Clone, Copy)]
struct Instant200;

impl<B> Service<Request<B>> for Instant200 {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<B>) -> Self::Future {
        ready(Ok(Response::new(Body::new())))
    }
}

fn request() -> Request<Body> {
    Request::get("http://upstream/quote")
        .body(Body::new())
        .expect("valid request")
}

/// One call on a clone of `svc`, as every task of a service does with a
/// stack built once.
async fn one_call<S>(svc: S)
where
    S: Service<Request<Body>>,
    S::Error: std::fmt::Debug,
{
    let resp = svc.oneshot(request()).await;
    std::hint::black_box(resp.expect("answered"));
}

fn deadline_and_attempt(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("timeouts");

    group.bench_function("tower_timeout", |b| {
        let svc = ServiceBuilder::new()
            .timeout(Duration::from_secs(5))
            .service(Instant200);
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });

    group.bench_function("resend_deadline_attempt", |b| {
        let svc = ServiceBuilder::new()
            .layer(DeadlineLayer::new(Duration::from_secs(10)))
            .layer(AttemptTimeoutLayer::new(Duration::from_secs(5)))
            .service(Instant200);
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });
    group.finish();
}

/// tower's retry with the simplest policy a user would write: clone the
/// request, retry 5xx up to twice.
#[derive(Clone)]
struct CloneAndRetry {
    left: usize,
}

impl<E> tower::retry::Policy<Request<Body>, Response<Body>, E> for CloneAndRetry {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Request<Body>,
        result: &mut Result<Response<Body>, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(r) if !r.status().is_server_error() => None,
            _ if self.left > 0 => {
                self.left -= 1;
                Some(ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Request<Body>) -> Option<Request<Body>> {
        Some(req.clone())
    }
}

fn full_stack(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("full_stack");

    group.bench_function("tower_retry_timeout", |b| {
        let svc = ServiceBuilder::new()
            .timeout(Duration::from_secs(10))
            .retry(CloneAndRetry { left: 2 })
            .timeout(Duration::from_secs(5))
            .service(Instant200);
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });

    group.bench_function("resend_stack", |b| {
        let svc = resend::stack().name("bench").service(Instant200);
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });
    group.finish();
}

criterion_group!(benches, deadline_and_attempt, full_stack);
criterion_main!(benches);
