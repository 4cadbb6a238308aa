//! DESIGN section 7's last rule, end to end across a real process crash:
//! two services, A (keyed, on the Redis store) calling B (keyed, on the
//! memory store) through a tower-resend stack with `idempotency_keys()`. A's
//! process is killed after B did its work; the caller's retry re-runs A in
//! a new process, whose derived key makes B replay: B's effect count stays 1.
//!
//! B runs in the test process. A runs as a child process: this test binary
//! run again with `--ignored --exact a_server_child`, told what to do by
//! environment variables ([`ENV_MODE`] and the others). It says
//! `LISTENING <port>` on stdout once bound, and, in the `hang` mode,
//! `B-CALLED` once B has answered, then hangs: the window in which the test
//! kills it.
//!
//! Real clock, loopback only, ports from 127.0.0.1:0, bounded by a timeout
//! around everything. Without Redis (`RESEND_REDIS_URL`, default
//! `redis://127.0.0.1:6379`): skipped with a warning, or failed when `CI` is
//! set.
#![cfg(feature = "redis")]
// The child speaks to the test on stdout; what it forwards goes to stderr.
#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "support/child.rs"]
mod child;
#[path = "support/redis.rs"]
mod redis_server;
#[path = "support/serve.rs"]
mod serve;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request as AxumRequest, State};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use child::{
    exit_with_the_test, is_derived, say, ChildServer, A_LEASE, LINE_WAIT, RETRY_FOR, SCENARIO,
};
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serve::serve;
use tokio::time::{sleep, timeout, Instant};
use tower::ServiceExt;
use tower_resend_server::idempotency::IDEMPOTENT_REPLAYED;
use tower_resend_server::{IdempotencyLayer, MemoryStore, RedisStore};

/// The child's mode: `hang` or `normal`. Unset: not a child.
const ENV_MODE: &str = "RESEND_CRASH_A_MODE";
/// B's base URL, `http://127.0.0.1:<port>`.
const ENV_B_URL: &str = "RESEND_CRASH_B_URL";
/// A's Redis key prefix, the same for both of A's processes.
const ENV_PREFIX: &str = "RESEND_CRASH_A_PREFIX";
/// The Redis A uses.
const ENV_REDIS: &str = "RESEND_REDIS_URL";

const CALLER_BODY: &str = "order-1: 3 widgets";

fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

fn key_of(headers: &HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

// ---------------------------------------------------------------- B ----

/// One request as B's outermost layer saw it.
#[derive(Clone, Debug)]
struct Seen {
    key: String,
    status: StatusCode,
    replayed: bool,
}

/// What B did: effects per Idempotency-Key, and every request it received.
#[derive(Clone, Default)]
struct B {
    effects: Arc<Mutex<HashMap<String, usize>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl B {
    fn total(&self) -> usize {
        self.effects.lock().unwrap().values().sum()
    }
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// B's work: counted, and answered 201 with a body naming the run.
async fn b_effect(State(b): State<B>, headers: HeaderMap, body: Bytes) -> Response {
    let key = key_of(&headers);
    let run = {
        let mut effects = b.effects.lock().unwrap();
        *effects.entry(key.clone()).or_default() += 1;
        effects.values().sum::<usize>()
    };
    let body = String::from_utf8_lossy(&body);
    (StatusCode::CREATED, format!("B run {run} ({body})")).into_response()
}

/// Outside B's IdempotencyLayer: records every request B receives and how it
/// was answered.
async fn b_record(State(b): State<B>, req: AxumRequest, next: Next) -> Response {
    let key = key_of(req.headers());
    let resp = next.run(req).await;
    let replayed = resp
        .headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v == "true");
    b.seen.lock().unwrap().push(Seen {
        key,
        status: resp.status(),
        replayed,
    });
    resp
}

async fn start_b() -> (B, SocketAddr) {
    let b = B::default();
    let app = Router::new()
        .route("/effects", post(b_effect))
        .with_state(b.clone())
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(from_fn_with_state(b.clone(), b_record));
    (b.clone(), serve(app).await)
}

// ---------------------------------------------------------------- A ----

type BClient = tower_resend::stack::Stack<tower_resend::connect::HyperClient>;

#[derive(Clone)]
struct A {
    b: BClient,
    b_url: String,
    hang: bool,
}

/// A's keyed handler: calls B through tower-resend (the key derived from A's
/// inbound one), then hangs (`hang`) or answers 201 with B's body, and B's
/// `Idempotent-Replayed` as `x-b-replayed`.
async fn a_order(State(a): State<A>, body: Bytes) -> Response {
    let mut text = b"from A: ".to_vec();
    text.extend_from_slice(&body);
    let req = Request::post(format!("{}/effects", a.b_url))
        .body(Full::new(Bytes::from(text)))
        .unwrap();
    let resp = match a.b.clone().oneshot(req).await {
        Ok(resp) => resp,
        Err(e) => return (StatusCode::BAD_GATEWAY, format!("B failed: {e}")).into_response(),
    };
    let status = resp.status();
    let replayed = resp.headers().get(IDEMPOTENT_REPLAYED).cloned();
    let b_body = match resp.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return (StatusCode::BAD_GATEWAY, format!("B's body: {e}")).into_response(),
    };
    if a.hang {
        say(&format!("B-CALLED {status}"));
        // The crash happens in here.
        std::future::pending::<()>().await;
    }
    if !status.is_success() {
        let msg = format!("B answered {status}: {}", String::from_utf8_lossy(&b_body));
        return (StatusCode::BAD_GATEWAY, msg).into_response();
    }
    let mut resp = (StatusCode::CREATED, b_body).into_response();
    if let Some(v) = replayed {
        resp.headers_mut().insert("x-b-replayed", v);
    }
    resp
}

/// Not a test: the entry point of service A's process, which the tests
/// start by running this binary again with `--ignored --exact
/// a_server_child` and [`ENV_MODE`] set. Run any other way (no
/// [`ENV_MODE`], as under `cargo test -- --include-ignored`), it returns at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the entry point of service A's child process, run by `a_killed_after_b_worked_*`"]
async fn a_server_child() {
    let Ok(mode) = std::env::var(ENV_MODE) else {
        eprintln!("a_server_child: {ENV_MODE} is unset, so this is not a child: nothing to do");
        return;
    };
    let hang = match mode.as_str() {
        "hang" => true,
        "normal" => false,
        other => panic!("{ENV_MODE}={other:?}: expected `hang` or `normal`"),
    };
    let need = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is unset"));
    let (b_url, prefix, redis) = (need(ENV_B_URL), need(ENV_PREFIX), need(ENV_REDIS));

    exit_with_the_test("a_server_child");

    let store = RedisStore::open(&redis).unwrap().prefix(prefix);
    let b = tower_resend::stack()
        .name("b")
        .total(Duration::from_secs(5))
        .attempt_timeout(Duration::from_secs(2))
        .idempotency_keys()
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let app = Router::new()
        .route("/orders", post(a_order))
        .with_state(A { b, b_url, hang })
        .layer(IdempotencyLayer::new(store).lease(A_LEASE));
    let addr = serve(app).await;
    say(&format!("LISTENING {}", addr.port()));
    std::future::pending::<()>().await;
}

/// Starts A's process in `mode` (`hang` or `normal`).
async fn start_a(name: &'static str, mode: &str, b: SocketAddr, prefix: &str) -> ChildServer {
    let envs = [
        (ENV_MODE, mode.to_owned()),
        (ENV_B_URL, format!("http://{b}")),
        (ENV_PREFIX, prefix.to_owned()),
        (ENV_REDIS, redis_server::url()),
    ];
    ChildServer::start(name, "a_server_child", &envs).await
}

fn url_of(a: &ChildServer) -> String {
    format!("http://127.0.0.1:{}/orders", a.port)
}

// ----------------------------------------------------------- caller ----

type Caller = tower_resend::connect::HyperClient;

fn caller() -> Caller {
    tower_resend::hyper_client(Duration::from_secs(1))
}

/// The caller's keyed POST to A.
fn order(url: &str, key: &str) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(CALLER_BODY.as_bytes())))
        .unwrap()
}

/// A's answer: status, headers, body.
async fn send(caller: &Caller, req: Request<Full<Bytes>>) -> (StatusCode, HeaderMap, String) {
    let resp = timeout(LINE_WAIT, caller.request(req))
        .await
        .expect("A answers in time")
        .expect("A answers");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// Sends the keyed POST again while A answers 409 (the dead holder's lease
/// has not expired), for at most [`RETRY_FOR`]; gives the first other answer
/// and how many 409s came before it.
async fn retry_through_409(
    caller: &Caller,
    url: &str,
    key: &str,
) -> ((StatusCode, HeaderMap, String), usize) {
    let give_up = Instant::now() + RETRY_FOR;
    let mut conflicts = 0;
    loop {
        let answer = send(caller, order(url, key)).await;
        if answer.0 != StatusCode::CONFLICT {
            return (answer, conflicts);
        }
        conflicts += 1;
        assert!(
            Instant::now() < give_up,
            "A still answers 409 after {RETRY_FOR:?} ({conflicts} tries): \
             the dead holder's {A_LEASE:?} lease was never replaced"
        );
        sleep(Duration::from_millis(100)).await;
    }
}

// ------------------------------------------------------------- test ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_after_b_worked_is_rerun_and_b_replays() {
    if !redis_server::reachable(&redis_server::url()).await {
        return;
    }
    timeout(SCENARIO, scenario())
        .await
        .unwrap_or_else(|_| panic!("the crash scenario took more than {SCENARIO:?}"));
}

async fn scenario() {
    let started = Instant::now();
    let (b, b_addr) = start_b().await;
    let prefix = format!("resend-test:{}:", unique("crash"));
    let caller = caller();
    let key = "order-1";

    // A's first process takes the caller's POST, has B do the work, and
    // hangs before answering.
    let mut a1 = start_a("A1", "hang", b_addr, &prefix).await;
    let first = tokio::spawn({
        let (caller, req) = (caller.clone(), order(&url_of(&a1), key));
        async move { caller.request(req).await.map(|r| r.status()) }
    });
    assert_eq!(a1.wait_for("B-CALLED ").await, "201 Created");
    assert_eq!(b.total(), 1);
    let seen = b.seen();
    assert_eq!(seen.len(), 1);
    assert!(is_derived(&seen[0].key), "B got a derived key: {seen:?}");

    // The crash: A's process dies while it holds the lease.
    a1.kill().await;
    let lost = timeout(LINE_WAIT, first)
        .await
        .expect("the caller's first POST ends with A's death")
        .unwrap();
    assert!(lost.is_err(), "A died before it answered: {lost:?}");

    // The caller retries on a new process of A, same store, same key, same
    // body: 409 until the dead lease expires, then A runs again.
    let a2 = start_a("A2", "normal", b_addr, &prefix).await;
    let ((status, headers, body), conflicts) = retry_through_409(&caller, &url_of(&a2), key).await;
    assert_eq!(status, StatusCode::CREATED, "A's retry: {body}");
    assert!(
        headers.get(IDEMPOTENT_REPLAYED).is_none(),
        "A ran again; nothing of A's was stored to replay"
    );
    assert_eq!(
        body,
        format!("B run 1 (from A: {CALLER_BODY})"),
        "A's answer carries B's first run"
    );
    assert_eq!(
        headers.get("x-b-replayed"),
        Some(&HeaderValue::from_static("true"))
    );

    // B: its work ran once; it got the same derived key twice and replayed
    // the second.
    assert_eq!(b.total(), 1, "B's effect ran once: {:?}", b.seen());
    let seen = b.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[1].key, seen[0].key, "the re-run derived the same key");
    assert_eq!(
        (seen[0].status, seen[0].replayed),
        (StatusCode::CREATED, false)
    );
    assert_eq!(
        (seen[1].status, seen[1].replayed),
        (StatusCode::CREATED, true)
    );

    // Again on the same key: A's own stored answer; B is not called.
    let (status, headers, again) = send(&caller, order(&url_of(&a2), key)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(again, body);
    assert_eq!(b.seen().len(), 2);

    // Control: another inbound key derives another key, and B works again.
    // Were keys not derived from the inbound one, the assertions above
    // could not tell.
    let (status, headers, other) = send(&caller, order(&url_of(&a2), "order-2")).await;
    assert_eq!(status, StatusCode::CREATED, "{other}");
    assert_eq!(other, format!("B run 2 (from A: {CALLER_BODY})"));
    assert!(headers.get("x-b-replayed").is_none());
    assert_eq!(b.total(), 2);
    let seen = b.seen();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(is_derived(&seen[2].key));
    assert_ne!(seen[2].key, seen[0].key);
    assert!(!seen[2].replayed);
    assert_eq!(b.effects.lock().unwrap().values().max(), Some(&1));

    eprintln!(
        "crash scenario: {conflicts} x 409 before A's re-run, {:?} in all",
        started.elapsed()
    );
    drop(a2);
}
