//! The behaviour suite of `tests/retry.rs`, over a reqwest client
//! (`tower_resend::reqwest::ReqwestService`) instead of hyper-util: the same
//! stack, the same scripted server, the same guarantees.
//!
//! `cargo test -p tower-resend-tests --features reqwest --test reqwest`

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::time::Duration;

use http::StatusCode;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::classify::Class;
use tower_resend::reqwest::{client_builder, ReqwestService};
use tower_resend::retry::Stop;
use tower_resend::ErrorKind;
use tower_resend_testkit::{Reply, Script, TestServer};

use common::{attempts, closed_port, get, idle, post, stack, within, CONNECT_TIMEOUT};

const MS: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);

async fn server(script: Script) -> TestServer {
    TestServer::start(script)
        .await
        .expect("start the test server")
}

/// The transport under test: a reqwest client as `client_builder` sets it up
/// (reqwest's retries off, TCP_NODELAY, the connect timeout, no timeout of
/// its own), without proxies from the environment.
fn transport() -> ReqwestService {
    ReqwestService::new(
        client_builder(CONNECT_TIMEOUT)
            .no_proxy()
            .build()
            .expect("build the reqwest client"),
    )
}

common::http_behaviour_suite!();

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_429_with_retry_after_is_honoured_over_reqwest() {
    let server = server(Script::new().then(Reply::status(429).header("retry-after", "1"))).await;
    let client = stack().service(transport());

    let resp = within(client.oneshot(post(server.uri("/charges"))))
        .await
        .expect("the second attempt answers");

    assert_eq!(resp.status(), StatusCode::OK);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    let gap = arrivals[1].at - arrivals[0].at;
    // Never earlier than asked, spread over half as much again (and the
    // backoff's jitter).
    assert!(gap >= SECOND && gap <= SECOND * 3 / 2 + 100 * MS, "{gap:?}");
}
