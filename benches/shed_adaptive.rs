//! The adaptive `ShedLayer` beside the fixed one and tower's
//! `ConcurrencyLimit` under `LoadShed`, at the same offered loads: a server
//! of 64 slots of 20 ms work, offered 1.5x of that while its capacity goes
//! 64 -> 32 -> 64 slots (4 s each), and 0.5x of it at 64 slots. Callers are
//! tower-resend stacks of up to 3 attempts (3 s a call). Per phase: the
//! server's goodput as a share of the phase's capacity, the p99 of accepted
//! work (the layer's queue and the work) over the phase and from a second
//! into it, the share of the work run that was retries, and the requests
//! refused. The fixed limits are 64, the capacity at the start.
//!
//! `cargo bench -p tower-resend-benches --bench shed_adaptive` (real clock,
//! in process; about a minute). The paused-clock form of the 1.5x run, with
//! its assertions, is `the_adaptive_limit_follows_a_capacity_that_changes`
//! in the server crate's `tests/shed.rs`.
#![allow(missing_docs, clippy::print_stdout)]

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_resend_server::{AdaptiveLimit, ShedLayer};

const WORK: Duration = Duration::from_millis(20);
const SLOTS: usize = 64;
const PHASE: Duration = Duration::from_secs(4);

type Server = BoxCloneService<Request<Full<Bytes>>, Response<Full<Bytes>>, Infallible>;

/// One answer of the server behind the layer.
#[derive(Clone, Copy)]
struct Answer {
    at: Duration,
    took: Duration,
    ok: bool,
    retry: bool,
}

/// `SLOTS` slots of `WORK`, some of which can be taken away.
fn busy_server(workers: Arc<Semaphore>) -> Server {
    BoxCloneService::new(service_fn(move |_: Request<Full<Bytes>>| {
        let workers = Arc::clone(&workers);
        async move {
            // The work goes on if the caller goes (a job started finishes).
            let work = tokio::spawn(async move {
                let _slot = workers.acquire_owned().await;
                tokio::time::sleep(WORK).await;
            });
            let _ = work.await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    }))
}

/// `server` behind a `ShedLayer`.
fn shed(server: Server, layer: ShedLayer) -> Server {
    let svc = ServiceBuilder::new().layer(layer).service(server);
    BoxCloneService::new(service_fn(move |req| {
        let svc = svc.clone();
        async move {
            let (parts, body) = svc.oneshot(req).await?.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            Ok(Response::from_parts(parts, Full::new(body)))
        }
    }))
}

/// `server` behind tower's `LoadShed` over `ConcurrencyLimit(SLOTS)`, an
/// overload answered 503 (as axum's `HandleErrorLayer` would).
fn tower_load_shed(server: Server) -> Server {
    let svc = ServiceBuilder::new()
        .load_shed()
        .concurrency_limit(SLOTS)
        .service(server);
    BoxCloneService::new(service_fn(move |req| {
        let svc = svc.clone();
        async move {
            Ok::<_, Infallible>(svc.oneshot(req).await.unwrap_or_else(|_overloaded| {
                let mut resp = Response::new(Full::default());
                *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                resp
            }))
        }
    }))
}

/// `server` with its answers written down.
fn logged(server: Server, log: Arc<Mutex<Vec<Answer>>>, start: Instant) -> Server {
    BoxCloneService::new(service_fn(move |req: Request<Full<Bytes>>| {
        let (server, log) = (server.clone(), Arc::clone(&log));
        let retry = req.headers().contains_key("resend-previous-attempts");
        async move {
            let arrived = Instant::now();
            let resp = server.oneshot(req).await?;
            let answer = Answer {
                at: arrived.duration_since(start),
                took: arrived.elapsed(),
                ok: resp.status() == StatusCode::OK,
                retry,
            };
            log.lock().unwrap_or_else(|e| e.into_inner()).push(answer);
            Ok(resp)
        }
    }))
}

/// Offers `rate` calls a second for `phases` phases, the capacity halved in
/// the middle one when there are three; what the server answered.
async fn run(variant: usize, rate: u32, phases: u32) -> Vec<Answer> {
    let workers = Arc::new(Semaphore::new(SLOTS));
    let server = busy_server(Arc::clone(&workers));
    let server = match variant {
        0 => shed(server, ShedLayer::adaptive(AdaptiveLimit::new())),
        1 => shed(server, ShedLayer::new(SLOTS)),
        _ => tower_load_shed(server),
    };
    let start = Instant::now();
    let log = Arc::new(Mutex::new(Vec::new()));
    let client = tower_resend::stack()
        .no_budget()
        .max_attempts(3)
        .total(Duration::from_secs(3))
        .attempt_timeout(Duration::from_millis(500))
        .seed(3)
        .service(logged(server, Arc::clone(&log), start));
    if phases == 3 {
        let workers = Arc::clone(&workers);
        tokio::spawn(async move {
            tokio::time::sleep_until(start + PHASE).await;
            let held: OwnedSemaphorePermit = workers
                .acquire_many_owned(SLOTS as u32 / 2)
                .await
                .expect("open");
            tokio::time::sleep_until(start + 2 * PHASE).await;
            drop(held);
        });
    }
    let gap = Duration::from_secs(1) / rate;
    let mut calls = JoinSet::new();
    for i in 0..rate * phases * PHASE.as_secs() as u32 {
        tokio::time::sleep_until(start + gap * i).await;
        let client = client.clone();
        calls.spawn(async move {
            let req = Request::get("http://server/work")
                .body(Full::default())
                .expect("valid request");
            let _ = client.oneshot(req).await;
        });
    }
    while calls.join_next().await.is_some() {}
    let answers = log.lock().unwrap_or_else(|e| e.into_inner()).clone();
    answers
}

fn p99(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs.get(xs.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or_default()
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let full = SLOTS as f64 / WORK.as_secs_f64();
    const NAMES: [&str; 3] = [
        "`ShedLayer::adaptive`",
        "`ShedLayer::new(64)`",
        "tower `LoadShed` + `ConcurrencyLimit(64)`",
    ];
    println!(
        "| offered | variant | phase (slots) | goodput | p99 | p99 from 1 s in | retries in work run | shed |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (load, phases) in [(1.5, 3), (0.5, 1)] {
        for (variant, name) in NAMES.iter().enumerate() {
            let answers = rt.block_on(run(variant, (full * load) as u32, phases));
            for phase in 0..phases {
                let slots = if phases == 3 && phase == 1 {
                    SLOTS / 2
                } else {
                    SLOTS
                };
                let (from, to) = (PHASE * phase, PHASE * (phase + 1));
                let here: Vec<&Answer> = answers
                    .iter()
                    .filter(|a| a.at >= from && a.at < to)
                    .collect();
                let ok: Vec<&&Answer> = here.iter().filter(|a| a.ok).collect();
                let capacity = slots as f64 / WORK.as_secs_f64() * PHASE.as_secs_f64();
                let retries = ok.iter().filter(|a| a.retry).count();
                let settled = ok
                    .iter()
                    .filter(|a| a.at >= from + Duration::from_secs(1))
                    .map(|a| a.took);
                println!(
                    "| {load}x | {name} | {phase} ({slots}) | {:.2} | {:.0} ms | {:.0} ms | {:.0} % | {} |",
                    ok.len() as f64 / capacity,
                    p99(ok.iter().map(|a| a.took).collect()).as_secs_f64() * 1e3,
                    p99(settled.collect()).as_secs_f64() * 1e3,
                    100.0 * retries as f64 / ok.len().max(1) as f64,
                    here.len() - ok.len(),
                );
            }
        }
    }
}
