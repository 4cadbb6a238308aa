//! The upstream of the pacing tests: a fixed-window quota on tokio's
//! clock, stated on every answer, 429 beyond it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::ErrorKind;
use tower_resend_testkit::{Reply, Script, TestServer};

/// The wall-clock time at the test's start, as the upstream and the layer
/// both take it: epoch resets are read against it, not the machine's.
pub(crate) const EPOCH_AT_START: u64 = 1_800_000_000;

/// Each caller's pause between its calls.
pub(crate) const THINK: Duration = Duration::from_millis(50);

/// How the upstream states its quota.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Announce {
    /// `RateLimit-Policy: "default";q=Q;w=W`, `RateLimit: "default";r=N;t=T`.
    Ietf,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset` as an epoch time.
    XEpoch,
    /// `x-ratelimit-{limit,remaining,reset}-requests`, the reset a duration.
    ModelDuration,
}

/// What the upstream served: when (from the start) and with what status.
#[derive(Default)]
pub(crate) struct Served {
    window: u64,
    used: u64,
    pub(crate) log: Vec<(Duration, u16)>,
}

/// A fixed-window quota on tokio's clock: `quota` calls in each `window`
/// from the start, stated on every answer; 429 beyond it, with a
/// Retry-After to the reset.
pub(crate) async fn upstream(
    announce: Announce,
    quota: u64,
    window: Duration,
    served: Arc<Mutex<Served>>,
) -> TestServer {
    let origin = Instant::now();
    TestServer::start(Script::from_fn(move |_| {
        let at = origin.elapsed();
        let k = (at.as_nanos() / window.as_nanos()) as u64;
        let end = window * (k as u32 + 1);
        let mut s = served.lock().unwrap();
        if s.window != k {
            (s.window, s.used) = (k, 0);
        }
        s.used += 1;
        let status = if s.used > quota { 429 } else { 200 };
        s.log.push((at, status));
        let left = quota.saturating_sub(s.used);
        let to_reset = end - at;
        // Whole seconds, rounded up: never earlier than the reset.
        let secs = to_reset.as_nanos().div_ceil(1_000_000_000);
        let reply = match announce {
            Announce::Ietf => Reply::status(status)
                .header(
                    "ratelimit-policy",
                    &format!("\"default\";q={quota};w={}", window.as_secs()),
                )
                .header("ratelimit", &format!("\"default\";r={left};t={secs}")),
            Announce::XEpoch => Reply::status(status)
                .header("x-ratelimit-limit", &quota.to_string())
                .header("x-ratelimit-remaining", &left.to_string())
                .header(
                    "x-ratelimit-reset",
                    &(EPOCH_AT_START + end.as_secs()).to_string(),
                ),
            Announce::ModelDuration => {
                let ms = to_reset.as_nanos().div_ceil(1_000_000);
                Reply::status(status)
                    .header("x-ratelimit-limit-requests", &quota.to_string())
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
pub(crate) struct Seen {
    pub(crate) ok: usize,
    pub(crate) refused: usize,
    pub(crate) failed: usize,
}

/// `callers` callers, each calling, then pausing [`THINK`], for `run`.
pub(crate) async fn load<S, RB>(stack: S, uri: http::Uri, callers: usize, run: Duration) -> Seen
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
    for _ in 0..callers {
        let (stack, uri) = (stack.clone(), uri.clone());
        set.spawn(async move {
            let mut seen = Seen::default();
            while start.elapsed() < run {
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
