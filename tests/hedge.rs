//! Hedged calls: the slow tail cut by a backup copy, only where a copy is
//! safe, within the retry budget. The upstream is in process, so that
//! every latency is tokio's paused clock and nothing else.
#![allow(clippy::print_stderr)]

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::{service_fn, ServiceExt};
use tower_resend::hedge::Hedged;
use tower_resend::retry::{Attempts, RetryBudget};

const CALLS: usize = 2000;
const FAST: Duration = Duration::from_millis(2);
const STALL: Duration = Duration::from_secs(1);

/// What the upstream saw: every send, by call (its path), with its key.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<HashMap<String, Vec<Option<String>>>>>);

impl Seen {
    fn sends(&self) -> usize {
        self.0.lock().unwrap().values().map(Vec::len).sum()
    }
}

/// An upstream where one call in 20 (`/n` with n a multiple of 20) stalls
/// a second on its first send and answers any later send at once; every
/// other send answers in 2 ms.
#[allow(clippy::type_complexity)]
fn upstream(
    seen: Seen,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl std::future::Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send,
> + Clone
       + Send
       + 'static {
    service_fn(move |req: Request<Full<Bytes>>| {
        let path = req.uri().path().to_owned();
        let key = req
            .headers()
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let first = {
            let mut seen = seen.0.lock().unwrap();
            let sends = seen.entry(path.clone()).or_default();
            sends.push(key);
            sends.len() == 1
        };
        let n: usize = path.trim_start_matches('/').parse().unwrap_or(1);
        let wait = if first && n.is_multiple_of(20) {
            STALL
        } else {
            FAST
        };
        async move {
            tokio::time::sleep(wait).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }
    })
}

fn request(method: Method, n: usize) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(format!("http://upstream/{n}"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// Latencies of `calls` calls of `method`, 20 at a time, through `stack`,
/// sorted; and how many were answered by a backup copy.
async fn run<S, RB>(stack: S, method: Method, calls: usize) -> (Vec<Duration>, usize)
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Error: std::fmt::Debug + Send,
    S::Future: Send,
    RB: Send + 'static,
{
    let by_backup = |n: usize, resp: &Response<RB>| {
        let hedged = resp.extensions().get::<Hedged>().copied();
        // The call's history says the same.
        let last = resp.extensions().get::<Attempts>().and_then(Attempts::last);
        assert_eq!(
            last.map(|a| (a.copies(), a.winning_copy())),
            Some(hedged.map_or((1, 1), |h| (h.sent, h.won))),
            "call {n}"
        );
        hedged.is_some_and(|h| h.won > 1)
    };
    let calls =
        common::in_parallel(stack, calls, move |n| request(method.clone(), n), by_backup).await;
    let backups = calls.iter().filter(|(_, backup)| *backup).count();
    (calls.into_iter().map(|(took, _)| took).collect(), backups)
}

fn p(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// 2 000 GETs, one in 20 stalling a second: with a backup after 10 ms the
/// p99 is under 50 ms (without, a second), and the backups are at most 8 %
/// more sends; every stalled call was answered by its backup. The same
/// with `maybe_hedge`.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_backup_cuts_the_slow_tail_for_a_few_percent_more_sends() {
    let seen = Seen::default();
    let stack = tower_resend::stack()
        .hedge(Duration::from_millis(10))
        .service(upstream(seen.clone()));
    let (hedged, backups) = run(stack, Method::GET, CALLS).await;
    let extra = seen.sends() - CALLS;

    let plain_seen = Seen::default();
    let plain = tower_resend::stack().service(upstream(plain_seen.clone()));
    let (unhedged, _) = run(plain, Method::GET, CALLS).await;

    let summary = format!(
        "hedged: p50 {:?}, p99 {:?}, p99.9 {:?}, {extra} extra sends, {backups} won by a backup; \
         not hedged: p50 {:?}, p99 {:?}",
        p(&hedged, 0.5),
        p(&hedged, 0.99),
        p(&hedged, 0.999),
        p(&unhedged, 0.5),
        p(&unhedged, 0.99),
    );
    eprintln!("{summary}");
    assert!(p(&hedged, 0.99) < Duration::from_millis(50), "{summary}");
    assert!(p(&unhedged, 0.99) >= STALL, "{summary}");
    assert!(extra <= CALLS * 8 / 100, "{summary}");
    assert_eq!(backups, CALLS / 20, "{summary}");
    assert_eq!(plain_seen.sends(), CALLS);

    // A setting read at run time: `maybe_hedge` hedges with `Some`, and
    // with `None` sends one copy, as a stack without hedging does (the
    // copies it would send if on, set after it, change nothing).
    for (after, extra_sends) in [(Some(Duration::from_millis(10)), CALLS / 20), (None, 0)] {
        let seen = Seen::default();
        let stack = tower_resend::stack()
            .maybe_hedge(after)
            .hedge_copies(3)
            .service(upstream(seen.clone()));
        let (latencies, backups) = run(stack, Method::GET, CALLS).await;
        assert_eq!(backups, extra_sends, "{after:?}");
        assert_eq!(seen.sends(), CALLS + extra_sends, "{after:?}");
        assert_eq!(p(&latencies, 0.99) >= STALL, after.is_none(), "{after:?}");
    }
}

/// A POST without a key is never hedged: no copy is sent, the stalled
/// calls wait their second. A POST under a key the stack chose is, and
/// every copy carries the same key.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn only_a_replay_safe_post_is_hedged_and_its_copies_share_a_key() {
    let seen = Seen::default();
    let stack = tower_resend::stack()
        .hedge(Duration::from_millis(10))
        .service(upstream(seen.clone()));
    let (latencies, backups) = run(stack, Method::POST, 200).await;
    assert_eq!(seen.sends(), 200, "no copy of a POST without a key");
    assert_eq!(backups, 0);
    assert!(p(&latencies, 0.99) >= STALL);

    let seen = Seen::default();
    let stack = tower_resend::stack()
        .idempotency_keys()
        .hedge(Duration::from_millis(10))
        .service(upstream(seen.clone()));
    let (latencies, backups) = run(stack, Method::POST, 200).await;
    assert_eq!(backups, 10);
    assert!(p(&latencies, 0.99) < Duration::from_millis(50));
    let sends = seen.0.lock().unwrap();
    for (path, keys) in sends.iter() {
        let distinct: HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), 1, "{path}: {keys:?}");
        assert!(keys[0].is_some(), "{path}: sent with a key");
        let n: usize = path.trim_start_matches('/').parse().unwrap();
        assert_eq!(
            keys.len(),
            if n.is_multiple_of(20) { 2 } else { 1 },
            "{path}"
        );
    }
}

/// With the retry budget dry, no backup goes out.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_the_budget_dry_no_backup_is_sent() {
    let seen = Seen::default();
    let dry = RetryBudget::new(0.0, 0.0, Duration::from_secs(10)).unwrap();
    let stack = tower_resend::stack()
        .budget(dry)
        .hedge(Duration::from_millis(10))
        .service(upstream(seen.clone()));
    let (latencies, backups) = run(stack, Method::GET, 200).await;
    assert_eq!(seen.sends(), 200);
    assert_eq!(backups, 0);
    assert!(p(&latencies, 0.99) >= STALL);
}

/// No copy goes out after the call's deadline: the first copy of `/20`
/// stalls, the deadline ends it at 50 ms, and the backup that would
/// follow is not sent.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn no_backup_is_sent_after_the_deadline() {
    let seen = Seen::default();
    let stack = tower_resend::stack()
        .total(Duration::from_millis(50))
        .hedge(Duration::from_millis(100))
        .service(upstream(seen.clone()));
    let start = Instant::now();
    let err = stack.oneshot(request(Method::GET, 20)).await.unwrap_err();
    assert!(err.is_deadline_exceeded(), "{err}");
    assert_eq!(start.elapsed(), Duration::from_millis(50));
    assert_eq!(seen.sends(), 1);
}

/// Every copy after the first says how many came before it, as a retry
/// does, so that a server shedding load sheds it first.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn backups_say_how_many_came_before() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    // The first send is answered 503, the retry stalls, its backup answers.
    let upstream = service_fn(move |req: Request<Full<Bytes>>| {
        let header = req
            .headers()
            .get("resend-previous-attempts")
            .map(|v| v.to_str().unwrap().to_owned());
        let n = {
            let mut log = log.lock().unwrap();
            log.push(header);
            log.len()
        };
        async move {
            let resp = match n {
                // A wait the server asked for goes up to the retry layer.
                1 => Response::builder().status(503).header("retry-after", "1"),
                2 => {
                    tokio::time::sleep(STALL).await;
                    Response::builder()
                }
                _ => Response::builder(),
            };
            Ok::<_, Infallible>(resp.body(Full::new(Bytes::new())).unwrap())
        }
    });
    let stack = tower_resend::stack()
        .hedge(Duration::from_millis(10))
        .service(upstream);
    let resp = stack.oneshot(request(Method::GET, 1)).await.unwrap();
    assert_eq!(resp.status(), 200);
    // The retry after the 503 stalled, and its backup answered.
    let attempts = resp.extensions().get::<Attempts>().unwrap();
    let last = attempts.last().unwrap();
    assert_eq!(
        (attempts.len(), last.copies(), last.winning_copy()),
        (2, 2, 2)
    );
    // Counted apart: one retry, one hedge.
    assert_eq!((attempts.retries(), attempts.hedges()), (1, 1));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, [None, Some("1".to_owned()), Some("2".to_owned())]);
}

/// When every call is slow, a tenth of them send a backup (plus the
/// budget's floor of about one a second), not all of them: hedges have a
/// budget of their own, apart from the retry budget (here too large to
/// matter). With a share of 1, nearly every call is hedged.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn when_every_call_is_slow_a_tenth_are_hedged() {
    const CALLS: usize = 1000;
    const TASKS: usize = 100;
    async fn hedged_share(share: f64) -> (usize, Duration) {
        let seen = Seen::default();
        let ample = RetryBudget::new(1.0, 0.0, Duration::from_secs(10)).unwrap();
        let stack = tower_resend::stack()
            .budget(ample)
            .hedge(Duration::from_millis(10))
            .hedge_share(share)
            .service(upstream(seen.clone()));
        let start = Instant::now();
        let mut set = JoinSet::new();
        for t in 0..TASKS {
            let stack = stack.clone();
            set.spawn(async move {
                // Every path a multiple of 20: every first send stalls.
                for n in (t..CALLS).step_by(TASKS) {
                    let req = request(Method::GET, n * 20);
                    stack.clone().oneshot(req).await.unwrap();
                }
            });
        }
        while set.join_next().await.is_some() {}
        (seen.sends() - CALLS, start.elapsed())
    }

    let (backups, took) = hedged_share(0.1).await;
    // The floor: five tokens at the start, one a second after.
    let bound = CALLS / 10 + 5 + took.as_secs() as usize + 1;
    assert!(
        backups <= bound,
        "{backups} backups in {took:?}, bound {bound}"
    );
    assert!(backups >= CALLS / 20, "{backups} backups: still hedging");

    let (backups, _) = hedged_share(1.0).await;
    assert!(
        backups >= CALLS * 9 / 10,
        "{backups} backups with a share of 1"
    );
}
