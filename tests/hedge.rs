//! Hedged calls: the slow tail cut by a backup copy, only where a copy is
//! safe, within the retry budget. The upstream is in process, so that
//! every latency is tokio's paused clock and nothing else.
#![allow(clippy::print_stderr)]

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
    const TASKS: usize = 20;
    let mut set = JoinSet::new();
    for t in 0..TASKS {
        let (stack, method) = (stack.clone(), method.clone());
        set.spawn(async move {
            let mut out = Vec::new();
            for n in (t..calls).step_by(TASKS) {
                let started = Instant::now();
                let resp = stack
                    .clone()
                    .oneshot(request(method.clone(), n))
                    .await
                    .unwrap_or_else(|e| panic!("call {n}: {e:?}"));
                let hedged = resp.extensions().get::<Hedged>().copied();
                let by_backup = hedged.is_some_and(|h| h.won > 1);
                // The call's history says the same.
                let last = resp.extensions().get::<Attempts>().and_then(Attempts::last);
                assert_eq!(
                    last.map(|a| (a.copies(), a.winning_copy())),
                    Some(hedged.map_or((1, 1), |h| (h.sent, h.won))),
                    "call {n}"
                );
                out.push((started.elapsed(), by_backup));
            }
            out
        });
    }
    let mut latencies = Vec::with_capacity(calls);
    let mut backups = 0;
    while let Some(done) = set.join_next().await {
        for (took, by_backup) in done.expect("the task") {
            latencies.push(took);
            backups += usize::from(by_backup);
        }
    }
    latencies.sort();
    (latencies, backups)
}

fn p(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// 2 000 GETs, one in 20 stalling a second: with a backup after 10 ms the
/// p99 is under 50 ms (without, a second), and the backups are at most 8 %
/// more sends; every stalled call was answered by its backup.
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
