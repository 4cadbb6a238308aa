//! The layers on an axum router, and resend client errors as axum responses.
#![cfg(feature = "axum")]

use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use resend::{DeadlineLayer, Error, RetryLayer};
use resend_server::{ClientErrorResponse, IdempotencyLayer, InboundDeadlineLayer, MemoryStore};
use serde_json::Value;
use tower::{service_fn, ServiceBuilder, ServiceExt};

async fn json(resp: Response<Body>) -> Value {
    serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

async fn call_slow_upstream() -> Result<String, ClientErrorResponse> {
    let shipping = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(10)).upstream("shipping"))
        .service(service_fn(|_: Request<()>| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, Error>(Response::new(()))
        }));
    resend::deadline::internal("db", tokio::time::sleep(Duration::from_millis(250))).await;
    shipping
        .oneshot(Request::new(()))
        .await
        .map_err(Error::from_box)?;
    Ok("shipped".into())
}

async fn call_failing_upstream() -> Result<String, ClientErrorResponse> {
    let payments = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(10)).upstream("payments"))
        .layer(RetryLayer::new().no_budget().seed(1))
        .service(service_fn(
            |_: Request<resend::retry::ReplayBody<String>>| async {
                let mut r = Response::new(String::new());
                *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                Ok::<_, Error>(r)
            },
        ));
    payments
        .oneshot(
            Request::post("http://payments/charges")
                .body(String::new())
                .unwrap(),
        )
        .await
        .map_err(Error::from_box)?;
    Ok("charged".into())
}

fn app() -> Router {
    Router::new()
        .route("/ship", post(call_slow_upstream))
        .route("/charge", post(call_failing_upstream))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(InboundDeadlineLayer::new(Duration::from_secs(30)))
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_upstream_deadline_becomes_504_naming_the_upstream() {
    let req = Request::post("/ship")
        .header("grpc-timeout", "2S")
        .header("idempotency-key", "ship-1")
        .body(Body::empty())
        .unwrap();
    let start = tokio::time::Instant::now();
    let resp = app().oneshot(req).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
    let body = json(resp).await;
    assert_eq!(body["error"], "deadline_exceeded");
    assert_eq!(body["error_source"], "upstream");
    assert_eq!(body["upstream"], "shipping");
    assert_eq!(body["spent_ms"]["upstream"]["shipping"], 1750);
    assert_eq!(body["spent_ms"]["internal"]["db"], 250);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn outcome_unknown_becomes_502_saying_verify() {
    let req = Request::post("/charge").body(Body::empty()).unwrap();
    let resp = app().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    let body = json(resp).await;
    assert_eq!(body["error"], "outcome_unknown");
    assert_eq!(body["upstream"], "payments");
    assert!(body["message"].as_str().unwrap().contains("verify"));
}
