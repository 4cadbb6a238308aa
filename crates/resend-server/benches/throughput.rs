//! Requests per second at concurrency 16 on loopback through an axum
//! handler: with no layer, and with the IdempotencyLayer on each store.
//! Every request is a POST with a fresh Idempotency-Key (the full path:
//! body read and hashed, lease taken, handler run, response stored).
//!
//! `cargo bench -p resend-server --all-features --bench throughput`
//! (Redis and PostgreSQL rows need the servers of `RESEND_REDIS_URL` and
//! `RESEND_PG_URL`; missing ones are skipped). `RESEND_BENCH_ROUNDS=n`
//! sets the rounds (3), `RESEND_BENCH_SECS=s` the measured seconds of each
//! row in a round (3), `RESEND_BENCH_MEMORY_ONLY=1` leaves out the Redis
//! and PostgreSQL rows, `RESEND_BENCH_ONLY=text` keeps the rows whose name
//! holds `text`.
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use resend_server::{IdempotencyLayer, MemoryStore, Store};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::ServiceExt;

const CONCURRENCY: usize = 16;
const WARMUP: Duration = Duration::from_millis(500);
const MEASURE: Duration = Duration::from_secs(3);
const ROUNDS: usize = 3;

async fn handler(body: Bytes) -> String {
    format!("ok {}", body.len())
}

async fn spawn(app: Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/orders")
}

fn plain() -> Router {
    Router::new().route("/orders", post(handler))
}

fn with_store<St: Store>(store: St) -> Router {
    plain().layer(IdempotencyLayer::new(store))
}

/// CPU time of this process (client and server, all threads) in seconds,
/// in user space and in all, from `/proc/self/stat` (Linux; 10 ms ticks).
/// `None` elsewhere.
fn cpu_seconds() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command (which may hold spaces): state is the 3rd,
    // utime the 14th and stime the 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ').skip(11);
    let utime: f64 = fields.next()?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    Some((utime / 100.0, (utime + stime) / 100.0))
}

/// Requests per second over `measure`, after `WARMUP`, and the CPU time
/// per request in microseconds (client and server together; user space,
/// and in all), which the other load on a shared machine disturbs less than
/// the rate.
async fn load(url: &str, measure: Duration) -> (f64, Option<(f64, f64)>) {
    let client = resend::hyper_client::<Full<Bytes>>(Duration::from_secs(1));
    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let run = uuid::Uuid::new_v4().simple().to_string();
    let mut tasks = Vec::new();
    for w in 0..CONCURRENCY {
        let (client, count, stop, url, run) = (
            client.clone(),
            count.clone(),
            stop.clone(),
            url.to_owned(),
            run.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let req = Request::post(&url)
                    .header("idempotency-key", format!("{run}-{w}-{i}"))
                    .body(Full::new(Bytes::from_static(
                        b"{\"sku\":\"abc\",\"qty\":1}",
                    )))
                    .unwrap();
                let resp = client.clone().oneshot(req).await.unwrap();
                assert!(resp.status().is_success(), "{url}: {}", resp.status());
                resp.into_body().collect().await.unwrap();
                count.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(WARMUP).await;
    let (start, before, cpu) = (Instant::now(), count.load(Ordering::Relaxed), cpu_seconds());
    tokio::time::sleep(measure).await;
    let done = count.load(Ordering::Relaxed) - before;
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu.zip(cpu_seconds()).map(|(a, b)| {
        let per = |x: f64, y: f64| (y - x) * 1e6 / done as f64;
        (per(a.0, b.0), per(a.1, b.1))
    });
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    (done as f64 / secs, cpu)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: then
    // only check that it runs.
    let quick = !std::env::args().any(|a| a == "--bench");
    // `RESEND_BENCH_ROUNDS=n` for more rounds; `RESEND_BENCH_MEMORY_ONLY=1`
    // to leave out the Redis and PostgreSQL rows.
    let rounds = if quick {
        1
    } else {
        std::env::var("RESEND_BENCH_ROUNDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(ROUNDS)
    };
    let measure = std::env::var("RESEND_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(MEASURE, Duration::from_secs_f64);
    let memory_only = std::env::var_os("RESEND_BENCH_MEMORY_ONLY").is_some();

    let mut targets: Vec<(&str, String)> = vec![
        ("axum, no layer", spawn(plain()).await),
        (
            // What any layer costs on an axum route: `Router::layer` boxes
            // the layered service again, and each request clones it.
            "axum, a layer that does nothing",
            spawn(plain().layer(tower::layer::util::Identity::new())).await,
        ),
        (
            // A store filling up from empty: every request leaves a record
            // (24 h), each in memory never used before.
            "IdempotencyLayer + MemoryStore, filling",
            spawn(with_store(
                MemoryStore::new().max_records(4_000_000).max_bytes(1 << 30),
            ))
            .await,
        ),
        (
            // A store at its bound, as a long-running server's is: the
            // default bounds (100 000 records), records kept 1 s, so that
            // as many expire as come and their memory is used again.
            "IdempotencyLayer + MemoryStore, steady",
            spawn(plain().layer(
                IdempotencyLayer::new(MemoryStore::new()).record_ttl(Duration::from_secs(1)),
            ))
            .await,
        ),
    ];
    #[cfg(feature = "redis")]
    if !memory_only {
        let url =
            std::env::var("RESEND_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let store = resend_server::RedisStore::open(&url)
            .unwrap()
            .prefix(format!("resend-bench:{}:", uuid::Uuid::new_v4().simple()));
        targets.push((
            "IdempotencyLayer + RedisStore",
            spawn(with_store(store)).await,
        ));
    }
    #[cfg(feature = "postgres")]
    if !memory_only {
        let url = std::env::var("RESEND_PG_URL")
            .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".into());
        let store = resend_server::PostgresStore::new(&url, "resend_idempotency_bench").unwrap();
        match store.migrate().await {
            Ok(()) => targets.push((
                "IdempotencyLayer + PostgresStore",
                spawn(with_store(store)).await,
            )),
            Err(e) => eprintln!("PostgreSQL unusable, row skipped: {e}"),
        }
    }
    // `RESEND_BENCH_ONLY=text` keeps only the rows whose name holds `text`,
    // for a profiler's run of one row (the ratios are then to the first row
    // kept).
    if let Ok(only) = std::env::var("RESEND_BENCH_ONLY") {
        targets.retain(|(name, _)| name.contains(only.as_str()));
    }
    if quick {
        for (_, url) in &targets {
            let client = resend::hyper_client::<Full<Bytes>>(Duration::from_secs(1));
            let req = Request::post(url.as_str())
                .header("idempotency-key", uuid::Uuid::new_v4().to_string())
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            let status = client.oneshot(req).await.unwrap().status();
            assert!(status.is_success() || status == 503, "{status}");
        }
        return;
    }

    // Rounds interleave the targets, so drift on a shared machine hits all alike.
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
    let mut cpu: Vec<Vec<(f64, f64)>> = vec![Vec::new(); targets.len()];
    for _ in 0..rounds {
        for (i, (_, url)) in targets.iter().enumerate() {
            let (rate, per_request) = load(url, measure).await;
            results[i].push(rate);
            cpu[i].extend(per_request);
        }
    }
    let base = median(results[0].clone());
    let base_rounds = results[0].clone();
    // The ratio to the no-layer run of the same round, then its median:
    // less sensitive to drift between rounds than a ratio of medians.
    let ratio = |r: &[f64]| {
        median(
            r.iter()
                .zip(&base_rounds)
                .map(|(x, b)| 100.0 * x / b)
                .collect(),
        )
    };
    // CPU per request of the no-layer run over this one's, per round: the
    // throughput ratio the layer allows when the process has the cores to
    // itself.
    let cpu_ratio = |c: &[(f64, f64)]| {
        (!c.is_empty() && c.len() == cpu[0].len()).then(|| {
            median(
                c.iter()
                    .zip(&cpu[0])
                    .map(|(x, b)| 100.0 * b.1 / x.1)
                    .collect(),
            )
        })
    };
    println!(
        "| setup | req/s (median of {rounds}) | vs no layer | median per-round ratio \
         | CPU µs/req (median) | user CPU µs/req (median) | median per-round CPU ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (((name, _), r), c) in targets.iter().zip(results).zip(&cpu) {
        let m = median(r.clone());
        let (c_med, u_med, c_ratio) = match (c.is_empty(), cpu_ratio(c)) {
            (false, Some(ratio)) => (
                format!("{:.1}", median(c.iter().map(|x| x.1).collect())),
                format!("{:.1}", median(c.iter().map(|x| x.0).collect())),
                format!("{ratio:.1}%"),
            ),
            _ => ("-".to_owned(), "-".to_owned(), "-".to_owned()),
        };
        println!(
            "| {name} | {m:.0} | {:.1}% | {:.1}% | {c_med} | {u_med} | {c_ratio} | rounds: {:?}, CPU: {:?}",
            100.0 * m / base,
            ratio(&r),
            r.iter().map(|x| x.round()).collect::<Vec<_>>(),
            c.iter()
                .map(|x| (x.1 * 10.0).round() / 10.0)
                .collect::<Vec<_>>()
        );
    }
}
