//! The slow tail, hedged: 2 000 GETs, 20 at a time, to an in-process
//! upstream where one call in 20 stalls a second on its first send (a
//! backup is answered in 2 ms, as is every other send). tower-resend's
//! hedging (a fixed delay, and the adaptive one) beside tower's `Hedge`
//! (which hedges at a latency percentile once it has seen enough calls)
//! and no hedging: p50, p99, p99.9 and the extra sends. Real time.
//!
//! `cargo bench -p tower-resend-benches --bench hedge_tail`
#![allow(missing_docs, clippy::print_stdout)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::{service_fn, BoxError, ServiceExt};

const CALLS: usize = 2000;
const TASKS: usize = 20;

/// Sends by call (its path).
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<HashMap<String, usize>>>);

impl Seen {
    fn sends(&self) -> usize {
        self.0.lock().expect("lock").values().sum()
    }
}

/// Answers in 2 ms; a call `/n` with n a multiple of 20 stalls a second on
/// its first send.
async fn answer<B>(seen: Seen, req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_owned();
    let first = {
        let mut seen = seen.0.lock().expect("lock");
        let n = seen.entry(path.clone()).or_default();
        *n += 1;
        *n == 1
    };
    let n: usize = path.trim_start_matches('/').parse().unwrap_or(1);
    let wait = if first && n.is_multiple_of(20) {
        Duration::from_secs(1)
    } else {
        Duration::from_millis(2)
    };
    tokio::time::sleep(wait).await;
    Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
}

fn get(n: usize) -> Request<Full<Bytes>> {
    Request::get(format!("http://upstream/{n}"))
        .body(Full::new(Bytes::new()))
        .expect("a request")
}

/// Sorted latencies of the calls through `svc`.
async fn run<S, R>(svc: S) -> Vec<Duration>
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<R>> + Clone + Send + 'static,
    S::Error: std::fmt::Debug + Send,
    S::Future: Send,
    R: Send + 'static,
{
    let mut set = JoinSet::new();
    for t in 0..TASKS {
        let svc = svc.clone();
        set.spawn(async move {
            let mut out = Vec::new();
            for n in (t..CALLS).step_by(TASKS) {
                let started = Instant::now();
                let resp = svc.clone().oneshot(get(n)).await.expect("an answer");
                std::hint::black_box(resp);
                out.push(started.elapsed());
            }
            out
        });
    }
    let mut all = Vec::with_capacity(CALLS);
    while let Some(done) = set.join_next().await {
        all.extend(done.expect("the task"));
    }
    all.sort();
    all
}

fn q(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// tower's `Hedge` needs to clone requests itself.
#[derive(Clone)]
struct CloneGet;

impl tower::hedge::Policy<Request<Full<Bytes>>> for CloneGet {
    fn clone_request(&self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        let mut copy = Request::new(req.body().clone());
        *copy.method_mut() = req.method().clone();
        *copy.uri_mut() = req.uri().clone();
        *copy.headers_mut() = req.headers().clone();
        Some(copy)
    }

    fn can_retry(&self, _: &Request<Full<Bytes>>) -> bool {
        true
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        println!("| variant | p50 | p99 | p99.9 | extra sends |");
        println!("|---|---|---|---|---|");
        let row = |name: &str, lat: &[Duration], seen: &Seen| {
            println!(
                "| {name} | {:.1} ms | {:.1} ms | {:.1} ms | {} ({:.1} %) |",
                q(lat, 0.5).as_secs_f64() * 1e3,
                q(lat, 0.99).as_secs_f64() * 1e3,
                q(lat, 0.999).as_secs_f64() * 1e3,
                seen.sends() - CALLS,
                (seen.sends() - CALLS) as f64 * 100.0 / CALLS as f64,
            );
        };

        let seen = Seen::default();
        let s = seen.clone();
        let up = service_fn(move |r| answer(s.clone(), r));
        let lat = run(tower_resend::stack().service(up)).await;
        row("tower-resend `stack()`, no hedging", &lat, &seen);

        let seen = Seen::default();
        let s = seen.clone();
        let up = service_fn(move |r| answer(s.clone(), r));
        let lat = run(tower_resend::stack()
            .hedge(Duration::from_millis(10))
            .service(up))
        .await;
        row("tower-resend `.hedge(10 ms)`", &lat, &seen);

        let seen = Seen::default();
        let s = seen.clone();
        let up = service_fn(move |r| answer(s.clone(), r));
        let stack = tower_resend::stack()
            .hedge_at_percentile(0.95, Duration::from_millis(1))
            .service(up);
        let lat = run(stack).await;
        row(
            "tower-resend `.hedge_at_percentile(0.95, 1 ms)`",
            &lat,
            &seen,
        );

        let seen = Seen::default();
        let s = seen.clone();
        let up = service_fn(move |r| answer(s.clone(), r)).map_err(BoxError::from);
        let hedge = tower::hedge::Hedge::new::<Request<Full<Bytes>>>(
            up,
            CloneGet,
            64,
            0.95,
            Duration::from_secs(10),
        );
        // Not Clone: shared behind tower's Buffer, as a user would.
        let hedge = tower::buffer::Buffer::new(hedge, 64);
        let lat = run(hedge).await;
        row("tower `Hedge` (p95, after 64 calls)", &lat, &seen);
    });
}
