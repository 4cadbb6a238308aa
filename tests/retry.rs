//! End-to-end tests of tower-resend's retries over loopback, against the scripted
//! `tower-resend-testkit` server, on tokio's paused clock.
//!
//! Every test asserts what the server saw (arrivals, their keys, bodies and
//! times) and what the client got (status, `Attempts`, error kind), per
//! DESIGN sections 3, 4 and 8.
#![allow(clippy::print_stderr)]

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};
use tower_resend::classify::Class;
use tower_resend::retry::{RetryLayer, Stop};
use tower_resend::ErrorKind;
use tower_resend_testkit::{Arrival, Reply, Script, TestServer};

use common::{
    attempts, closed_port, get, idle, post, stack, transport, within, Chunks, CONNECT_TIMEOUT,
};

const MS: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);
/// The ceiling of the first jittered backoff (`Backoff::DEFAULT`, base 100 ms).
const FIRST_JITTER: Duration = Duration::from_millis(100);

async fn server(script: Script) -> TestServer {
    TestServer::start(script)
        .await
        .expect("start the test server")
}

// 1. Overloaded and rejected answers.

common::http_behaviour_suite!();

fn first_gap(arrivals: &[Arrival]) -> Duration {
    assert!(arrivals.len() >= 2, "{} arrival(s)", arrivals.len());
    arrivals[1].at - arrivals[0].at
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_429_with_retry_after_1_comes_back_within_1_to_1_5_s_plus_the_first_jitter() {
    let server = server(Script::new().then(Reply::status(429).header("retry-after", "1"))).await;
    let client = stack().service(transport());

    let resp = within(client.oneshot(get(server.uri("/items"))))
        .await
        .expect("the second attempt answers");

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(attempts(&resp).len(), 2);
    assert_eq!(
        attempts(&resp).iter().next().and_then(|a| a.server_wait()),
        Some(SECOND)
    );
    // Never earlier than asked; spread over half as much again (so that
    // clients told the same thing do not come back in step), plus the
    // backoff's jitter.
    let gap = first_gap(&server.arrivals());
    assert!(gap >= SECOND, "{gap:?}");
    assert!(gap <= SECOND * 3 / 2 + FIRST_JITTER, "{gap:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_429_is_retried_even_for_a_post_without_key() {
    let server = server(Script::new().then(Reply::status(429).header("retry-after", "1"))).await;
    let client = stack().service(transport());

    let resp = within(client.oneshot(post(server.uri("/charges"))))
        .await
        .expect("the second attempt answers");

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(attempts(&resp).len(), 2);
    assert_eq!(server.arrival_count(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_503_to_a_post_without_key_is_not_retried_and_outcome_unknown() {
    let server = server(Script::new().otherwise(Reply::status(503))).await;
    let client = stack().service(transport());

    let err = within(client.oneshot(post(server.uri("/charges"))))
        .await
        .expect_err("a 503 may have been processed");

    assert!(err.is_outcome_unknown());
    assert_eq!(err.attempts(), 1);
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_429_with_an_http_date_retry_after_waits_until_that_date() {
    // HTTP-dates have a resolution of one second, and SystemTime is not
    // paused: "now + 3 s" reads as between 2 and 3 s from now.
    let date = httpdate::fmt_http_date(SystemTime::now() + 3 * SECOND);
    let server = server(Script::new().then(Reply::status(429).header("retry-after", &date))).await;
    let client = stack().service(transport());

    let resp = within(client.oneshot(get(server.uri("/items"))))
        .await
        .expect("the second attempt answers");

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(attempts(&resp).len(), 2);
    let gap = first_gap(&server.arrivals());
    assert!(gap >= 2 * SECOND, "{gap:?}");
    assert!(gap <= 3 * SECOND * 3 / 2 + FIRST_JITTER, "{gap:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_retry_after_past_the_deadline_returns_the_429_at_once() {
    let server =
        server(Script::new().otherwise(Reply::status(429).header("retry-after", "60"))).await;
    // Honour waits up to 120 s, so that the 10 s deadline is what says no.
    let client = stack()
        .total(10 * SECOND)
        .retry(|r| r.max_server_wait(120 * SECOND))
        .service(transport());

    let start = Instant::now();
    let resp = within(client.oneshot(get(server.uri("/items"))))
        .await
        .expect("the 429 is returned");

    assert!(start.elapsed() < 100 * MS, "{:?}", start.elapsed());
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let a = attempts(&resp);
    assert_eq!(a.len(), 1);
    assert_eq!(a.stop(), Stop::Deadline);
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_retry_after_past_the_longest_honoured_wait_returns_the_429_at_once() {
    let server =
        server(Script::new().otherwise(Reply::status(429).header("retry-after", "60"))).await;
    // Defaults: waits honoured up to 30 s; a 10 s deadline.
    let client = stack().service(transport());

    let start = Instant::now();
    let resp = within(client.oneshot(get(server.uri("/items"))))
        .await
        .expect("the 429 is returned");

    assert!(start.elapsed() < 100 * MS, "{:?}", start.elapsed());
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let a = attempts(&resp);
    assert_eq!(a.len(), 1);
    assert!(
        matches!(a.stop(), Stop::ServerSaidNo | Stop::Deadline),
        "{:?}",
        a.stop()
    );
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
}

// 6. Silent upstream: give up at the deadline, never later.

/// Seeds for the tests whose outcome depends on the jitter drawn: the waits
/// decide whether a third attempt fits before the deadline, and both paths
/// must behave.
const SEEDS: std::ops::Range<u64> = 0..16;

/// One GET against a silent upstream, 1 s in all and 400 ms per attempt, with
/// jitter seeded by `seed`; no retry budget, so that time alone limits it.
/// Returns the error, the time it took and the arrivals at the server.
async fn give_up_on_a_silent_upstream(seed: u64) -> (tower_resend::Error, Duration, usize) {
    let server = server(Script::new().otherwise(Reply::never())).await;
    let client = stack()
        .seed(seed)
        .no_budget()
        .total(SECOND)
        .attempt_timeout(400 * MS)
        .service(transport());
    let start = Instant::now();
    let err = within(client.oneshot(get(server.uri("/items"))))
        .await
        .expect_err("nobody answers");
    (err, start.elapsed(), server.arrival_count())
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_silent_upstream_is_given_up_on_by_the_deadline_never_later() {
    for seed in SEEDS {
        let (err, elapsed, arrivals) = give_up_on_a_silent_upstream(seed).await;
        assert!(elapsed <= SECOND + 5 * MS, "seed {seed}: {elapsed:?}");
        assert!(
            (2..=3).contains(&arrivals),
            "seed {seed}: a GET that timed out at 400 ms of 1 s is retried: {arrivals}"
        );
        assert!(!err.is_not_sent(), "seed {seed}: {err}");
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_silent_upstream_fails_with_deadline_exceeded_whatever_the_jitter() {
    for seed in SEEDS {
        let (err, elapsed, _) = give_up_on_a_silent_upstream(seed).await;
        assert!(elapsed <= SECOND + 5 * MS, "seed {seed}: {elapsed:?}");
        assert_eq!(
            err.kind(),
            ErrorKind::DeadlineExceeded,
            "seed {seed}: {err}; {:?}",
            err.history().map(ToString::to_string)
        );
        assert!(err.is_deadline_exceeded());
        assert!(err.is_timeout());
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_deadline_that_cuts_the_last_allowed_attempt_is_deadline_exceeded() {
    // Attempt 1 times out at 600 ms; the retry (after at most 100 ms) is the
    // last one allowed and the 1 s deadline cuts it: whatever the jitter.
    let server = server(Script::new().otherwise(Reply::never())).await;
    let client = stack()
        .no_budget()
        .max_attempts(2)
        .total(SECOND)
        .attempt_timeout(600 * MS)
        .service(transport());
    let start = Instant::now();
    let err = within(client.oneshot(get(server.uri("/items"))))
        .await
        .expect_err("nobody answers");

    assert_eq!(start.elapsed(), SECOND);
    assert_eq!(server.arrival_count(), 2);
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
    assert!(err.is_timeout());
}

// 7. Outage: upstream attempts per logical request.

/// Runs `calls` concurrent logical GETs through clones of `client` against
/// an always-503 upstream and returns upstream attempts per logical call.
async fn attempts_per_call_in_an_outage(
    client: tower_resend::stack::Stack<common::Transport>,
    calls: usize,
) -> f64 {
    let server = server(Script::new().otherwise(Reply::status(503))).await;
    let mut set = JoinSet::new();
    for i in 0..calls {
        let req = get(server.uri(&format!("/items/{i}")));
        set.spawn(client.clone().oneshot(req));
    }
    let mut answered = 0;
    while let Some(joined) = within(set.join_next()).await {
        let resp = joined
            .expect("the task ran")
            .expect("a 503 is returned, not an error");
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        answered += 1;
    }
    assert_eq!(answered, calls);
    server.arrival_count() as f64 / calls as f64
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_outage_costs_at_most_1_3_attempts_per_call_with_the_budget() {
    let ratio = attempts_per_call_in_an_outage(stack().service(transport()), 100).await;
    assert!(ratio <= 1.3, "{ratio}");
    assert!(ratio > 1.0, "the budget allows some retries: {ratio}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_outage_costs_3_attempts_per_call_without_the_budget() {
    let ratio = attempts_per_call_in_an_outage(stack().no_budget().service(transport()), 100).await;
    assert!(ratio >= 2.7, "{ratio}");
    assert!(ratio <= 3.0, "{ratio}");
}

// 8. After an outage: no herd.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn after_an_outage_retries_are_spread_not_in_step() {
    const CLIENTS: usize = 100;
    const OUTAGE: Duration = Duration::from_secs(2);
    const WINDOW: Duration = Duration::from_millis(50);

    let start = Instant::now();
    let server = server(Script::from_fn(move |a| {
        if a.at.duration_since(start) < OUTAGE {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    }))
    .await;

    // 100 independent clients (each its own stack, budget and jitter seed),
    // all sending their first attempt at t = 0.
    let mut set = JoinSet::new();
    for i in 0..CLIENTS {
        let client = stack().seed(i as u64).service(transport());
        let req = get(server.uri(&format!("/herd/{i}")));
        set.spawn(client.oneshot(req));
    }
    let mut ok = 0;
    while let Some(joined) = within(set.join_next()).await {
        let resp = joined
            .expect("the task ran")
            .expect("recovers once the outage ends");
        assert_eq!(resp.status(), StatusCode::OK, "{}", attempts(&resp));
        ok += 1;
    }
    assert_eq!(ok, CLIENTS);

    // Each client's arrivals in order; its first attempt was at t = 0.
    let mut by_client: BTreeMap<String, Vec<Instant>> = BTreeMap::new();
    for a in server.arrivals() {
        by_client
            .entry(a.uri.path().to_owned())
            .or_default()
            .push(a.at);
    }
    assert_eq!(by_client.len(), CLIENTS);
    let mut retries = Vec::new();
    for times in by_client.values_mut() {
        times.sort();
        assert_eq!(times[0], start, "every first attempt at t = 0");
        retries.extend_from_slice(&times[1..]);
    }
    assert!(
        retries.len() >= CLIENTS,
        "every client retried at least once"
    );

    // Retries per 50 ms window: the busiest holds at most 3x the mean of the
    // windows that saw retry traffic.
    let mut windows: BTreeMap<u128, usize> = BTreeMap::new();
    for t in &retries {
        *windows
            .entry(t.duration_since(start).as_nanos() / WINDOW.as_nanos())
            .or_default() += 1;
    }
    let busiest = *windows.values().max().expect("retries happened");
    let mean = retries.len() as f64 / windows.len() as f64;
    assert!(
        busiest as f64 <= 3.0 * mean,
        "busiest window {busiest}, mean {mean:.1} over {} windows: {windows:?}",
        windows.len()
    );
    // A herd in step would also pass that ratio (every retry of a round in
    // one window): the clients must not come back at the same instants.
    let mut at_instant: BTreeMap<Instant, usize> = BTreeMap::new();
    for t in &retries {
        *at_instant.entry(*t).or_default() += 1;
    }
    let most_at_once = *at_instant.values().max().expect("retries happened");
    assert!(most_at_once <= 10, "{most_at_once} retries at one instant");
}

/// 100 calls at once through one stack (one budget), against an upstream
/// that answers 503 (with `retry_after`, if any) for 2 s and 200 after;
/// 7 attempts, no total. The outage costs the upstream little (the budget
/// throttles the retries rather than failing them), the calls still get
/// through once it ends, and the comeback is spread.
async fn a_two_second_outage(retry_after: Option<&'static str>) {
    const CALLS: usize = 100;
    const OUTAGE: Duration = Duration::from_secs(2);
    const WINDOW: Duration = Duration::from_millis(50);
    let start = Instant::now();
    let server = server(Script::from_fn(move |a| {
        if a.at.duration_since(start) < OUTAGE {
            match retry_after {
                Some(v) => Reply::status(503).header("retry-after", v),
                None => Reply::status(503),
            }
        } else {
            Reply::ok()
        }
    }))
    .await;
    let client = stack()
        .seed(11)
        .max_attempts(7)
        .total(3600 * SECOND)
        .service(transport());
    let mut set = JoinSet::new();
    for i in 0..CALLS {
        let req = get(server.uri(&format!("/outage/{i}")));
        let client = client.clone();
        set.spawn(async move {
            let r = client.oneshot(req).await;
            (r, Instant::now())
        });
    }
    let (mut ok, mut last) = (0, start);
    while let Some(joined) = within(set.join_next()).await {
        let (resp, at) = joined.expect("the task ran");
        if resp.is_ok_and(|r| r.status() == StatusCode::OK) {
            ok += 1;
            last = last.max(at);
        }
    }
    let arrivals = server.arrivals();
    let during = arrivals
        .iter()
        .filter(|a| a.at.duration_since(start) < OUTAGE)
        .count();
    // Retries: every arrival but each call's first, per 50 ms window.
    let mut seen = std::collections::HashSet::new();
    let mut windows: BTreeMap<u128, usize> = BTreeMap::new();
    for a in &arrivals {
        if !seen.insert(a.uri.path().to_owned()) {
            *windows
                .entry(a.at.duration_since(start).as_nanos() / WINDOW.as_nanos())
                .or_default() += 1;
        }
    }
    let retries: usize = windows.values().sum();
    let busiest = windows.values().copied().max().unwrap_or(0);
    let mean = retries as f64 / windows.len().max(1) as f64;
    let summary = format!(
        "retry-after {retry_after:?}: {during} sends during the outage, {} in all; {ok}/{CALLS} ok, the last at {:?}; \
         busiest 50 ms window {busiest} retries, mean {mean:.1} over {} windows",
        arrivals.len(),
        last.duration_since(start),
        windows.len()
    );
    eprintln!("{summary}");
    assert!(during <= 150, "{summary}");
    assert!(ok >= 95, "{summary}");
    assert!(last.duration_since(start) <= 6 * SECOND, "{summary}");
    assert!(busiest as f64 <= 3.0 * mean, "{summary}: {windows:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_two_second_outage_costs_little_and_the_calls_get_through() {
    a_two_second_outage(None).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_two_second_outage_with_retry_after_1_costs_little_and_the_calls_get_through() {
    a_two_second_outage(Some("1")).await;
}

/// A quiet client (a fresh stack, one call at a time) whose upstream
/// answers each call 503, 503 and then 200, with `Retry-After: 0`: under a
/// 1 s total per call, all three calls succeed. The budget keeps a crowd
/// off a struggling upstream; it does not make a client with little
/// traffic wait a second for its first retries (it once did: 0 of 3).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_quiet_client_retries_at_once_and_every_call_gets_through() {
    let busy = || Reply::status(503).header("retry-after", "0");
    let mut script = Script::new();
    for _ in 0..3 {
        script = script.then(busy()).then(busy()).then(Reply::ok());
    }
    let server = server(script).await;
    let client = stack().total(SECOND).service(transport());
    for call in 0..3 {
        let started = Instant::now();
        let resp = within(client.clone().oneshot(get(server.uri("/quiet"))))
            .await
            .unwrap_or_else(|e| panic!("call {call}: {e}"));
        assert_eq!(resp.status(), StatusCode::OK, "call {call}");
        assert_eq!(attempts(&resp).len(), 3, "call {call}");
        let took = started.elapsed();
        assert!(took < SECOND / 2, "call {call} took {took:?}");
    }
    assert_eq!(server.arrival_count(), 9);
}

/// Every retry of an HTTP request says how many attempts came before it
/// (`resend-previous-attempts`, by default), so that an overloaded server
/// can shed retries first; the first attempt carries none; the header can
/// be renamed or turned off.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retries_say_how_many_attempts_came_before() {
    let previous = |server: &TestServer, name: &str| -> Vec<Option<String>> {
        server
            .arrivals()
            .iter()
            .map(|a| {
                a.headers
                    .get(name)
                    .map(|v| v.to_str().unwrap_or_default().to_owned())
            })
            .collect()
    };
    let busy = || Script::new().then_n(2, Reply::status(503).header("retry-after", "0"));
    let s = server(busy()).await;
    let resp = within(
        stack()
            .no_budget()
            .service(transport())
            .oneshot(get(s.uri("/a"))),
    )
    .await
    .expect("an answer");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        previous(&s, "resend-previous-attempts"),
        [None, Some("1".into()), Some("2".into())]
    );

    let s = server(busy()).await;
    let client = stack()
        .no_budget()
        .retry(|r| r.attempt_header(http::HeaderName::from_static("x-retry-attempt")))
        .service(transport());
    within(client.oneshot(get(s.uri("/a"))))
        .await
        .expect("an answer");
    assert_eq!(
        previous(&s, "x-retry-attempt"),
        [None, Some("1".into()), Some("2".into())]
    );
    assert_eq!(previous(&s, "resend-previous-attempts"), [None, None, None]);

    let s = server(busy()).await;
    let client = stack()
        .no_budget()
        .retry(|r| r.no_attempt_header())
        .service(transport());
    within(client.oneshot(get(s.uri("/a"))))
        .await
        .expect("an answer");
    assert_eq!(previous(&s, "resend-previous-attempts"), [None, None, None]);
}

/// Retries of requests that were not sent (connection refused) cost the
/// upstream nothing while it otherwise answers: with a budget of no tokens
/// at all, a call makes all its attempts, and ends not-sent, not out of
/// budget. Once five attempts in a row have failed (nothing listens: an
/// outage, not a connection gone), a refusal is retried as any failure,
/// with a token: with none, the call ends after one attempt, out of budget.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn not_sent_retries_spend_no_budget_token_until_the_upstream_fails_as_a_whole() {
    let empty = tower_resend::retry::RetryBudget::new(0.0, 0.0, SECOND).expect("a budget");
    let client = stack().budget(empty).max_attempts(4).service(transport());
    let port = closed_port();
    let refused = |i: u32| {
        post(
            format!("http://127.0.0.1:{port}/charges/{i}")
                .parse()
                .expect("a URI"),
        )
    };
    let err = within(client.clone().oneshot(refused(0)))
        .await
        .expect_err("nothing listens");
    assert!(err.is_not_sent(), "{err}");
    assert_ne!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    assert_eq!(err.attempts(), 4, "{err}");
    // The fifth refusal in a row: the upstream fails as a whole.
    let err = within(client.oneshot(refused(1)))
        .await
        .expect_err("nothing listens");
    assert!(err.is_not_sent(), "{err}");
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted, "{err}");
    assert_eq!(err.attempts(), 1, "{err}");
}

/// In an outage, the refusals retried free before the stack knew it (the
/// first four of five failures in a row) are charged to the budget when it
/// does: a hundred GETs over a second, every attempt refused, cost the
/// upstream the budget's share of them in all (1.2 attempts a call), not
/// that share and the free refusals on top.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_outage_costs_the_budgets_share_from_its_first_refusal() {
    let budget = tower_resend::retry::RetryBudget::new(0.2, 0.0, SECOND).expect("a budget");
    let client = stack().budget(budget).service(transport());
    let port = closed_port();
    let mut calls = JoinSet::new();
    for i in 0..100 {
        let uri = format!("http://127.0.0.1:{port}/items/{i}");
        calls.spawn(within(
            client.clone().oneshot(get(uri.parse().expect("a URI"))),
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut attempts = 0;
    while let Some(ended) = calls.join_next().await {
        let err = ended
            .expect("the call's task")
            .expect_err("nothing listens");
        assert!(err.is_not_sent(), "{err}");
        attempts += err.attempts();
    }
    assert!(attempts <= 120, "{attempts} attempts for 100 calls");
}

/// A GET whose 200 head arrives and whose small body then breaks (the
/// connection drops) is an attempt that failed: its body is read before the
/// response is returned, so the retry layer retries it, and the caller
/// gets the whole body of the second attempt.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_get_whose_small_body_breaks_is_retried_and_succeeds() {
    let flaky = server(
        Script::new()
            .then(Reply::ok().reset_mid_body(Bytes::from_static(b"0123456789")))
            .otherwise(Reply::ok().body("the whole body")),
    )
    .await;
    let client = stack().service(transport());
    let resp = within(client.oneshot(get(flaky.uri("/items/1"))))
        .await
        .expect("the retry answers");
    assert_eq!(resp.status(), StatusCode::OK);
    let history = attempts(&resp).clone();
    assert_eq!(history.len(), 2, "{history}");
    assert_eq!(
        history.iter().next().map(|a| a.class()),
        Some(Class::Unknown)
    );
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("the body of the second attempt is whole")
        .to_bytes();
    assert_eq!(body, "the whole body");
    assert_eq!(flaky.arrival_count(), 2);

    // Off (read_ahead(0)): the break reaches the caller while it reads.
    let off =
        server(Script::new().then(Reply::ok().reset_mid_body(Bytes::from_static(b"0123456789"))))
            .await;
    let client = stack().read_ahead(0).service(transport());
    let resp = within(client.oneshot(get(off.uri("/items/1"))))
        .await
        .expect("the head arrives");
    assert!(http_body_util::BodyExt::collect(resp.into_body())
        .await
        .is_err());
    assert_eq!(off.arrival_count(), 1);
}

/// A body of unknown length (chunked over HTTP/1.1, no `content-length`
/// over HTTP/2) that breaks after 10 bytes: read ahead all the same, so a
/// GET is retried and gets the whole body of the next answer; a POST
/// without a key is not sent again, and its caller sees the break.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_body_of_unknown_length_that_breaks_is_retried_for_a_get_only() {
    for h2 in [false, true] {
        let script = || {
            Script::new()
                .then(Reply::ok().reset_mid_stream(Bytes::from_static(b"0123456789")))
                .otherwise(Reply::ok().body("the whole body"))
        };
        let start = |script: Script| async move {
            let b = TestServer::builder().script(script);
            let b = if h2 { b.http2_only() } else { b };
            b.start().await.expect("start the test server")
        };
        let mut builder = Client::builder(TokioExecutor::new());
        builder.http2_only(h2);
        let client = stack().service(tower_resend::connect::hyper_client_with(
            &builder,
            CONNECT_TIMEOUT,
        ));

        let flaky = start(script()).await;
        let resp = within(client.clone().oneshot(get(flaky.uri("/items/1"))))
            .await
            .unwrap_or_else(|e| panic!("h2 {h2}: {e}"));
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(attempts(&resp).len(), 2, "h2 {h2}");
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("the second answer is whole")
            .to_bytes();
        assert_eq!(body, "the whole body", "h2 {h2}");
        assert_eq!(flaky.arrival_count(), 2);

        let once = start(script()).await;
        let resp = within(client.oneshot(post(once.uri("/charges"))))
            .await
            .expect("the head arrives");
        assert!(
            http_body_util::BodyExt::collect(resp.into_body())
                .await
                .is_err(),
            "h2 {h2}: the caller sees the break"
        );
        idle(30 * SECOND).await;
        assert_eq!(once.arrival_count(), 1, "h2 {h2}");
    }
}

/// A body that sends one chunk and then nothing, under an idle timeout of
/// 200 ms and a total of 5 s: the attempt fails at 200 ms after the chunk;
/// a GET is retried and gets the next, whole answer; a POST without a key
/// is not sent again, and its caller's read fails at 200 ms.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_body_that_goes_silent_fails_its_attempt_at_the_idle_timeout() {
    const IDLE: Duration = Duration::from_millis(200);
    let script = || {
        Script::new()
            .then(Reply::ok().stall_mid_body(Bytes::from_static(b"0123456789")))
            .otherwise(Reply::ok().body("the whole body"))
    };
    let client = stack()
        .total(5 * SECOND)
        .idle_timeout(IDLE)
        .service(transport());

    let flaky = server(script()).await;
    let resp = within(client.clone().oneshot(get(flaky.uri("/items/1"))))
        .await
        .expect("the retry answers");
    let history = attempts(&resp).clone();
    assert_eq!(history.len(), 2, "{history}");
    let first = history.iter().next().expect("the first attempt");
    assert_eq!(first.class(), Class::Unknown);
    assert!(
        first.took() >= IDLE && first.took() < IDLE + 50 * MS,
        "{history}"
    );
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("the second answer is whole")
        .to_bytes();
    assert_eq!(body, "the whole body");
    assert_eq!(flaky.arrival_count(), 2);

    let once = server(script()).await;
    let resp = within(client.oneshot(post(once.uri("/charges"))))
        .await
        .expect("the head arrives");
    let started = Instant::now();
    let err = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect_err("the caller's read fails");
    assert!(started.elapsed() >= IDLE && started.elapsed() < IDLE + 50 * MS);
    let err = err
        .downcast_ref::<tower_resend::Error>()
        .map(tower_resend::Error::kind);
    assert_eq!(err, Some(ErrorKind::AttemptTimeout));
    idle(30 * SECOND).await;
    assert_eq!(once.arrival_count(), 1);
}

/// A POST without a key is not replay-safe: its body is not read ahead,
/// and a break in it is never a reason to send it again.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_post_whose_body_breaks_is_not_resent() {
    let server =
        server(Script::new().then(Reply::ok().reset_mid_body(Bytes::from_static(b"0123456789"))))
            .await;
    let client = stack().service(transport());
    let resp = within(client.oneshot(post(server.uri("/charges"))))
        .await
        .expect("the head arrives");
    assert!(http_body_util::BodyExt::collect(resp.into_body())
        .await
        .is_err());
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
}

/// A keyed POST whose first attempt times out while the server works, and
/// whose retry is told 409 (another attempt holds the key): the server is
/// well, so the 409 is no failed probe of a failing upstream, and the next
/// retry goes out after its backoff, with no pause of the budget's floor
/// (one second) to wait through.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_409_in_progress_is_no_failed_probe_the_next_retry_waits_only_its_backoff() {
    let payments = server(
        Script::new()
            .then(Reply::work_then_hang())
            .then(Reply::status(409))
            .otherwise(Reply::status(201)),
    )
    .await;
    let client = stack()
        .idempotency_keys()
        .max_attempts(3)
        .attempt_timeout(500 * MS)
        .service(transport());
    let resp = within(client.oneshot(post(payments.uri("/payments"))))
        .await
        .expect("the third attempt gets the answer");
    assert_eq!(resp.status(), StatusCode::CREATED);
    let at: Vec<_> = payments.arrivals().iter().map(|a| a.at).collect();
    assert_eq!(at.len(), 3);
    // The second retry's full-jitter backoff is at most 200 ms by default.
    let gap = at[2] - at[1];
    assert!(gap <= 250 * MS, "{gap:?}");
}

/// A keyed call that ends on "still in progress" (409), or on a shed 503
/// after an earlier attempt that may have run, is not a plain response: it
/// ends outcome-unknown, naming the caller's key and the advice to send it
/// again with that key (whose record will answer). One whose earlier
/// attempts promise that nothing ran (429), or that has no key, keeps its
/// response.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_keyed_call_ending_in_progress_or_shed_after_it_may_have_run_says_resend_with_the_key() {
    use tower_resend::RetryAdvice;
    let keyed = |uri: http::Uri| {
        let mut req = post(uri);
        req.headers_mut()
            .insert("idempotency-key", "order-7".parse().unwrap());
        req
    };
    let client = stack().max_attempts(3).service(transport());

    // The first attempt ran (500), the others found it still running.
    let running = server(
        Script::new()
            .then(Reply::status(500))
            .otherwise(Reply::status(409)),
    )
    .await;
    let err = within(client.clone().oneshot(keyed(running.uri("/orders"))))
        .await
        .expect_err("no attempt settled it");
    assert_eq!(running.arrivals().len(), 3);
    assert!(err.is_outcome_unknown(), "{err}");
    assert_eq!(err.idempotency_key(), Some("order-7"));
    assert!(
        matches!(err.retry_advice(), RetryAdvice::SameKey(_)),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains("same Idempotency-Key, order-7"), "{text}");

    // Every attempt found another one running: the same.
    let busy = server(Script::new().otherwise(Reply::status(409))).await;
    let err = within(client.clone().oneshot(keyed(busy.uri("/orders"))))
        .await
        .expect_err("in progress to the end");
    assert!(
        err.is_outcome_unknown() && err.idempotency_key() == Some("order-7"),
        "{err}"
    );

    // Shed after an attempt that may have run.
    let shed = server(
        Script::new()
            .then(Reply::status(500))
            .otherwise(Reply::status(503).header("retry-after", "0")),
    )
    .await;
    let err = within(client.clone().oneshot(keyed(shed.uri("/orders"))))
        .await
        .expect_err("shed after it may have run");
    assert!(err.is_outcome_unknown(), "{err}");
    assert!(
        matches!(err.retry_advice(), RetryAdvice::SameKey(_)),
        "{err}"
    );

    // Shed after attempts that promise nothing ran (429): the 503 stands.
    let refused = server(
        Script::new()
            .then(Reply::status(429).header("retry-after", "0"))
            .then(Reply::status(429).header("retry-after", "0"))
            .otherwise(Reply::status(503).header("retry-after", "0")),
    )
    .await;
    let resp = within(client.clone().oneshot(keyed(refused.uri("/orders"))))
        .await
        .expect("nothing may have run: the answer stands");
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);

    // Without a key, a GET that ends on 503 keeps its response.
    let down = server(Script::new().otherwise(Reply::status(503).header("retry-after", "0"))).await;
    let resp = within(client.oneshot(get(down.uri("/orders"))))
        .await
        .expect("a GET's last answer");
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&resp).len(), 3);
}

/// A POST sent under a key (the stack's or the caller's), that may have
/// been processed and has no retry left, ends outcome-unknown, with the key readable and
/// the advice to retry with that same key — never a bare "retry later",
/// which a job runner would follow with a new key, doing the work twice.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_keyed_post_with_no_retry_left_says_retry_with_the_same_key() {
    use tower_resend::RetryAdvice;
    // Attempts that time out, then no attempt left.
    let silent = server(Script::new().otherwise(Reply::never())).await;
    let client = stack()
        .idempotency_keys()
        .max_attempts(2)
        .attempt_timeout(500 * MS)
        .service(transport());
    let err = within(client.oneshot(post(silent.uri("/charges"))))
        .await
        .expect_err("nobody answers");
    let arrivals = silent.arrivals();
    assert_eq!(arrivals.len(), 2);
    let sent = arrivals[0].headers["idempotency-key"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(arrivals[1].headers["idempotency-key"], sent.as_str());
    assert!(err.is_outcome_unknown(), "{err}");
    assert_eq!(err.idempotency_key(), Some(sent.as_str()));
    assert!(
        matches!(err.retry_advice(), RetryAdvice::SameKey(_)),
        "{err}"
    );
    assert!(err.to_string().contains(&sent), "{err}");

    // The deadline (which fires outside the key layer) says the same.
    let client = stack()
        .idempotency_keys()
        .total(SECOND)
        .attempt_timeout(5 * SECOND)
        .service(transport());
    let err = within(client.oneshot(post(silent.uri("/charges"))))
        .await
        .expect_err("nobody answers");
    let sent = silent.arrivals()[2].headers["idempotency-key"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(err.is_outcome_unknown(), "{err}");
    assert_eq!(err.idempotency_key(), Some(sent.as_str()));
    assert!(matches!(err.retry_advice(), RetryAdvice::SameKey(_)));

    // A key the caller set: the same advice, naming the caller's key.
    let client = stack()
        .idempotency_keys()
        .max_attempts(2)
        .attempt_timeout(500 * MS)
        .service(transport());
    let mut req = post(silent.uri("/charges"));
    req.extensions_mut()
        .insert(tower_resend::IdempotencyKey::new("order-7").unwrap());
    let err = within(client.clone().oneshot(req))
        .await
        .expect_err("nobody answers");
    assert!(err.is_outcome_unknown(), "{err}");
    assert_eq!(err.idempotency_key(), Some("order-7"));
    assert!(matches!(err.retry_advice(), RetryAdvice::SameKey(_)));
    assert!(
        err.to_string().contains("same Idempotency-Key, order-7"),
        "{err}"
    );

    // Nothing sent (a closed port): safe to send again at once; the key is
    // still there to read.
    let port = closed_port();
    let err = within(client.oneshot(post(
        format!("http://127.0.0.1:{port}/charges").parse().unwrap(),
    )))
    .await
    .expect_err("nothing listens");
    assert!(err.is_not_sent() && !err.is_outcome_unknown(), "{err}");
    assert!(err.idempotency_key().is_some());
    assert_eq!(err.retry_advice(), RetryAdvice::After(Duration::ZERO));
}

/// A request's own `CallOptions` override the stack's attempts and attempt
/// limit, for that request alone.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn call_options_set_attempts_and_the_attempt_limit_per_request() {
    use tower_resend::retry::CallOptions;
    let failing = server(Script::new().otherwise(Reply::status(503))).await;
    let client = stack().no_budget().service(transport());
    for (attempts, expected) in [(Some(5), 5), (Some(1), 1), (None, 3)] {
        let before = failing.arrival_count();
        let mut req = get(failing.uri("/items"));
        if let Some(n) = attempts {
            req.extensions_mut()
                .insert(CallOptions::new().max_attempts(n));
        }
        let resp = within(client.clone().oneshot(req))
            .await
            .expect("the last 503 is returned");
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(failing.arrival_count() - before, expected, "{attempts:?}");
    }
    // The attempt limit: 100 ms for this request, 5 s for the others.
    let silent = server(Script::new().otherwise(Reply::never())).await;
    let client = stack()
        .no_budget()
        .max_attempts(2)
        .attempt_timeout(5 * SECOND)
        .total(60 * SECOND)
        .service(transport());
    let mut req = get(silent.uri("/slow"));
    req.extensions_mut()
        .insert(CallOptions::new().attempt_timeout(100 * MS));
    let start = Instant::now();
    let err = within(client.clone().oneshot(req))
        .await
        .expect_err("nobody answers");
    assert_eq!(err.attempts(), 2, "{err}");
    assert!(start.elapsed() < 500 * MS, "{:?}", start.elapsed());
    let start = Instant::now();
    let err = within(client.oneshot(get(silent.uri("/slow"))))
        .await
        .expect_err("nobody answers");
    assert_eq!(err.attempts(), 2);
    assert!(start.elapsed() >= 10 * SECOND, "{:?}", start.elapsed());
}

// 9. Bodies: replayed byte for byte under the cap, never over it.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_streamed_put_body_is_replayed_byte_for_byte() {
    let server = server(Script::new().then(Reply::status(503))).await;
    let body = Chunks::new(8, 4096); // 32 KiB, under the 64 KiB cap
    let expected = body.concat();
    let client = stack().service(tower_resend::hyper_client(CONNECT_TIMEOUT));

    let req = Request::put(server.uri("/objects/1"))
        .body(body)
        .expect("a valid request");
    let resp = within(client.oneshot(req))
        .await
        .expect("the retry answers");

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(attempts(&resp).len(), 2);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    assert_eq!(arrivals[0].body, expected);
    assert_eq!(arrivals[1].body, arrivals[0].body);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_streamed_body_over_the_cap_is_sent_once_and_not_replayed() {
    let server = server(Script::new().otherwise(Reply::status(503))).await;
    let body = Chunks::new(25, 4096); // 100 KiB, over the 64 KiB cap
    let expected = body.concat();
    let client = stack().service(tower_resend::hyper_client(CONNECT_TIMEOUT));

    let req = Request::put(server.uri("/objects/1"))
        .body(body)
        .expect("a valid request");
    let resp = within(client.oneshot(req))
        .await
        .expect("the 503 is returned");

    // retry/future.rs `finish`: a response stays a response; the reason is
    // in its Attempts.
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let a = attempts(&resp);
    assert_eq!(a.len(), 1);
    assert_eq!(a.stop(), Stop::NotReplayable);
    idle(30 * SECOND).await;
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 1);
    assert_eq!(
        arrivals[0].body, expected,
        "the one attempt sent the whole body"
    );
}

// 10. Nested retry layers do not multiply.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn three_nested_retry_layers_send_3_times_not_27() {
    let server = server(Script::new().otherwise(Reply::status(503))).await;
    let layer = RetryLayer::new().max_attempts(3).no_budget().seed(7);
    let hyper = tower_resend::hyper_client(CONNECT_TIMEOUT);
    let client = layer.layer(layer.layer(layer.layer(hyper)));

    let resp = within(client.oneshot(get(server.uri("/items"))))
        .await
        .expect("the last 503 is returned");

    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let a = attempts(&resp);
    assert_eq!(a.len(), 3);
    assert_eq!(a.stop(), Stop::MaxAttempts);
    idle(60 * SECOND).await;
    assert_eq!(server.arrival_count(), 3);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stack_nested_inside_a_stack_through_an_async_adapter_sends_3_times_not_9() {
    let server = server(Script::new().otherwise(Reply::status(503))).await;
    let inner = stack()
        .no_budget()
        .service(tower_resend::hyper_client(CONNECT_TIMEOUT));
    // The idiomatic adapter: call the inner stack when polled.
    let adapter = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let inner = inner.clone();
        async move { inner.oneshot(req).await }
    });
    let client = stack().no_budget().service(adapter);

    let resp = within(client.oneshot(get(server.uri("/items"))))
        .await
        .expect("the last 503 is returned");

    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    idle(60 * SECOND).await;
    assert_eq!(server.arrival_count(), 3);
}

// 11. The same over HTTP/2.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn over_http2_get_through_503_503_200_answers_200_after_three_attempts() {
    let server = TestServer::builder()
        .script(
            Script::new()
                .then_n(2, Reply::status(503))
                .route("/bad", Script::new().otherwise(Reply::status(400))),
        )
        .http2_only()
        .start()
        .await
        .expect("start the test server");
    let mut builder = Client::builder(TokioExecutor::new());
    builder.http2_only(true);
    let client = stack().service(tower_resend::connect::hyper_client_with(
        &builder,
        CONNECT_TIMEOUT,
    ));

    let resp = within(client.clone().oneshot(get(server.uri("/items"))))
        .await
        .expect("the third attempt answers 200");

    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(attempts(&resp).len(), 3);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 3);
    assert!(arrivals.iter().all(|a| a.version == Version::HTTP_2));

    let resp = within(client.oneshot(get(server.uri("/bad"))))
        .await
        .expect("a 400 is an answer, not an error");
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(attempts(&resp).len(), 1);
    idle(10 * SECOND).await;
    assert_eq!(server.arrival_count(), 4);
}
