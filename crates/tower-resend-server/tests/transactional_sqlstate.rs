//! A statement of the handler's that fails, unanswered, under
//! `PostgresTransactional`: its transaction is aborted, nothing of it
//! commits, and the layer answers by what the statement's SQLSTATE means
//! for another try. A violated constraint fails the same every time: a
//! final 422 that a client does not send again. A serialization failure
//! passes next time: a 503 with `Retry-After: 1`, which a client sends
//! again, and the work is done once. Anything else: a 500, as before. The
//! key is free in every case.
//!
//! On the real PostgreSQL of this machine, through a tower-resend client
//! stack over loopback where the client's decision is the point. Without
//! PostgreSQL: skipped with a warning, or failed when `CI` is set.
//!
//! The clock is real: the pool's and the layer's timeouts wait on sockets,
//! and a paused clock would jump past them while PostgreSQL answers. The
//! one real wait is the client's `Retry-After` of a second.
#![cfg(all(feature = "postgres", feature = "axum"))]
#![allow(clippy::print_stderr)]

#[path = "support/pg.rs"]
mod pg;
#[path = "support/serve.rs"]
mod serve;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use sqlx::PgPool;
use tokio::sync::OnceCell;
use tower::ServiceExt;
use tower_resend::{retry::Attempts, IdempotencyKey};
use tower_resend_server::{IdempotencyLayer, IdempotentTx, InboundDeadlineLayer, PostgresStore};

const TABLE: &str = "resend_idempotency_sqlstate_test";

fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

/// The pool, with the tables made; `None` (skip) without PostgreSQL.
async fn pool() -> Option<PgPool> {
    static READY: OnceCell<bool> = OnceCell::const_new();
    let url = pg::url();
    let ready = *READY
        .get_or_init(|| async {
            let pool = pg::pool(&url, 2);
            let made = async {
                PostgresStore::with_table(pool.clone(), TABLE)?
                    .transactional()
                    .migrate()
                    .await?;
                for table in [
                    "CREATE TABLE IF NOT EXISTS resend_sqlstate_effects (id bigserial PRIMARY KEY, op text NOT NULL)",
                    "CREATE TABLE IF NOT EXISTS resend_sqlstate_orders (op text PRIMARY KEY)",
                ] {
                    sqlx::query(table).execute(&pool).await.map_err(|e| {
                        tower_resend_server::StoreError::with_source("test tables", e)
                    })?;
                }
                Ok::<_, tower_resend_server::StoreError>(())
            };
            match tokio::time::timeout(Duration::from_secs(5), made).await {
                Ok(Ok(())) => true,
                other if std::env::var_os("CI").is_some() => {
                    panic!("PostgreSQL at {url}: {other:?}, and CI is set")
                }
                other => {
                    eprintln!("WARNING: PostgreSQL at {url} is unusable ({other:?}): test SKIPPED");
                    false
                }
            }
        })
        .await;
    ready.then(|| pg::pool(&url, 8))
}

async fn effects(pool: &PgPool, op: &str) -> i64 {
    pg::count(pool, "resend_sqlstate_effects", "op", op).await
}

/// The rows (a claim or a record) that `key` has in the layer's table.
async fn records(pool: &PgPool, key: &str) -> i64 {
    pg::count(pool, TABLE, "key", key).await
}

/// How many times the handler ran.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

/// The handler: writes `op`'s effect (the `op` header) through its
/// transaction, then runs the statement that `then` (a header) names,
/// ignores its failure, and answers 201 as if all went well:
/// - `unique`: an INSERT that violates a primary key (23505);
/// - `serialize-once`: on the first run only, a statement that fails
///   with 40001 (serialization failure), through `fetch_optional`;
/// - `raise`: a statement that fails with P0001 (raise_exception): a
///   SQLSTATE that says nothing of another try.
async fn charge(State(runs): State<Runs>, headers: HeaderMap, mut tx: IdempotentTx) -> StatusCode {
    let run = runs.0.fetch_add(1, Ordering::SeqCst);
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let (op, then) = (header("op"), header("then"));
    sqlx::query("INSERT INTO resend_sqlstate_effects (op) VALUES ($1)")
        .bind(&op)
        .execute(&mut *tx)
        .await
        .unwrap();
    let failed = match then.as_str() {
        "unique" => sqlx::query("INSERT INTO resend_sqlstate_orders (op) VALUES ($1)")
            .bind(&op)
            .execute(&mut *tx)
            .await
            .is_err(),
        "serialize-once" if run == 0 => {
            sqlx::query("DO $$ BEGIN RAISE EXCEPTION 'provoked' USING ERRCODE = '40001'; END $$")
                .fetch_optional(&mut *tx)
                .await
                .is_err()
        }
        "raise" => sqlx::query("DO $$ BEGIN RAISE EXCEPTION 'provoked'; END $$")
            .execute(&mut *tx)
            .await
            .is_err(),
        _ => false,
    };
    // The failure is not answered: that is the point.
    let _ = failed;
    StatusCode::CREATED
}

/// The app on a loopback port, and how many times its handler ran.
async fn serve(pool: &PgPool) -> (SocketAddr, Runs) {
    let backend = PostgresStore::with_table(pool.clone(), TABLE)
        .unwrap()
        .transactional();
    let runs = Runs::default();
    let app = Router::new()
        .route("/charges", post(charge))
        .with_state(runs.clone())
        .layer(IdempotencyLayer::new(backend))
        .layer(InboundDeadlineLayer::new(Duration::from_secs(30)));
    (serve::serve(app).await, runs)
}

/// A POST to `addr` under `key` (none: unkeyed), doing `op` as `then` says.
fn post_to(addr: SocketAddr, key: Option<&str>, op: &str, then: &str) -> Request<Full<Bytes>> {
    let mut req = Request::post(format!("http://{addr}/charges"))
        .header("authorization", "Bearer t")
        .header("op", op)
        .header("then", then)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    if let Some(key) = key {
        req.extensions_mut()
            .insert(IdempotencyKey::new(key).unwrap());
    }
    req
}

/// A client stack of up to 3 attempts, with idempotency keys.
fn client() -> tower_resend::stack::Stack<tower_resend::connect::HyperClient> {
    tower_resend::stack()
        .name("charges")
        .max_attempts(3)
        .no_budget()
        .idempotency_keys()
        .service(tower_resend::hyper_client(Duration::from_secs(2)))
}

async fn problem<B>(resp: axum::http::Response<B>) -> serde_json::Value
where
    B: http_body::Body<Data = Bytes, Error: std::fmt::Debug>,
{
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("a problem document: {e}"))
}

/// (a) A unique violation, unanswered: a final 422 `constraint_violation`
/// (not a 409, which a keyed client reads as "in progress" and resends).
/// The client makes one attempt, nothing is committed, the key is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_violation_is_a_final_422_sent_once() {
    let Some(pool) = pool().await else { return };
    let (addr, runs) = serve(&pool).await;
    let (op, key) = (unique("op"), unique("k"));
    sqlx::query("INSERT INTO resend_sqlstate_orders (op) VALUES ($1)")
        .bind(&op)
        .execute(&pool)
        .await
        .unwrap();

    let resp = client()
        .oneshot(post_to(addr, Some(&key), &op, "unique"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(resp.extensions().get::<Attempts>().unwrap().len(), 1);
    assert!(resp.headers().get("retry-after").is_none());
    assert_eq!(
        resp.headers()["content-type"],
        tower_resend_server::problems::CONTENT_TYPE
    );
    let body = problem(resp).await;
    assert_eq!(body["error"], "constraint_violation");
    assert_eq!(body["status"], 422);
    assert_eq!(
        runs.0.load(Ordering::SeqCst),
        1,
        "one attempt reached the handler"
    );
    assert_eq!(effects(&pool, &op).await, 0, "rolled back");
    assert_eq!(records(&pool, &key).await, 0, "the key is free");
}

/// (b) A serialization failure, unanswered: 503 with `Retry-After: 1`;
/// the client sends it again with the same key, and the second run commits:
/// the work is done once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_is_a_503_the_client_resends() {
    let Some(pool) = pool().await else { return };
    let (addr, runs) = serve(&pool).await;
    let (op, key) = (unique("op"), unique("k"));

    // The first answer, as the client's first attempt sees it.
    let first = Request::post(format!("http://{addr}/charges"))
        .header("authorization", "Bearer t")
        .header("idempotency-key", &key)
        .header("op", &op)
        .header("then", "serialize-once")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let raw = tower_resend::hyper_client(Duration::from_secs(2))
        .oneshot(first)
        .await
        .unwrap();
    assert_eq!(raw.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(raw.headers()["retry-after"], "1");
    let body = problem(raw).await;
    assert_eq!(body["error"], "transaction_conflict");
    assert_eq!(effects(&pool, &op).await, 0, "rolled back");
    assert_eq!(records(&pool, &key).await, 0, "the key is free");

    // Through the client, from the start: a 503, then the resend commits.
    runs.0.store(0, Ordering::SeqCst);
    let (op, key) = (unique("op"), unique("k"));
    let resp = client()
        .oneshot(post_to(addr, Some(&key), &op, "serialize-once"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    assert_eq!(resp.extensions().get::<Attempts>().unwrap().len(), 2);
    assert_eq!(runs.0.load(Ordering::SeqCst), 2);
    assert_eq!(effects(&pool, &op).await, 1, "the work is done once");
    assert_eq!(records(&pool, &key).await, 1, "the key's record");
}

/// (c) A SQLSTATE that says nothing of another try: 500
/// `transaction_aborted`, as before; rolled back, the key free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_sqlstate_is_a_500_as_before() {
    let Some(pool) = pool().await else { return };
    let (addr, _) = serve(&pool).await;
    let (op, key) = (unique("op"), unique("k"));
    let req = Request::post(format!("http://{addr}/charges"))
        .header("authorization", "Bearer t")
        .header("idempotency-key", &key)
        .header("op", &op)
        .header("then", "raise")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tower_resend::hyper_client(Duration::from_secs(2))
        .oneshot(req)
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem(resp).await["error"], "transaction_aborted");
    assert_eq!(effects(&pool, &op).await, 0, "rolled back");
    assert_eq!(records(&pool, &key).await, 0, "the key is free");
}

/// (d) Without a key, a failed statement the handler did not answer is not
/// a 200 (or the handler's 201): PostgreSQL answers the COMMIT of an
/// aborted transaction with a ROLLBACK and no error, so the layer checks
/// before it commits. Answered by the SQLSTATE, as a keyed request is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unkeyed_failed_statement_is_not_answered_as_a_success() {
    let Some(pool) = pool().await else { return };
    let (addr, _) = serve(&pool).await;
    for (then, status, code) in [
        (
            "unique",
            StatusCode::UNPROCESSABLE_ENTITY,
            "constraint_violation",
        ),
        (
            "raise",
            StatusCode::INTERNAL_SERVER_ERROR,
            "transaction_aborted",
        ),
    ] {
        let op = unique("op");
        sqlx::query("INSERT INTO resend_sqlstate_orders (op) VALUES ($1)")
            .bind(&op)
            .execute(&pool)
            .await
            .unwrap();
        let resp = tower_resend::hyper_client(Duration::from_secs(2))
            .oneshot(post_to(addr, None, &op, then))
            .await
            .unwrap();
        assert_eq!(resp.status(), status, "{then}");
        assert_eq!(problem(resp).await["error"], code, "{then}");
        assert_eq!(effects(&pool, &op).await, 0, "{then}: rolled back");
    }
    // And a handler whose statements all pass still commits, unkeyed.
    let op = unique("op");
    let resp = tower_resend::hyper_client(Duration::from_secs(2))
        .oneshot(post_to(addr, None, &op, "nothing-fails"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    assert_eq!(effects(&pool, &op).await, 1, "committed");
}
