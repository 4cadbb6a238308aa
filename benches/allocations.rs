//! Heap allocations of one successful call, counted by a counting global
//! allocator: the default `tower_resend::stack()` over a service that
//! answers 200 at once, beside tower's retry stack making the same writes
//! (a `Deadline` on the request, a history on the response).
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
use tower::ServiceExt;
use tower_resend_benches::variants::{self, Variant};
use tower_resend_benches::Body;

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
        let interesting = ["tower_resend", "tower::", "tower_http", "http::"]
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

async fn measure<S: Variant>(name: &str, mut svc: S) {
    for _ in 0..1_000 {
        call(&mut svc).await;
    }
    const N: usize = 1_000;
    COUNT.store(0, Ordering::Relaxed);
    BYTES.store(0, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
    for _ in 0..N {
        call(&mut svc).await;
    }
    ON.store(false, Ordering::Relaxed);
    let (count, bytes) = (COUNT.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
    if let Ok(mut sizes) = SIZES.lock() {
        sizes.clear();
    }
    RECORD.store(true, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
    call(&mut svc).await;
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
        measure("tower retry, same writes", variants::tower_retry_ext()).await;
        measure("tower_resend::stack()", variants::stack()).await;
    });
}
