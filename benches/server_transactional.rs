//! What transactional idempotency costs over the handler's own
//! transaction: requests per second at concurrency 16 on loopback through
//! an axum handler that does one INSERT in a transaction, with and without
//! the layer. Every request is a POST with a fresh Idempotency-Key.
//!
//! `cargo bench -p resend-benches --features postgres --bench server_transactional`
//! (the PostgreSQL of `RESEND_PG_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`). Rows:
//! - the handler's own transaction (`pool.begin()`, INSERT, commit), no
//!   layer: the baseline;
//! - `PostgresTransactional`: the handler's INSERT in the transaction the
//!   layer lends it; the key's claim and record in the same transaction,
//!   one commit in all;
//! - like for like: the same claim and record written by hand in the
//!   handler's own transaction (what a user would write to get the same
//!   behaviour without the layer);
//! - `PostgresStore` (a lease in the store) around the handler's own
//!   transaction: the lease's commit, the handler's, the response's.
//!
//! Each round gives every row a slice of load (`RESEND_BENCH_SECS`, 1 s),
//! in an order that turns from round to round (`RESEND_BENCH_ROUNDS`, 9);
//! a row's figure is the median over the rounds of its ratio to the
//! baseline's slice of the same round.
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use resend_server::{IdempotencyLayer, IdempotentTx, PostgresStore};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::ServiceExt;

const CONCURRENCY: usize = 16;
const ROUNDS: usize = 9;
const MEASURE: Duration = Duration::from_secs(1);
const TABLE: &str = "resend_idempotency_bench_tx_ff";

type Client = resend::HyperClient;

/// The handler without the layer: its own transaction.
async fn own(State(pool): State<PgPool>, body: Bytes) -> String {
    let mut tx = pool.begin().await.unwrap();
    let id: i64 =
        sqlx::query_scalar("INSERT INTO resend_bench_orders (body) VALUES ($1) RETURNING id")
            .bind(&body[..])
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    tx.commit().await.unwrap();
    format!("order {id}")
}

/// Like for like: the same exactly-once behaviour written by hand in the
/// handler's own transaction — the key claimed with the same INSERT, the
/// response recorded with the same UPDATE, one commit — without the layer.
async fn by_hand(State(pool): State<PgPool>, headers: http::HeaderMap, body: Bytes) -> String {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let token = uuid::Uuid::new_v4().simple().to_string();
    let mut tx = pool.begin().await.unwrap();
    let claimed = sqlx::query(&format!(
        "INSERT INTO {TABLE} AS r (scope, key, fingerprint, token, done, expires_at, response)
         VALUES ('anonymous', $1, $2, $3, false, clock_timestamp() + interval '1 day', NULL)
         ON CONFLICT (scope, key) DO UPDATE SET token = EXCLUDED.token
           WHERE r.expires_at <= clock_timestamp()
         RETURNING 1"
    ))
    .bind(&key)
    .bind(&[0u8; 32][..])
    .bind(&token)
    .fetch_optional(&mut *tx)
    .await
    .unwrap();
    assert!(claimed.is_some());
    let id: i64 =
        sqlx::query_scalar("INSERT INTO resend_bench_orders (body) VALUES ($1) RETURNING id")
            .bind(&body[..])
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    let answer = format!("order {id}");
    sqlx::query(&format!(
        "UPDATE {TABLE} SET done = true, response = $3 WHERE scope = 'anonymous' AND key = $1 AND token = $2"
    ))
    .bind(&key)
    .bind(&token)
    .bind(answer.as_bytes())
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    answer
}

/// The same handler under the transactional layer: the layer's transaction.
async fn lent(mut tx: IdempotentTx, body: Bytes) -> String {
    let id: i64 =
        sqlx::query_scalar("INSERT INTO resend_bench_orders (body) VALUES ($1) RETURNING id")
            .bind(&body[..])
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    format!("order {id}")
}

async fn spawn(app: Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/orders")
}

async fn load(client: &Client, url: &str, warmup: Duration, measure: Duration) -> f64 {
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
    tokio::time::sleep(warmup).await;
    let (start, before) = (Instant::now(), count.load(Ordering::Relaxed));
    tokio::time::sleep(measure).await;
    let done = count.load(Ordering::Relaxed) - before;
    let secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    done as f64 / secs
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
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
    let url = std::env::var("RESEND_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = |n| {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(n)
            .connect_lazy(&url)
            .unwrap()
    };
    let setup = pool(2);
    sqlx::query("CREATE TABLE IF NOT EXISTS resend_bench_orders (id bigserial PRIMARY KEY, body bytea NOT NULL)")
        .execute(&setup)
        .await
        .expect("PostgreSQL at RESEND_PG_URL");
    let store = PostgresStore::with_table(setup.clone(), TABLE).unwrap();
    store.migrate().await.unwrap();

    // Each row has a pool of its own, as large as the load.
    let size = CONCURRENCY as u32;
    let targets: Vec<(&str, String)> = vec![
        (
            "handler's own transaction, no layer",
            spawn(
                Router::new()
                    .route("/orders", post(own))
                    .with_state(pool(size)),
            )
            .await,
        ),
        (
            "PostgresTransactional (the handler's transaction, lent)",
            spawn(
                Router::new()
                    .route("/orders", post(lent))
                    .layer(IdempotencyLayer::new(
                        PostgresStore::with_table(pool(size), TABLE)
                            .unwrap()
                            .transactional(),
                    )),
            )
            .await,
        ),
        (
            "the same claim and record written by hand in the handler's transaction",
            spawn(
                Router::new()
                    .route("/orders", post(by_hand))
                    .with_state(pool(size)),
            )
            .await,
        ),
        (
            "PostgresStore around the handler's own transaction",
            spawn(
                Router::new()
                    .route("/orders", post(own))
                    .with_state(pool(size))
                    .layer(IdempotencyLayer::new(
                        PostgresStore::with_table(pool(size), TABLE).unwrap(),
                    )),
            )
            .await,
        ),
    ];
    // `RESEND_BENCH_ONLY=text` keeps only the rows whose name holds `text`
    // (for a profiler's run of one row).
    let mut targets = targets;
    if let Ok(only) = std::env::var("RESEND_BENCH_ONLY") {
        targets.retain(|(name, _)| name.contains(only.as_str()));
    }
    let clients: Vec<Client> = targets
        .iter()
        .map(|_| resend::hyper_client(Duration::from_secs(1)))
        .collect();
    if quick {
        for ((_, url), client) in targets.iter().zip(&clients) {
            load(client, url, Duration::ZERO, Duration::from_millis(50)).await;
        }
        return;
    }
    for ((_, url), client) in targets.iter().zip(&clients) {
        load(
            client,
            url,
            Duration::from_millis(500),
            Duration::from_millis(100),
        )
        .await;
    }
    let mut rates: Vec<Vec<f64>> = targets.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for k in 0..targets.len() {
            let i = (k + round) % targets.len();
            let rate = load(
                &clients[i],
                &targets[i].1,
                Duration::from_millis(100),
                measure,
            )
            .await;
            rates[i].push(rate);
        }
    }
    println!("| setup | req/s (median of {rounds}) | median per-round ratio |");
    println!("|---|---|---|");
    for ((name, _), row) in targets.iter().zip(&rates) {
        let ratios: Vec<f64> = row
            .iter()
            .zip(&rates[0])
            .map(|(x, b)| 100.0 * x / b)
            .collect();
        println!(
            "| {name} | {:.0} | {:.1}% | rounds: {:?}",
            median(row.clone()),
            median(ratios),
            row.iter().map(|r| r.round()).collect::<Vec<_>>()
        );
    }
}
