use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use tower::{service_fn, Layer, ServiceExt};
use tower_resend::deadline::{internal, server::current_ledger, server::Source};
use tower_resend::{deadline::CallDeadlineLayer, Deadline, Error};

use super::InboundDeadlineLayer;
use crate::MaybeBuffered;

type Resp = Response<MaybeBuffered<Full<Bytes>>>;

fn ok(body: String) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from(body))))
}

async fn json(resp: Resp) -> Value {
    serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

/// A handler that reports the deadline it sees.
fn echo_deadline() -> impl tower::Service<
    Request<()>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(|req: Request<()>| async move {
        let ext = req.extensions().get::<Deadline>().copied();
        let ambient = Deadline::current();
        assert_eq!(ext, ambient);
        assert!(current_ledger().is_some());
        ok(format!("{}", ambient.unwrap().remaining().as_millis()))
    })
}

async fn text(resp: Resp) -> String {
    String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap()
}

/// A deadline already in force and earlier than the caller's budget is
/// kept: one the request carries (an outer layer's) or the ambient scope's
/// (the layer called inside one). A default budget over the maximum is
/// held to the maximum.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_earlier_deadline_already_in_force_is_kept() {
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(echo_deadline());
    let req = || {
        Request::post("/")
            .header("grpc-timeout", "5S")
            .body(())
            .unwrap()
    };
    let mut carried = req();
    carried
        .extensions_mut()
        .insert(Deadline::after(Duration::from_secs(2)));
    assert_eq!(
        text(svc.clone().oneshot(carried).await.unwrap()).await,
        "2000"
    );
    let ambient = Deadline::after(Duration::from_secs(3));
    let within = tower_resend::deadline::scope(ambient, svc.clone().oneshot(req()));
    assert_eq!(text(within.await.unwrap()).await, "3000");
    let over = InboundDeadlineLayer::new(Duration::from_secs(10))
        .default_budget(Duration::from_secs(60))
        .layer(echo_deadline());
    let none = Request::post("/").body(()).unwrap();
    assert_eq!(
        text(over.clone().oneshot(none).await.unwrap()).await,
        "10000"
    );
    let malformed = Request::post("/")
        .header("grpc-timeout", "soon")
        .body(())
        .unwrap();
    assert_eq!(text(over.oneshot(malformed).await.unwrap()).await, "10000");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn reads_grpc_timeout_bounded_by_the_maximum() {
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(echo_deadline());
    let req = |t: &str| {
        Request::post("/")
            .header("grpc-timeout", t)
            .body(())
            .unwrap()
    };
    assert_eq!(
        text(svc.clone().oneshot(req("1500m")).await.unwrap()).await,
        "1500"
    );
    assert_eq!(
        text(svc.clone().oneshot(req("1H")).await.unwrap()).await,
        "10000"
    );
    // No header: the default, which is the maximum unless set.
    let none = Request::post("/").body(()).unwrap();
    assert_eq!(
        text(svc.clone().oneshot(none).await.unwrap()).await,
        "10000"
    );
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10))
        .default_budget(Duration::from_secs(3))
        .layer(echo_deadline());
    let none = Request::post("/").body(()).unwrap();
    assert_eq!(text(svc.oneshot(none).await.unwrap()).await, "3000");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn reads_a_configured_millisecond_header() {
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10))
        .http_header(HeaderName::from_static("x-timeout-ms"))
        .layer(echo_deadline());
    let req = Request::post("/")
        .header("x-timeout-ms", "750")
        .body(())
        .unwrap();
    assert_eq!(text(svc.clone().oneshot(req).await.unwrap()).await, "750");
    // grpc-timeout wins when both are present.
    let req = Request::post("/")
        .header("x-timeout-ms", "750")
        .header("grpc-timeout", "2S")
        .body(())
        .unwrap();
    assert_eq!(text(svc.oneshot(req).await.unwrap()).await, "2000");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_malformed_header_is_ignored_and_the_default_applies() {
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10))
        .default_budget(Duration::from_secs(4))
        .http_header(HeaderName::from_static("x-timeout-ms"))
        .layer(echo_deadline());
    for (h, v) in [
        ("grpc-timeout", "123456789m"),
        ("grpc-timeout", "10"),
        ("grpc-timeout", "abcS"),
        ("x-timeout-ms", "-5"),
        ("x-timeout-ms", "1.5"),
    ] {
        let req = Request::post("/").header(h, v).body(()).unwrap();
        let resp = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{h}: {v}");
        assert_eq!(text(resp).await, "4000", "{h}: {v}");
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_budget_spent_on_arrival_is_504_deadline_and_nothing_runs() {
    let ran = Arc::new(AtomicBool::new(false));
    let r = ran.clone();
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(
        move |_: Request<()>| {
            r.store(true, Ordering::SeqCst);
            async { ok(String::new()) }
        },
    ));
    let req = Request::post("/")
        .header("grpc-timeout", "0m")
        .body(())
        .unwrap();
    let resp = svc.oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    let body = json(resp).await;
    assert_eq!(body["status"], 504);
    assert_eq!(body["error"], "deadline_exceeded");
    assert_eq!(
        body["type"],
        "https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#deadline_exceeded"
    );
    assert_eq!(body["error_source"], "deadline");
    assert_eq!(body["upstream"], Value::Null);
    assert_eq!(body["budget_ms"], 0);
    assert!(!ran.load(Ordering::SeqCst));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn time_out_in_marked_work_is_internal_and_the_handler_is_cancelled() {
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let d = dropped.clone();
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(
        move |_: Request<()>| {
            let flag = Flag(d.clone());
            async move {
                let _flag = flag;
                internal("cache", tokio::time::sleep(Duration::from_millis(300))).await;
                internal("db", tokio::time::sleep(Duration::from_secs(60))).await;
                ok(String::new())
            }
        },
    ));
    let start = tokio::time::Instant::now();
    let req = Request::post("/")
        .header("grpc-timeout", "2S")
        .body(())
        .unwrap();
    let resp = svc.oneshot(req).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert!(dropped.load(Ordering::SeqCst));
    let body = json(resp).await;
    assert_eq!(body["error_source"], "internal");
    assert_eq!(body["internal"], "db");
    assert_eq!(
        body["detail"],
        "the request's deadline ran out in the handler's own work (db)"
    );
    assert_eq!(body["budget_ms"], 2000);
    assert_eq!(body["spent_ms"]["total"], 2000);
    assert_eq!(body["spent_ms"]["internal"]["cache"], 300);
    assert_eq!(body["spent_ms"]["internal"]["db"], 1700);
    assert_eq!(body["spent_ms"]["unattributed"], 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn time_out_in_an_outbound_call_names_the_upstream() {
    // The outbound call is still in flight when the inbound deadline fires
    // (here: a call recorded in the ambient ledger by hand, as a client
    // whose own deadline is later would).
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(
        |_: Request<()>| async {
            internal("db", tokio::time::sleep(Duration::from_millis(200))).await;
            let _call = current_ledger()
                .unwrap()
                .start(Source::Upstream, "shipping".into());
            tokio::time::sleep(Duration::from_secs(60)).await;
            ok(String::new())
        },
    ));
    let req = Request::post("/")
        .header("grpc-timeout", "1S")
        .body(())
        .unwrap();
    let body = json(svc.oneshot(req).await.unwrap()).await;
    assert_eq!(body["error_source"], "upstream");
    assert_eq!(body["upstream"], "shipping");
    assert_eq!(body["spent_ms"]["upstream"]["shipping"], 800);
    assert_eq!(body["spent_ms"]["internal"]["db"], 200);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn outbound_resend_stacks_inherit_the_deadline_and_record_their_time() {
    // A tower-resend stack inside the handler: its deadline is the caller's 1 s,
    // not its own 10 s, and its time is in the ledger.
    let upstream = CallDeadlineLayer::new(Duration::from_secs(10))
        .upstream("shipping")
        .layer(service_fn(|_: Request<()>| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, Error>(Response::new(()))
        }));
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(
        move |_: Request<()>| {
            let upstream = upstream.clone();
            async move {
                let start = tokio::time::Instant::now();
                let err = Error::from_box(upstream.oneshot(Request::new(())).await.unwrap_err());
                assert!(err.is_deadline_exceeded());
                assert_eq!(start.elapsed(), Duration::from_secs(1));
                let snap = current_ledger().unwrap().snapshot();
                assert_eq!(snap.finished[0].source, Source::Upstream);
                assert_eq!(&*snap.finished[0].name, "shipping");
                assert_eq!(snap.finished[0].spent, Duration::from_secs(1));
                ok("mapped".into())
            }
        },
    ));
    let req = Request::post("/")
        .header("grpc-timeout", "1S")
        .body(())
        .unwrap();
    assert_eq!(text(svc.oneshot(req).await.unwrap()).await, "mapped");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn grpc_requests_get_grpc_status_4() {
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(
        |_: Request<()>| async {
            internal("db", tokio::time::sleep(Duration::from_secs(60))).await;
            ok(String::new())
        },
    ));
    let req = Request::post("/pkg.Svc/Method")
        .header("content-type", "application/grpc")
        .header("grpc-timeout", "100m")
        .body(())
        .unwrap();
    let resp = svc.oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["grpc-status"], "4");
    assert_eq!(
        resp.headers()["grpc-message"],
        "deadline exceeded in internal db"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_response_ready_at_the_deadline_wins() {
    let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(
        |_: Request<()>| async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            ok("made it".into())
        },
    ));
    let req = Request::post("/")
        .header("grpc-timeout", "1S")
        .body(())
        .unwrap();
    let resp = svc.oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(text(resp).await, "made it");
}
