//! The main demo: an embedded flaky upstream and a narrated timeline of what
//! resend did and why. No outside services; it runs in a few seconds.
//!
//! `cargo run --example quickstart`
#![allow(clippy::print_stdout)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use examples::ms;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::{retry::Attempts, Deadline, Error, IdempotencyKey};
use tower_resend_server::{IdempotencyLayer, MemoryStore};
use tower_resend_testkit::{Reply, Script, TestServer};

type Body = Full<Bytes>;

fn client() -> tower_resend::connect::HyperClient {
    tower_resend::hyper_client(Duration::from_secs(2))
}

/// A payments service that honours Idempotency-Key (tower-resend-server's
/// layer): each charge takes 800 ms, longer than the caller's 500 ms
/// attempt timeout. Returns its address and its count of charges made.
async fn payments_service() -> std::io::Result<(String, Arc<AtomicU32>)> {
    async fn charge(State(charges): State<Arc<AtomicU32>>) -> (StatusCode, &'static str) {
        charges.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(800)).await;
        (StatusCode::CREATED, "charged")
    }
    let charges = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .route("/payments", post(charge))
        .with_state(Arc::clone(&charges))
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((format!("http://{addr}"), charges))
}

fn show_attempts(a: Option<&Attempts>) -> String {
    a.map_or_else(|| "-".to_owned(), ToString::to_string)
}

fn show_error(e: &Error) -> String {
    let history = e
        .history()
        .map_or_else(String::new, |h| format!("\n      history: {h}"));
    format!("{e}{history}")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The flaky upstream: one route per scene.
    let upstream = TestServer::start(
        Script::new()
            .route(
                "/stock",
                Script::new()
                    .then_n(2, Reply::status(503))
                    .otherwise(Reply::ok().body("42 in stock")),
            )
            .route(
                "/orders",
                Script::new()
                    .then(Reply::work_then_hang())
                    .otherwise(Reply::status(201).effect()),
            )
            .route(
                "/quotes",
                Script::new()
                    .then(Reply::status(429).header("retry-after", "1"))
                    .otherwise(Reply::ok().body("12.50")),
            )
            .route("/slow", Script::new().otherwise(Reply::never())),
    )
    .await?;
    let (payments_url, charges) = payments_service().await?;
    println!("upstream listening on {}\n", upstream.addr());

    let stack = tower_resend::stack()
        .name("inventory")
        .total(Duration::from_secs(3))
        .attempt_timeout(Duration::from_millis(500))
        .max_attempts(3)
        .retry(|r| r.overload_floor(Duration::from_millis(200)))
        .service(client());

    // 1. A GET carried through two 503s.
    let t = Instant::now();
    let resp = stack
        .clone()
        .oneshot(Request::get(upstream.uri("/stock")).body(Body::default())?)
        .await?;
    println!(
        "1. GET /stock -> {} after {}",
        resp.status(),
        ms(t.elapsed())
    );
    println!(
        "   attempts: {}",
        show_attempts(resp.extensions().get::<Attempts>())
    );
    println!(
        "   why: 503 is 'overloaded', GET is idempotent: retried after the floor plus jitter.\n"
    );

    // 2. A POST without a key that timed out after the work was done.
    let t = Instant::now();
    let err = stack
        .clone()
        .oneshot(Request::post(upstream.uri("/orders")).body(Body::from("{\"item\":7}"))?)
        .await
        .expect_err("the upstream never answers the first POST");
    println!(
        "2. POST /orders (no key) -> error after {}",
        ms(t.elapsed())
    );
    println!("   {}", show_error(&err));
    println!(
        "   outcome unknown: {}; orders created upstream: {} (sent once, never resent)\n",
        err.is_outcome_unknown(),
        upstream.effects(None)
    );

    // 3. A keyed POST to a server that honours keys: the first attempt
    // times out while the charge runs; the retries carry the same key, are
    // told "in progress" (409), then get the first run's answer.
    let payments = tower_resend::stack()
        .name("payments")
        .total(Duration::from_secs(3))
        .attempt_timeout(Duration::from_millis(500))
        .max_attempts(4)
        .idempotency_keys()
        .service(client());
    let mut req =
        Request::post(format!("{payments_url}/payments")).body(Body::from("{\"cents\":1250}"))?;
    req.extensions_mut()
        .insert(IdempotencyKey::new("payment:order-7")?);
    let t = Instant::now();
    let resp = payments.oneshot(req).await?;
    println!(
        "3. POST /payments (key payment:order-7) -> {} after {}",
        resp.status(),
        ms(t.elapsed())
    );
    println!(
        "   attempts: {}",
        show_attempts(resp.extensions().get::<Attempts>())
    );
    println!(
        "   replayed: {}; charges made: {}",
        resp.headers()
            .get("idempotent-replayed")
            .map_or("no", |_| "yes"),
        charges.load(Ordering::SeqCst)
    );
    println!(
        "   why: the key makes the POST replay-safe, and tower-resend-server runs the work once.\n"
    );

    // 4. A 429 whose Retry-After was honoured.
    let t = Instant::now();
    let resp = stack
        .clone()
        .oneshot(Request::get(upstream.uri("/quotes")).body(Body::default())?)
        .await?;
    let at: Vec<_> = upstream
        .arrivals()
        .into_iter()
        .filter(|a| a.uri.path() == "/quotes")
        .map(|a| a.at)
        .collect();
    println!(
        "4. GET /quotes -> {} after {}",
        resp.status(),
        ms(t.elapsed())
    );
    if let [first, second, ..] = at[..] {
        println!(
            "   Retry-After: 1 -> the second attempt came {} after the first",
            ms(second - first)
        );
    }
    println!();

    // 5. A deadline that ran out, and where: this request brings its own
    // budget of 1.2 s, shorter than the stack's 3 s.
    let mut req = Request::get(upstream.uri("/slow")).body(Body::default())?;
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(1200)));
    let t = Instant::now();
    let err = stack
        .clone()
        .oneshot(req)
        .await
        .expect_err("the upstream never answers /slow");
    println!(
        "5. GET /slow -> error after {} (budget 1.2 s, 500 ms per attempt)",
        ms(t.elapsed())
    );
    println!("   {}", show_error(&err));
    println!(
        "   kind: {:?}; the caller can always tell which limit fired.",
        err.kind()
    );
    assert_eq!(resp.status(), StatusCode::OK);
    Ok(())
}
