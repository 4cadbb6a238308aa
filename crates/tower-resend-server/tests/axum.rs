//! The layers on an axum router, and resend client errors as axum responses:
//! every error body one problem document (RFC 9457).
#![cfg(feature = "axum")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};

use tower_resend::{
    breaker::CircuitBreakerLayer, deadline::CallDeadlineLayer, retry::RetryLayer,
    timeout::AttemptTimeoutLayer, Error, ErrorKind,
};
use tower_resend_server::{
    ClientErrorResponse, IdempotencyLayer, InboundDeadlineLayer, MemoryStore,
};

const PROBLEM: &str = "application/problem+json";

async fn json(resp: Response<Body>) -> Value {
    serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

/// The body of a problem response, checked for the members every problem
/// has: its media type, `type` (the code's section of the docs), `title`,
/// `status` (the response's) and `detail`.
async fn problem(resp: Response<Body>) -> Value {
    assert_eq!(resp.headers()["content-type"], PROBLEM);
    let status = resp.status();
    let body = json(resp).await;
    assert_problem(status, &body);
    body
}

fn assert_problem(status: StatusCode, body: &Value) {
    let code = body["error"].as_str().expect("an error code");
    assert_eq!(
        body["type"],
        format!(
            "https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#{code}"
        )
    );
    assert!(
        body["title"].as_str().is_some_and(|t| !t.is_empty()),
        "{body}"
    );
    assert!(
        body["detail"].as_str().is_some_and(|t| !t.is_empty()),
        "{body}"
    );
    assert_eq!(body["status"], status.as_u16(), "{body}");
}

async fn call_slow_upstream() -> Result<String, ClientErrorResponse> {
    let shipping = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(10)).upstream("shipping"))
        .service(service_fn(|_: Request<()>| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, Error>(Response::new(()))
        }));
    tower_resend::deadline::internal("db", tokio::time::sleep(Duration::from_millis(250))).await;
    shipping
        .oneshot(Request::new(()))
        .await
        .map_err(Error::from_box)?;
    Ok("shipped".into())
}

async fn call_failing_upstream() -> Result<String, ClientErrorResponse> {
    let payments = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(10)).upstream("payments"))
        .layer(RetryLayer::new().no_budget().seed(1))
        .service(service_fn(|_: Request<String>| async {
            let mut r = Response::new(String::new());
            *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            Ok::<_, Error>(r)
        }));
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
    let body = problem(resp).await;
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
    let body = problem(resp).await;
    assert_eq!(body["error"], "outcome_unknown");
    assert_eq!(body["upstream"], "payments");
    assert_eq!(body["attempts"], 1);
    assert!(body["detail"].as_str().unwrap().contains("verify"));
    assert_eq!(body.get("internal_detail"), None);
}

/// A keyed handler whose upstream call ends "outcome unknown" answers 502,
/// and that 502 is the operation's end: the retry replays it, and the
/// upstream is not sent the POST again. One whose call was never sent (the
/// connection refused) answers a 502 marked `NothingDone`: the lease is
/// dropped, and the retry runs the handler again.
#[tokio::test(flavor = "current_thread")]
async fn client_errors_are_kept_unless_nothing_was_processed() {
    let sent = Arc::new(AtomicUsize::new(0));
    let unknown = {
        let sent = sent.clone();
        ServiceBuilder::new()
            .layer(CallDeadlineLayer::new(Duration::from_secs(10)).upstream("payments"))
            .layer(RetryLayer::new().no_budget().seed(1))
            .service(service_fn(move |_: Request<String>| {
                let sent = sent.clone();
                async move {
                    sent.fetch_add(1, Ordering::SeqCst);
                    let mut r = Response::new(String::new());
                    *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                    Ok::<_, Error>(r)
                }
            }))
    };
    // Nothing listens on port 1 of loopback: every attempt is refused.
    let refused = tower_resend::stack()
        .name("payments")
        .backoff(
            tower_resend::retry::Backoff::new(
                Duration::from_millis(1),
                2.0,
                Duration::from_millis(2),
            )
            .unwrap(),
        )
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
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
        assert_eq!(problem(resp).await["error"], "outcome_unknown");
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

/// The handler of `/ship`: 250 ms of its own work, then a POST to the
/// upstream "shipping", a tower-resend stack over a service that never answers.
/// The call inherits the caller's deadline, which ends it with its outcome
/// unknown (the POST may have arrived).
fn shipping_app(runs: Arc<AtomicUsize>) -> Router {
    let sent = Arc::new(AtomicUsize::new(0));
    let shipping = tower_resend::stack().name("shipping").service(service_fn({
        let sent = sent.clone();
        move |_: Request<String>| {
            sent.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<Response<String>, Error>>()
        }
    }));
    Router::new()
        .route(
            "/ship",
            post(move || {
                let (shipping, runs) = (shipping.clone(), runs.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tower_resend::deadline::internal(
                        "db",
                        tokio::time::sleep(Duration::from_millis(250)),
                    )
                    .await;
                    let req = Request::post("http://shipping/shipments")
                        .body(String::new())
                        .unwrap();
                    let err = shipping.oneshot(req).await.unwrap_err();
                    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{err}");
                    Err::<String, _>(ClientErrorResponse::from(err))
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(InboundDeadlineLayer::new(Duration::from_secs(30)))
}

/// A handler whose upstream runs out of the inbound deadline answers the
/// documented 504 naming the upstream (not a 502 `outcome_unknown`), with
/// and without an `Idempotency-Key` on the inbound request; keyed, the 504
/// is the operation's end, replayed.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_upstream_out_of_inbound_deadline_is_a_504_problem_naming_it() {
    for key in [None, Some("ship-2")] {
        let runs = Arc::new(AtomicUsize::new(0));
        let app = shipping_app(runs.clone());
        let req = || {
            let mut req = Request::post("/ship").header("grpc-timeout", "2S");
            if let Some(key) = key {
                req = req.header("idempotency-key", key);
            }
            req.body(Body::empty()).unwrap()
        };
        let start = tokio::time::Instant::now();
        let resp = app.clone().oneshot(req()).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(2), "key {key:?}");
        assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT, "key {key:?}");
        let body = problem(resp).await;
        assert_eq!(body["error"], "deadline_exceeded", "key {key:?}: {body}");
        assert_eq!(body["title"], "Deadline exceeded");
        assert_eq!(body["error_source"], "upstream", "key {key:?}: {body}");
        assert_eq!(body["upstream"], "shipping", "key {key:?}: {body}");
        assert_eq!(body["spent_ms"]["total"], 2000);
        assert_eq!(body["spent_ms"]["upstream"]["shipping"], 1750);
        assert_eq!(body["spent_ms"]["internal"]["db"], 250);
        assert_eq!(body["spent_ms"]["unattributed"], 0);
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains("shipping"), "{detail}");
        // Unkeyed, the handler's own answer (the client error passed on)
        // reaches the caller; keyed, the handler runs in a task of its own,
        // and the inbound deadline layer may answer first, with the same
        // attribution (the handler's answer is what is kept and replayed).
        if key.is_none() || body.get("attempts").is_some() {
            assert_eq!(body["attempts"], 1);
            assert!(detail.contains("may have acted"), "{detail}");
        }
        assert_eq!(body.get("internal_detail"), None);
        if key.is_some() {
            // (The keyed work's task stores its end as the caller is
            // answered: a retry a moment later finds it.)
            tokio::time::sleep(Duration::from_millis(1)).await;
            let again = app.oneshot(req()).await.unwrap();
            assert_eq!(again.status(), StatusCode::GATEWAY_TIMEOUT);
            assert_eq!(again.headers()["idempotent-replayed"], "true");
            assert_eq!(problem(again).await["upstream"], "shipping");
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        }
    }
}

/// A handler cut by the inbound deadline while an outbound call is in
/// flight (here a call the handler records in the ledger itself, as a
/// client whose own deadline is later would) answers the 504 naming that
/// upstream, keyed or not: the keyed handler's 504 is built from where the
/// time went at the cut, before the handler is dropped.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_handler_cut_in_an_upstream_call_names_it_with_and_without_a_key() {
    let app = Router::new()
        .route(
            "/ship",
            post(|| async {
                tower_resend::deadline::internal(
                    "db",
                    tokio::time::sleep(Duration::from_millis(250)),
                )
                .await;
                let _call = tower_resend::deadline::server::current_ledger()
                    .unwrap()
                    .start(
                        tower_resend::deadline::server::Source::Upstream,
                        "shipping".into(),
                    );
                tokio::time::sleep(Duration::from_secs(60)).await;
                "shipped"
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(InboundDeadlineLayer::new(Duration::from_secs(30)));
    for key in [None, Some("ship-3")] {
        let mut req = Request::post("/ship").header("grpc-timeout", "2S");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        let resp = app
            .clone()
            .oneshot(req.body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
        let body = problem(resp).await;
        assert_eq!(body["error_source"], "upstream", "key {key:?}: {body}");
        assert_eq!(body["upstream"], "shipping", "key {key:?}: {body}");
        assert_eq!(body["budget_ms"], 2000);
        assert_eq!(body["spent_ms"]["upstream"]["shipping"], 1750);
        assert_eq!(body["spent_ms"]["internal"]["db"], 250);
    }
}

/// A failing upstream's error, as `ClientErrorResponse` answers it.
async fn answered(e: Error) -> (StatusCode, http::HeaderMap, Value) {
    let resp = ClientErrorResponse::from(e).into_response();
    let (status, headers) = (resp.status(), resp.headers().clone());
    let body = problem(resp).await;
    (status, headers, body)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn client_errors_are_problems_one_shape_per_kind() {
    // DeadlineExceeded: 504 naming the upstream.
    let silent = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(1)).upstream("shipping"))
        .service(service_fn(|_: Request<()>| {
            std::future::pending::<Result<Response<()>, Error>>()
        }));
    let e = Error::from_box(silent.oneshot(Request::new(())).await.unwrap_err());
    assert_eq!(e.kind(), ErrorKind::DeadlineExceeded);
    let (status, _, body) = answered(e).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(body["error"], "deadline_exceeded");
    assert_eq!(body["error_source"], "upstream");
    assert_eq!(body["upstream"], "shipping");
    assert_eq!(body["spent_ms"]["total"], 1000);

    // AttemptTimeout: 504 upstream_timeout.
    let slow = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(10)).upstream("shipping"))
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(1)))
        .service(service_fn(|_: Request<()>| {
            std::future::pending::<Result<Response<()>, Error>>()
        }));
    let e = Error::from_box(slow.oneshot(Request::new(())).await.unwrap_err());
    assert_eq!(e.kind(), ErrorKind::AttemptTimeout);
    let (status, _, body) = answered(e).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(body["error"], "upstream_timeout");
    assert_eq!(body["upstream"], "shipping");
    assert_eq!(body.get("error_source"), None);

    // OutcomeUnknown that the deadline caused: a POST cut in flight by the
    // call's deadline. 504, naming the upstream.
    let shipping = tower_resend::stack()
        .name("shipping")
        .total(Duration::from_secs(2))
        .service(service_fn(|_: Request<String>| {
            std::future::pending::<Result<Response<String>, Error>>()
        }));
    let req = Request::post("http://shipping/")
        .body(String::new())
        .unwrap();
    let e = shipping.oneshot(req).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutcomeUnknown, "{e}");
    let (status, _, body) = answered(e).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(body["error"], "deadline_exceeded");
    assert_eq!(body["error_source"], "upstream");
    assert_eq!(body["upstream"], "shipping");

    // The same under a key the stack chose: the key the upstream knows the
    // call by.
    let shipping = tower_resend::stack()
        .name("shipping")
        .total(Duration::from_secs(2))
        .idempotency_keys()
        .max_attempts(1)
        .service(service_fn(|_: Request<String>| {
            std::future::pending::<Result<Response<String>, Error>>()
        }));
    let req = Request::post("http://shipping/")
        .body(String::new())
        .unwrap();
    let e = shipping.oneshot(req).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutcomeUnknown, "{e}");
    let key = e
        .idempotency_key()
        .expect("the key the stack chose")
        .to_owned();
    let (status, _, body) = answered(e).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(body["error"], "deadline_exceeded");
    assert_eq!(body["upstream"], "shipping");
    assert_eq!(body["idempotency_key"], key);

    // OutcomeUnknown of another cause: 502, verify first.
    let failing =
        tower_resend::stack()
            .name("payments")
            .service(service_fn(|_: Request<String>| async {
                let mut r = Response::new(String::new());
                *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                Ok::<_, Error>(r)
            }));
    let req = Request::post("http://payments/")
        .body(String::new())
        .unwrap();
    let e = failing.oneshot(req).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutcomeUnknown, "{e}");
    let (status, _, body) = answered(e).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(body["error"], "outcome_unknown");
    assert_eq!(body["upstream"], "payments");
    assert_eq!(body.get("error_source"), None);

    // CircuitOpen: 503, Retry-After the time left open, rounded up.
    let mut dead = ServiceBuilder::new()
        .layer(
            CircuitBreakerLayer::new()
                .min_throughput(10)
                .upstream("payments"),
        )
        .layer(AttemptTimeoutLayer::new(Duration::from_millis(200)))
        .service(service_fn(|_: Request<()>| {
            std::future::pending::<Result<Response<()>, Error>>()
        }));
    for _ in 0..10 {
        dead.ready()
            .await
            .unwrap()
            .call(Request::new(()))
            .await
            .unwrap_err();
    }
    tokio::time::advance(Duration::from_millis(1500)).await;
    let e = Error::from_box(dead.oneshot(Request::new(())).await.unwrap_err());
    assert_eq!(e.kind(), ErrorKind::CircuitOpen);
    assert_eq!(e.limit(), Some(Duration::from_millis(3500)));
    let (status, headers, body) = answered(e).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "4");
    assert_eq!(body["error"], "circuit_open");
    assert_eq!(body["upstream"], "payments");
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("nothing was sent"));

    // AtCapacity: 503 upstream_overloaded, Retry-After 1, nothing sent. An
    // instance of a fleet sheds one call (its limit comes down to one)
    // and holds the next: the third is refused at once.
    let fleet = tower_resend::fleet::FleetLayer::fixed(["http://10.0.0.1:8080"])
        .unwrap()
        .limit(tower_resend::fleet::InstanceLimit::adaptive());
    let inventory = tower_resend::stack()
        .name("inventory")
        .max_attempts(1)
        .fleet(fleet)
        .service(service_fn(|req: Request<String>| async move {
            if req.uri().path() == "/shed" {
                let mut r = Response::new(String::new());
                *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                return Ok(r);
            }
            std::future::pending::<Result<Response<String>, Error>>().await
        }));
    let get = |path: &str| {
        Request::get(format!("http://inventory{path}"))
            .body(String::new())
            .unwrap()
    };
    let shed = inventory.clone().oneshot(get("/shed")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    let held = tokio::spawn(inventory.clone().oneshot(get("/held")));
    tokio::task::yield_now().await;
    let e = inventory.oneshot(get("/")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AtCapacity, "{e}");
    let (status, headers, body) = answered(e).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(body["error"], "upstream_overloaded");
    assert_eq!(body["upstream"], "inventory");
    assert!(body["detail"].as_str().unwrap().contains("was not sent"));
    held.abort();

    // QuotaSpent: 503 upstream_overloaded, Retry-After the quota's reset,
    // rounded up, nothing sent. The upstream's first answer says its
    // quota is spent for 29.5 s; the next call has 10 s.
    let search = tower_resend::stack()
        .name("search")
        .total(Duration::from_secs(10))
        .pace(tower_resend::quota::PaceLayer::new())
        .service(service_fn(|_: Request<String>| async {
            let r = Response::builder()
                .header("x-ratelimit-remaining-requests", "0")
                .header("x-ratelimit-reset-requests", "29.5s")
                .body(String::new())
                .unwrap();
            Ok::<_, Error>(r)
        }));
    search.clone().oneshot(get("/")).await.unwrap();
    let e = search.oneshot(get("/")).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::QuotaSpent, "{e}");
    let (status, headers, body) = answered(e).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "30");
    assert_eq!(body["error"], "upstream_overloaded");
    assert_eq!(body["upstream"], "search");
    assert!(body["detail"].as_str().unwrap().contains("quota"));
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("nothing was sent"));

    // A transport error: 502 upstream_failed.
    let io = std::io::Error::new(
        std::io::ErrorKind::ConnectionReset,
        "reset by 10.1.2.3:8443",
    );
    let (status, _, body) = answered(Error::from_box(io.into())).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(body["error"], "upstream_failed");
    assert_eq!(body.get("upstream"), None);
}

/// The text of an internal error reaches the caller only when the server
/// asks for it, in `internal_detail`; `detail` is tower-resend's own sentence.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn internal_error_text_only_when_configured() {
    let failing = tower_resend::stack()
        .name("payments")
        .max_attempts(1)
        .service(service_fn(|_: Request<String>| async {
            Err::<Response<String>, _>(std::io::Error::other("tls alert from db-7.internal:5432"))
        }));
    let err = || async {
        let req = Request::get("http://payments/")
            .body(String::new())
            .unwrap();
        failing.clone().oneshot(req).await.unwrap_err()
    };

    let resp = ClientErrorResponse::from(err().await).into_response();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    let body = problem(resp).await;
    assert_eq!(body["error"], "upstream_failed");
    assert_eq!(body["upstream"], "payments");
    assert_eq!(body["detail"], "the call to the upstream payments failed");
    assert!(!body.to_string().contains("db-7.internal"), "{body}");
    assert_eq!(body.get("internal_detail"), None);

    let resp = ClientErrorResponse::new(err().await)
        .with_internal_detail(true)
        .into_response();
    let body = problem(resp).await;
    assert_eq!(body["detail"], "the call to the upstream payments failed");
    let internal = body["internal_detail"].as_str().unwrap();
    assert!(
        internal.contains("tls alert from db-7.internal:5432"),
        "{internal}"
    );
    assert!(
        internal.starts_with("payments: transport error"),
        "{internal}"
    );
}

/// The idempotency layer's own answers on an axum router are problem
/// documents too: 409 (with Retry-After) while the first request runs, 422
/// for the key reused with another body, 400 for a malformed key.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_idempotency_layers_answers_are_problems() {
    let app = Router::new()
        .route(
            "/orders",
            post(|body: String| async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                format!("created {body}")
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let req = |key: &str, body: &'static str| {
        Request::post("/orders")
            .header("idempotency-key", key)
            .body(Body::from(body))
            .unwrap()
    };
    let first = tokio::spawn(app.clone().oneshot(req("order-1", "a")));
    tokio::time::sleep(Duration::from_millis(10)).await;

    let busy = app.clone().oneshot(req("order-1", "a")).await.unwrap();
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    assert!(busy.headers().contains_key("retry-after"));
    let body = problem(busy).await;
    assert_eq!(body["error"], "idempotency_key_in_progress");

    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    let reused = app.clone().oneshot(req("order-1", "b")).await.unwrap();
    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body = problem(reused).await;
    assert_eq!(body["error"], "idempotency_key_reused");
    assert_eq!(body["title"], "Idempotency-Key reused for another request");

    let malformed = app.oneshot(req("order 1", "a")).await.unwrap();
    assert_eq!(malformed.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem(malformed).await["error"], "idempotency_key_invalid");
}

/// A call whose deadline had run out before it could be sent is a 504
/// that says so, and that nothing was sent.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_call_stopped_before_it_was_sent_says_nothing_was_sent() {
    let shipping = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(1)).upstream("shipping"))
        .service(service_fn(|_: Request<()>| async {
            Ok::<_, Error>(Response::new(()))
        }));
    let mut req = Request::new(());
    req.extensions_mut()
        .insert(tower_resend::Deadline::after(Duration::ZERO));
    let e = Error::from_box(shipping.oneshot(req).await.unwrap_err());
    assert_eq!(e.kind(), ErrorKind::DeadlineExceeded);
    let (status, _, body) = answered(e).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(body["error"], "deadline_exceeded");
    assert_eq!(
        body["detail"],
        "the request's deadline ran out before the call to the upstream shipping could be sent; nothing was sent"
    );
}

/// A keyed POST cut by the server's inbound deadline: the server keeps its
/// 504 (the work may be half done) and replays it under the key. The client
/// sees the replay and stops there: one retry, not three, and the error
/// says "verify first" (not "retry with the same key", which would get the
/// same 504 for the record's life), keeping the key it sent.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_replayed_deadline_answer_advises_verify_first() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let server = Router::new()
        .route(
            "/charges",
            post(move || {
                let runs = Arc::clone(&counted);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    "charged"
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(InboundDeadlineLayer::new(Duration::from_millis(500)));
    let client = tower_resend::stack()
        .idempotency_keys()
        .max_attempts(3)
        .service(server);
    let post = Request::post("/charges").body(String::from("one")).unwrap();
    let err = client.oneshot(post).await.expect_err("outcome unknown");

    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{err}");
    assert_eq!(
        err.retry_advice(),
        tower_resend::RetryAdvice::VerifyFirst,
        "{err}"
    );
    assert!(err.idempotency_key().is_some(), "the key it was sent under");
    let history = err.history().expect("the attempts");
    let replays: Vec<bool> = history.iter().map(|a| a.replayed()).collect();
    assert_eq!(replays, [false, true], "{history:?}");
    assert!(history
        .iter()
        .all(|a| a.status() == Some(StatusCode::GATEWAY_TIMEOUT)));
    assert_eq!(history.stop(), tower_resend::retry::Stop::Replayed);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "run once, cut, replayed");
}
