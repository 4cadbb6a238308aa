//! What transactional idempotency costs over the handler's own
//! transaction: requests per second at concurrency 16 on loopback through
//! an axum handler that does one INSERT in a transaction, with and without
//! the layer. Every request is a POST with a fresh Idempotency-Key.
//!
//! `cargo bench -p tower-resend-benches --features postgres --bench server_transactional`
//! (the PostgreSQL of `RESEND_PG_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`). Rows:
//! - the handler's own transaction (`pool.begin()`, INSERT, commit), no
//!   layer: the baseline;
//! - `PostgresTransactional`: the handler's INSERT in the transaction the
//!   layer lends it; the key's claim and record in the same transaction,
//!   one commit in all, and no round trip of their own (the claim goes with
//!   the BEGIN, the record with the COMMIT);
//! - like for like: the same claim and record written by hand in the
//!   handler's own transaction, with the statements the layer sends (the
//!   claim with the BEGIN, the record, through the table's record function,
//!   with the COMMIT: what a user would write to get the same behaviour
//!   without the layer, at its cheapest);
//! - the same by hand, one statement per round trip: BEGIN, the claim
//!   (`INSERT ... ON CONFLICT`), the INSERT, the record (UPDATE), COMMIT —
//!   five round trips, as the layer sent before;
//! - `PostgresStore` (a lease in the store) around the handler's own
//!   transaction: the lease's commit, the handler's, the response's.
//!
//! `RESEND_PG_DELAY_MS=0.5` (say) puts a relay between the rows' pools and
//! the database that holds each answer that long, as a network would: the
//! rows then differ by their round trips more than by their CPU.
//! `RESEND_PG_COMMIT_DELAY_US=2000` (say) sets the rows' sessions'
//! `commit_delay` (a superuser setting), which holds each commit's flush of
//! the log that long (while other transactions run, as under load here), as
//! a slower disk would: the rows then differ by their commits.
//!
//! Each round gives every row a slice of load (`RESEND_BENCH_SECS`, 1 s),
//! in an order that turns from round to round (`RESEND_BENCH_ROUNDS`, 9);
//! a row's figure is the median over the rounds of its ratio to the
//! baseline's slice of the same round.
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use sqlx::PgPool;
use tokio::time::Instant;
use tower_resend_benches::keyed::{serve, Load};
use tower_resend_benches::median;
use tower_resend_server::{IdempotencyLayer, IdempotentTx, PostgresStore};

const CONCURRENCY: usize = 16;
const ROUNDS: usize = 9;
const MEASURE: Duration = Duration::from_secs(1);
const TABLE: &str = "resend_idempotency_bench_tx_ff";

type Client = tower_resend::connect::HyperClient;

/// The handler's work: one INSERT, in `conn`'s transaction.
async fn insert_order(conn: &mut sqlx::PgConnection, body: &[u8]) -> i64 {
    sqlx::query_scalar("INSERT INTO resend_bench_orders (body) VALUES ($1) RETURNING id")
        .bind(body)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The handler without the layer: its own transaction.
async fn own(State(pool): State<PgPool>, body: Bytes) -> String {
    let mut tx = pool.begin().await.unwrap();
    let id = insert_order(&mut tx, &body).await;
    tx.commit().await.unwrap();
    format!("order {id}")
}

/// Like for like: the same exactly-once behaviour written by hand in the
/// handler's own transaction, with the statements the layer sends — the key
/// claimed by a plain INSERT sent with the BEGIN (`begin_with`), the
/// response recorded by the table's record function (an UPDATE that fails
/// unless it found the claim), sent with the COMMIT — without the layer.
/// (Simple queries take no parameters: the key goes in as a quoted
/// literal, as the layer's does.)
async fn by_hand(State(pool): State<PgPool>, headers: http::HeaderMap, body: Bytes) -> String {
    let key = literal(headers["idempotency-key"].to_str().unwrap());
    let token = uuid::Uuid::new_v4().simple().to_string();
    let fingerprint = "00".repeat(32);
    let mut tx = pool
        .begin_with(format!(
            "INSERT INTO {TABLE} (scope, key, fingerprint, token, done, expires_at, response)
             VALUES ('anonymous', {key}, decode('{fingerprint}', 'hex'), '{token}', false,
                     clock_timestamp() + interval '1 day', NULL); BEGIN"
        ))
        .await
        .unwrap();
    let id = insert_order(&mut tx, &body).await;
    let answer = format!("order {id}");
    let response: String = answer.bytes().map(|b| format!("{b:02x}")).collect();
    let record = format!(
        "SELECT {TABLE}_record('anonymous', {key}, '{token}', decode('{response}', 'hex'));
         COMMIT; BEGIN"
    );
    sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&record))
        .await
        .unwrap();
    // Committed: what is left open is the empty transaction after it, which
    // the ROLLBACK queued by the drop ends.
    drop(tx);
    answer
}

/// The same by hand, one statement per round trip (BEGIN, the claim with
/// `ON CONFLICT`, the INSERT, the record, COMMIT): what the layer sent
/// before its claim went with the BEGIN and its record with the COMMIT.
async fn by_hand_plain(
    State(pool): State<PgPool>,
    headers: http::HeaderMap,
    body: Bytes,
) -> String {
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
    let id = insert_order(&mut tx, &body).await;
    let answer = format!("order {id}");
    let written = sqlx::query(&format!(
        "UPDATE {TABLE} SET done = true, response = $3 WHERE scope = 'anonymous' AND key = $1 AND token = $2"
    ))
    .bind(&key)
    .bind(&token)
    .bind(answer.as_bytes())
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_eq!(written.rows_affected(), 1);
    tx.commit().await.unwrap();
    answer
}

/// `s` as an SQL string literal: `E'...'`, `\` and `'` doubled.
fn literal(s: &str) -> String {
    format!("E'{}'", s.replace('\\', "\\\\").replace('\'', "''"))
}

/// The same handler under the transactional layer: the layer's transaction.
async fn lent(mut tx: IdempotentTx, body: Bytes) -> String {
    let id = insert_order(&mut tx, &body).await;
    format!("order {id}")
}

/// A relay on loopback to the database at `upstream` that holds what the
/// database sends for `delay` before passing it on, as a network between
/// the application and its database would; what the application sends
/// goes through at once. Threads of its own (a thread's sleep is finer
/// than tokio's timer, which counts whole milliseconds), so that it takes
/// no time from the runtime under test. Its address.
fn delayed(upstream: String, delay: Duration) -> std::net::SocketAddr {
    use std::net::{TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for app in listener.incoming() {
            let (Ok(app), Ok(db)) = (app, TcpStream::connect(&upstream)) else {
                continue;
            };
            for s in [&app, &db] {
                s.set_nodelay(true).unwrap();
            }
            let (app2, db2) = (app.try_clone().unwrap(), db.try_clone().unwrap());
            std::thread::spawn(move || relay(app, db, Duration::ZERO));
            std::thread::spawn(move || relay(db2, app2, delay));
        }
    });
    addr
}

/// Copies what `from` sends to `to`, each read `delay` later.
fn relay(mut from: std::net::TcpStream, mut to: std::net::TcpStream, delay: Duration) {
    use std::io::{Read, Write};
    let (queue, queued) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        for (at, bytes) in queued {
            if let Some(wait) = at.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    let mut buf = vec![0; 64 * 1024];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        let at = Instant::now() + delay;
        if queue.send((at, buf[..n].to_vec())).is_err() {
            break;
        }
    }
}

/// Requests per second over `measure`, after `warmup`.
async fn load(client: &Client, url: &str, warmup: Duration, measure: Duration) -> f64 {
    let load = Load::start(client, url, CONCURRENCY);
    tokio::time::sleep(warmup).await;
    let (start, before) = (Instant::now(), load.answered());
    tokio::time::sleep(measure).await;
    let done = load.answered() - before;
    let secs = start.elapsed().as_secs_f64();
    load.stop().await;
    done as f64 / secs
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
    // `RESEND_PG_DELAY_MS`: what the database sends reaches the rows'
    // pools that much later (0: directly).
    let delay = std::env::var("RESEND_PG_DELAY_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::ZERO, Duration::from_secs_f64)
        / 1000;
    let options = {
        use std::str::FromStr;
        let direct = sqlx::postgres::PgConnectOptions::from_str(&url).expect("RESEND_PG_URL");
        if delay.is_zero() {
            direct
        } else {
            let upstream = format!("{}:{}", direct.get_host(), direct.get_port());
            let relay = delayed(upstream, delay);
            direct.host("127.0.0.1").port(relay.port())
        }
    };
    // `RESEND_PG_COMMIT_DELAY_US`: each commit's flush held that long.
    let options = match std::env::var("RESEND_PG_COMMIT_DELAY_US") {
        Ok(us) => {
            let us: u32 = us.parse().expect("RESEND_PG_COMMIT_DELAY_US: microseconds");
            options.options([
                ("commit_delay", us.to_string()),
                ("commit_siblings", "1".into()),
            ])
        }
        Err(_) => options,
    };
    let pool = |n| {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(n)
            .connect_lazy_with(options.clone())
    };
    let setup = pool(2);
    sqlx::query("CREATE TABLE IF NOT EXISTS resend_bench_orders (id bigserial PRIMARY KEY, body bytea NOT NULL)")
        .execute(&setup)
        .await
        .expect("PostgreSQL at RESEND_PG_URL");
    // The table, and its record function (for the layer's record and the
    // one by hand).
    PostgresStore::with_table(setup.clone(), TABLE)
        .unwrap()
        .transactional()
        .migrate()
        .await
        .unwrap();

    // Each row has a pool of its own, as large as the load.
    let size = CONCURRENCY as u32;
    // (The two rows by hand, which never run at once, share one: the
    // database's connections stay under its limit.)
    let by_hand_pool = pool(size);
    let targets: Vec<(&str, String)> = vec![
        (
            "handler's own transaction, no layer",
            serve(
                Router::new()
                    .route("/orders", post(own))
                    .with_state(pool(size)),
            )
            .await,
        ),
        (
            "PostgresTransactional (the handler's transaction, lent)",
            serve(
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
            serve(
                Router::new()
                    .route("/orders", post(by_hand))
                    .with_state(by_hand_pool.clone()),
            )
            .await,
        ),
        (
            "the same by hand, one statement per round trip",
            serve(
                Router::new()
                    .route("/orders", post(by_hand_plain))
                    .with_state(by_hand_pool),
            )
            .await,
        ),
        (
            "PostgresStore around the handler's own transaction",
            serve(
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
        .map(|_| tower_resend::hyper_client(Duration::from_secs(1)))
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
