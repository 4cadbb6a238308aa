use http::{HeaderValue, Request, Response};

use super::*;
use crate::idempotency::{derive_keys, IDEMPOTENCY_KEY};
use crate::stack;
use tower::{service_fn, ServiceExt};

/// The key a POST to `uri` was sent with, inside a keyed operation.
async fn derived(builder: StackBuilder, uri: &'static str) -> HeaderValue {
    let echo = service_fn(|req: Request<String>| async move {
        let key = req.headers()[IDEMPOTENCY_KEY].to_str().unwrap().to_owned();
        Ok::<_, std::convert::Infallible>(Response::new(key))
    });
    let stack = builder.service(echo);
    let req = Request::post(uri).body(String::new()).unwrap();
    let resp = derive_keys("s", HeaderValue::from_static("k"), stack.oneshot(req))
        .await
        .unwrap();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap();
    HeaderValue::from_bytes(&body.to_bytes()).unwrap()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_stacks_name_counts_its_derived_keys() {
    let by_name = derived(
        stack().name("shipping").idempotency_keys(),
        "http://10.0.0.7/",
    )
    .await;
    // In either order of the builder's calls.
    let keys_first = derived(
        stack().idempotency_keys().name("shipping"),
        "http://10.0.0.7/",
    )
    .await;
    assert_eq!(by_name, keys_first);
    // The same key as an unnamed stack calling `shipping` by host.
    assert_eq!(
        by_name,
        derived(stack().idempotency_keys(), "http://shipping/").await
    );
    assert_ne!(
        by_name,
        derived(stack().idempotency_keys(), "http://10.0.0.7/").await
    );
}

/// Each attempt tells the callee when its caller stops waiting for it: the
/// attempt's limit while the call has more time than that, the call's time
/// left once it has less, and a request's own attempt limit when it gives
/// one.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn each_attempt_says_when_its_caller_stops_waiting() {
    use crate::retry::CallOptions;
    use std::time::Duration;

    let name = http::HeaderName::from_static("x-timeout-ms");
    let echo = service_fn(|req: Request<String>| async move {
        let v = req.headers()["x-timeout-ms"].to_str().unwrap().to_owned();
        Ok::<_, std::convert::Infallible>(Response::new(v))
    });
    let client = |total| {
        stack()
            .total(total)
            .attempt_timeout(Duration::from_secs(1))
            .deadline_header(name.clone())
            .service(echo)
    };
    let resp = client(Duration::from_secs(3))
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(
        sent(resp).await,
        "995",
        "the attempt's 1 s, less the margin"
    );
    let resp = client(Duration::from_millis(400))
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(sent(resp).await, "395", "the call's 400 ms");
    let mut req = Request::new(String::new());
    req.extensions_mut()
        .insert(CallOptions::new().attempt_timeout(Duration::from_millis(250)));
    let resp = client(Duration::from_secs(3)).oneshot(req).await.unwrap();
    assert_eq!(sent(resp).await, "245", "the request's own attempt limit");
}

async fn sent<B>(resp: Response<B>) -> String
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let body = http_body_util::BodyExt::collect(resp.into_body()).await;
    String::from_utf8(body.unwrap().to_bytes().to_vec()).unwrap()
}

/// A paced stack: the retry layer stops at once on the pacing layer's
/// refusal (it is not sent again), and a wait for a reset is inside the
/// call's deadline.
#[cfg(feature = "quota")]
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn paced_a_refusal_ends_the_call_at_once_and_a_reset_is_waited_for() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::time::Instant;

    use crate::error::{ErrorKind, RetryAdvice};
    use crate::quota::PaceLayer;

    const S: Duration = Duration::from_secs(1);
    // The upstream's answer: 200, with the quota field it is set to.
    let said = Arc::new(Mutex::new("\"default\";r=0;t=30"));
    let calls = Arc::new(AtomicU32::new(0));
    let up = {
        let (said, calls) = (Arc::clone(&said), Arc::clone(&calls));
        service_fn(move |_: Request<String>| {
            calls.fetch_add(1, Ordering::SeqCst);
            let field = *said.lock().unwrap();
            async move {
                let resp = Response::builder()
                    .header("ratelimit", field)
                    .body(String::new())
                    .unwrap();
                Ok::<_, std::convert::Infallible>(resp)
            }
        })
    };
    let layer = PaceLayer::new();
    let stack = stack()
        .name("quota")
        .total(10 * S)
        .pace(layer.clone())
        .service(up);
    stack
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    let start = Instant::now();
    let err = stack
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(err.kind(), ErrorKind::QuotaSpent, "{err}");
    assert_eq!(err.retry_advice(), RetryAdvice::After(30 * S));
    assert!(err.is_not_sent());
    assert_eq!(err.attempts(), 1);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // A reset within the deadline: waited for, and the call succeeds.
    *said.lock().unwrap() = "\"default\";r=0;t=4";
    tokio::time::advance(30 * S).await;
    stack
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .unwrap();
    let start = Instant::now();
    let resp = stack.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(start.elapsed(), 4 * S);
    assert_eq!(resp.status(), 200);
    assert_eq!(layer.stats().waits, 1);
}
