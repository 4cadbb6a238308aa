//! An HTTP route table over one hyper-util client: two routes, two
//! policies, against the scripted server on loopback (paused clock).
//!
//! `cargo test -p tower-resend-tests --test routes`

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::time::Duration;

use http::{Method, StatusCode};
use tower::ServiceExt;
use tower_resend::routes::{RoutePolicy, Routes};
use tower_resend::ErrorKind;
use tower_resend_testkit::{Reply, Script, TestServer};

use common::{attempts, get, post, stack, transport, within};

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn two_routes_get_two_policies_and_the_rest_the_base() {
    // Everything is down (503), but /slow, which takes 3 s to answer.
    let server = TestServer::start(
        Script::new()
            .route(
                "/slow",
                Script::new().otherwise(Reply::ok().delay(Duration::from_secs(3))),
            )
            .otherwise(Reply::status(503)),
    )
    .await
    .expect("start the test server");
    let routes = Routes::new()
        // Catalogue reads: five attempts.
        .route(Method::GET, "/catalog", RoutePolicy::new().max_attempts(5))
        // Stock levels: one attempt, a short deadline.
        .route(
            Method::GET,
            "/stock",
            RoutePolicy::new()
                .max_attempts(1)
                .total(Duration::from_secs(1)),
        )
        .any_method("/slow", RoutePolicy::new().total(Duration::from_secs(1)));
    // The base: 3 attempts, 10 s (tests/common), no budget to count.
    let api = routes.service(stack().no_budget(), transport());

    let resp = within(api.clone().oneshot(get(server.uri("/catalog/items/7"))))
        .await
        .expect("the last 503");
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&resp).len(), 5);

    let resp = within(api.clone().oneshot(get(server.uri("/stock/7"))))
        .await
        .expect("the 503");
    assert_eq!(attempts(&resp).len(), 1);

    // A path no route takes: the base's three.
    let resp = within(api.clone().oneshot(get(server.uri("/catalogue"))))
        .await
        .expect("the last 503");
    assert_eq!(attempts(&resp).len(), 3);
    assert_eq!(server.arrival_count(), 5 + 1 + 3);

    // The short deadline: /slow answers in 3 s, its route allows 1 s.
    let start = tokio::time::Instant::now();
    let err = within(api.clone().oneshot(post(server.uri("/slow"))))
        .await
        .expect_err("cut at 1 s");
    assert!(
        matches!(
            err.kind(),
            ErrorKind::DeadlineExceeded | ErrorKind::OutcomeUnknown
        ),
        "{err}"
    );
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

/// The same table from JSON, as a service reads it from its settings.
#[cfg(feature = "service-config")]
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_table_read_from_json_routes_the_same() {
    let server = TestServer::start(Script::new().otherwise(Reply::status(503)))
        .await
        .expect("start the test server");
    let routes = Routes::from_json(
        r#"{"routes": [
            {"method": "GET", "path": "/catalog", "maxAttempts": 5,
             "backoff": {"initial": "0.01s", "max": "0.1s", "multiplier": 2}},
            {"method": "GET", "path": "/stock", "maxAttempts": 1, "timeout": "1s"}
        ]}"#,
    )
    .expect("a valid table");
    let api = routes.service(stack().no_budget(), transport());
    for (path, want) in [("/catalog/7", 5), ("/stock/7", 1), ("/other", 3)] {
        let resp = within(api.clone().oneshot(get(server.uri(path))))
            .await
            .expect("the last 503");
        assert_eq!(attempts(&resp).len(), want, "{path}");
    }
}

/// A paced base under a route table: every route's stack spends the one
/// quota the upstream states (the `PaceLayer` is shared, as a budget is).
/// The first answer, on `/catalog`, says none is left for 30 s, past the
/// 10 s deadline; a call on `/stock` then fails at once, not sent, and
/// the upstream sees one call.
#[cfg(feature = "quota")]
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_routes_stack_spends_the_one_quota_of_a_paced_base() {
    let spent = Reply::ok().header("ratelimit", "\"default\";r=0;t=30");
    let server = TestServer::start(Script::new().otherwise(spent))
        .await
        .expect("start the test server");
    let routes = Routes::new()
        .route(Method::GET, "/catalog", RoutePolicy::new().max_attempts(5))
        .route(Method::GET, "/stock", RoutePolicy::new().max_attempts(1));
    let pace = tower_resend::quota::PaceLayer::new();
    let api = routes.service(stack().pace(pace.clone()), transport());

    let resp = within(api.clone().oneshot(get(server.uri("/catalog/7"))))
        .await
        .expect("the first call goes: nothing is known of the quota yet");
    assert_eq!(resp.status(), StatusCode::OK);
    let e = within(api.clone().oneshot(get(server.uri("/stock/7"))))
        .await
        .expect_err("the quota has no room before the deadline");
    assert_eq!(e.kind(), ErrorKind::QuotaSpent, "{e}");
    assert!(e.is_not_sent(), "{e}");
    assert_eq!(server.arrival_count(), 1);
    assert_eq!(pace.stats().refused, 1);
}
