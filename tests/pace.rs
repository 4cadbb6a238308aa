//! Pacing by the quota the upstream states, on loopback, on tokio's paused
//! clock: an upstream with a quota of 100 calls per 10 s window, stated on
//! every answer (in the IETF fields, in `X-RateLimit-*` with epoch resets,
//! in the model APIs' fields with duration resets), 429 beyond it; 20
//! callers for 60 s through the stack with pacing, and beside them the
//! same load through the stack without it.
#![allow(clippy::print_stderr)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::quota::PaceLayer;
use tower_resend::ErrorKind;
use tower_resend_testkit::{Reply, Script, TestServer};

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

const CALLERS: usize = 20;
const QUOTA: u64 = 100;
const WINDOW: Duration = Duration::from_secs(10);
const RUN: Duration = Duration::from_secs(60);
/// Each caller's pause between its calls.
const THINK: Duration = Duration::from_millis(50);
/// The wall-clock time at the test's start, as the upstream and the layer
/// both take it: epoch resets are read against it, not the machine's.
const EPOCH_AT_START: u64 = 1_800_000_000;

/// How the upstream states its quota.
#[derive(Clone, Copy, Debug)]
enum Announce {
    /// `RateLimit-Policy: "default";q=100;w=10`, `RateLimit: "default";r=N;t=T`.
    Ietf,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset` as an epoch time.
    XEpoch,
    /// `x-ratelimit-{limit,remaining,reset}-requests`, the reset a duration.
    ModelDuration,
}

/// What the upstream served: when (from the start) and with what status.
#[derive(Default)]
struct Served {
    window: u64,
    used: u64,
    log: Vec<(Duration, u16)>,
}

/// A fixed-window quota on tokio's clock: 100 calls in each window of
/// 10 s from the start, stated on every answer; 429 beyond it, with a
/// Retry-After to the reset.
async fn upstream(announce: Announce, served: Arc<Mutex<Served>>) -> TestServer {
    let origin = Instant::now();
    TestServer::start(Script::from_fn(move |_| {
        let at = origin.elapsed();
        let window = (at.as_nanos() / WINDOW.as_nanos()) as u64;
        let end = WINDOW * (window as u32 + 1);
        let mut s = served.lock().unwrap();
        if s.window != window {
            (s.window, s.used) = (window, 0);
        }
        s.used += 1;
        let status = if s.used > QUOTA { 429 } else { 200 };
        s.log.push((at, status));
        let left = QUOTA.saturating_sub(s.used);
        let to_reset = end - at;
        // Whole seconds, rounded up: never earlier than the reset.
        let secs = to_reset.as_nanos().div_ceil(1_000_000_000);
        let reply = match announce {
            Announce::Ietf => Reply::status(status)
                .header(
                    "ratelimit-policy",
                    &format!("\"default\";q={QUOTA};w={}", WINDOW.as_secs()),
                )
                .header("ratelimit", &format!("\"default\";r={left};t={secs}")),
            Announce::XEpoch => Reply::status(status)
                .header("x-ratelimit-limit", &QUOTA.to_string())
                .header("x-ratelimit-remaining", &left.to_string())
                .header(
                    "x-ratelimit-reset",
                    &(EPOCH_AT_START + end.as_secs()).to_string(),
                ),
            Announce::ModelDuration => {
                let ms = to_reset.as_nanos().div_ceil(1_000_000);
                Reply::status(status)
                    .header("x-ratelimit-limit-requests", &QUOTA.to_string())
                    .header("x-ratelimit-remaining-requests", &left.to_string())
                    .header(
                        "x-ratelimit-reset-requests",
                        &format!("{}.{:03}s", ms / 1000, ms % 1000),
                    )
            }
        };
        if status == 429 {
            reply.header("retry-after", &secs.to_string())
        } else {
            reply
        }
    }))
    .await
    .expect("start the test server")
}

/// What the callers saw: answers, and calls refused (not sent) because the
/// quota had no room before their deadline.
#[derive(Debug, Default)]
struct Seen {
    ok: usize,
    refused: usize,
    failed: usize,
}

/// `CALLERS` callers, each calling, then pausing `THINK`, for `RUN`.
async fn load<S, RB>(stack: S, uri: http::Uri) -> Seen
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = http::Response<RB>,
            Error = tower_resend::Error,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    RB: Send + 'static,
{
    let start = Instant::now();
    let mut set = JoinSet::new();
    for _ in 0..CALLERS {
        let (stack, uri) = (stack.clone(), uri.clone());
        set.spawn(async move {
            let mut seen = Seen::default();
            while start.elapsed() < RUN {
                let req = Request::get(uri.clone())
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                match stack.clone().oneshot(req).await {
                    Ok(_) => seen.ok += 1,
                    Err(e) if e.kind() == ErrorKind::QuotaSpent => {
                        assert!(e.is_not_sent(), "{e}");
                        seen.refused += 1;
                    }
                    Err(_) => seen.failed += 1,
                }
                tokio::time::sleep(THINK).await;
            }
            seen
        });
    }
    let mut all = Seen::default();
    while let Some(done) = set.join_next().await {
        let s = done.expect("a caller");
        all.ok += s.ok;
        all.refused += s.refused;
        all.failed += s.failed;
    }
    all
}

/// What the upstream saw over the run.
#[derive(Debug)]
struct Figures {
    served: usize,
    /// 200s within the run (a call that began before its end may be
    /// answered after it, in the next window).
    ok: usize,
    too_many: usize,
    /// The most 200s in the first second of a window after the first.
    at_reset: usize,
    /// The most 200s in any one second but the first (in which the
    /// callers' first calls go before any answer told the quota).
    busiest: usize,
}

fn figures(served: &Served) -> Figures {
    let seconds = RUN.as_secs() as usize + 1;
    let mut per_second = vec![0; seconds];
    for (at, status) in &served.log {
        if *status == 200 {
            if let Some(n) = per_second.get_mut(at.as_secs() as usize) {
                *n += 1;
            }
        }
    }
    let at_reset = (1..RUN.as_secs() / WINDOW.as_secs())
        .map(|k| per_second[(k * WINDOW.as_secs()) as usize])
        .max()
        .unwrap_or(0);
    Figures {
        served: served.log.len(),
        ok: served
            .log
            .iter()
            .filter(|(at, s)| *s == 200 && *at < RUN)
            .count(),
        too_many: served.log.iter().filter(|(_, s)| *s == 429).count(),
        at_reset,
        busiest: per_second.into_iter().skip(1).max().unwrap_or(0),
    }
}

/// One run: the load through the stack, paced or not.
async fn run(announce: Announce, paced: bool) -> (Figures, Seen) {
    let served = Arc::new(Mutex::new(Served::default()));
    let server = upstream(announce, Arc::clone(&served)).await;
    let uri = server.uri("/");
    let stack = common::stack();
    let seen = if paced {
        let pace = PaceLayer::new().wall_clock(UNIX_EPOCH + Duration::from_secs(EPOCH_AT_START));
        load(stack.pace(pace).service(common::transport()), uri).await
    } else {
        load(stack.service(common::transport()), uri).await
    };
    let f = figures(&served.lock().unwrap());
    eprintln!("{announce:?}, paced: {paced}: {f:?}, callers saw {seen:?}");
    (f, seen)
}

/// Paced: no 429, at least 95 % of the quota used, at most 20 % of a
/// window's quota in the first second after its reset. Beside it, the same
/// load without pacing meets 429s.
async fn paced_against_unpaced(announce: Announce) {
    let quota_in_run = (RUN.as_secs() / WINDOW.as_secs() * QUOTA) as usize;
    let (paced, seen) = run(announce, true).await;
    assert_eq!(paced.too_many, 0, "{announce:?}: {paced:?}");
    assert!(
        paced.ok * 100 >= quota_in_run * 95,
        "{announce:?}: {} of {quota_in_run}",
        paced.ok
    );
    assert!(paced.ok <= quota_in_run, "{announce:?}: {paced:?}");
    assert!(
        paced.at_reset * 100 <= QUOTA as usize * 20,
        "{announce:?}: {paced:?}"
    );
    assert!(
        paced.busiest * 100 <= QUOTA as usize * 20,
        "{announce:?}: {paced:?}"
    );
    assert_eq!(seen.failed, 0, "{announce:?}: {seen:?}");
    assert_eq!(
        seen.ok, paced.served,
        "{announce:?}: every call sent was answered 200"
    );

    let (unpaced, _) = run(announce, false).await;
    assert!(unpaced.too_many > 0, "{announce:?}: {unpaced:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn paced_by_the_ietf_fields_no_call_meets_a_429() {
    paced_against_unpaced(Announce::Ietf).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn paced_by_x_ratelimit_with_epoch_resets_no_call_meets_a_429() {
    paced_against_unpaced(Announce::XEpoch).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn paced_by_the_model_apis_duration_resets_no_call_meets_a_429() {
    paced_against_unpaced(Announce::ModelDuration).await;
}
