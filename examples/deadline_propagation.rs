//! The caller's deadline, handed down: an inbound request with a 2 s budget,
//! a handler that spends 300 ms on its own work and then calls a slow
//! upstream through a tower-resend stack, the upstream seeing the shrunken budget
//! on the wire, and the 504 that names the upstream (an RFC 9457 problem
//! document, `application/problem+json`).
//!
//! Runs on loopback with no outside services, in about two seconds:
//! `cargo run --example deadline_propagation`.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderName, Request};
use http_body_util::{BodyExt, Empty, Full};
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_resend::{
    deadline::CallDeadlineLayer, deadline::DeadlineHeaderLayer, timeout::AttemptTimeoutLayer, Error,
};
use tower_resend_server::{ClientErrorResponse, InboundDeadlineLayer};

const BUDGET_HEADER: HeaderName = HeaderName::from_static("x-timeout-ms");

/// The slow upstream: says what budget it was given, then takes 5 s.
async fn shipping(headers: HeaderMap) -> &'static str {
    let budget = headers
        .get(&BUDGET_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none");
    println!("  [shipping]  got the request; x-timeout-ms: {budget} (what is left of the caller's 2000, less 300 ms of db work)");
    tokio::time::sleep(Duration::from_secs(5)).await;
    "shipped"
}

/// Our handler: its own work, then the upstream, with no deadline plumbing.
async fn create_order(State(upstream): State<String>) -> Result<String, ClientErrorResponse> {
    let left = tower_resend::Deadline::current().map_or(0, |d| d.remaining().as_millis());
    println!("  [orders]    handler runs with {left} ms left");
    tower_resend::deadline::internal("db", tokio::time::sleep(Duration::from_millis(300))).await;

    // One stack per upstream; it inherits the caller's deadline.
    let client = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(10)).upstream("shipping"))
        .layer(DeadlineHeaderLayer::new().http_header(BUDGET_HEADER))
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(5)))
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let req = Request::post(format!("{upstream}/shipments"))
        .body(Empty::<Bytes>::new())
        .expect("a valid request");
    let resp = client.oneshot(req).await.map_err(Error::from_box)?;
    Ok(format!("order created: {}", resp.status()))
}

async fn spawn(app: Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::main]
async fn main() {
    let upstream = spawn(Router::new().route("/shipments", post(shipping))).await;
    let orders = spawn(
        Router::new()
            .route("/orders", post(create_order))
            .with_state(upstream)
            .layer(InboundDeadlineLayer::new(Duration::from_secs(30)).http_header(BUDGET_HEADER)),
    )
    .await;

    println!("POST {orders}/orders with x-timeout-ms: 2000");
    let start = tokio::time::Instant::now();
    let client = tower_resend::hyper_client(Duration::from_secs(1));
    let req = Request::post(format!("{orders}/orders"))
        .header(BUDGET_HEADER, "2000")
        .body(Full::<Bytes>::default())
        .expect("request");
    let resp = client
        .oneshot(req)
        .await
        .expect("the orders service answers");
    let status = resp.status();
    let content_type = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_owned();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    println!(
        "  [caller]    after {} ms: {status} ({content_type})",
        start.elapsed().as_millis()
    );
    match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(json) => println!(
            "{}",
            serde_json::to_string_pretty(&json).unwrap_or_default()
        ),
        Err(_) => println!("{}", String::from_utf8_lossy(&body)),
    }
}
