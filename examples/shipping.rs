//! The seeds' scenario: a background job that requests a shipment and a quote
//! lookup on a user's page, against one flaky shipping service.
//!
//! - The job sends its request with a key derived from the operation
//!   (`shipment-request:{order}`), so a run of the job that starts again sends
//!   the same key; the shipping service honours keys, and the stack retries
//!   through timeouts and 503s without booking twice.
//! - The quote lookup is on the user's path: a short budget, at most one
//!   retry, then "cannot show it now" instead of a spinning page.
//!
//! `cargo run --example shipping`
#![allow(clippy::print_stdout)]

use std::collections::HashSet;
use std::time::Duration;

use examples::ms;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::{retry::Attempts, IdempotencyKey, RetryAdvice};
use tower_resend_testkit::{Reply, Script, TestServer};

type Body = Full<Bytes>;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The shipping service: its first answers are slow or 503. A server that
    // honours keys (tower-resend-server's IdempotencyLayer) books once per key.
    let shipping = TestServer::start(
        Script::new()
            .route(
                "/shipments",
                Script::new()
                    .then(Reply::work_then_hang())
                    .then(Reply::status(503).header("retry-after", "1"))
                    .otherwise(Reply::status(201).body("{\"shipment\":\"SH-42\"}")),
            )
            .route(
                "/quotes",
                Script::new().otherwise(Reply::ok().body("12.50").delay(Duration::from_secs(2))),
            ),
    )
    .await?;

    // One stack per use: the job can wait; the page cannot.
    let job_stack = tower_resend::stack()
        .name("shipping")
        .total(Duration::from_secs(10))
        .attempt_timeout(Duration::from_millis(500))
        .max_attempts(4)
        .idempotency_keys()
        .service(tower_resend::hyper_client(Duration::from_secs(2)));
    let page_stack = tower_resend::stack()
        .name("shipping-quotes")
        .total(Duration::from_millis(800))
        .attempt_timeout(Duration::from_millis(350))
        .max_attempts(2)
        .service(tower_resend::hyper_client(Duration::from_secs(2)));

    // The background job: request a shipment for order 42.
    let order = 42;
    let mut req = Request::post(shipping.uri("/shipments")).body(Body::from("{\"order\":42}"))?;
    req.extensions_mut()
        .insert(IdempotencyKey::new(format!("shipment-request:{order}"))?);
    let t = Instant::now();
    match job_stack.clone().oneshot(req).await {
        Ok(resp) => {
            println!(
                "job: shipment for order {order} -> {} after {}",
                resp.status(),
                ms(t.elapsed())
            );
            if let Some(a) = resp.extensions().get::<Attempts>() {
                println!("     attempts: {a}");
            }
        }
        Err(e) => match e.retry_advice() {
            RetryAdvice::After(wait) => println!("job: release the job for {}: {e}", ms(wait)),
            RetryAdvice::VerifyFirst => {
                println!("job: look the shipment up before sending again: {e}")
            }
            _ => println!("job: fail it for review: {e}"),
        },
    }
    let mut keys = HashSet::new();
    for a in shipping
        .arrivals()
        .iter()
        .filter(|a| a.uri.path() == "/shipments")
    {
        println!(
            "     the service saw attempt {} with key {:?}",
            a.attempt, a.idempotency_key
        );
        keys.insert(a.idempotency_key.clone());
    }
    println!(
        "     distinct keys: {} (one operation, one key: a server that honours keys books it once)\n",
        keys.len()
    );

    // The user's page: a quote, with a short budget.
    let t = Instant::now();
    let quote = page_stack
        .clone()
        .oneshot(Request::get(shipping.uri("/quotes")).body(Body::default())?)
        .await;
    match quote {
        Ok(resp) if resp.status() == StatusCode::OK => {
            println!("page: quote shown after {}", ms(t.elapsed()))
        }
        Ok(resp) => println!(
            "page: quote unavailable ({}), cannot show it now",
            resp.status()
        ),
        Err(e) => {
            println!(
                "page: cannot show the quote now ({} spent, budget 800 ms)",
                ms(t.elapsed())
            );
            println!("      {e}");
        }
    }
    Ok(())
}
