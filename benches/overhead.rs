//! In-process overhead of resend's layers on one successful call, against
//! tower's own middleware in the same run.
//!
//! `cargo bench -p resend-benches --bench overhead`
#![allow(missing_docs)] // criterion's macros make undocumented functions

use criterion::{criterion_group, criterion_main, Criterion};
use http::Request;
use tower::ServiceExt;

use resend_benches::variants::{self, Variant};
use resend_benches::Body;

fn request() -> Request<Body> {
    Request::get("http://upstream/quote")
        .body(Body::new())
        .expect("valid request")
}

/// One call on a clone of `svc`, as every task of a service does with a
/// stack built once.
async fn one_call<S: Variant>(svc: S) {
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
        let svc = variants::tower_timeout();
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });

    // tower's Timeout after writing the same Deadline extension that the
    // design requires resend's DeadlineLayer to write: what the extension
    // alone costs, for comparison (not a target).
    group.bench_function("tower_timeout_with_deadline_extension", |b| {
        let svc = variants::tower_timeout_ext();
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });

    group.bench_function("resend_deadline_attempt", |b| {
        let svc = variants::resend_deadline_attempt();
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });
    group.finish();
}

fn full_stack(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("full_stack");

    group.bench_function("tower_retry_timeout", |b| {
        let svc = variants::tower_retry();
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });

    // The same after writing the two things the design makes resend carry
    // per call (a Deadline on the request, a history on the response):
    // what those writes cost by themselves, for comparison (not a target).
    group.bench_function("tower_retry_timeout_with_extensions", |b| {
        let svc = variants::tower_retry_ext();
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });

    group.bench_function("resend_stack", |b| {
        let svc = variants::stack();
        b.to_async(&rt).iter(|| one_call(svc.clone()));
    });
    group.finish();
}

criterion_group!(benches, deadline_and_attempt, full_stack);
criterion_main!(benches);
