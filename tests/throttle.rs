//! Adaptive client-side throttling on loopback: an upstream with room for a
//! tenth of what its callers offer for 10 s, then for all of it.
#![allow(clippy::print_stderr)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::retry::AdaptiveThrottle;
use tower_resend::ErrorKind;
use tower_resend_testkit::{Reply, Script, TestServer};

const CALLERS: usize = 20;
const EVERY: Duration = Duration::from_millis(50);
/// Room, while short of capacity: 4 accepted per 100 ms (40 a second,
/// a tenth of the 400 a second offered).
const ROOM: usize = 4;

/// The upstream's counts while it is short of capacity: arrivals, accepts.
#[derive(Default)]
struct Upstream {
    short: AtomicBool,
    arrived_short: AtomicUsize,
    accepted_short: AtomicUsize,
    slot: Mutex<(u128, usize)>,
}

async fn upstream(counts: Arc<Upstream>) -> TestServer {
    let origin = Instant::now();
    TestServer::start(Script::from_fn(move |_| {
        if !counts.short.load(Ordering::SeqCst) {
            return Reply::ok();
        }
        counts.arrived_short.fetch_add(1, Ordering::SeqCst);
        let tick = origin.elapsed().as_millis() / 100;
        let mut slot = counts.slot.lock().unwrap();
        if slot.0 != tick {
            *slot = (tick, 0);
        }
        if slot.1 < ROOM {
            slot.1 += 1;
            counts.accepted_short.fetch_add(1, Ordering::SeqCst);
            Reply::ok()
        } else {
            Reply::status(503)
        }
    }))
    .await
    .expect("start the test server")
}

/// What the callers saw in a stretch of time: calls, sent (not turned
/// away), throttled.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    calls: usize,
    throttled: usize,
}

/// `CALLERS` callers, each calling every `EVERY` for `run`; the calls made
/// between `from` and `to` (from the start).
async fn callers<S, RB>(
    stack: S,
    uri: http::Uri,
    run: Duration,
    from: Duration,
    to: Duration,
) -> Seen
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
            while start.elapsed() < run {
                let at = start.elapsed();
                let req = Request::get(uri.clone())
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                let throttled = match stack.clone().oneshot(req).await {
                    Ok(_) => false,
                    Err(e) if e.kind() == ErrorKind::Throttled => {
                        assert!(e.is_not_sent(), "{e}");
                        true
                    }
                    // A 503 the retry layer gave up on: sent.
                    Err(_) => false,
                };
                if at >= from && at < to {
                    seen.calls += 1;
                    seen.throttled += usize::from(throttled);
                }
                tokio::time::sleep(EVERY).await;
            }
            seen
        });
    }
    let mut all = Seen::default();
    while let Some(done) = set.join_next().await {
        let s = done.expect("a caller");
        all.calls += s.calls;
        all.throttled += s.throttled;
    }
    all
}

/// Short of capacity for 10 s, the upstream receives about twice what it
/// accepts (K = 2, plus the padding) where without throttling it receives
/// about ten times; the calls turned away are "not sent" errors of their
/// own kind; once it has room again, nearly every call is sent again
/// within the window (the SRE rule forgets the rejections as they leave
/// it).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_throttled_client_sends_about_twice_what_the_upstream_accepts() {
    // Without throttling (3 s of it is enough to see the ratio).
    let counts = Arc::new(Upstream::default());
    counts.short.store(true, Ordering::SeqCst);
    let server = upstream(Arc::clone(&counts)).await;
    // (One attempt a call: the callers offer their load as first attempts,
    // which the retry budget does not bound.)
    let plain = tower_resend::stack()
        .max_attempts(1)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let s = Duration::from_secs(3);
    callers(plain, server.uri("/"), s, Duration::ZERO, s).await;
    let (arrived, accepted) = (
        counts.arrived_short.load(Ordering::SeqCst),
        counts.accepted_short.load(Ordering::SeqCst),
    );
    let unthrottled = arrived as f64 / accepted as f64;
    assert!(
        unthrottled >= 8.0,
        "without: {arrived} arrived, {accepted} accepted"
    );

    // Throttled.
    let counts = Arc::new(Upstream::default());
    counts.short.store(true, Ordering::SeqCst);
    let server = upstream(Arc::clone(&counts)).await;
    let throttle = AdaptiveThrottle::new();
    let stack = tower_resend::stack()
        .max_attempts(1)
        .adaptive_throttle(throttle.clone())
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let short = Duration::from_secs(10);
    let recover = {
        let counts = Arc::clone(&counts);
        tokio::spawn(async move {
            tokio::time::sleep(short).await;
            counts.short.store(false, Ordering::SeqCst);
        })
    };
    // 10 s short, then 35 s with room; the calls once a window (30 s)
    // has passed since.
    let run = short + Duration::from_secs(35);
    let late = callers(
        stack,
        server.uri("/"),
        run,
        short + Duration::from_secs(30),
        run,
    )
    .await;
    recover.await.unwrap();
    let (arrived, accepted) = (
        counts.arrived_short.load(Ordering::SeqCst),
        counts.accepted_short.load(Ordering::SeqCst),
    );
    let throttled = arrived as f64 / accepted as f64;
    eprintln!(
        "short of capacity: without throttling {unthrottled:.1}x, with {throttled:.2}x \
         ({arrived} arrived, {accepted} accepted, {} turned away); \
         30-35 s after: {} of {} calls turned away",
        throttle.turned_away(),
        late.throttled,
        late.calls
    );
    assert!(throttled <= 2.3, "{arrived} arrived, {accepted} accepted");
    assert!(throttle.turned_away() > 0);
    assert!(
        late.calls > 0 && late.throttled * 100 <= late.calls * 5,
        "{late:?}"
    );
    assert_eq!(throttle.probability(), 0.0);
}

/// A sanity check on the stack's status codes: a throttled stack over an
/// upstream that accepts everything sends every call.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_healthy_upstream_is_never_throttled() {
    let server = TestServer::start(Script::new()).await.unwrap();
    let throttle = AdaptiveThrottle::new();
    let stack = tower_resend::stack()
        .adaptive_throttle(throttle.clone())
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    for _ in 0..200 {
        let req = Request::get(server.uri("/"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = stack.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
    }
    assert_eq!(throttle.turned_away(), 0);
    assert_eq!(server.arrival_count(), 200);
}
