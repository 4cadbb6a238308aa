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
use resend_server::idempotency::NothingDone;
use resend_server::{IdempotencyLayer, IdempotentTx, InboundDeadlineLayer, PostgresStore};
use sqlx::PgPool;
use tokio::sync::OnceCell;
use tower::ServiceExt;

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
                .map_err(|e| resend_server::StoreError::with_source("effects table", e))?;
                Ok::<_, resend_server::StoreError>(())
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

async fn effects(pool: &PgPool, op: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM resend_tx_effects WHERE op = $1")
        .bind(op)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// What the handler does, from the query: `op=` names its effect; `ms=`
/// is how long it works (holding its transaction) after writing it; `then=`
/// how it ends: `500`, `nothing` (503 marked NothingDone), `429`, `panic`,
/// or else 201.
struct How {
    op: String,
    then: String,
    ms: u64,
}

impl How {
    fn of(uri: &axum::http::Uri) -> Self {
        let mut how = Self {
            op: String::new(),
            then: String::new(),
            ms: 0,
        };
        for pair in uri.query().unwrap_or("").split('&') {
            match pair.split_once('=') {
                Some(("op", v)) => how.op = v.to_owned(),
                Some(("then", v)) => how.then = v.to_owned(),
                Some(("ms", v)) => how.ms = v.parse().unwrap_or(0),
                _ => {}
            }
        }
        how
    }
}

async fn charge(uri: axum::http::Uri, mut tx: IdempotentTx, body: String) -> Response {
    let how = How::of(&uri);
    sqlx::query("INSERT INTO resend_tx_effects (op) VALUES ($1)")
        .bind(&how.op)
        .execute(&mut *tx)
        .await
        .unwrap();
    if how.ms > 0 {
        tokio::time::sleep(Duration::from_millis(how.ms)).await;
    }
    drop(tx);
    let run = uuid::Uuid::new_v4().simple().to_string();
    match how.then.as_str() {
        "500" => (StatusCode::INTERNAL_SERVER_ERROR, format!("failed {run}")).into_response(),
        "429" => (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response(),
        "nothing" => {
            let mut r = (StatusCode::SERVICE_UNAVAILABLE, "try later").into_response();
            r.extensions_mut().insert(NothingDone);
            r
        }
        "panic" => panic!("the handler was told to panic"),
        _ => (StatusCode::CREATED, format!("charged {body} {run}")).into_response(),
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
    let (done, record_xid): (bool, String) = sqlx::query_as(&format!(
        "SELECT done, xmin::text FROM {TABLE} WHERE key = $1"
    ))
    .bind(&key)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(done);
    let effect_xid: String =
        sqlx::query_scalar("SELECT xmin::text FROM resend_tx_effects WHERE op = $1")
            .bind(&op)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        record_xid, effect_xid,
        "the record and the work share one transaction"
    );
}

/// What is kept: a final response commits with its work (5xx included);
/// nothing done (NothingDone, 429), a panic or the deadline roll the work
/// back with the claim, so the retry runs on a clean slate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_commits_and_what_rolls_back() {
    let Some(pool) = pool().await else { return };
    // A 500: committed, replayed, not run again.
    let (op, key) = (unique("op"), unique("k"));
    let q = format!("op={op}&then=500");
    let first = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = text(first).await;
    let again = app(&pool).oneshot(req(Some(&key), &q, "a")).await.unwrap();
    assert!(replayed(again.headers()));
    assert_eq!(text(again).await, body);
    assert_eq!(effects(&pool, &op).await, 1);
    // Rolled back, then the retry (told to succeed) runs and commits once.
    for then in ["nothing", "429", "panic"] {
        let (op, key) = (unique("op"), unique("k"));
        let first = app(&pool)
            .oneshot(req(Some(&key), &format!("op={op}&then={then}"), "a"))
            .await
            .unwrap();
        assert!(first.status().as_u16() >= 429, "{then}: {}", first.status());
        assert_eq!(
            effects(&pool, &op).await,
            0,
            "{then}: the work is rolled back"
        );
        // (Same fingerprint: the query is part of it, so the retry says
        // `then` the same way; the handler's outcome differs only by run.)
        let retry = app(&pool)
            .oneshot(req(Some(&key), &format!("op={op}&then={then}"), "a"))
            .await
            .unwrap();
        assert!(!replayed(retry.headers()), "{then}: the retry runs again");
        assert_eq!(effects(&pool, &op).await, 0, "{then}");
    }
    // The deadline cuts the handler: rolled back (the effect written before
    // the cut is undone), 504 naming where the time went.
    let (op, key) = (unique("op"), unique("k"));
    let mut r = req(Some(&key), &format!("op={op}&ms=1000"), "a");
    r.headers_mut()
        .insert("grpc-timeout", "300m".parse().unwrap());
    let cut = app(&pool).oneshot(r).await.unwrap();
    assert_eq!(cut.status(), StatusCode::GATEWAY_TIMEOUT);
    tokio::time::sleep(Duration::from_millis(200)).await;
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
    let holder = tokio::spawn({
        let (app, r) = (app(&pool), req(Some(&key), &q, "a"));
        async move { app.oneshot(r).await.unwrap().status() }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut short = req(Some(&key), &q, "a");
    short
        .headers_mut()
        .insert("grpc-timeout", "400m".parse().unwrap());
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
        let client = resend::hyper_client(Duration::from_secs(1));
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
async fn backend() -> Option<resend_server::PostgresTransactional> {
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
        resend::IdempotencyKeyLayer::new()
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
