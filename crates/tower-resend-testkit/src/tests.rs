use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{self, Client};
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use crate::{Reply, Script, TestServer};

pub(crate) type TestClient = Client<HttpConnector, Full<Bytes>>;

/// A connector with `TCP_NODELAY`: without it, Nagle's algorithm and delayed
/// ACKs can stall a small write for ~40 ms of real time, during which the
/// paused clock auto-advances and fires timers early.
pub(crate) fn connector() -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector
}

pub(crate) fn http1() -> TestClient {
    Client::builder(TokioExecutor::new()).build(connector())
}

pub(crate) fn http2() -> TestClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(connector())
}

pub(crate) fn get(server: &TestServer, path: &str) -> Request<Full<Bytes>> {
    Request::get(server.uri(path))
        .body(Full::default())
        .unwrap()
}

pub(crate) fn post(
    server: &TestServer,
    path: &str,
    key: Option<&str>,
    body: &'static str,
) -> Request<Full<Bytes>> {
    let mut request = Request::post(server.uri(path));
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// Fails the test instead of hanging if `fut` never completes (instant on the
/// paused clock).
pub(crate) async fn within<F: std::future::Future>(fut: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(600), fut)
        .await
        .expect("still pending after 10 minutes")
}

pub(crate) async fn send(
    client: &TestClient,
    request: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, legacy::Error> {
    within(client.request(request)).await
}

pub(crate) async fn status_of(client: &TestClient, request: Request<Full<Bytes>>) -> u16 {
    send(client, request).await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn queue_then_fallback() {
    let server = TestServer::start(Script::new().then_n(2, Reply::status(503)))
        .await
        .unwrap();
    let client = http1();

    let mut seen = Vec::new();
    for i in 0..4 {
        let request = Request::post(server.uri(&format!("/pay?n={i}")))
            .header("idempotency-key", "key-1")
            .header("x-trace", format!("t{i}"))
            .body(Full::new(Bytes::from(format!("body {i}"))))
            .unwrap();
        let response = send(&client, request).await.unwrap();
        seen.push(response.status().as_u16());
        let body = within(response.into_body().collect())
            .await
            .unwrap()
            .to_bytes();
        assert!(body.is_empty());
    }
    assert_eq!(seen, [503, 503, 200, 200]);

    assert_eq!(server.arrival_count(), 4);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 4);
    for (i, arrival) in arrivals.iter().enumerate() {
        assert_eq!(arrival.attempt, i + 1);
        assert_eq!(arrival.method, Method::POST);
        assert_eq!(arrival.uri.path(), "/pay");
        assert_eq!(arrival.uri.query(), Some(format!("n={i}").as_str()));
        assert_eq!(arrival.uri.to_string(), format!("/pay?n={i}"));
        assert_eq!(arrival.version, Version::HTTP_11);
        assert_eq!(arrival.headers["x-trace"], format!("t{i}").as_str());
        assert_eq!(arrival.idempotency_key.as_deref(), Some("key-1"));
        assert_eq!(arrival.body, format!("body {i}"));
    }
    assert!(arrivals.windows(2).all(|w| w[0].at <= w[1].at));
    assert_eq!(server.connections(), 1, "the client reuses its connection");
    assert_eq!(server.total_effects(), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn reply_headers_and_body() {
    let reply = Reply::status(201)
        .header("x-one", "1")
        .header("x-many", "a")
        .header("x-many", "b")
        .body("hello");
    let server = TestServer::start(Script::new().otherwise(reply))
        .await
        .unwrap();
    let response = send(&http1(), get(&server, "/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()["x-one"], "1");
    let many: Vec<_> = response.headers().get_all("x-many").iter().collect();
    assert_eq!(many, ["a", "b"]);
    assert_eq!(response.headers()["content-length"], "5");
    let body = within(response.into_body().collect())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(body, "hello");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn delay_waits_on_the_paused_clock() {
    let server = TestServer::start(
        Script::new()
            .then(Reply::ok().delay(Duration::from_secs(2)))
            .otherwise(Reply::status(204)),
    )
    .await
    .unwrap();
    let client = http1();

    let start = Instant::now();
    let response = send(&client, get(&server, "/slow")).await.unwrap();
    let elapsed = start.elapsed();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        elapsed >= Duration::from_secs(2),
        "answered after {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(3),
        "answered after {elapsed:?}"
    );

    let start = Instant::now();
    assert_eq!(status_of(&client, get(&server, "/fast")).await, 204);
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn never_answers() {
    let server = TestServer::start(Script::new().then(Reply::never()))
        .await
        .unwrap();
    let client = http1();

    let start = Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        send(&client, get(&server, "/hang")),
    )
    .await;
    assert!(outcome.is_err(), "the request must still be pending");
    assert!(start.elapsed() >= Duration::from_secs(60));
    assert_eq!(server.arrival_count(), 1);
    assert_eq!(server.arrivals()[0].uri.path(), "/hang");
    assert_eq!(server.total_effects(), 0);

    // The server still serves others.
    assert_eq!(status_of(&client, get(&server, "/")).await, 200);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn close_http1_gives_no_response() {
    let server = TestServer::start(Script::new().then(Reply::close()))
        .await
        .unwrap();
    let client = http1();

    let error = send(&client, get(&server, "/")).await.unwrap_err();
    assert!(!error.is_connect(), "the connection was made: {error:?}");
    assert_eq!(server.arrival_count(), 1);

    // A fresh connection works.
    assert_eq!(status_of(&client, get(&server, "/")).await, 200);
    assert_eq!(server.connections(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn close_http2_resets_the_stream() {
    let server = TestServer::start(Script::new().then(Reply::close()))
        .await
        .unwrap();
    let client = http2();

    let error = send(&client, get(&server, "/")).await.unwrap_err();
    assert!(!error.is_connect(), "the connection was made: {error:?}");
    assert_eq!(server.arrival_count(), 1);
    assert_eq!(server.arrivals()[0].version, Version::HTTP_2);

    // Only the stream was reset: the connection carries on.
    assert_eq!(status_of(&client, get(&server, "/")).await, 200);
    assert_eq!(server.connections(), 1);
}

async fn check_reset_mid_body(client: TestClient) {
    let server = TestServer::start(
        Script::new()
            .then(
                Reply::status(200)
                    .header("x-partial", "yes")
                    .reset_mid_body("partial"),
            )
            .then(Reply::status(500).reset_mid_body(Bytes::new())),
    )
    .await
    .unwrap();

    let response = send(&client, get(&server, "/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-partial"], "yes");
    let mut body = response.into_body();
    let mut received = Vec::new();
    let error = loop {
        match within(body.frame()).await {
            Some(Ok(frame)) => received.extend_from_slice(&frame.into_data().unwrap()),
            Some(Err(error)) => break error,
            None => panic!("the body must fail, got {received:?} and a clean end"),
        }
    };
    assert_eq!(received, b"partial", "then {error:?}");
    assert_eq!(server.connections(), 1);

    let response = send(&client, get(&server, "/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    within(response.into_body().collect()).await.unwrap_err();
    assert_eq!(server.arrival_count(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn reset_mid_body_http1() {
    check_reset_mid_body(http1()).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn reset_mid_body_http2() {
    check_reset_mid_body(http2()).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn work_then_hang_does_the_work() {
    let server = TestServer::start(Script::new().then(Reply::work_then_hang()))
        .await
        .unwrap();
    let client = http1();

    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        send(&client, post(&server, "/charge", Some("k1"), "x")),
    )
    .await;
    assert!(outcome.is_err(), "the client must never hear back");
    assert_eq!(server.effects(Some("k1")), 1);
    assert_eq!(server.effects(None), 0);
    assert_eq!(server.total_effects(), 1);
    assert_eq!(server.arrival_count(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn effects_are_counted_per_key() {
    let server = TestServer::start(Script::new().otherwise(Reply::ok().effect()))
        .await
        .unwrap();
    let client = http1();

    for key in [Some("a"), Some("a"), Some("b"), None, None, None] {
        assert_eq!(status_of(&client, post(&server, "/", key, "")).await, 200);
    }
    let fallback = Request::post(server.uri("/"))
        .header("x-idempotency-key", "c")
        .body(Full::default())
        .unwrap();
    assert_eq!(status_of(&client, fallback).await, 200);
    let not_visible_ascii = Request::post(server.uri("/"))
        .header(
            "idempotency-key",
            http::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        )
        .body(Full::default())
        .unwrap();
    assert_eq!(status_of(&client, not_visible_ascii).await, 200);

    assert_eq!(server.effects(Some("a")), 2);
    assert_eq!(server.effects(Some("b")), 1);
    assert_eq!(server.effects(Some("c")), 1);
    assert_eq!(server.effects(Some("zzz")), 0);
    assert_eq!(server.effects(None), 4);
    assert_eq!(server.total_effects(), 8);
    assert_eq!(server.arrivals()[6].idempotency_key.as_deref(), Some("c"));
    assert_eq!(server.arrivals()[7].idempotency_key, None);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn effect_happens_after_the_delay_even_if_the_client_gives_up() {
    let server =
        TestServer::start(Script::new().then(Reply::ok().delay(Duration::from_secs(5)).effect()))
            .await
            .unwrap();
    let client = http1();

    let start = Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(1),
        send(&client, post(&server, "/", Some("slow"), "")),
    )
    .await;
    assert!(outcome.is_err());
    assert_eq!(server.effects(Some("slow")), 0, "not before the delay");
    drop(client);

    tokio::time::sleep_until(start + Duration::from_secs(5)).await;
    for _ in 0..100 {
        if server.effects(Some("slow")) == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(server.effects(Some("slow")), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn routes_have_their_own_scripts() {
    let server = TestServer::start(
        Script::new()
            .then(Reply::status(500))
            .route(
                "/a",
                Script::new()
                    .then(Reply::status(503))
                    .otherwise(Reply::status(201)),
            )
            .route("/b", Script::new().otherwise(Reply::status(404))),
    )
    .await
    .unwrap();
    let client = http1();

    assert_eq!(status_of(&client, get(&server, "/a")).await, 503);
    assert_eq!(status_of(&client, get(&server, "/b?x=1")).await, 404);
    assert_eq!(status_of(&client, get(&server, "/a")).await, 201);
    assert_eq!(status_of(&client, get(&server, "/other")).await, 500);
    assert_eq!(status_of(&client, get(&server, "/other")).await, 200);
    assert_eq!(status_of(&client, get(&server, "/a")).await, 201);
    assert_eq!(server.arrival_count(), 6);
    let attempts: Vec<_> = server.arrivals().iter().map(|a| a.attempt).collect();
    assert_eq!(attempts, [1, 2, 3, 4, 5, 6]);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn from_fn_sees_the_arrival() {
    let server = TestServer::start(
        Script::from_fn(|arrival| match arrival.idempotency_key.as_deref() {
            Some(key) => Reply::ok().body(format!("{key}#{}", arrival.attempt)),
            None => Reply::status(400),
        })
        .then(Reply::status(503)),
    )
    .await
    .unwrap();
    let client = http1();

    assert_eq!(
        status_of(&client, post(&server, "/", Some("k"), "")).await,
        503
    );
    let response = send(&client, post(&server, "/", Some("k"), ""))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = within(response.into_body().collect())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(body, "k#2");
    assert_eq!(status_of(&client, post(&server, "/", None, "")).await, 400);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn http2_prior_knowledge_and_http1_on_one_port() {
    let server = TestServer::start(Script::new().otherwise(Reply::ok().body("hi")))
        .await
        .unwrap();

    let response = send(&http2(), post(&server, "/two?q=2", Some("h2"), "payload"))
        .await
        .unwrap();
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        within(response.into_body().collect())
            .await
            .unwrap()
            .to_bytes(),
        "hi"
    );

    let response = send(&http1(), get(&server, "/one")).await.unwrap();
    assert_eq!(response.version(), Version::HTTP_11);
    assert_eq!(
        within(response.into_body().collect())
            .await
            .unwrap()
            .to_bytes(),
        "hi"
    );

    let arrivals = server.arrivals();
    assert_eq!(arrivals[0].version, Version::HTTP_2);
    assert_eq!(arrivals[0].uri.to_string(), "/two?q=2", "origin form");
    assert_eq!(arrivals[0].idempotency_key.as_deref(), Some("h2"));
    assert_eq!(arrivals[0].body, "payload");
    assert_eq!(arrivals[1].version, Version::HTTP_11);
    assert_eq!(server.connections(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn http1_only_and_http2_only() {
    let h1 = TestServer::builder().http1_only().start().await.unwrap();
    assert_eq!(status_of(&http1(), get(&h1, "/")).await, 200);
    assert!(send(&http2(), get(&h1, "/")).await.is_err());

    let h2 = TestServer::builder().http2_only().start().await.unwrap();
    assert_eq!(status_of(&http2(), get(&h2, "/")).await, 200);
    assert!(send(&http1(), get(&h2, "/")).await.is_err());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn body_over_the_limit_is_refused() {
    let server = TestServer::builder()
        .script(Script::new().then(Reply::status(500)))
        .body_limit(4)
        .start()
        .await
        .unwrap();
    let client = http1();

    assert_eq!(
        status_of(&client, post(&server, "/", None, "too long")).await,
        413
    );
    assert_eq!(
        status_of(&client, post(&server, "/", None, "ok")).await,
        500,
        "the queue was not consumed"
    );
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    assert_eq!(arrivals[0].body, "");
    assert_eq!(arrivals[1].body, "ok");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn take_arrivals_keeps_counting() {
    let server = TestServer::start(Script::new()).await.unwrap();
    let client = http1();
    assert_eq!(status_of(&client, get(&server, "/")).await, 200);
    assert_eq!(server.take_arrivals().len(), 1);
    assert!(server.arrivals().is_empty());
    assert_eq!(status_of(&client, get(&server, "/")).await, 200);
    assert_eq!(server.arrival_count(), 2);
    assert_eq!(server.arrivals()[0].attempt, 2);
}
