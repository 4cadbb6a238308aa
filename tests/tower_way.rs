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

/// Code written for the earlier names still compiles: each is a deprecated
/// alias of the type it became (its warning names the new path).
#[test]
#[allow(deprecated)]
fn the_earlier_names_are_aliases_of_the_new_ones() {
    use std::any::TypeId;
    fn same<A: 'static, B: 'static>() -> bool {
        TypeId::of::<A>() == TypeId::of::<B>()
    }
    assert!(same::<
        tower_resend::DeadlineLayer,
        tower_resend::deadline::CallDeadlineLayer,
    >());
    assert!(same::<
        tower_resend::IdempotencyKeyLayer,
        tower_resend::idempotency::SetIdempotencyKeyLayer,
    >());
    assert!(same::<tower_resend::Attempts, tower_resend::retry::Attempts>());
    assert!(same::<
        tower_resend::CallOptions,
        tower_resend::retry::CallOptions,
    >());
    assert!(same::<
        tower_resend::StackBuilder,
        tower_resend::stack::StackBuilder,
    >());
    assert!(same::<
        tower_resend::routes::Router<()>,
        tower_resend::routes::PerRoute<()>,
    >());
    assert!(same::<
        tower_resend::fleet::InvalidInstance,
        tower_resend::fleet::InvalidFleet,
    >());
}

/// A stack with its type erased is one line in a struct field, and calls
/// as the stack does.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_boxed_stack_fits_in_a_struct_field_and_calls_as_the_stack() {
    use tower_resend::stack::BoxStack;

    #[derive(Clone)]
    struct State {
        shipping: BoxStack<String>,
    }
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let seen = calls.clone();
    let upstream = tower::service_fn(move |_req: http::Request<String>| {
        let first = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        async move {
            let status = if first { 503 } else { 200 };
            Ok::<_, tower_resend::BoxError>(
                http::Response::builder()
                    .status(status)
                    .body(http_body_util::Full::new(bytes::Bytes::from_static(b"ok")))
                    .unwrap(),
            )
        }
    });
    let state = State {
        shipping: tower_resend::stack()
            .name("shipping")
            .hedge(std::time::Duration::from_millis(50))
            .service(upstream)
            .boxed(),
    };
    let resp = state
        .shipping
        .clone()
        .oneshot(
            http::Request::get("http://shipping/rates")
                .body(String::new())
                .unwrap(),
        )
        .await
        .expect("the backup answers");
    assert_eq!(resp.status(), 200);
    // The 503 sent the hedge's backup at once: one attempt of two copies.
    let attempts = resp
        .extensions()
        .get::<tower_resend::retry::Attempts>()
        .unwrap();
    let last = attempts.iter().last().unwrap();
    assert_eq!((attempts.len(), last.copies()), (1, 2), "{attempts}");
}
