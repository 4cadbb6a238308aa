//! Transactional idempotency on the real PostgreSQL of this machine: the
//! handler writes its effect through the transaction the layer gives it, and
//! the effect and the key's record commit together or not at all.
//!
//! Effects are rows of a table (`resend_tx_effects`), one per run of a
//! handler's work, tagged with the test's own operation names, so the tests
//! share the database and never meet. Without PostgreSQL: skipped with a
//! warning, or failed when `CI` is set.
#![cfg(all(feature = "postgres", feature = "axum"))]
#![allow(clippy::print_stderr, clippy::print_stdout)]

mod common;
#[path = "support/pg.rs"]
mod pg;

use std::process::Stdio;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http_body_util::BodyExt;
use sqlx::{PgPool, Row};
use tokio::sync::OnceCell;
use tower::ServiceExt;
use tower_resend_server::idempotency::{KeepResponse, NothingDone};
use tower_resend_server::{IdempotencyLayer, IdempotentTx, InboundDeadlineLayer, PostgresStore};

const TABLE: &str = "resend_idempotency_tx_test";

fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
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
                sqlx::query(
                    "CREATE TABLE IF NOT EXISTS resend_tx_effects (id bigserial PRIMARY KEY, op text NOT NULL)",
                )
                .execute(&pool)
                .await
                .map_err(|e| tower_resend_server::StoreError::with_source("effects table", e))?;
                Ok::<_, tower_resend_server::StoreError>(())
            };
            match tokio::time::timeout(Duration::from_secs(5), made).await {
                Ok(Ok(())) => true,
                other if in_ci() => panic!("PostgreSQL at {url}: {other:?}, and CI is set"),
                other => {
                    eprintln!("WARNING: PostgreSQL at {url} is unusable ({other:?}): test SKIPPED");
                    false
                }
            }
        })
        .await;
    ready.then(|| pg::pool(&url, 24))
}

/// `key`'s record is final, and was written by the very transaction that
/// wrote `op`'s effect (the same xmin): no commit of its own.
async fn assert_committed_together(pool: &PgPool, key: &str, op: &str) {
    let (done, record_xid): (bool, String) = sqlx::query_as(&format!(
        "SELECT done, xmin::text FROM {TABLE} WHERE key = $1"
    ))
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(done);
    let effect_xid: String =
        sqlx::query_scalar("SELECT xmin::text FROM resend_tx_effects WHERE op = $1")
            .bind(op)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        record_xid, effect_xid,
        "the record and the work share one transaction"
    );
}

async fn effects(pool: &PgPool, op: &str) -> i64 {
    pg::count(pool, "resend_tx_effects", "op", op).await
}

/// The rows (a claim or a record) that `key` has in the layer's table.
async fn records(pool: &PgPool, key: &str) -> i64 {
    pg::count(pool, TABLE, "key", key).await
}

/// What the handler does, from the query: `op=` names its effect; `ms=`
/// is how long it works (holding its transaction) after writing it; `then=`
/// how it ends: `500`, `500kept` (marked KeepResponse), `conflict` (a failed statement, answered 409), `ignore` (a failed statement, answered 201), `nothing` (503 marked NothingDone), `429`, `panic`,
/// `forget` (it deletes its key's claim row through its transaction, then
/// answers 201), or else 201; `size=` pads a 201's body to that many bytes.
struct How {
    op: String,
    then: String,
    ms: u64,
    size: usize,
}

impl How {
    fn of(uri: &axum::http::Uri) -> Self {
        let mut how = Self {
            op: String::new(),
            then: String::new(),
            ms: 0,
            size: 0,
        };
        for pair in uri.query().unwrap_or("").split('&') {
            match pair.split_once('=') {
                Some(("op", v)) => how.op = v.to_owned(),
                Some(("then", v)) => how.then = v.to_owned(),
                Some(("ms", v)) => how.ms = v.parse().unwrap_or(0),
                Some(("size", v)) => how.size = v.parse().unwrap_or(0),
                _ => {}
            }
        }
        how
    }
}

async fn charge(
    uri: axum::http::Uri,
    headers: HeaderMap,
    mut tx: IdempotentTx,
    body: String,
) -> Response {
    let how = How::of(&uri);
    sqlx::query("INSERT INTO resend_tx_effects (op) VALUES ($1)")
        .bind(&how.op)
        .execute(&mut *tx)
        .await
        .unwrap();
    if how.then == "forget" {
        let key = headers["idempotency-key"].to_str().unwrap();
        sqlx::query(&format!("DELETE FROM {TABLE} WHERE key = $1"))
            .bind(key)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    // A statement of the handler's that fails aborts its transaction.
    let failed = match how.then.as_str() {
        "conflict" | "ignore" => sqlx::query("SELECT 1 / 0").execute(&mut *tx).await.is_err(),
        _ => false,
    };
    if how.ms > 0 {
        tokio::time::sleep(Duration::from_millis(how.ms)).await;
    }
    drop(tx);
    let run = uuid::Uuid::new_v4().simple().to_string();
    match how.then.as_str() {
        "500" => (StatusCode::INTERNAL_SERVER_ERROR, format!("failed {run}")).into_response(),
        "500kept" => {
            let mut r =
                (StatusCode::INTERNAL_SERVER_ERROR, format!("failed {run}")).into_response();
            r.extensions_mut().insert(KeepResponse);
            r
        }
        // The handler's own answer to its statement's failure.
        "conflict" if failed => {
            (StatusCode::CONFLICT, format!("already there {run}")).into_response()
        }
        "429" => (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response(),
        "nothing" => {
            let mut r = (StatusCode::SERVICE_UNAVAILABLE, "try later").into_response();
            r.extensions_mut().insert(NothingDone);
            r
        }
        "panic" => panic!("the handler was told to panic"),
        _ => {
            let mut text = format!("charged {body} {run}");
            if text.len() < how.size {
                text.extend(std::iter::repeat_n('.', how.size - text.len()));
            }
            (StatusCode::CREATED, text).into_response()
        }
    }
}

fn app(pool: &PgPool) -> Router {
    let backend = PostgresStore::with_table(pool.clone(), TABLE)
        .unwrap()
        .transactional();
    Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(backend))
        .layer(InboundDeadlineLayer::new(Duration::from_secs(30)))
}

fn req(key: Option<&str>, query: &str, body: &'static str) -> Request<Body> {
    let mut b = Request::post(format!("/charges?{query}")).header("authorization", "Bearer t");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Body::from(body)).unwrap()
}

/// `req` with an inbound deadline of `timeout` (a `grpc-timeout` value).
fn req_within(
    key: Option<&str>,
    query: &str,
    body: &'static str,
    timeout: &'static str,
) -> Request<Body> {
    let mut r = req(key, query, body);
    r.headers_mut().insert(
        "grpc-timeout",
        axum::http::HeaderValue::from_static(timeout),
    );
    r
}

/// A keyed request through `app` in a task of its own: the key's holder.
fn hold(app: Router, key: &str, query: &str) -> tokio::task::JoinHandle<StatusCode> {
    let r = req(Some(key), query, "a");
    tokio::spawn(async move { app.oneshot(r).await.unwrap().status() })
}

async fn text(resp: Response) -> String {
    String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap()
}

fn replayed(h: &HeaderMap) -> bool {
    h.get("idempotent-replayed").is_some_and(|v| v == "true")
}

/// The effect and the record commit together: the first run's response is
/// replayed, the effect is there once, another body is 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_commits_with_the_work() {
    let Some(pool) = pool().await else { return };
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}");
    let first = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!replayed(first.headers()));
    let body = text(first).await;
    for _ in 0..3 {
        let again = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
        assert_eq!(again.status(), StatusCode::CREATED);
        assert!(replayed(again.headers()));
        assert_eq!(text(again).await, body);
    }
    assert_eq!(effects(&pool, &op).await, 1);
    let other = app(&pool).oneshot(req(Some(&key), &q, "b")).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(effects(&pool, &op).await, 1);
    // The record is in the table, done, with the response — written by the
    // very transaction that wrote the effect (the same xmin): no commit of
    // its own.
    assert_committed_together(&pool, &key, &op).await;
}

/// What is kept: a final response commits with its work, a 5xx only when
/// the handler marks it `KeepResponse`; nothing done (NothingDone, 429), a
/// 5xx, a panic or the deadline roll the work back with the claim, so the
/// retry runs on a clean slate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_commits_and_what_rolls_back() {
    let Some(pool) = pool().await else { return };
    // A 500 the handler keeps: committed, replayed, not run again.
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}&then=500kept");
    let first = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = text(first).await;
    let again = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    assert!(replayed(again.headers()));
    assert_eq!(text(again).await, body);
    assert_eq!(effects(&pool, &op).await, 1);
    // Rolled back, then the retry runs again: the handler's own answer each
    // time (the 500's body says which run), nothing replayed.
    for then in ["500", "nothing", "429", "panic"] {
        let (op, key) = (unique("op"), unique("k"));
        let first = app(&pool)
            .oneshot(req(Some(&key), &format!("op={op}&then={then}"), "a"))
            .await
            .unwrap();
        assert!(first.status().as_u16() >= 429, "{then}: {}", first.status());
        let first_body = text(first).await;
        assert_eq!(
            effects(&pool, &op).await,
            0,
            "{then}: the work is rolled back"
        );
        assert_eq!(records(&pool, &key).await, 0, "{then}: the key is free");
        // (Same fingerprint: the query is part of it, so the retry says
        // `then` the same way; the handler's outcome differs only by run.)
        let retry = app(&pool)
            .oneshot(req(Some(&key), &format!("op={op}&then={then}"), "a"))
            .await
            .unwrap();
        assert!(!replayed(retry.headers()), "{then}: the retry runs again");
        if then == "500" {
            assert_ne!(text(retry).await, first_body, "a second run answers");
        }
        assert_eq!(effects(&pool, &op).await, 0, "{then}");
    }
    // The deadline cuts the handler: rolled back (the effect written before
    // the cut is undone), 504 naming where the time went.
    let (op, key) = (unique("op"), unique("k"));
    let r = req_within(Some(&key), &format!("op={op}&ms=1000"), "a", "300m");
    let cut = app(&pool).oneshot(r).await.unwrap();
    assert_eq!(cut.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(effects(&pool, &op).await, 0);
    let retry = app(&pool)
        .oneshot(req(Some(&key), &format!("op={op}&ms=1000"), "a"))
        .await;
    // (No deadline this time but the server's 30 s: it runs, and commits.)
    let retry = retry.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!replayed(retry.headers()));
    assert_eq!(effects(&pool, &op).await, 1);
}

/// A statement of the handler's that fails (here a division by zero; a
/// unique violation alike) aborts its transaction: the handler's own answer
/// to it is the answer, nothing is kept, and the key is free (not 503
/// "commit outcome unknown": an aborted transaction cannot commit). A
/// handler that answers as if it had succeeded gets a 500 that says nothing
/// was committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_statement_in_the_handler_is_its_answer_not_an_unknown_commit() {
    let Some(pool) = pool().await else { return };
    for (then, status, error) in [
        ("conflict", StatusCode::CONFLICT, None),
        (
            "ignore",
            StatusCode::INTERNAL_SERVER_ERROR,
            Some("transaction_aborted"),
        ),
    ] {
        let (op, key) = (unique("op"), unique("k"));
        let q = format!("op={op}&then={then}");
        for run in 0..2 {
            let resp = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
            assert_eq!(resp.status(), status, "{then}, run {run}");
            assert!(!replayed(resp.headers()), "{then}: nothing is kept");
            let body = text(resp).await;
            match error {
                Some(code) => assert!(body.contains(code), "{then}: {body}"),
                None => assert!(body.starts_with("already there"), "{then}: {body}"),
            }
            assert_eq!(effects(&pool, &op).await, 0, "{then}");
            assert_eq!(records(&pool, &key).await, 0, "{then}: the key is free");
        }
    }
}

/// A POST without a key gets a transaction too, committed by the same rule,
/// with no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_key_get_a_transaction_too() {
    let Some(pool) = pool().await else { return };
    let op = unique("op");
    for _ in 0..2 {
        let r = app(&pool)
            .oneshot(req(None, &format!("op={op}"), "a"))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    assert_eq!(effects(&pool, &op).await, 2);
    let op = unique("op");
    let r = app(&pool)
        .oneshot(req(None, &format!("op={op}&then=nothing"), "a"))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(effects(&pool, &op).await, 0);
}

/// Concurrent duplicates: one runs; the others wait on the key (the row it
/// claimed, uncommitted) and replay once it commits — or, when their
/// deadline is shorter than the wait, get 409 within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_wait_then_replay_or_409_in_time() {
    let Some(pool) = pool().await else { return };
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}&ms=300");
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (app, r) = (app(&pool), req(Some(&key), &q, "a"));
        tasks.push(tokio::spawn(async move {
            let r = app.oneshot(r).await.unwrap();
            (r.status(), replayed(r.headers()), text(r).await)
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    assert_eq!(effects(&pool, &op).await, 1);
    let ran: Vec<_> = answers.iter().filter(|a| !a.1).collect();
    assert_eq!(ran.len(), 1, "{answers:?}");
    assert!(
        answers
            .iter()
            .all(|a| a.0 == StatusCode::CREATED && a.2 == ran[0].2),
        "{answers:?}"
    );
    // A duplicate whose deadline is shorter than the holder's work: 409,
    // within its deadline.
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}&ms=1500");
    let name = unique("tx-holder");
    let holder = hold(app(&pg::named_pool(&pg::url(), 2, &name)), &key, &q);
    until_claimed(&pool, &name).await;
    let short = req_within(Some(&key), &q, "a", "400m");
    let start = tokio::time::Instant::now();
    let busy = app(&pool).oneshot(short).await.unwrap();
    let took = start.elapsed();
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    assert!(busy.headers().contains_key("retry-after"));
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(1000),
        "{took:?}"
    );
    assert_eq!(holder.await.unwrap(), StatusCode::CREATED);
    assert_eq!(effects(&pool, &op).await, 1);
}

/// A holder that works far past its lease (100 ms; its handler takes
/// 1.5 s, as a stalled process or a store slow to answer would) is not
/// taken over: a duplicate sent once the lease has run out waits on the
/// holder's open transaction and gets its answer, and the work runs once.
/// A lease store cannot promise that (its holder's calls must land within
/// the lease); the README says the transactional mode holds even then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_past_its_lease_is_not_taken_over() {
    let Some(pool) = pool().await else { return };
    let short_lease = |pool: &PgPool| {
        let backend = PostgresStore::with_table(pool.clone(), TABLE)
            .unwrap()
            .transactional();
        Router::new()
            .route("/charges", post(charge))
            .layer(IdempotencyLayer::new(backend).lease(Duration::from_millis(100)))
            .layer(InboundDeadlineLayer::new(Duration::from_secs(30)))
    };
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}&ms=1500");
    let name = unique("tx-holder");
    let holder = hold(short_lease(&pg::named_pool(&pg::url(), 2, &name)), &key, &q);
    until_claimed(&pool, &name).await;
    // Past the lease (on PostgreSQL's clock, which started it at the claim).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dup = short_lease(&pool)
        .oneshot(req(Some(&key), &q, "a"))
        .await
        .unwrap();
    let (status, again) = (dup.status(), replayed(dup.headers()));
    let body = text(dup).await;
    assert_eq!(holder.await.unwrap(), StatusCode::CREATED);
    assert_eq!(effects(&pool, &op).await, 1, "the work ran twice");
    assert!(
        (status == StatusCode::CREATED && again) || status == StatusCode::CONFLICT,
        "{status} (replayed: {again}): {body}"
    );
}

// ---- a server killed mid-handler, after its effect ----

/// The child's mode; unset: not a child.
const ENV_CHILD: &str = "RESEND_TX_CHILD";

/// Not a test: the entry point of the child process that
/// `a_server_killed_after_its_effect_leaves_nothing` starts (this test
/// binary, run again with `--ignored --exact tx_server_child`). It serves
/// the app on 127.0.0.1:0, says `LISTENING <port>`, and, when its handler
/// has written its effect (in the transaction), says `EFFECT` and hangs
/// there: the window in which the test kills it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process's entry point, started by a_server_killed_after_its_effect_leaves_nothing"]
async fn tx_server_child() {
    if std::env::var_os(ENV_CHILD).is_none() {
        eprintln!("tx_server_child is a child process's entry point; nothing to do");
        return;
    }
    let pool = pg::pool(&pg::url(), 4);
    let backend = PostgresStore::with_table(pool, TABLE)
        .unwrap()
        .transactional();
    async fn hang(uri: axum::http::Uri, mut tx: IdempotentTx) -> StatusCode {
        let how = How::of(&uri);
        sqlx::query("INSERT INTO resend_tx_effects (op) VALUES ($1)")
            .bind(&how.op)
            .execute(&mut *tx)
            .await
            .unwrap();
        println!("EFFECT");
        std::future::pending::<()>().await;
        StatusCode::CREATED
    }
    let app = Router::new()
        .route("/charges", post(hang))
        .layer(IdempotencyLayer::new(backend));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("LISTENING {}", listener.local_addr().unwrap().port());
    // Ends with the test process (its stdin closes) or after a minute.
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        let _ = std::io::stdin().read_line(&mut sink);
    });
    tokio::select! {
        _ = axum::serve(listener, app) => {}
        _ = stdin_closed => {}
        _ = tokio::time::sleep(Duration::from_secs(60)) => {}
    }
}

/// A child started by this test, killed when the guard goes.
struct ChildGuard(tokio::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// A server process killed mid-handler after it wrote its effect in its
/// transaction: the transaction never commits, so the effect is gone with
/// it and the key is free; the caller's retry runs once: 0 then 1 effect,
/// never 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_after_its_effect_leaves_nothing() {
    use tokio::io::AsyncBufReadExt;
    let Some(pool) = pool().await else { return };
    let scenario = async {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "tx_server_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_CHILD, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut guard = ChildGuard(child);
        let mut port = None;
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(p) = line.split("LISTENING ").nth(1) {
                port = Some(p.trim().parse::<u16>().unwrap());
                break;
            }
        }
        let port = port.expect("the child listens");
        let (op, key) = (unique("op"), unique("k"));
        let client = tower_resend::hyper_client(Duration::from_secs(1));
        let sent = tokio::spawn({
            let (client, op, key) = (client.clone(), op.clone(), key.clone());
            async move {
                let r = Request::post(format!("http://127.0.0.1:{port}/charges?op={op}"))
                    .header("idempotency-key", &key)
                    .header("authorization", "Bearer t")
                    .body(http_body_util::Full::new(bytes::Bytes::from_static(b"a")))
                    .unwrap();
                client.oneshot(r).await
            }
        });
        // The effect is written (uncommitted) when the child says so.
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("EFFECT") {
                break;
            }
        }
        guard.0.kill().await.unwrap();
        assert!(sent.await.unwrap().is_err(), "the caller got no answer");
        // The kill reached PostgreSQL as a lost connection: rolled back.
        let mut left = 1;
        for _ in 0..100 {
            left = effects(&pool, &op).await;
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(left, 0, "the killed transaction's effect is gone");
        // The retry, on a live server, runs once and commits.
        let r = app(&pool)
            .oneshot(req(Some(&key), &format!("op={op}"), "a"))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        assert!(!replayed(r.headers()));
        assert_eq!(effects(&pool, &op).await, 1);
        let again = app(&pool)
            .oneshot(req(Some(&key), &format!("op={op}"), "a"))
            .await
            .unwrap();
        assert!(replayed(again.headers()));
        assert_eq!(effects(&pool, &op).await, 1);
    };
    tokio::time::timeout(Duration::from_secs(20), scenario)
        .await
        .expect("bounded");
}

// ---- the rules every backend keeps ----

/// The transactional backend, on the test table; `None` (skip) without
/// PostgreSQL.
async fn backend() -> Option<tower_resend_server::PostgresTransactional> {
    let pool = pool().await?;
    Some(
        PostgresStore::with_table(pool, TABLE)
            .unwrap()
            .transactional(),
    )
}

// The rules of the shared suite that hold as they are in transactional mode
// (the handler here ignores its transaction: the layer commits the record
// alone). Those it changes are tested above: while the first request runs,
// a duplicate waits on its uncommitted row, so it cannot see a fingerprint
// (409 rather than 422); a failed handler's work is rolled back, so its key
// runs again.
store_rules!(@each (flavor = "multi_thread", worker_threads = 2) backend();
    key_syntax required_key replay fingerprint_mismatch
    a_caller_that_goes_away_does_not_cancel_the_work callers_never_see_each_others_responses
    safe_methods_pass_through body_caps fifty_at_once);

/// A keyed handler rolled back and run again sends the same derived keys
/// downstream: the work outside the transaction (an outbound call) is
/// deduplicated by the upstream, as the rolled-back writes are undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_run_sends_the_same_outbound_keys_again() {
    use tower::Layer;
    let Some(pool) = pool().await else { return };
    let sent: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let upstream = {
        let sent = sent.clone();
        tower_resend::idempotency::SetIdempotencyKeyLayer::new()
            .upstream("payments")
            .layer(tower::service_fn(move |req: Request<()>| {
                let sent = sent.clone();
                async move {
                    let key = req.headers()["idempotency-key"]
                        .to_str()
                        .unwrap()
                        .to_owned();
                    sent.lock().unwrap().push(key);
                    Ok::<_, std::convert::Infallible>(())
                }
            }))
    };
    let handler = move |mut tx: IdempotentTx| {
        let upstream = upstream.clone();
        async move {
            sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
            upstream
                .oneshot(Request::post("http://payments/charges").body(()).unwrap())
                .await
                .unwrap();
            // Nothing of ours is kept: the transaction rolls back.
            let mut r = (StatusCode::SERVICE_UNAVAILABLE, "later").into_response();
            r.extensions_mut().insert(NothingDone);
            r
        }
    };
    let backend = PostgresStore::with_table(pool, TABLE)
        .unwrap()
        .transactional();
    let app = Router::new()
        .route("/charges", post(handler))
        .layer(IdempotencyLayer::new(backend));
    let key = unique("k");
    for _ in 0..2 {
        let r = app
            .clone()
            .oneshot(req(Some(&key), "op=x", "a"))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    let other = app
        .oneshot(req(Some(&unique("k")), "op=x", "a"))
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::SERVICE_UNAVAILABLE);
    let sent = sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 3);
    assert_eq!(sent[0], sent[1], "the re-run sends the same key");
    assert_ne!(sent[0], sent[2], "another operation, another key");
}

// ---- what the key costs: the claim with the BEGIN, the record with the COMMIT ----

/// The layer's trace events, read back by key: which way a key was claimed
/// and recorded. One subscriber for the whole test binary, which only
/// listens to this crate.
mod traced {
    use std::sync::{Mutex, Once};

    use tracing::field::{Field, Visit};
    use tracing::{Event, Metadata, Subscriber};
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

    static EVENTS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

    struct Capture;

    #[derive(Default)]
    struct Fields {
        key: Option<String>,
        message: String,
    }

    impl Visit for Fields {
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "key" {
                self.key = Some(value.to_owned());
            }
        }

        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.message = format!("{value:?}");
            }
        }
    }

    impl<S: Subscriber> Layer<S> for Capture {
        fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
            metadata.target().starts_with("tower_resend_server")
        }

        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let mut fields = Fields::default();
            event.record(&mut fields);
            if let Some(key) = fields.key {
                EVENTS.lock().unwrap().push((key, fields.message));
            }
        }
    }

    pub(super) fn install() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Capture))
                .expect("the test binary's only subscriber");
        });
    }

    /// What the layer said about `key`, in order.
    pub(super) fn of(key: &str) -> Vec<String> {
        EVENTS
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, m)| m.clone())
            .collect()
    }
}

const CLAIMED_WITH_BEGIN: &str = "idempotency key claimed with its transaction's BEGIN";
const NOT_NEW: &str = "idempotency key not new: claimed the long way";
const REPLAYING: &str = "replaying a stored response";
const STILL_WAITING: &str = "idempotency key claim still waiting: claimed the long way";
const RECORDED_WITH_COMMIT: &str = "idempotent response recorded with the COMMIT";
const RECORDED_THEN_COMMITTED: &str = "idempotent response recorded, then committed";

/// How many of the connections named `name` are idle inside a transaction
/// (open, or aborted).
async fn in_transaction(pool: &PgPool, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(name)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Whether the statement this runs on `pool` is in no transaction but its
/// own: a simple query outside one is its own transaction, which starts
/// with it, so `now()` (the transaction's start) is the statement's.
async fn outside_any_transaction(pool: &PgPool) -> bool {
    sqlx::raw_sql("SELECT now() = statement_timestamp()")
        .fetch_one(pool)
        .await
        .unwrap()
        .get(0)
}

/// Waits (up to 5 s) until a connection named `name` holds an open
/// transaction: a keyed request's claim is made, and its handler works.
async fn until_claimed(pool: &PgPool, name: &str) {
    for _ in 0..500 {
        if in_transaction(pool, name).await > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no connection named {name} claimed a key within 5 s");
}

/// A new key is claimed in the transaction's first round trip (with its
/// BEGIN) and recorded in its last (with its COMMIT): the long way is not
/// taken. The effect and the record still share one transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_is_claimed_with_the_begin_and_recorded_with_the_commit() {
    let Some(pool) = pool().await else { return };
    traced::install();
    let (op, key) = (unique("op"), unique("k"));
    let first = app(&pool)
        .oneshot(req(Some(&key), &format!("op={op}"), "a"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(
        traced::of(&key),
        [CLAIMED_WITH_BEGIN, RECORDED_WITH_COMMIT],
        "one round trip for the claim, one for the record"
    );
    assert_committed_together(&pool, &key, &op).await;
}

/// A key that is not new fails the claim in one round trip, and takes the
/// long way, which answers as before: the replay, 422 for another body, a
/// run again over an expired record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_is_not_new_takes_the_long_way() {
    let Some(pool) = pool().await else { return };
    traced::install();
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}");
    let first = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    let body = text(first).await;
    let again = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    assert!(replayed(again.headers()));
    assert_eq!(text(again).await, body);
    let other = app(&pool).oneshot(req(Some(&key), &q, "b")).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(effects(&pool, &op).await, 1);
    assert_eq!(
        traced::of(&key),
        [
            CLAIMED_WITH_BEGIN,
            RECORDED_WITH_COMMIT,
            NOT_NEW,
            REPLAYING,
            NOT_NEW
        ]
    );
    // An expired record: the plain INSERT conflicts with it, and the long
    // way takes it over; the work runs again, once.
    sqlx::query(&format!(
        "UPDATE {TABLE} SET expires_at = clock_timestamp() - interval '1 second' WHERE key = $1"
    ))
    .bind(&key)
    .execute(&pool)
    .await
    .unwrap();
    let after = app(&pool).oneshot(req(Some(&key), &q, "b")).await.unwrap();
    assert_eq!(after.status(), StatusCode::CREATED);
    assert!(!replayed(after.headers()));
    assert_eq!(effects(&pool, &op).await, 2);
    assert_eq!(traced::of(&key)[5..], [NOT_NEW, RECORDED_WITH_COMMIT]);
}

/// A claim that fails in its one round trip leaves its connection out of
/// any transaction: on a pool of one connection, a new key, a duplicate, a
/// mismatch and a new key again all answer, and the connection is then
/// idle, in no transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_claim_leaves_its_connection_out_of_any_transaction() {
    let Some(_) = pool().await else { return };
    let name = unique("tx-one");
    let one = pg::named_pool(&pg::url(), 1, &name);
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}");
    let statuses = [
        (Some(key.clone()), "a"),
        (Some(key.clone()), "a"),
        (Some(key.clone()), "b"),
        (Some(unique("k")), "a"),
        (None, "a"),
    ];
    let mut got = Vec::new();
    for (key, body) in statuses {
        let r = app(&one)
            .oneshot(req(key.as_deref(), &q, body))
            .await
            .unwrap();
        got.push(r.status().as_u16());
    }
    assert_eq!(got, [201, 201, 422, 201, 201]);
    assert_eq!(effects(&one, &op).await, 3);
    assert!(
        outside_any_transaction(&one).await,
        "the pool's connection is in no transaction"
    );
    assert_eq!(pg::idle_in_transaction(&one, &name).await, 0);
}

/// A claim that waits on a holder beyond its bound, or whose caller goes
/// away while it waits, is not dropped midway: it is finished on its own,
/// and when the holder rolls back (so that it does claim the key) it is
/// rolled back too. The key is free for the retry, and no connection is
/// left in a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_cut_while_it_waits_is_finished_and_rolled_back() {
    let Some(pool) = pool().await else { return };
    traced::install();
    let name = unique("tx-cut");
    let named = pg::named_pool(&pg::url(), 8, &name);
    // Its connections made first: the duplicate below has 300 ms in all,
    // which a busy machine could spend making them (a TLS handshake each)
    // rather than waiting on the holder, and answer 504 instead of 409.
    let mut made = Vec::new();
    for _ in 0..4 {
        made.push(named.acquire().await.unwrap());
    }
    drop(made);
    let (op, key) = (unique("op"), unique("k"));
    // The holder works 1 s, then ends with nothing done: rolled back.
    let q = format!("op={op}&ms=1000&then=nothing");
    let holder = hold(app(&named), &key, &q);
    until_claimed(&pool, &name).await;
    // A duplicate with a short deadline: its claim waits on the holder past
    // its bound, and it is told 409 in time.
    let short = req_within(Some(&key), &q, "a", "300m");
    let busy = app(&named).oneshot(short).await.unwrap();
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    assert!(traced::of(&key).contains(&STILL_WAITING.to_owned()));
    // A duplicate whose caller goes away while its claim waits.
    let gone = tokio::time::timeout(
        Duration::from_millis(100),
        app(&named).oneshot(req(Some(&key), &q, "a")),
    )
    .await;
    assert!(gone.is_err(), "the caller went away first");
    assert_eq!(holder.await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    // Both waiting claims then get the key, and give it back.
    assert_eq!(pg::idle_in_transaction(&pool, &name).await, 0);
    let mut retry = None;
    for _ in 0..50 {
        let r = app(&pool)
            .oneshot(req(Some(&key), &format!("op={op}"), "a"))
            .await
            .unwrap();
        if r.status() != StatusCode::CONFLICT {
            retry = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let retry = retry.expect("the key is free again");
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!replayed(retry.headers()));
    assert_eq!(effects(&pool, &op).await, 1);
    assert_eq!(pg::idle_in_transaction(&pool, &name).await, 0);
}

/// The COMMIT cannot run without the record: a handler that deletes its
/// key's claim row through its transaction gets the layer's 500, its work
/// is rolled back with it, and the key is free. The same for a large
/// response, recorded by the bound UPDATE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commit_never_runs_without_the_record() {
    let Some(pool) = pool().await else { return };
    traced::install();
    for size in [0, 200_000] {
        let (op, key) = (unique("op"), unique("k"));
        let q = format!("op={op}&then=forget&size={size}");
        let r = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR, "{size}");
        assert!(text(r).await.contains("handler_failed"), "{size}");
        assert_eq!(effects(&pool, &op).await, 0, "{size}: rolled back");
        assert_eq!(records(&pool, &key).await, 0, "{size}: the key is free");
        let recorded = traced::of(&key);
        assert!(
            !recorded.contains(&RECORDED_WITH_COMMIT.to_owned()),
            "{recorded:?}"
        );
        assert_eq!(
            recorded.contains(&RECORDED_THEN_COMMITTED.to_owned()),
            size > 0,
            "{size}: {recorded:?}"
        );
    }
}

/// A response larger than what goes into the COMMIT's query is recorded by
/// the bound UPDATE, then committed; it replays whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_response_is_recorded_then_committed() {
    let Some(pool) = pool().await else { return };
    traced::install();
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}&size=200000");
    let first = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let body = text(first).await;
    assert_eq!(body.len(), 200_000);
    assert_eq!(
        traced::of(&key),
        [CLAIMED_WITH_BEGIN, RECORDED_THEN_COMMITTED]
    );
    let again = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    assert!(replayed(again.headers()));
    assert_eq!(text(again).await, body);
    assert_eq!(effects(&pool, &op).await, 1);
}

/// Keys and scopes go into the one-round-trip statements as literals:
/// quotes, backslashes, an attempt at SQL, and text beyond ASCII come back
/// exactly, with `standard_conforming_strings` on or off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_scopes_with_quotes_and_backslashes_round_trip() {
    use std::str::FromStr;
    let Some(pool) = pool().await else { return };
    traced::install();
    for conforming in ["on", "off"] {
        let options = sqlx::postgres::PgConnectOptions::from_str(&pg::url())
            .unwrap()
            .options([("standard_conforming_strings", conforming)]);
        let odd = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options);
        let scope = format!(
            "tenant\\'; DROP TABLE {TABLE}; -- ' \\\\ ' naïve 日本 😀 {}",
            unique("s")
        );
        let backend = PostgresStore::with_table(odd.clone(), TABLE)
            .unwrap()
            .transactional();
        let app = Router::new().route("/charges", post(charge)).layer(
            IdempotencyLayer::new(backend).scope_with({
                let scope = scope.clone();
                move |_| scope.clone()
            }),
        );
        let key = format!("it's\\a\\\\'key'--{}", uuid::Uuid::new_v4().simple());
        let op = unique("op");
        let q = format!("op={op}");
        let first = app.clone().oneshot(req(Some(&key), &q, "a")).await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED, "{conforming}");
        let body = text(first).await;
        assert_eq!(
            traced::of(&key),
            [CLAIMED_WITH_BEGIN, RECORDED_WITH_COMMIT],
            "{conforming}"
        );
        let (stored_scope, done): (String, bool) =
            sqlx::query_as(&format!("SELECT scope, done FROM {TABLE} WHERE key = $1"))
                .bind(&key)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(stored_scope, scope, "{conforming}");
        assert!(done);
        let again = app.oneshot(req(Some(&key), &q, "a")).await.unwrap();
        assert!(replayed(again.headers()), "{conforming}");
        assert_eq!(text(again).await, body);
        assert_eq!(effects(&pool, &op).await, 1);
    }
}

/// A table of its own (made by `PostgresStore::migrate`, without the
/// record function), dropped with what the migration made when it goes.
struct OwnTable {
    pool: PgPool,
    name: String,
}

impl OwnTable {
    async fn new(pool: &PgPool) -> Self {
        let name = format!("resend_txfn_{}", uuid::Uuid::new_v4().simple());
        PostgresStore::with_table(pool.clone(), &name)
            .unwrap()
            .migrate()
            .await
            .unwrap();
        Self {
            pool: pool.clone(),
            name,
        }
    }

    fn backend(&self) -> tower_resend_server::PostgresTransactional {
        PostgresStore::with_table(self.pool.clone(), &self.name)
            .unwrap()
            .transactional()
    }

    async fn has_function(&self) -> bool {
        sqlx::query_scalar("SELECT to_regprocedure($1) IS NOT NULL")
            .bind(format!("{}_record(text, text, text, bytea)", self.name))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn drop(self) {
        sqlx::raw_sql(&format!(
            "DROP FUNCTION IF EXISTS {0}_record(text, text, text, bytea); DROP TABLE {0}",
            self.name
        ))
        .execute(&self.pool)
        .await
        .unwrap();
    }
}

fn app_on(backend: tower_resend_server::PostgresTransactional) -> Router {
    Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(backend))
        .layer(InboundDeadlineLayer::new(Duration::from_secs(30)))
}

/// The record goes with the COMMIT only through the table's record
/// function. Without it (a table made by `PostgresStore::migrate`, or by
/// an older migration), the record takes its own round trip, and all else
/// is the same; `PostgresTransactional::migrate` makes the function, and
/// the record goes with the COMMIT. A function dropped under a running
/// layer fails the one record that finds it gone — rolled back, the work
/// with it, the layer's 500 — and the records after it take their own
/// round trip again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_goes_with_the_commit_through_the_tables_function() {
    let Some(pool) = pool().await else { return };
    traced::install();
    let table = OwnTable::new(&pool).await;
    assert!(!table.has_function().await);
    let backend = table.backend();
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}");
    let first = app_on(backend.clone())
        .oneshot(req(Some(&key), &q, "a"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let body = text(first).await;
    assert_eq!(
        traced::of(&key),
        [CLAIMED_WITH_BEGIN, RECORDED_THEN_COMMITTED]
    );
    let again = app_on(backend.clone())
        .oneshot(req(Some(&key), &q, "a"))
        .await
        .unwrap();
    assert!(replayed(again.headers()));
    assert_eq!(text(again).await, body);
    assert_eq!(effects(&pool, &op).await, 1);

    // Migrated in transactional mode: the function is there, and used.
    backend.migrate().await.unwrap();
    assert!(table.has_function().await);
    assert!(backend.migration_sql().contains(&format!(
        "CREATE OR REPLACE FUNCTION {}_record(",
        table.name
    )));
    let key = unique("k");
    let r = app_on(backend.clone())
        .oneshot(req(Some(&key), &q, "a"))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(traced::of(&key), [CLAIMED_WITH_BEGIN, RECORDED_WITH_COMMIT]);
    // A layer of its own finds the function by itself.
    let key = unique("k");
    let r = app_on(table.backend())
        .oneshot(req(Some(&key), &q, "a"))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(traced::of(&key), [CLAIMED_WITH_BEGIN, RECORDED_WITH_COMMIT]);
    assert_eq!(effects(&pool, &op).await, 3);

    // Dropped under the running layer.
    sqlx::query(&format!(
        "DROP FUNCTION {}_record(text, text, text, bytea)",
        table.name
    ))
    .execute(&pool)
    .await
    .unwrap();
    let key = unique("k");
    let lost = app_on(backend.clone())
        .oneshot(req(Some(&key), &q, "a"))
        .await
        .unwrap();
    assert_eq!(lost.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(text(lost).await.contains("handler_failed"));
    assert_eq!(effects(&pool, &op).await, 3, "rolled back");
    let retry = app_on(backend.clone())
        .oneshot(req(Some(&key), &q, "a"))
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!replayed(retry.headers()));
    assert_eq!(effects(&pool, &op).await, 4);
    assert_eq!(
        traced::of(&key),
        [
            CLAIMED_WITH_BEGIN,
            CLAIMED_WITH_BEGIN,
            RECORDED_THEN_COMMITTED
        ]
    );
    table.drop().await;
}

/// The transactional migration (the table, its index and the record
/// function) from several processes at once: each of them succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transactional_migration_runs_from_several_processes_at_once() {
    let Some(pool) = pool().await else { return };
    let name = format!("resend_txfn_{}", uuid::Uuid::new_v4().simple());
    let migrations: Vec<_> = (0..4)
        .map(|_| {
            let backend = PostgresStore::with_table(pg::pool(&pg::url(), 1), &name)
                .unwrap()
                .transactional();
            tokio::spawn(async move { backend.migrate().await })
        })
        .collect();
    for m in migrations {
        m.await.unwrap().unwrap();
    }
    let table = OwnTable { pool, name };
    assert!(table.has_function().await);
    table.drop().await;
}

/// A relay to PostgreSQL (without TLS, so that it can read the client's
/// messages) that holds the server's bytes from the moment the client
/// sends bytes that hold the pattern it is armed with, until it is
/// released: a `BEGIN` on the wire whose answer is late. (The check of the
/// connection that comes before it, on its way out of the pool, is
/// answered.)
struct Stall {
    port: u16,
    armed: tokio::sync::watch::Sender<Option<&'static [u8]>>,
    hold: tokio::sync::watch::Sender<bool>,
    accept: tokio::task::AbortHandle,
}

/// sqlx's `BEGIN` of a transaction: a simple query message ('Q', its
/// length, the text and its NUL).
const BARE_BEGIN: &[u8] = b"Q\0\0\0\x0aBEGIN\0";
/// The end of the layer's claim of a new key with its `BEGIN`.
const CLAIM_THEN_BEGIN: &[u8] = b"; BEGIN\0";

impl Stall {
    async fn start(target: std::net::SocketAddr) -> Stall {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (armed, _) = tokio::sync::watch::channel(None);
        let (hold, held) = tokio::sync::watch::channel(false);
        let (armed2, hold2) = (armed.clone(), hold.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let (armed, hold) = (armed2.clone(), hold2.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0; 16 * 1024];
                    while let Ok(n @ 1..) = cr.read(&mut buf).await {
                        let chunk = &buf[..n];
                        let pattern = *armed.borrow();
                        if pattern.is_some_and(|p: &[u8]| chunk.windows(p.len()).any(|w| w == p)) {
                            armed.send_replace(None);
                            hold.send_replace(true);
                        }
                        if sw.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
                let mut held = held.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0; 16 * 1024];
                    while let Ok(n @ 1..) = sr.read(&mut buf).await {
                        if held.wait_for(|h| !*h).await.is_err()
                            || cw.write_all(&buf[..n]).await.is_err()
                        {
                            return;
                        }
                    }
                });
            }
        })
        .abort_handle();
        Stall {
            port,
            armed,
            hold,
            accept,
        }
    }

    /// Whether a `BEGIN` was held since the relay was armed.
    fn held(&self) -> bool {
        *self.hold.borrow()
    }

    fn release(&self) {
        self.armed.send_replace(None);
        self.hold.send_replace(false);
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// A `BEGIN` cut by the store timeout while it is on the wire (sent, its
/// answer late) is finished on its own and rolled back: its connection does
/// not go back to the pool inside the transaction, where the next user
/// would find it (and, once a statement failed there, every statement
/// refused: 25P02). sqlx counts a transaction as begun only once its
/// `BEGIN` has answered, and its guard rolls back only a counted one, so a
/// `begin()` future dropped mid-way leaves that to the caller. Every
/// `BEGIN` the layer sends: an unsafe request's without a key, a claim's
/// the long way (the key is not new), and a new key's claim with its
/// `BEGIN` in one statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_cut_on_the_wire_leaves_no_transaction_behind() {
    use std::str::FromStr;
    let Some(pool) = pool().await else { return };
    let stall = Stall::start("127.0.0.1:5432".parse().unwrap()).await;
    let name = unique("tx-begin-cut");
    let options =
        sqlx::postgres::PgConnectOptions::from_str(&pg::with_port(&pg::url(), stall.port))
            .unwrap()
            .ssl_mode(sqlx::postgres::PgSslMode::Disable)
            .application_name(&name);
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);
    // The pool's one connection is made, and idle.
    sqlx::query("SELECT 1").execute(&one).await.unwrap();
    let backend = PostgresStore::with_table(one.clone(), TABLE)
        .unwrap()
        .transactional();
    let app = Router::new()
        .route("/charges", post(charge))
        .layer(IdempotencyLayer::new(backend).store_timeout(Duration::from_millis(300)));
    // A key with a record: a request with it again claims the long way,
    // whose transaction begins with a bare BEGIN.
    let key = unique("k");
    let first = unique("op");
    let done = app
        .clone()
        .oneshot(req(Some(&key), &format!("op={first}"), "a"))
        .await
        .unwrap();
    assert_eq!(done.status(), StatusCode::CREATED);
    let (unkeyed, new_key, new_op) = (unique("op"), unique("k"), unique("op"));
    for (case, pattern, request) in [
        // An unsafe request without a key runs in a transaction of its own.
        (
            "without a key",
            BARE_BEGIN,
            req(None, &format!("op={unkeyed}"), "a"),
        ),
        (
            "claimed the long way",
            BARE_BEGIN,
            req(Some(&key), &format!("op={first}"), "a"),
        ),
        // A new key is claimed by the transaction's first statement; its
        // caller goes away while it is on the wire (cut by the store
        // timeout instead, it would be followed by a claim the long way,
        // whose BEGIN on the same connection would roll it back by chance).
        (
            "a new key",
            CLAIM_THEN_BEGIN,
            req(Some(&new_key), &format!("op={new_op}"), "a"),
        ),
    ] {
        stall.armed.send_replace(Some(pattern));
        if pattern == BARE_BEGIN {
            let cut = app.clone().oneshot(request).await.unwrap();
            assert_eq!(cut.status(), StatusCode::SERVICE_UNAVAILABLE, "{case}");
        } else {
            let gone =
                tokio::time::timeout(Duration::from_millis(100), app.clone().oneshot(request));
            assert!(gone.await.is_err(), "{case}: the request ended");
        }
        assert!(stall.held(), "{case}: no BEGIN was held");
        stall.release();
        // (The BEGIN's transaction, if it were left open, began over 100 ms
        // ago.)
        let alone = outside_any_transaction(&one).await;
        assert!(
            alone,
            "{case}: the pool's connection came back inside the BEGIN's transaction"
        );
        assert_eq!(pg::idle_in_transaction(&pool, &name).await, 0, "{case}");
    }
    assert_eq!(effects(&pool, &unkeyed).await, 0, "nothing ran");
    assert_eq!(effects(&pool, &new_op).await, 0, "nothing ran");
    assert_eq!(
        records(&pool, &new_key).await,
        0,
        "the cut claim was rolled back"
    );
    assert_eq!(effects(&pool, &first).await, 1, "the key's work ran once");
}
