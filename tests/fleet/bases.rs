//! What a fleet makes of the bases it is given: a base's path is kept on
//! every attempt, what a fleet cannot honour (no instance, a base with a
//! query or a fragment) is refused when it is built, and a call whose
//! instances all failed names each of them.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tower::ServiceExt;
use tower_resend::classify::Class;
use tower_resend::fleet::FleetLayer;
use tower_resend_testkit::{Reply, Script};

use super::common::closed_addrs;
use super::{base, server};

/// A base with a path keeps it: each attempt's path goes under it, joined
/// by one `/`, with the request's query; a base of `/`, or without a
/// path, adds nothing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_base_path_is_kept() {
    let s = server(Script::new().otherwise(Reply::ok())).await;
    for (path, seen) in [
        ("/api/v2", "/api/v2/orders?x=1"),
        ("/api/v2/", "/api/v2/orders?x=1"),
        ("/", "/orders?x=1"),
        ("", "/orders?x=1"),
    ] {
        let fleet = FleetLayer::fixed([format!("{}{path}", base(&s))]).unwrap();
        let stack = tower_resend::stack()
            .fleet(fleet)
            .service(tower_resend::hyper_client(Duration::from_secs(1)));
        let req = Request::get("http://inventory/orders?x=1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = stack.oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "base path {path:?}");
        let arrivals = s.take_arrivals();
        let paths: Vec<String> = arrivals.iter().map(|a| a.uri.to_string()).collect();
        assert_eq!(paths, [seen], "base path {path:?}");
    }
}

/// What a fleet cannot honour is refused when it is built, with the
/// problem named: no instance at all, a base with a query or a fragment.
#[test]
fn a_fleet_refuses_at_build_what_it_cannot_honour() {
    let none: [&str; 0] = [];
    let e = FleetLayer::fixed(none).unwrap_err();
    assert_eq!(
        e.to_string(),
        "a fleet needs at least one instance: the list of instances is empty"
    );
    let e = FleetLayer::fixed(["http://127.0.0.1:8080", "http://127.0.0.1:8081/api?v=2"])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(
            "invalid instance address \"http://127.0.0.1:8081/api?v=2\": \
             a base URI cannot have a query"
        ),
        "{e}"
    );
    let e = FleetLayer::fixed(["http://127.0.0.1:8080/api#v2"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("a base URI cannot have a fragment"), "{e}");
}

/// Every instance refuses the connection: the call tries each once, at
/// once (not sent, so no wait: the classifier sees through the error that
/// names the instance), and its error names every instance it tried, in
/// the order it tried them, then the cause.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn when_every_instance_refuses_the_error_names_each() {
    let addrs = closed_addrs(3);
    let fleet = FleetLayer::fixed(addrs.iter().map(|a| format!("http://{a}"))).unwrap();
    let stack = tower_resend::stack()
        .name("inventory")
        .fleet(fleet)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let req = Request::get("http://inventory/items/1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let e = stack.oneshot(req).await.unwrap_err();
    let history = e.history().expect("the attempts");
    assert_eq!(e.kind(), tower_resend::ErrorKind::RetriesExhausted, "{e}");
    assert!(e.is_not_sent(), "{e}");
    assert!(
        history
            .iter()
            .all(|a| a.class() == Class::NotSent && a.waited() == Duration::ZERO),
        "{history}"
    );
    let tried: Vec<String> = history
        .iter()
        .map(|a| a.server().expect("named").to_string())
        .collect();
    let mut each: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    let mut sorted = tried.clone();
    each.sort();
    sorted.sort();
    assert_eq!(sorted, each, "{history}");
    let text = e.to_string();
    let last = &tried[2];
    assert!(
        text.contains(&format!(
            "instance {last} (the call tried {})",
            tried.join(", ")
        )),
        "{text}"
    );
    assert!(text.to_lowercase().contains("refused"), "{text}");
    // The summary for callers names no address.
    assert!(!e.summary().to_string().contains("127.0.0.1"), "{e}");
}

/// Three instances of four gone (their ports refuse): a call whose first
/// attempts meet them goes on to the fourth, however many refused it, as
/// gRPC's transparent retries do not count toward `maxAttempts` (gRFC
/// A6): the refused attempts went nowhere, at once, and the call answers
/// 200 within its 3 attempts' cap. Each call has a fleet of its own, so
/// that one call's refusals set nothing aside for the next: with refusals
/// counted, a quarter of them failed (their three attempts all refused).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn refused_attempts_go_on_to_an_instance_that_answers_uncounted() {
    let live = server(Script::new().otherwise(Reply::ok())).await;
    let gone = closed_addrs(3);
    let (mut refused_in_all, mut thrice) = (0, 0);
    for call in 0..40 {
        let mut bases: Vec<String> = gone.iter().map(|a| format!("http://{a}")).collect();
        bases.push(base(&live));
        let stack = tower_resend::stack()
            .fleet(FleetLayer::fixed(bases).unwrap())
            .service(tower_resend::hyper_client(Duration::from_secs(1)));
        let req = Request::get("http://inventory/items/1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = match stack.oneshot(req).await {
            Ok(resp) => resp,
            Err(e) => panic!("call {call}: {e}"),
        };
        assert_eq!(resp.status(), StatusCode::OK, "call {call}");
        let history = resp
            .extensions()
            .get::<tower_resend::retry::Attempts>()
            .expect("the attempts");
        let attempts: Vec<_> = history.iter().collect();
        let (last, refused) = attempts.split_last().expect("an attempt");
        assert_eq!(last.class(), Class::Success, "call {call}: {history}");
        assert!(
            refused
                .iter()
                .all(|a| a.class() == Class::NotSent && a.waited() == Duration::ZERO),
            "call {call}: {history}"
        );
        refused_in_all += refused.len();
        thrice += usize::from(refused.len() == 3);
    }
    assert_eq!(live.take_arrivals().len(), 40);
    // Each call meets the gone instances at their share (1.5 a call), and
    // a quarter of the calls all three of them before the one that answers
    // (none of 40 with a chance of 1 in 100 000).
    assert!(refused_in_all > 20, "{refused_in_all} attempts refused");
    assert!(thrice > 0, "no call met all three gone instances");
}
