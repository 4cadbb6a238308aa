//! Requests per second at concurrency 16 on loopback through an axum
//! handler: with no layer, with the IdempotencyLayer on each store, and
//! with it over a store that keeps nothing (the layer's own cost).
//! Every request is a POST with a fresh Idempotency-Key (the full path:
//! body read and hashed, lease taken, handler run, response stored).
//!
//! `cargo bench -p tower-resend-benches --all-features --bench server_throughput`
//! (Redis and PostgreSQL rows need the servers of `RESEND_REDIS_URL` and
//! `RESEND_PG_URL`; missing ones are skipped). Each round gives every row a
//! short slice of load, in an order that turns from round to round, and
//! each row is compared with the no-layer row (with the same handler) of
//! its own round.
//! `RESEND_BENCH_ROUNDS=n` sets the rounds (15), `RESEND_BENCH_SECS=s` the
//! measured seconds of a slice (0.5), `RESEND_BENCH_MEMORY_ONLY=1` leaves
//! out the Redis and PostgreSQL rows, `RESEND_BENCH_ONLY=text` keeps the
//! rows whose name holds `text`, `RESEND_BENCH_WORKERS=n` runs it on `n`
//! workers (2).
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::future::{ready, Future};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend_benches::keyed::{serve, Load};
use tower_resend_benches::median;
use tower_resend_server::store::{Begin, Claim, LeaseState, StoredResponse, Ttl};
use tower_resend_server::{IdempotencyLayer, MemoryStore, Store, StoreError};

const CONCURRENCY: usize = 16;
/// Load before a target's first slice: its connections made, its code and
/// data warm.
const WARMUP: Duration = Duration::from_millis(500);
/// Load before every later slice (the connections are kept between slices).
const SLICE_WARMUP: Duration = Duration::from_millis(50);
/// A slice: one target's measured time in a round.
const MEASURE: Duration = Duration::from_millis(500);
const ROUNDS: usize = 15;

type Client = tower_resend::connect::HyperClient;

async fn handler(body: Bytes) -> String {
    format!("ok {}", body.len())
}

/// A handler that waits once before it answers, as one that calls a
/// database does: the layer then arms its lease's renewal timer.
async fn waiting(body: Bytes) -> String {
    tokio::task::yield_now().await;
    format!("ok {}", body.len())
}

/// A store that keeps nothing and answers at once: with it, the row
/// measures the layer's own work (body read, fingerprint, key, scope,
/// futures, renewal registration) apart from the memory store's. Every key
/// is new to it, so it suits only this bench.
#[derive(Clone)]
struct NullStore;

impl Store for NullStore {
    fn begin(
        &self,
        _: &Claim<'_>,
        _: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        ready(Ok(Begin::Acquired))
    }
    fn renew(
        &self,
        _: &Claim<'_>,
        _: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        ready(Ok(LeaseState::Held))
    }
    fn complete(
        &self,
        _: &Claim<'_>,
        _: &StoredResponse,
        _: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        ready(Ok(LeaseState::Held))
    }
    fn release(&self, _: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send {
        ready(Ok(()))
    }
}

fn plain() -> Router {
    Router::new().route("/orders", post(handler))
}

fn with_store<St: Store>(store: St) -> Router {
    plain().layer(IdempotencyLayer::new(store))
}

/// The steady rows' layer: the default bounds, records kept 1 s.
fn steady() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(MemoryStore::new()).record_ttl(Duration::from_secs(1))
}

/// CPU time of this process (client and server, all threads) in seconds:
/// in user space, from `/proc/self/stat` (10 ms ticks), and in all, from
/// each thread's `/proc/self/task/*/schedstat` (nanoseconds, so that a
/// short slice is measured as well as a long one). Linux; `None` elsewhere.
fn cpu_seconds() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command (which may hold spaces): state is the 3rd,
    // utime the 14th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let utime: f64 = rest.split(' ').nth(11)?.parse().ok()?;
    let mut total_ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path().join("schedstat");
        // A thread that ended between the listing and the read is skipped.
        if let Ok(s) = std::fs::read_to_string(path) {
            total_ns += s.split(' ').next()?.parse::<u64>().ok()?;
        }
    }
    Some((utime / 100.0, total_ns as f64 / 1e9))
}

/// Sends from [`CONCURRENCY`] tasks through `client` for `warmup`, then
/// counts the answers over `measure`: requests per second, and the CPU time
/// per request in microseconds (client and server together; user space,
/// and in all), which the other load on a shared machine disturbs less than
/// the rate.
async fn load(client: &Client, url: &str, warmup: Duration, measure: Duration) -> Slice {
    let load = Load::start(client, url, CONCURRENCY);
    tokio::time::sleep(warmup).await;
    let (start, before, cpu) = (Instant::now(), load.answered(), cpu_seconds());
    tokio::time::sleep(measure).await;
    let done = load.answered() - before;
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu.zip(cpu_seconds()).map(|(a, b)| {
        let per = |x: f64, y: f64| (y - x) * 1e6 / done as f64;
        Cpu {
            user: per(a.0, b.0),
            total: per(a.1, b.1),
        }
    });
    load.stop().await;
    Slice {
        rate: done as f64 / secs,
        cpu,
    }
}

/// One target's slice of a round.
struct Slice {
    /// Requests per second.
    rate: f64,
    cpu: Option<Cpu>,
}

/// CPU time per request, in microseconds.
#[derive(Clone, Copy)]
struct Cpu {
    /// User space, client and server.
    user: f64,
    /// In all, client and server.
    total: f64,
}

fn main() {
    // Two workers (the machine's cores), or `RESEND_BENCH_WORKERS=n`.
    let workers = std::env::var("RESEND_BENCH_WORKERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2usize)
        .max(1);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench());
}

async fn bench() {
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
            .max(1)
    };
    let measure = std::env::var("RESEND_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(MEASURE, Duration::from_secs_f64);
    let memory_only = std::env::var_os("RESEND_BENCH_MEMORY_ONLY").is_some();

    // Each row, and the row it is compared with.
    let mut targets: Vec<(&str, String, usize)> = vec![
        ("axum, no layer", serve(plain()).await, 0),
        (
            // What any layer costs on an axum route: `Router::layer` boxes
            // the layered service again, and each request clones it.
            "axum, a layer that does nothing",
            serve(plain().layer(tower::layer::util::Identity::new())).await,
            0,
        ),
        (
            // A store filling up from empty: every request leaves a record
            // (24 h), each in memory never used before.
            "IdempotencyLayer + MemoryStore, filling",
            serve(with_store(
                MemoryStore::new().max_records(4_000_000).max_bytes(1 << 30),
            ))
            .await,
            0,
        ),
        (
            // A store at its bound, as a long-running server's is: the
            // default bounds (100 000 records), records kept 1 s, so that
            // as many expire as come and their memory is used again.
            "IdempotencyLayer + MemoryStore, steady",
            serve(plain().layer(steady())).await,
            0,
        ),
        (
            "axum, no layer, a handler that waits once",
            serve(Router::new().route("/orders", post(waiting))).await,
            4,
        ),
        (
            // The same handler: its lease's renewal timer is armed.
            "IdempotencyLayer + MemoryStore, steady, a handler that waits once",
            serve(
                Router::new()
                    .route("/orders", post(waiting))
                    .layer(steady()),
            )
            .await,
            4,
        ),
        (
            // The layer's own cost: the same handler and layer, over a store
            // that keeps nothing.
            "IdempotencyLayer + a store that keeps nothing, a handler that waits once",
            serve(
                Router::new()
                    .route("/orders", post(waiting))
                    .layer(IdempotencyLayer::new(NullStore)),
            )
            .await,
            4,
        ),
    ];
    #[cfg(feature = "redis")]
    if !memory_only {
        let url =
            std::env::var("RESEND_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let store = tower_resend_server::RedisStore::open(&url)
            .unwrap()
            .prefix(format!("resend-bench:{}:", uuid::Uuid::new_v4().simple()));
        targets.push((
            "IdempotencyLayer + RedisStore",
            serve(with_store(store)).await,
            0,
        ));
    }
    #[cfg(feature = "postgres")]
    if !memory_only {
        let url = std::env::var("RESEND_PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect_lazy(&url)
            .unwrap();
        let store =
            tower_resend_server::PostgresStore::with_table(pool, "resend_idempotency_bench")
                .unwrap();
        match store.migrate().await {
            Ok(()) => targets.push((
                "IdempotencyLayer + PostgresStore",
                serve(with_store(store)).await,
                0,
            )),
            Err(e) => eprintln!("PostgreSQL unusable, row skipped: {e}"),
        }
    }
    // `RESEND_BENCH_ONLY=text` keeps only the rows whose name holds `text`,
    // for a profiler's run of one row (the ratios are then to the first row
    // kept).
    if let Ok(only) = std::env::var("RESEND_BENCH_ONLY") {
        targets.retain(|(name, ..)| name.contains(only.as_str()));
        for target in &mut targets {
            target.2 = 0;
        }
    }
    if quick {
        for (_, url, _) in &targets {
            let client: Client = tower_resend::hyper_client(Duration::from_secs(1));
            let req = Request::post(url.as_str())
                .header("idempotency-key", uuid::Uuid::new_v4().to_string())
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            let status = client.oneshot(req).await.unwrap().status();
            assert!(status.is_success() || status == 503, "{status}");
        }
        return;
    }

    // Rounds interleave the targets in short slices, each round in another
    // order, so that the drift of a shared machine (its other load, its
    // clock) hits every target alike and is compared within the round.
    let clients: Vec<Client> = targets
        .iter()
        .map(|_| tower_resend::hyper_client(Duration::from_secs(1)))
        .collect();
    for ((_, url, _), client) in targets.iter().zip(&clients) {
        load(client, url, WARMUP, Duration::from_millis(100)).await;
    }
    let mut slices: Vec<Vec<Slice>> = targets.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for k in 0..targets.len() {
            let i = (k + round) % targets.len();
            slices[i].push(load(&clients[i], &targets[i].1, SLICE_WARMUP, measure).await);
        }
    }
    report(&targets, &slices, rounds);
}

/// Prints one row per target: its median rate, and its medians of per-round
/// ratios to its baseline row (the no-layer one with the same handler) in
/// rate and in CPU time per request. A ratio to the baseline of the same
/// round, then its median, is less sensitive to drift between rounds than a
/// ratio of medians. The CPU ratio (the baseline's CPU per request over this
/// one's) is the throughput ratio the layer allows when the process has the
/// cores to itself.
fn report(targets: &[(&str, String, usize)], slices: &[Vec<Slice>], rounds: usize) {
    let per_round = |row: &[Slice], base: &[Slice], f: &dyn Fn(&Slice, &Slice) -> Option<f64>| {
        let v: Vec<f64> = row.iter().zip(base).filter_map(|(x, b)| f(x, b)).collect();
        (!v.is_empty()).then(|| median(v))
    };
    let cpu_med = |row: &[Slice], f: &dyn Fn(&Cpu) -> f64| {
        let v: Vec<f64> = row.iter().filter_map(|s| s.cpu.as_ref().map(f)).collect();
        (!v.is_empty()).then(|| median(v))
    };
    let show = |x: Option<f64>, unit: &str| x.map_or("-".to_owned(), |x| format!("{x:.1}{unit}"));
    println!(
        "| setup | req/s (median of {rounds}) | vs its baseline | median per-round ratio \
         | CPU µs/req (median) | user CPU µs/req (median) | median per-round CPU ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    for ((name, _, base), row) in targets.iter().zip(slices) {
        let base = &slices[*base];
        let base_rate = median(base.iter().map(|s| s.rate).collect());
        let rate = median(row.iter().map(|s| s.rate).collect());
        let ratio = per_round(row, base, &|x, b| Some(100.0 * x.rate / b.rate));
        let cpu_ratio = per_round(row, base, &|x, b| Some(100.0 * b.cpu?.total / x.cpu?.total));
        println!(
            "| {name} | {rate:.0} | {:.1}% | {} | {} | {} | {} | rounds: {:?}",
            100.0 * rate / base_rate,
            show(ratio, "%"),
            show(cpu_med(row, &|c| c.total), ""),
            show(cpu_med(row, &|c| c.user), ""),
            show(cpu_ratio, "%"),
            row.iter().map(|s| s.rate.round()).collect::<Vec<_>>(),
        );
    }
}
