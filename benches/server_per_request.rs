//! The layer's own cost per keyed request, in process (no sockets): `n`
//! POSTs with fresh keys through `Idempotency<_, MemoryStore>` or straight
//! to the handler, on a current-thread runtime. Meant for instruction
//! counts, which are repeatable on a noisy machine:
//!
//! ```text
//! cargo bench -p tower-resend-benches --bench server_per_request --no-run
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p \
//!     target/release/deps/server_per_request-* memory 50000
//! ```
//!
//! The layer's cost per request is (memory - none) / n; `axum-none-wait`
//! and `axum-memory-wait` run a handler that waits once. Each run also
//! prints its loop's wall time per request; `axum-none-mt` and
//! `axum-memory-mt` send from 16 tasks on two workers (run them under
//! `time` for the CPU).
#![allow(clippy::print_stdout, missing_docs)]

use std::convert::Infallible;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_resend_server::{IdempotencyLayer, MaybeBuffered, MemoryStore};

async fn handler<B>(req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let len = req
        .into_body()
        .collect()
        .await
        .map_or(0, |b| b.to_bytes().len());
    let mut resp = Response::new(Full::new(Bytes::from(format!("ok {len}"))));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    Ok(resp)
}

fn request(key: &str) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header(header::HOST, "127.0.0.1:40000")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "22")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(
            b"{\"sku\":\"abc\",\"qty\":1}",
        )))
        .unwrap()
}

async fn axum_handler(body: Bytes) -> String {
    format!("ok {}", body.len())
}

/// The handler of the `-wait` modes: it waits once before it answers, as
/// one calling a database does (the layer arms its lease's renewal timer).
async fn axum_waiting(body: Bytes) -> String {
    tokio::task::yield_now().await;
    format!("ok {}", body.len())
}

/// `n` requests through `app`, keyed `{prefix}-{i}`; with `yield_each`,
/// the task lets others in after each one, as a socket's wait would.
async fn axum_run(
    app: axum::Router,
    prefix: String,
    n: u64,
    keyed: bool,
    yield_each: bool,
) -> usize {
    // As `axum::serve` does for each connection: the handlers become routes
    // once, not on every request.
    let mut app = app.with_state(());
    let mut total = 0;
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        let req = request(&key).map(axum::body::Body::new);
        let resp = ServiceExt::<Request<axum::body::Body>>::ready(&mut app)
            .await
            .unwrap()
            .call(req)
            .await
            .unwrap();
        assert!(!keyed || resp.status().is_success());
        total += resp.into_body().collect().await.unwrap().to_bytes().len();
        if yield_each {
            tokio::task::yield_now().await;
        }
    }
    total
}

/// `axum-none-mt` and `axum-memory-mt` (`axum-none-wait-mt`,
/// `axum-memory-wait-mt` with the handler that waits once): `n` requests in
/// all from 16 tasks
/// on a runtime of two workers, as the `throughput` bench's server sees
/// them, without its sockets: what the two cores sharing the store and the
/// router cost.
fn multi_thread(mode: &str, n: u64) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = MemoryStore::new().max_records(4_000_000).max_bytes(1 << 30);
    let app = if mode.contains("-wait") {
        axum::Router::new().route("/orders", axum::routing::post(axum_waiting))
    } else {
        axum::Router::new().route("/orders", axum::routing::post(axum_handler))
    };
    let keyed = mode.starts_with("axum-memory");
    let app = if keyed {
        app.layer(IdempotencyLayer::new(store.clone()))
    } else {
        app
    };
    let start = tokio::time::Instant::now();
    let total: usize = rt.block_on(async {
        let tasks: Vec<_> = (0..16)
            .map(|t| {
                tokio::spawn(axum_run(
                    app.clone(),
                    format!("run-{t}"),
                    n / 16,
                    keyed,
                    true,
                ))
            })
            .collect();
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap();
        }
        total
    });
    let ns = start.elapsed().as_nanos() as f64 / n.max(1) as f64;
    println!("{mode} {n}: {total} bytes, {ns:.0} ns per request (two workers)");
}

/// Sends `n` keyed requests through `svc`, one after the other: the bytes
/// of the answers.
async fn drive<S, B>(mut svc: S, n: u64) -> usize
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let mut total = 0;
    for i in 0..n {
        let key = format!("run-{i}");
        let resp = svc
            .ready()
            .await
            .unwrap()
            .call(request(&key))
            .await
            .unwrap();
        assert!(resp.status().is_success());
        total += resp.into_body().collect().await.unwrap().to_bytes().len();
    }
    total
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let mode = args.next().unwrap_or_else(|| "memory".into());
    let n: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1000);
    if mode.ends_with("-mt") {
        // A runtime of its own, off this one's thread.
        return std::thread::spawn(move || multi_thread(&mode, n))
            .join()
            .unwrap();
    }
    // Held here, so that its records are freed after the loop is timed.
    let store = MemoryStore::new().max_records(4_000_000).max_bytes(1 << 30);
    let start = tokio::time::Instant::now();
    let total = match mode.as_str() {
        "axum-none" | "axum-memory" | "axum-none-wait" | "axum-memory-wait" => {
            let app = if mode.ends_with("-wait") {
                axum::Router::new().route("/orders", axum::routing::post(axum_waiting))
            } else {
                axum::Router::new().route("/orders", axum::routing::post(axum_handler))
            };
            if mode.starts_with("axum-none") {
                axum_run(app, "run".into(), n, false, false).await
            } else {
                let app = app.layer(IdempotencyLayer::new(store.clone()));
                axum_run(app, "run".into(), n, true, false).await
            }
        }
        "none" => {
            let svc =
                service_fn(|req: Request<Full<Bytes>>| handler(req.map(MaybeBuffered::inner)));
            drive(svc, n).await
        }
        _ => {
            let svc = IdempotencyLayer::new(store.clone()).layer(service_fn(handler));
            drive(svc, n).await
        }
    };
    // The loop's own time: a rough figure, which other load on the machine
    // moves; the instruction counts are the repeatable one.
    let ns = start.elapsed().as_nanos() as f64 / n.max(1) as f64;
    println!("{mode} {n}: {total} bytes, {ns:.0} ns per request");
}
