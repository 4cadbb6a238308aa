//! The main demo: an embedded flaky upstream and a narrated timeline of what
//! resend did and why. No outside services; it runs in a few seconds.
//!
//! `cargo run --example quickstart`
#![allow(clippy::print_stdout)]

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use resend::{Attempts, Deadline, Error, IdempotencyKey};
use resend_testkit::{Reply, Script, TestServer};
use tokio::time::Instant;
use tower::ServiceExt;

type Body = Full<Bytes>;

fn client() -> resend::HyperClient {
    resend::hyper_client(Duration::from_secs(2))
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
                "/payments",
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
    println!("upstream listening on {}\n", upstream.addr());

    let stack = resend::stack()
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
    println!("1. GET /stock -> {} after {:?}", resp.status(), t.elapsed());
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
    println!("2. POST /orders (no key) -> error after {:?}", t.elapsed());
    println!("   {}", show_error(&err));
    println!(
        "   outcome unknown: {}; orders created upstream: {} (sent once, never resent)\n",
        err.is_outcome_unknown(),
        upstream.effects(None)
    );

    // 3. The same POST through a stack whose upstream honours keys.
    let payments = resend::stack()
        .name("payments")
        .total(Duration::from_secs(3))
        .attempt_timeout(Duration::from_millis(500))
        .idempotency_keys()
        .service(client());
    let mut req = Request::post(upstream.uri("/payments")).body(Body::from("{\"cents\":1250}"))?;
    req.extensions_mut()
        .insert(IdempotencyKey::new("payment:order-7")?);
    let t = Instant::now();
    let resp = payments.oneshot(req).await?;
    let keys: Vec<_> = upstream
        .arrivals()
        .into_iter()
        .filter(|a| a.uri.path() == "/payments")
        .map(|a| a.idempotency_key.unwrap_or_default())
        .collect();
    println!(
        "3. POST /payments (key payment:order-7) -> {} after {:?}",
        resp.status(),
        t.elapsed()
    );
    println!(
        "   attempts: {}",
        show_attempts(resp.extensions().get::<Attempts>())
    );
    println!("   keys sent on each attempt: {keys:?}");
    println!("   why: the key makes the POST replay-safe; a server that honours it runs the work once.\n");

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
        "4. GET /quotes -> {} after {:?}",
        resp.status(),
        t.elapsed()
    );
    if let [first, second, ..] = at[..] {
        println!(
            "   Retry-After: 1 -> the second attempt came {:?} after the first",
            second - first
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
        "5. GET /slow -> error after {:?} (budget 1.2 s, 500 ms per attempt)",
        t.elapsed()
    );
    println!("   {}", show_error(&err));
    println!(
        "   kind: {:?}; the caller can always tell which limit fired.",
        err.kind()
    );
    assert_eq!(resp.status(), StatusCode::OK);
    Ok(())
}
