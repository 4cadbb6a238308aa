//! The stack as tower users build services: a layer in a `ServiceBuilder`
//! beside tower-http's, over a hyper-util client the user made, sending the
//! key the caller chose. Over loopback, against the scripted test server,
//! on tokio's paused clock.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_http::set_header::SetRequestHeaderLayer;
use tower_http::trace::TraceLayer;
use tower_resend::retry::Attempts;
use tower_resend::IdempotencyKey;
use tower_resend_testkit::{Reply, Script, TestServer};

/// A user's own client, built as hyper-util's docs show: the transport as
/// it is, no body wrapper.
fn users_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn server(script: Script) -> TestServer {
    TestServer::start(script)
        .await
        .expect("start the test server")
}

fn attempts<B>(resp: &http::Response<B>) -> u32 {
    resp.extensions().get::<Attempts>().map_or(0, Attempts::len)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_stack_is_a_layer_beside_tower_https_layers() {
    let server = server(
        Script::new()
            .then(Reply::status(503))
            .otherwise(Reply::ok()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(TraceLayer::new_for_http())
        .layer(SetRequestHeaderLayer::overriding(
            http::header::USER_AGENT,
            HeaderValue::from_static("tower-way-test"),
        ))
        .layer(tower_resend::stack().name("x").max_attempts(3))
        .service(users_client());
    let req = Request::get(server.uri("/items"))
        .body(Full::new(Bytes::new()))
        .unwrap();

    let resp = tokio::time::timeout(Duration::from_secs(30), svc.oneshot(req))
        .await
        .expect("in time")
        .expect("the second attempt answers");

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(attempts(&resp), 2);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    // tower-http's header layer ran outside the stack: every attempt has it.
    assert!(arrivals
        .iter()
        .all(|a| a.headers.get(http::header::USER_AGENT)
            == Some(&HeaderValue::from_static("tower-way-test"))));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hedging_stack_is_a_layer_too() {
    // The first copy hangs; the backup, sent 50 ms later, answers.
    let server = server(Script::new().then(Reply::never()).otherwise(Reply::ok())).await;
    let svc = ServiceBuilder::new()
        .layer(TraceLayer::new_for_http())
        .layer(
            tower_resend::stack()
                .name("x")
                .max_attempts(3)
                .hedge(Duration::from_millis(50)),
        )
        .service(users_client());
    let req = Request::get(server.uri("/items"))
        .body(Full::new(Bytes::new()))
        .unwrap();

    let resp = tokio::time::timeout(Duration::from_secs(30), svc.oneshot(req))
        .await
        .expect("in time")
        .expect("the backup answers");

    assert_eq!(resp.status(), StatusCode::OK);
    let history = resp.extensions().get::<Attempts>().expect("attempts");
    assert_eq!(history.len(), 1, "hedged copies are one attempt");
    let attempt = history.iter().next().expect("one attempt");
    assert_eq!(attempt.copies(), 2);
    assert_eq!(attempt.winning_copy(), 2);
    assert_eq!(server.arrival_count(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_users_own_hyper_client_is_the_transport_as_it_is() {
    let server = server(Script::new().otherwise(Reply::ok().body("hello"))).await;
    let svc = tower_resend::stack().service(users_client());
    let req = Request::post(server.uri("/echo"))
        .body(Full::new(Bytes::from_static(b"payload")))
        .unwrap();

    let resp = tokio::time::timeout(Duration::from_secs(30), svc.oneshot(req))
        .await
        .expect("in time")
        .expect("answered");

    assert_eq!(resp.status(), StatusCode::OK);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 1);
    assert_eq!(arrivals[0].body.as_ref(), b"payload");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_callers_key_is_sent_on_every_attempt_without_idempotency_keys() {
    let server = server(
        Script::new()
            .then(Reply::status(503))
            .otherwise(Reply::status(201)),
    )
    .await;
    // No `.idempotency_keys()`: the stack makes no keys of its own.
    let svc = tower_resend::stack()
        .max_attempts(3)
        .service(users_client());
    let mut req = Request::post(server.uri("/orders"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    req.extensions_mut()
        .insert(IdempotencyKey::new("order-7").unwrap());

    let resp = tokio::time::timeout(Duration::from_secs(30), svc.oneshot(req))
        .await
        .expect("in time")
        .expect("the POST, keyed, is resent after the 503");

    assert_eq!(resp.status(), StatusCode::CREATED);
    assert_eq!(attempts(&resp), 2);
    let keys: Vec<_> = server
        .arrivals()
        .into_iter()
        .map(|a| a.idempotency_key)
        .collect();
    assert_eq!(keys, vec![Some("order-7".to_owned()); 2]);
}
