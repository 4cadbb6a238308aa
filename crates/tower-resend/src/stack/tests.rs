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
