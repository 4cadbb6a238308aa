//! Heap allocations of one successful call, counted by a counting global
//! allocator: the default `tower_resend::stack()` over a service that
//! answers 200 at once, beside tower's retry stack making the same writes
//! (a `Deadline` on the request, a history on the response); then, on the
//! server, a keyed POST through an axum handler with the
//! `IdempotencyLayer` on the memory store, beside the same handler alone.
//!
//! `cargo bench -p tower-resend-benches --bench allocations` prints, per
//! variant, the allocations and bytes of one call (the mean over 1,000
//! calls after a warm-up, and the sizes of one call's allocations in
//! order). With `RESEND_ALLOC_TRACE=1` it also prints where each of one
//! call's allocations was made (the first frames of a backtrace), which is
//! how BENCHMARKS.md says what each is for.
#![allow(clippy::print_stdout, clippy::print_stderr)]
// A counting `GlobalAlloc` is an `unsafe` trait: the only unsafe code in
// the workspace, forwarding to `System`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use http::Request;
use http_body_util::BodyExt;
use tower::{Service, ServiceExt};
use tower_resend_benches::variants::{self, Variant};
use tower_resend_benches::Body;
use tower_resend_server::{IdempotencyLayer, MemoryStore};

/// Counts allocations while `ON`; records their sizes (and, when tracing,
/// their backtraces) while `RECORD`.
struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static RECORD: AtomicBool = AtomicBool::new(false);
static TRACE: AtomicBool = AtomicBool::new(false);
/// Set while the allocator itself is recording (its own allocations are
/// not counted).
static BUSY: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);
static SIZES: Mutex<Vec<(usize, Option<String>)>> = Mutex::new(Vec::new());

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ON.load(Ordering::Relaxed) && !BUSY.load(Ordering::Relaxed) {
            COUNT.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(layout.size(), Ordering::Relaxed);
            if RECORD.load(Ordering::Relaxed) {
                BUSY.store(true, Ordering::Relaxed);
                let trace = TRACE
                    .load(Ordering::Relaxed)
                    .then(|| where_from(&std::backtrace::Backtrace::force_capture()));
                if let Ok(mut sizes) = SIZES.lock() {
                    sizes.push((layout.size(), trace));
                }
                BUSY.store(false, Ordering::Relaxed);
            }
        }
        // SAFETY: forwarded to the system allocator with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ON.load(Ordering::Relaxed) && !BUSY.load(Ordering::Relaxed) {
            COUNT.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(new_size, Ordering::Relaxed);
        }
        // SAFETY: forwarded to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The frames of a backtrace in our code or tower's, most recent first, as
/// `function (file:line)` lines.
fn where_from(bt: &std::backtrace::Backtrace) -> String {
    let text = bt.to_string();
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let name = line.trim();
        let interesting = [
            "tower_resend",
            "tower::",
            "tower_http",
            "http::",
            "axum",
            "bytes::",
        ]
        .iter()
        .any(|p| name.contains(p))
            && !name.contains("allocations::");
        if interesting {
            let at = lines
                .peek()
                .map(|l| l.trim().trim_start_matches("at ").to_owned())
                .unwrap_or_default();
            out.push(format!("      {name}  [{at}]"));
            if out.len() == 4 {
                break;
            }
        }
    }
    out.join("\n")
}

async fn call<S: Variant>(svc: &mut S) {
    let req = Request::get("http://upstream.test/items")
        .body(Body::new())
        .expect("a valid request");
    let resp = svc.ready().await.expect("ready").call(req).await;
    assert!(resp.is_ok(), "the call succeeds");
}

/// A keyed POST (a fresh key each time) through `app`, an axum router, its
/// answer read.
async fn post(app: &mut axum::Router, i: &mut u64) {
    *i += 1;
    let req = Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("order-{i}"))
        .body(axum::body::Body::from("{\"sku\":\"abc\",\"qty\":1}"))
        .expect("a valid request");
    let resp = ServiceExt::<Request<axum::body::Body>>::ready(app)
        .await
        .expect("ready")
        .call(req)
        .await
        .expect("an answer");
    assert!(resp.status().is_success(), "{}", resp.status());
    let body = resp.into_body().collect().await.expect("the body");
    assert!(!body.to_bytes().is_empty());
}

/// An axum handler that waits once before it answers, as one calling a
/// database does (the idempotency layer then arms its lease's renewal).
async fn waiting(body: bytes::Bytes) -> String {
    tokio::task::yield_now().await;
    format!("ok {}", body.len())
}

/// Counts the allocations of `one()` (the mean over 1,000 after a warm-up)
/// and lists one's.
async fn measure(name: &str, mut one: impl AsyncFnMut()) {
    for _ in 0..1_000 {
        one().await;
    }
    const N: usize = 1_000;
    COUNT.store(0, Ordering::Relaxed);
    BYTES.store(0, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
    for _ in 0..N {
        one().await;
    }
    ON.store(false, Ordering::Relaxed);
    let (count, bytes) = (COUNT.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
    if let Ok(mut sizes) = SIZES.lock() {
        sizes.clear();
    }
    RECORD.store(true, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
    one().await;
    ON.store(false, Ordering::Relaxed);
    RECORD.store(false, Ordering::Relaxed);
    println!(
        "{name:<28} {:>5.2} allocations, {:>6.1} bytes per call",
        count as f64 / N as f64,
        bytes as f64 / N as f64
    );
    let sizes = SIZES.lock().map(|s| s.clone()).unwrap_or_default();
    for (i, (size, trace)) in sizes.iter().enumerate() {
        println!("    {:>2}. {size:>5} B", i + 1);
        if let Some(trace) = trace {
            println!("{trace}");
        }
    }
}

fn main() {
    TRACE.store(
        std::env::var_os("RESEND_ALLOC_TRACE").is_some(),
        Ordering::Relaxed,
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let mut tower = variants::tower_retry_ext();
        measure("tower retry, same writes", async || call(&mut tower).await).await;
        let mut stack = variants::stack();
        measure("tower_resend::stack()", async || call(&mut stack).await).await;
        // The server: a keyed request, beside the same request with no
        // layer (a fresh key each time, so every one runs and is kept).
        let route = || axum::Router::new().route("/orders", axum::routing::post(waiting));
        for (name, app) in [
            ("axum, no layer", route()),
            (
                "axum + IdempotencyLayer",
                route().layer(IdempotencyLayer::new(MemoryStore::new())),
            ),
        ] {
            let (mut app, mut i) = (app.with_state(()), 0);
            measure(name, async || post(&mut app, &mut i).await).await;
        }
    });
}
