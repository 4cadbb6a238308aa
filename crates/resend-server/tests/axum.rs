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

/// A keyed handler whose upstream call ends "outcome unknown" answers 502,
/// and that 502 is the operation's end: the retry replays it, and the
/// upstream is not sent the POST again. One whose call was never sent (the
/// connection refused) answers a 502 marked `NothingDone`: the lease is
/// dropped, and the retry runs the handler again.
#[tokio::test(flavor = "current_thread")]
async fn client_errors_are_kept_unless_nothing_was_processed() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let sent = Arc::new(AtomicUsize::new(0));
    let unknown = {
        let sent = sent.clone();
        ServiceBuilder::new()
            .layer(DeadlineLayer::new(Duration::from_secs(10)).upstream("payments"))
            .layer(RetryLayer::new().no_budget().seed(1))
            .service(service_fn(
                move |_: Request<resend::retry::ReplayBody<String>>| {
                    let sent = sent.clone();
                    async move {
                        sent.fetch_add(1, Ordering::SeqCst);
                        let mut r = Response::new(String::new());
                        *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                        Ok::<_, Error>(r)
                    }
                },
            ))
    };
    // Nothing listens on port 1 of loopback: every attempt is refused.
    let refused = resend::stack()
        .name("payments")
        .backoff(
            resend::retry::Backoff::new(Duration::from_millis(1), 2.0, Duration::from_millis(2))
                .unwrap(),
        )
        .service(resend::hyper_client::<resend::retry::ReplayBody<String>>(
            Duration::from_secs(1),
        ));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/unknown",
            post({
                let runs = runs.clone();
                move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let req = Request::post("http://payments/charges")
                        .body(String::new())
                        .unwrap();
                    unknown.oneshot(req).await.map_err(Error::from_box)?;
                    Ok::<_, ClientErrorResponse>("charged")
                }
            }),
        )
        .route(
            "/refused",
            post({
                let runs = runs.clone();
                move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let req = Request::post("http://127.0.0.1:1/charges")
                        .body(String::new())
                        .unwrap();
                    refused.oneshot(req).await?;
                    Ok::<_, ClientErrorResponse>("charged")
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let call = |path: &str| {
        Request::post(path)
            .header("idempotency-key", format!("k{path}"))
            .body(Body::empty())
            .unwrap()
    };
    // Outcome unknown: kept.
    for replayed in [false, true] {
        let resp = app.clone().oneshot(call("/unknown")).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(resp.headers().contains_key("idempotent-replayed"), replayed);
        assert_eq!(json(resp).await["error"], "outcome_unknown");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        sent.load(Ordering::SeqCst),
        1,
        "the upstream POST is not sent again"
    );
    // Never sent: not kept; the retry runs again.
    for _ in 0..2 {
        let resp = app.clone().oneshot(call("/refused")).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
        assert!(!resp.headers().contains_key("idempotent-replayed"));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}
