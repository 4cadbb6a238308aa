//! tower-resend's guarantees over a reqwest client: an embedded flaky upstream on
//! 127.0.0.1 and a narrated timeline. No outside services; a few seconds.
//!
//! `cargo run --example reqwest_client`
#![allow(clippy::print_stdout)]

use std::time::Duration;

use examples::ms;

use http::Request;
use http_body_util::BodyExt;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::reqwest::{client_builder, ReqwestService};
use tower_resend::{retry::Attempts, Deadline, Error};
use tower_resend_testkit::{Reply, Script, TestServer};

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
async fn main() -> Result<(), tower_resend::BoxError> {
    let upstream = TestServer::start(
        Script::new()
            .route(
                "/stock",
                Script::new()
                    .then_n(2, Reply::status(503))
                    .otherwise(Reply::ok().body("42 in stock")),
            )
            .route("/orders", Script::new().otherwise(Reply::work_then_hang()))
            .route("/slow", Script::new().otherwise(Reply::never())),
    )
    .await?;
    println!("upstream listening on {}\n", upstream.addr());

    // The reqwest client, set up to sit under resend: reqwest's own retries
    // off (one layer retries), its connect timeout as the stack's, no
    // overall timeout of its own (tower-resend's attempt timeout and deadline
    // bound every call and say which fired).
    let client = client_builder(Duration::from_secs(2)).no_proxy().build()?;
    let stack = tower_resend::stack()
        .name("inventory")
        .total(Duration::from_secs(3))
        .attempt_timeout(Duration::from_millis(500))
        .retry(|r| r.overload_floor(Duration::from_millis(200)))
        .service(ReqwestService::new(client));

    // 1. A GET carried through two 503s.
    let t = Instant::now();
    let resp = stack
        .clone()
        .oneshot(Request::get(upstream.uri("/stock")).body(String::new())?)
        .await?;
    let status = resp.status();
    let attempts = show_attempts(resp.extensions().get::<Attempts>());
    let body = resp.into_body().collect().await?.to_bytes();
    println!(
        "1. GET /stock -> {status} {body:?} after {}",
        ms(t.elapsed())
    );
    println!("   attempts: {attempts}");
    println!("   why: 503 is 'overloaded', GET is idempotent: retried.\n");

    // 2. A POST without a key that timed out after the work was done.
    let t = Instant::now();
    let err = stack
        .clone()
        .oneshot(Request::post(upstream.uri("/orders")).body("{\"item\":7}".to_owned())?)
        .await
        .expect_err("the upstream never answers");
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

    // 3. Nothing listens: reqwest's is_connect() means nothing was sent.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let t = Instant::now();
    let err = stack
        .clone()
        .oneshot(Request::post(format!("http://{closed}/orders")).body("{}".to_owned())?)
        .await
        .expect_err("nothing listens");
    println!(
        "3. POST to a closed port -> error after {}",
        ms(t.elapsed())
    );
    println!("   {}", show_error(&err));
    println!(
        "   not sent: {}: safe to retry even a POST without a key.\n",
        err.is_not_sent()
    );

    // 4. A silent upstream: given up on by the deadline, never later. This
    // request brings its own budget of 1.2 s, shorter than the stack's 3 s.
    let mut req = Request::get(upstream.uri("/slow")).body(String::new())?;
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(1200)));
    let t = Instant::now();
    let err = stack
        .clone()
        .oneshot(req)
        .await
        .expect_err("the upstream never answers /slow");
    println!(
        "4. GET /slow -> error after {} (budget 1.2 s, 500 ms per attempt)",
        ms(t.elapsed())
    );
    println!("   {}", show_error(&err));
    println!("   kind: {:?}", err.kind());
    Ok(())
}
