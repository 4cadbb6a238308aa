//! Foundations over a real transport: hyper-util's client on loopback, the
//! connect timeout, and the error kinds of a silent or broken upstream.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::time::Instant;
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};
use tower_resend::connect::ConnectTimeout;
use tower_resend::{
    deadline::CallDeadlineLayer, timeout::AttemptTimeoutLayer, Error, ErrorKind, Phase,
};
use tower_resend_testkit::{Reply, Script, TestServer};

type Body = Empty<Bytes>;

/// A port on 127.0.0.1 with nothing listening.
async fn closed_port() -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    port
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn connect_refused_is_reported_as_not_sent() {
    let port = closed_port().await;
    let client = tower_resend::hyper_client(Duration::from_secs(2));
    let uri = format!("http://127.0.0.1:{port}/")
        .parse::<http::Uri>()
        .unwrap();
    let err = client
        .oneshot(Request::get(uri).body(Body::new()).unwrap())
        .await
        .unwrap_err();
    // hyper-util's error wraps ours; the fact survives.
    let err = Error::from_box(err);
    assert_eq!(err.kind(), ErrorKind::Transport);
    assert!(err.is_not_sent(), "{err:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_connector_that_never_completes_is_cut_at_the_connect_timeout() {
    // A stub connector: the connection is never made.
    let stuck = service_fn(|_: http::Uri| {
        std::future::pending::<Result<TokioIo<tokio::net::TcpStream>, Infallible>>()
    });
    let client = Client::builder(TokioExecutor::new())
        .build::<_, Body>(ConnectTimeout::new(stuck, Duration::from_secs(2)));
    let start = Instant::now();
    let err = client
        .oneshot(
            Request::get("http://upstream.test/")
                .body(Body::new())
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    let err = Error::from_box(Box::new(err));
    assert_eq!(err.kind(), ErrorKind::ConnectTimeout);
    assert!(err.is_not_sent());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_silent_upstream_is_cut_by_the_attempt_timeout_then_the_deadline() {
    let server = TestServer::start(Script::new().otherwise(Reply::never()))
        .await
        .unwrap();
    let client = tower_resend::hyper_client(Duration::from_secs(2));

    // Attempt timeout first: 400 ms under a 1 s deadline.
    let svc = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(1)).upstream("silent"))
        .layer(AttemptTimeoutLayer::new(Duration::from_millis(400)))
        .service(client.clone());
    let start = Instant::now();
    let err = svc
        .oneshot(Request::get(server.uri("/a")).body(Body::new()).unwrap())
        .await
        .unwrap_err();
    let err = Error::from_box(err);
    assert_eq!(err.kind(), ErrorKind::AttemptTimeout);
    assert_eq!(err.upstream(), Some("silent"));
    assert!(!err.is_not_sent(), "the request reached the server");
    assert_eq!(start.elapsed(), Duration::from_millis(400));

    // The deadline when it is the tighter limit.
    let svc = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_millis(300)))
        .layer(AttemptTimeoutLayer::new(Duration::from_millis(400)))
        .service(client);
    let start = Instant::now();
    let err = svc
        .oneshot(Request::get(server.uri("/b")).body(Body::new()).unwrap())
        .await
        .unwrap_err();
    let err = Error::from_box(err);
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(err.phase(), Some(Phase::Attempt));
    assert_eq!(start.elapsed(), Duration::from_millis(300));
    assert_eq!(server.arrival_count(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_reset_mid_body_is_a_transport_error_that_may_have_been_processed() {
    for http2 in [false, true] {
        let builder = if http2 {
            TestServer::builder().http2_only()
        } else {
            TestServer::builder().http1_only()
        };
        let server = builder
            .script(
                Script::new().otherwise(Reply::ok().reset_mid_body(Bytes::from_static(b"partial"))),
            )
            .start()
            .await
            .unwrap();
        let mut b = Client::builder(TokioExecutor::new());
        b.http2_only(http2);
        let client = tower_resend::connect::hyper_client_with(&b, Duration::from_secs(2));
        let svc = CallDeadlineLayer::new(Duration::from_secs(5))
            .upstream("broken")
            .layer(client);
        let resp = svc
            .oneshot(Request::get(server.uri("/body")).body(Body::new()).unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let err = Error::from_box(resp.into_body().collect().await.unwrap_err());
        assert_eq!(err.kind(), ErrorKind::Transport, "http2={http2}: {err:?}");
        assert_eq!(err.phase(), Some(Phase::Body));
        assert!(!err.is_not_sent());
        assert_eq!(err.upstream(), Some("broken"));
    }
}
