//! resend as reqwest users expect it: `ResendMiddleware` in a
//! `reqwest_middleware::ClientWithMiddleware` (the caller keeps `.send()`,
//! `.json()`, `.text()`), and `send_with` on a plain reqwest request; the
//! same stack, the same scripted server and the same guarantees as the
//! tower suites.
//!
//! `cargo test -p tower-resend-tests --features reqwest-middleware --test reqwest_middleware`

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, StatusCode};
use reqwest_middleware::{reqwest, ClientBuilder, ClientWithMiddleware, Next};
use serde_json::json;
use tokio::time::Instant;
use tower_resend::reqwest::{client_builder, resend_error, RequestBuilderExt, ResendMiddleware};
use tower_resend::retry::{NoRetry, Stop};
use tower_resend::{retry::Attempts, ErrorKind, RetryAdvice};
use tower_resend_testkit::{Reply, Script, TestServer};

use common::{idle, stack, within, Chunks, CONNECT_TIMEOUT};

const MS: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);

type TestResult = Result<(), Box<dyn std::error::Error>>;

async fn server(script: Script) -> TestServer {
    TestServer::start(script)
        .await
        .expect("start the test server")
}

/// A reqwest client as `client_builder` sets it up (reqwest's retries off,
/// TCP_NODELAY, the connect timeout, no timeout of its own), without
/// proxies from the environment.
fn reqwest_client() -> reqwest::Client {
    client_builder(CONNECT_TIMEOUT)
        .no_proxy()
        .build()
        .expect("build the reqwest client")
}

/// A `ClientWithMiddleware` with resend added in one line.
fn client(stack: tower_resend::stack::StackBuilder) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest_client())
        .with(ResendMiddleware::new(stack))
        .build()
}

fn url(server: &TestServer, path: &str) -> String {
    server.uri(path).to_string()
}

/// The attempt history a response carries.
fn attempts(resp: &reqwest::Response) -> &Attempts {
    resp.extensions()
        .get::<Attempts>()
        .expect("every response through resend carries Attempts")
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn get_through_503_503_200_answers_200_after_three_attempts() -> TestResult {
    let server = server(
        Script::new().then_n(2, Reply::status(503)).otherwise(
            Reply::ok()
                .header("content-type", "application/json")
                .body(r#"{"parcel":7}"#),
        ),
    )
    .await;
    let client = client(stack());

    // What a reqwest-middleware user writes, unchanged.
    let resp = within(client.get(url(&server, "/items")).send()).await?;

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.url().as_str(), url(&server, "/items"));
    let a = attempts(&resp);
    assert_eq!(a.len(), 3);
    assert_eq!(a.stop(), Stop::Final);
    assert_eq!(
        a.iter().map(|a| a.status()).collect::<Vec<_>>(),
        [
            Some(StatusCode::SERVICE_UNAVAILABLE),
            Some(StatusCode::SERVICE_UNAVAILABLE),
            Some(StatusCode::OK)
        ]
    );
    let body: serde_json::Value = resp.json().await?;
    assert_eq!(body, json!({ "parcel": 7 }));
    assert_eq!(server.arrival_count(), 3);
    Ok(())
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn post_without_key_that_timed_out_is_sent_once_and_outcome_unknown() {
    let server = server(Script::new().otherwise(Reply::work_then_hang())).await;
    let client = client(stack().attempt_timeout(SECOND));

    let err = within(
        client
            .post(url(&server, "/charges"))
            .body("amount=100")
            .send(),
    )
    .await
    .expect_err("nobody answers");

    // reqwest-middleware's error, with tower-resend's inside.
    assert!(err.is_middleware());
    let reqwest_middleware::Error::Middleware(inner) = &err else {
        panic!("not a middleware error: {err:?}");
    };
    let e = inner
        .downcast_ref::<tower_resend::Error>()
        .expect("a tower_resend::Error inside");
    assert!(std::ptr::eq(e, resend_error(&err).expect("found")));
    assert_eq!(e.kind(), ErrorKind::OutcomeUnknown, "{e}");
    assert_eq!(e.upstream(), Some("upstream"));
    assert!(!e.is_not_sent());
    assert_eq!(e.retry_advice(), RetryAdvice::VerifyFirst);
    let history = e.history().expect("the retry layer records the call");
    assert_eq!(history.len(), 1);
    assert_eq!(history.stop(), Stop::OutcomeUnknown);
    // The attempt timeout fired, and says so down the source chain.
    let cause = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<tower_resend::Error>())
        .expect("the attempt's error");
    assert_eq!(cause.kind(), ErrorKind::AttemptTimeout);

    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
    assert_eq!(server.arrivals()[0].body, "amount=100");
    assert_eq!(server.total_effects(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn post_with_idempotency_keys_carries_one_key_on_every_attempt() {
    let server = server(Script::new().otherwise(Reply::work_then_hang())).await;
    let client = client(stack().attempt_timeout(SECOND).idempotency_keys());

    let err = within(
        client
            .post(url(&server, "/charges"))
            .json(&json!({ "amount": 100 }))
            .send(),
    )
    .await
    .expect_err("nobody answers");

    let e = resend_error(&err).expect("resend's error");
    // It may have been processed, under a key the stack chose: retry with it.
    assert_eq!(e.kind(), ErrorKind::OutcomeUnknown, "{e}");
    assert!(matches!(e.retry_advice(), RetryAdvice::SameKey(_)));
    assert_eq!(e.attempts(), 3);
    assert_eq!(e.history().map(|h| h.stop()), Some(Stop::MaxAttempts));

    idle(30 * SECOND).await;
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 3, "3 attempts, the cap");
    let key = arrivals[0].idempotency_key.clone();
    assert!(key.is_some());
    assert!(arrivals.iter().all(|a| a.idempotency_key == key));
    assert_eq!(key.as_deref(), e.idempotency_key());
    // The JSON body, whole, on every attempt.
    assert!(arrivals.iter().all(|a| a.body == r#"{"amount":100}"#));
    assert!(arrivals
        .iter()
        .all(|a| a.headers["content-type"] == "application/json"));
    assert_eq!(server.effects(key.as_deref()), 3);
    assert_eq!(server.effects(None), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_429_with_retry_after_is_honoured() -> TestResult {
    let server = server(Script::new().then(Reply::status(429).header("retry-after", "1"))).await;
    let client = client(stack());

    let resp = within(
        client
            .post(url(&server, "/charges"))
            .body("amount=100")
            .send(),
    )
    .await?;

    assert_eq!(resp.status(), StatusCode::OK);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    let gap = arrivals[1].at - arrivals[0].at;
    // Never earlier than asked, spread over half as much again (and the
    // backoff's jitter).
    assert!(gap >= SECOND && gap <= SECOND * 3 / 2 + 100 * MS, "{gap:?}");
    Ok(())
}

/// A paced stack as the middleware (`stack().pace(..).reqwest_middleware()`):
/// the upstream's first answer says its quota has none left for 30 s, past
/// the call's 10 s; the next call fails at once, not sent, `QuotaSpent`
/// with the reset as its advice, and the upstream sees one call.
#[cfg(feature = "quota")]
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_paced_stack_as_the_middleware_keeps_to_the_stated_quota() {
    let spent = Reply::ok().header("ratelimit", "\"default\";r=0;t=30");
    let server = server(Script::new().otherwise(spent)).await;
    let pace = tower_resend::quota::PaceLayer::new();
    let client = ClientBuilder::new(reqwest_client())
        .with(stack().pace(pace.clone()).reqwest_middleware())
        .build();

    let first = within(client.get(url(&server, "/search")).send())
        .await
        .expect("the first call goes: nothing is known of the quota yet");
    assert_eq!(first.status(), StatusCode::OK);
    let start = Instant::now();
    let err = within(client.get(url(&server, "/search")).send())
        .await
        .expect_err("the quota has no room before the deadline");

    assert_eq!(start.elapsed(), Duration::ZERO);
    let e = resend_error(&err).expect("resend's error");
    assert_eq!(e.kind(), ErrorKind::QuotaSpent, "{e}");
    assert!(e.is_not_sent(), "{e}");
    assert!(
        matches!(e.retry_advice(), RetryAdvice::After(d) if d > 29 * SECOND && d <= 30 * SECOND),
        "{e}"
    );
    assert_eq!(server.arrival_count(), 1);
    assert_eq!(pace.stats().refused, 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_silent_upstream_is_given_up_on_by_the_deadline() {
    let server = server(Script::new().otherwise(Reply::never())).await;
    let client = client(stack().no_budget().total(SECOND).attempt_timeout(400 * MS));
    let start = Instant::now();

    let err = within(client.get(url(&server, "/items")).send())
        .await
        .expect_err("nobody answers");

    let elapsed = start.elapsed();
    assert!(elapsed <= SECOND + 5 * MS, "{elapsed:?}");
    let e = resend_error(&err).expect("resend's error");
    assert_eq!(e.kind(), ErrorKind::DeadlineExceeded, "{e}");
    assert!((2..=3).contains(&server.arrival_count()));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_streamed_body_under_the_cap_is_replayed_and_one_over_it_is_not() -> TestResult {
    // Under the cap (64 KiB): the first attempt keeps a copy, the second
    // sends it again.
    let server = server(Script::new().then(Reply::status(503))).await;
    let client = client(stack());
    let chunks = Chunks::new(4, 256);
    let whole = chunks.concat();

    let resp = within(
        client
            .put(url(&server, "/parcels/7"))
            .body(reqwest::Body::wrap(chunks))
            .send(),
    )
    .await?;

    assert_eq!(resp.status(), StatusCode::OK);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    assert!(arrivals.iter().all(|a| a.body == whole));

    // Over a cap of 512 bytes: sent once, whole. A 503 is returned as it
    // is, with the reason it was not retried...
    let server = self::server(Script::new().then(Reply::status(503))).await;
    let client = self::client(stack().retry(|r| r.replay_cap(512)));
    let chunks = Chunks::new(4, 256);
    let whole = chunks.concat();

    let resp = within(
        client
            .put(url(&server, "/parcels/7"))
            .body(reqwest::Body::wrap(chunks))
            .send(),
    )
    .await?;

    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&resp).stop(), Stop::NotReplayable);
    idle(30 * SECOND).await;
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 1);
    assert_eq!(arrivals[0].body, whole);

    // ...and a failure that needed a retry is an error that says why.
    let server = self::server(Script::new().then(Reply::close())).await;
    let chunks = Chunks::new(4, 256);

    let err = within(
        client
            .put(url(&server, "/parcels/7"))
            .body(reqwest::Body::wrap(chunks))
            .send(),
    )
    .await
    .expect_err("the connection was closed, and the body cannot be sent again");

    let e = resend_error(&err).expect("resend's error");
    assert_eq!(e.kind(), ErrorKind::BodyNotReplayable, "{e}");
    assert_eq!(e.attempts(), 1);
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
    Ok(())
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_body_in_memory_is_resent_whole_whatever_its_size() -> TestResult {
    let server = server(Script::new().then(Reply::status(503))).await;
    // A cap far below the body: reqwest holds it in memory, so every
    // attempt shares it.
    let client = client(stack().retry(|r| r.replay_cap(16)));
    let body = vec![b'x'; 100 * 1024];

    let resp = within(
        client
            .put(url(&server, "/parcels/7"))
            .body(body.clone())
            .send(),
    )
    .await?;

    assert_eq!(resp.status(), StatusCode::OK);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    assert!(arrivals.iter().all(|a| a.body == body));
    assert!(arrivals
        .iter()
        .all(|a| a.headers["content-length"] == "102400"));
    Ok(())
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn resends_extensions_reach_the_stack() -> TestResult {
    let server = server(Script::new().otherwise(Reply::status(503))).await;
    let client = client(stack());

    let resp = within(
        client
            .get(url(&server, "/items"))
            .with_extension(NoRetry)
            .send(),
    )
    .await?;

    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&resp).stop(), Stop::Disabled);
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
    Ok(())
}

/// Counts the attempts that pass it (the counter travels in the call's
/// extensions) and leaves the last count there.
#[derive(Clone)]
struct Counter(Arc<AtomicUsize>);

#[derive(Clone, Debug, PartialEq)]
struct Counted(usize);

fn count<'a>(
    req: reqwest::Request,
    ext: &'a mut Extensions,
    next: Next<'a>,
) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<reqwest::Response>> + Send + 'a>> {
    let n = ext
        .get::<Counter>()
        .map_or(0, |c| c.0.fetch_add(1, Ordering::SeqCst) + 1);
    ext.insert(Counted(n));
    next.run(req, ext)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_attempt_goes_through_the_rest_of_the_chain() -> TestResult {
    let server = server(
        Script::new()
            .then_n(2, Reply::status(503))
            .otherwise(Reply::ok().body("parcel 7")),
    )
    .await;
    let client = ClientBuilder::new(reqwest_client())
        .with(ResendMiddleware::new(stack()))
        .with(count)
        .build();
    let counter = Counter(Arc::new(AtomicUsize::new(0)));
    let mut ext = Extensions::new();
    ext.insert(counter.clone());

    let req = client.get(url(&server, "/items")).build()?;
    let resp = within(client.execute_with_extensions(req, &mut ext)).await?;

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.text().await?, "parcel 7");
    assert_eq!(counter.0.load(Ordering::SeqCst), 3);
    // What the chain below left in the extensions comes back.
    assert_eq!(ext.get::<Counted>(), Some(&Counted(3)));
    Ok(())
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn send_with_takes_a_plain_reqwest_request_through_the_stack() -> TestResult {
    let server = server(
        Script::new()
            .then(Reply::status(503))
            .otherwise(Reply::ok().body("parcel 7")),
    )
    .await;
    let resend = stack().reqwest_middleware();
    let client = reqwest_client();

    let pending = client.get(url(&server, "/items")).send_with(&resend);
    fn is_send<T: Send>(_: &T) {}
    is_send(&pending);
    let resp = within(pending).await?;

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(attempts(&resp).len(), 2);
    assert_eq!(resp.text().await?, "parcel 7");

    // A built request, through `execute`.
    let req = client.get(url(&server, "/items")).build()?;
    let resp = within(resend.execute(&client, req)).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(attempts(&resp).len(), 1);
    assert_eq!(server.arrival_count(), 3);
    Ok(())
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn send_with_a_post_without_key_that_timed_out_is_sent_once() {
    let server = server(Script::new().otherwise(Reply::work_then_hang())).await;
    let resend = stack().attempt_timeout(SECOND).reqwest_middleware();

    let err = within(
        reqwest_client()
            .post(url(&server, "/charges"))
            .body("amount=100")
            .send_with(&resend),
    )
    .await
    .expect_err("nobody answers");

    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{err}");
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
    assert_eq!(server.total_effects(), 1);
}

/// The stack is built once: its circuit breaker (and its retry budget) is
/// shared by every call of the client and of its clones.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_circuit_breaker_for_every_call_of_the_client() {
    let server = server(Script::new().otherwise(Reply::never())).await;
    let client = ClientBuilder::new(reqwest_client())
        .with(ResendMiddleware::new(
            stack()
                .attempt_timeout(100 * MS)
                .max_attempts(1)
                .circuit_breaker_with(
                    tower_resend::breaker::CircuitBreakerLayer::new().min_throughput(5),
                ),
        ))
        .build();

    for _ in 0..5 {
        let err = within(client.clone().get(url(&server, "/quote")).send())
            .await
            .expect_err("nobody answers");
        let e = resend_error(&err).expect("resend's error");
        assert_eq!(e.kind(), ErrorKind::AttemptTimeout, "{e}");
    }
    let start = Instant::now();
    let err = within(client.get(url(&server, "/quote")).send())
        .await
        .expect_err("the circuit is open");

    assert_eq!(start.elapsed(), Duration::ZERO);
    let e = resend_error(&err).expect("resend's error");
    assert_eq!(e.kind(), ErrorKind::CircuitOpen, "{e}");
    assert!(e.is_not_sent());
    assert_eq!(server.arrival_count(), 5);
}
