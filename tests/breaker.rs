//! The circuit breaker against a dead upstream, on tokio's paused clock:
//! every attempt times out, 100 calls a second for 10 s, then the upstream
//! recovers.
//!
//! What must hold (the words): once open, calls fail in under 1 ms
//! and the upstream sees only the probes; after the upstream recovers, the
//! breaker closes within one break duration (plus the probes' own time).
//! Calls that reach the upstream are counted exactly.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_resend::breaker::{CircuitBreaker, CircuitState};
use tower_resend::classify::Class;
use tower_resend::{
    breaker::CircuitBreakerLayer, timeout::AttemptTimeoutLayer, Error, ErrorKind, RetryAdvice,
};

const MS: Duration = Duration::from_millis(1);

/// One call every 10 ms: 100 calls a second.
const TICK: Duration = Duration::from_millis(10);
/// The attempt timeout: short, and off the 10 ms grid so that no timeout
/// fires at the instant a call is sent.
const ATTEMPT: Duration = Duration::from_millis(505);
/// Dead for the first 10 s (calls 0..1000), then answering 200 at once.
const DEAD_CALLS: u32 = 1000;
/// Then 5 s more (calls 1000..1500).
const ALL_CALLS: u32 = 1500;
/// The breaker's defaults.
const BREAK: Duration = tower_resend::breaker::DEFAULT_BREAK_DURATION;

/// An upstream that never answers until it is told it has recovered, and
/// logs when each call reached it (from the test's start).
#[derive(Clone)]
struct Upstream {
    start: Instant,
    recovered: Arc<AtomicBool>,
    arrivals: Arc<Mutex<Vec<Duration>>>,
}

impl Upstream {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            recovered: Arc::new(AtomicBool::new(false)),
            arrivals: Arc::default(),
        }
    }

    fn arrivals(&self) -> Vec<Duration> {
        self.arrivals.lock().unwrap().clone()
    }

    fn service<B>(
        &self,
    ) -> impl Service<
        Request<B>,
        Response = Response<Empty<Bytes>>,
        Error = std::convert::Infallible,
        Future = impl Future<Output = Result<Response<Empty<Bytes>>, std::convert::Infallible>> + Send,
    > + Clone
           + Send
           + 'static {
        let up = self.clone();
        service_fn(move |_req: Request<B>| {
            up.arrivals.lock().unwrap().push(up.start.elapsed());
            let alive = up.recovered.load(Ordering::SeqCst);
            async move {
                if !alive {
                    std::future::pending::<()>().await;
                }
                Ok(Response::new(Empty::new()))
            }
        })
    }
}

/// One call's fate: when it was sent (from the start), how long it took,
/// and how it ended.
#[derive(Debug)]
struct Call {
    k: u32,
    took: Duration,
    result: Result<StatusCode, Error>,
}

/// Sends call `k` at `k * TICK`, for `k` in `0..ALL_CALLS`, each through a
/// clone of `client` in a task of its own; the upstream recovers at call
/// `DEAD_CALLS`. `probe(k)` runs just before call `k` is sent.
async fn drive<S, B, R>(
    client: S,
    up: &Upstream,
    mut probe: impl FnMut(u32),
    request: impl Fn() -> Request<B>,
) -> Vec<Call>
where
    S: Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<tower_resend::BoxError>,
    B: Send + 'static,
{
    let start = up.start;
    let mut tasks = JoinSet::new();
    for k in 0..ALL_CALLS {
        tokio::time::sleep_until(start + TICK * k).await;
        if k == DEAD_CALLS {
            up.recovered.store(true, Ordering::SeqCst);
        }
        probe(k);
        let svc = client.clone();
        let req = request();
        tasks.spawn(async move {
            let sent = Instant::now();
            let result = svc.oneshot(req).await;
            Call {
                k,
                took: sent.elapsed(),
                result: result
                    .map(|r| r.status())
                    .map_err(|e| Error::from_box(e.into())),
            }
        });
    }
    let mut calls: Vec<Call> = tasks.join_all().await;
    calls.sort_by_key(|c| c.k);
    calls
}

fn kind(c: &Call) -> Option<ErrorKind> {
    c.result.as_ref().err().map(Error::kind)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_dead_upstream_at_100_calls_a_second_sees_only_the_probes() {
    let up = Upstream::new();
    let client: CircuitBreaker<_> = CircuitBreakerLayer::new()
        .upstream("shipping")
        .layer(AttemptTimeoutLayer::new(ATTEMPT).layer(up.service::<()>()));

    // The calls 0..150 go out while the breaker is closed. Their timeouts
    // come back from 505 ms on, one every 10 ms; the 100th (call 99's, at
    // 1 495 ms) meets the minimum throughput at a 100 % failure ratio and
    // opens it. Calls 100..150 were sent before that.
    let seen = client.clone();
    let mut states = Vec::new();
    let calls = drive(
        client.clone(),
        &up,
        |k| {
            if [99, 149, 150, 649, 650, 653, 1200, 1201, 1203, 1204].contains(&k) {
                states.push((k, seen.state()));
            }
        },
        || Request::new(()),
    )
    .await;
    let opened_at = 1495 * MS;
    let first_refused = 150;

    // The breaker opened once the 100th failure came back, not before.
    assert_eq!(
        states,
        [
            (99, CircuitState::Closed),
            (149, CircuitState::Closed),
            (150, CircuitState::Open),
            (649, CircuitState::Open),
            // The break ended at 6 495 ms: call 650 (6 500 ms) is the first
            // probe, and 651 and 652 the other two. Call 650's timeout
            // (7 005 ms) opens it again until 12 005 ms.
            (650, CircuitState::Open),
            (653, CircuitState::HalfOpen),
            (1200, CircuitState::Open),
            // Calls 1201..1204 (12 010 ms on) are the probes of the
            // recovered upstream; the third success closes it.
            (1201, CircuitState::Open),
            (1203, CircuitState::HalfOpen),
            (1204, CircuitState::Closed),
        ]
    );

    // What reached the upstream, exactly: the calls made while closed, the
    // three probes of each half-open spell, and everything once it closed.
    let sent: Vec<u32> = (0..first_refused)
        .chain(650..653)
        .chain(1201..ALL_CALLS)
        .collect();
    let expected: Vec<Duration> = sent.iter().map(|&k| TICK * k).collect();
    assert_eq!(up.arrivals(), expected);
    // During each break, nothing but the probes.
    let during_breaks = up
        .arrivals()
        .into_iter()
        .filter(|&t| t >= opened_at && t < TICK * 1204)
        .count();
    assert_eq!(during_breaks, 6);

    for c in &calls {
        let k = c.k;
        if sent.contains(&k) {
            // Let through: timed out while the upstream was dead, answered
            // once it had recovered.
            if k < DEAD_CALLS {
                assert_eq!(kind(c), Some(ErrorKind::AttemptTimeout), "call {k}");
                assert_eq!(c.took, ATTEMPT, "call {k}");
            } else {
                assert_eq!(c.result.as_ref().ok(), Some(&StatusCode::OK), "call {k}");
            }
            continue;
        }
        // Refused: at once, not sent, with the time left as advice.
        let e = c.result.as_ref().expect_err("refused");
        assert_eq!(e.kind(), ErrorKind::CircuitOpen, "call {k}: {e}");
        assert!(c.took < MS, "call {k} took {:?}", c.took);
        assert!(e.is_not_sent(), "call {k}");
        assert_eq!(e.upstream(), Some("shipping"));
        match e.retry_advice() {
            RetryAdvice::After(wait) => assert!(wait > Duration::ZERO && wait <= BREAK),
            other => panic!("call {k}: {other:?}"),
        }
    }
    let refused = calls
        .iter()
        .filter(|c| kind(c) == Some(ErrorKind::CircuitOpen))
        .count();
    // 1 500 calls: 150 + 3 + 3 + 296 sent, the other 1 048 refused.
    assert_eq!(sent.len(), 452);
    assert_eq!(refused, 1048);

    // The upstream recovered at 10 s; the breaker closed at 12 030 ms, when
    // the third probe answered: within one break (and the probes' time).
    let recovered_at = TICK * DEAD_CALLS;
    let closed_at = TICK * 1203;
    assert!(closed_at - recovered_at <= BREAK + 3 * TICK);
    assert_eq!(client.state(), CircuitState::Closed);
}

/// The composed stack: the breaker sits inside the retry layer, so it sees
/// every attempt. Only what holds whatever the retry layer does with a
/// circuit-open attempt is asserted: once the breaker has opened, the
/// upstream sees nothing but probes, and calls fail without reaching it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_stack_with_a_breaker_stops_calling_a_dead_upstream() {
    let up = Upstream::new();
    let client = tower_resend::stack()
        .name("shipping")
        .total(Duration::from_secs(2))
        .attempt_timeout(ATTEMPT)
        .seed(7)
        .circuit_breaker()
        .service(up.service());
    let calls = drive(
        client,
        &up,
        |_| {},
        || {
            Request::get("http://shipping/quote")
                .body(Empty::<Bytes>::new())
                .unwrap()
        },
    )
    .await;

    // A call that failed without reaching the upstream on its last attempt.
    let refused = |c: &Call| match &c.result {
        Err(e) if e.kind() == ErrorKind::CircuitOpen => true,
        Err(e) => e
            .history()
            .and_then(|h| h.last())
            .is_some_and(|a| a.class() == Class::NotSent && e.is_not_sent()),
        Ok(_) => false,
    };
    let first = calls
        .iter()
        .find(|c| refused(c))
        .expect("the breaker opened");
    // A call that lasted (its retries waited for budget tokens) may be
    // refused on a later attempt: the opening is when its refusal came, at
    // the latest.
    let opened_by = calls
        .iter()
        .filter(|c| refused(c))
        .map(|c| TICK * c.k + c.took)
        .min()
        .expect("the breaker opened");
    let _ = first;
    assert!(opened_by < Duration::from_secs(3), "{opened_by:?}");
    // After that, the upstream sees only probes: three per break at most.
    let later = up
        .arrivals()
        .into_iter()
        .filter(|&t| t > opened_by && t < TICK * DEAD_CALLS)
        .count();
    let breaks = (TICK * DEAD_CALLS - opened_by).as_secs_f64() / BREAK.as_secs_f64();
    assert!(
        later <= 3 * (breaks.ceil() as usize),
        "{later} attempts reached the upstream after {opened_by:?}"
    );
    // Nearly every call of the dead spell after the opening was refused.
    let refused_dead = calls
        .iter()
        .filter(|c| c.k < DEAD_CALLS && TICK * c.k > opened_by && refused(c))
        .count();
    let after = calls
        .iter()
        .filter(|c| c.k < DEAD_CALLS && TICK * c.k > opened_by)
        .count();
    assert!(
        refused_dead + 3 * (breaks.ceil() as usize) >= after,
        "{refused_dead} of {after}"
    );
    // And the recovered upstream answers again before the end.
    assert!(calls.last().is_some_and(|c| c.result.is_ok()));
}

/// With retries off, the stack's error is the breaker's own: one concrete
/// `tower_resend::Error` of kind `CircuitOpen`, named after the stack.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_stacks_error_is_circuit_open_when_it_does_not_retry() {
    let up = Upstream::new();
    let client = tower_resend::stack()
        .name("shipping")
        .attempt_timeout(ATTEMPT)
        .max_attempts(1)
        .circuit_breaker_with(CircuitBreakerLayer::new().min_throughput(5))
        .service(up.service());
    let get = || {
        Request::get("http://shipping/quote")
            .body(Empty::<Bytes>::new())
            .unwrap()
    };
    for _ in 0..5 {
        let e = client.clone().oneshot(get()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AttemptTimeout);
    }
    let start = Instant::now();
    let e = client.clone().oneshot(get()).await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(e.kind(), ErrorKind::CircuitOpen, "{e}");
    assert!(e.is_not_sent());
    assert_eq!(e.upstream(), Some("shipping"));
    assert!(
        e.to_string()
            .starts_with("shipping: circuit open for another 5 s after 100% of 5 calls failed"),
        "{e}"
    );
    assert_eq!(up.arrivals().len(), 5);
}
