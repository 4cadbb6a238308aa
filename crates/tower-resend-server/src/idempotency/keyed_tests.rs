//! The flow of a keyed request, through the layer on a memory store.

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::{BodyExt, Full};
use tower::{Layer, ServiceExt};

use crate::body::MaybeBuffered;
use crate::idempotency::IdempotencyLayer;
use crate::store::MemoryStore;

/// A response with `content-length` and `extra` as headers, through the
/// layer (response cap `cap`), then replayed.
async fn first_and_replay(
    cap: usize,
    extra: Option<(&'static str, &'static str)>,
) -> [Response<MaybeBuffered<Full<Bytes>>>; 2] {
    let handler = tower::service_fn(move |_: Request<MaybeBuffered<Full<Bytes>>>| async move {
        let mut resp = Response::new(Full::new(Bytes::from_static(b"hello")));
        let h = resp.headers_mut();
        h.insert("content-type", HeaderValue::from_static("text/plain"));
        h.insert("content-length", HeaderValue::from_static("5"));
        h.insert("x-a", HeaderValue::from_static("1"));
        if let Some((n, v)) = extra {
            h.insert(n, HeaderValue::from_static(v));
        }
        Ok::<_, std::convert::Infallible>(resp)
    });
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .response_cap(cap)
        .layer(handler);
    let req = || {
        Request::post("/x")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let first = svc.clone().oneshot(req()).await.unwrap();
    let again = svc.oneshot(req()).await.unwrap();
    [first, again]
}

async fn body(resp: Response<MaybeBuffered<Full<Bytes>>>) -> Bytes {
    resp.into_body().collect().await.unwrap().to_bytes()
}

/// The handler's headers reach the first caller as it set them (its
/// `content-length` as the body's exact size, which hyper writes), and the
/// replay carries them without the hop-by-hop ones.
#[tokio::test]
async fn headers_reach_the_first_caller_and_the_replay() {
    let [first, again] = first_and_replay(1024, None).await;
    assert_eq!(first.headers()["content-type"], "text/plain");
    assert_eq!(first.headers()["x-a"], "1");
    assert_eq!(first.body().size_hint().exact(), Some(5));
    assert_eq!(first.headers()["content-length"], "5");
    assert_eq!(body(first).await, "hello");
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["x-a"], "1");
    assert!(again.headers().get("content-length").is_none());
    assert_eq!(body(again).await, "hello");

    // Another hop-by-hop header: the first caller gets it, the replay does
    // not.
    let [first, again] = first_and_replay(1024, Some(("connection", "close"))).await;
    assert_eq!(first.headers()["connection"], "close");
    assert_eq!(first.headers()["content-length"], "5");
    assert_eq!(body(first).await, "hello");
    assert!(again.headers().get("connection").is_none());
    assert_eq!(again.headers()["x-a"], "1");
    assert_eq!(body(again).await, "hello");
}

/// A body past the cap goes on to the first caller whole, with the length
/// the handler gave it; the replay says the body was not kept.
#[tokio::test]
async fn a_body_past_the_cap_keeps_its_length() {
    let [first, again] = first_and_replay(3, None).await;
    assert_eq!(first.headers()["content-length"], "5");
    assert_eq!(first.headers()["x-a"], "1");
    assert_eq!(body(first).await, "hello");
    assert_eq!(again.headers()["idempotent-body-omitted"], "true");
    assert_eq!(body(again).await, "");
}

/// The marks a handler sets for the layer (here as headers) are read and
/// taken off, but for "nothing done", which the caller gets (whoever said
/// it): its client learns that this attempt did nothing. Marked so, the
/// answer is not kept, and the retry runs.
#[tokio::test]
async fn a_handlers_marks_are_taken_off_its_answer_but_nothing_done() {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = tower::service_fn(move |_: Request<MaybeBuffered<Full<Bytes>>>| {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            let mut resp = Response::new(Full::new(Bytes::from_static(b"later")));
            *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            resp.headers_mut().insert(
                crate::idempotency::IDEMPOTENT_NOTHING_DONE,
                HeaderValue::from_static("TRUE"),
            );
            resp.headers_mut().insert(
                crate::idempotency::IDEMPOTENT_KEEP,
                HeaderValue::from_static("true"),
            );
            Ok::<_, std::convert::Infallible>(resp)
        }
    });
    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(handler);
    for _ in 0..2 {
        let req = Request::post("/x")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()["idempotent-nothing-done"], "true");
        assert!(resp.headers().get("idempotent-keep").is_none());
        assert!(resp.headers().get("idempotent-replayed").is_none());
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// A keyed request's own box (its body read, its key claimed, then the work
/// waited on), traced or not, is within glibc's per-thread cache (see
/// `work_tests.rs`).
#[tokio::test]
async fn a_keyed_requests_box_stays_within_the_thread_cache() {
    use std::borrow::Cow;
    use std::sync::Arc;

    use tracing::Instrument;

    use super::super::config::{Config, Shared};
    use super::super::request;
    use super::super::work::tests::{handler, CACHED};
    use super::{claim_then_run, keyed, Keyed};

    let shared = Arc::new(Shared {
        store: MemoryStore::new(),
        config: Config::new(),
    });
    let request = || {
        let req = Request::post("/x")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (parts, body) = req.into_parts();
        let keyed = Keyed {
            scope: Cow::Borrowed("anonymous"),
            key: request::key(&parts).unwrap().unwrap(),
            deadline: None,
        };
        (parts, body, keyed)
    };
    let (parts, body, key) = request();
    let boxed = keyed(
        Arc::clone(&shared),
        handler(),
        parts,
        body,
        key,
        tracing::Span::none(),
    );
    let room = std::mem::size_of_val(&*boxed);
    assert!(room <= CACHED, "a keyed request's box: {room} bytes");
    // Traced: the same, in its span.
    let (parts, body, key) = request();
    let traced =
        claim_then_run(shared, handler(), parts, body, key).instrument(tracing::Span::none());
    let room = std::mem::size_of_val(&traced);
    assert!(room <= CACHED, "a traced keyed request's box: {room} bytes");
}
