//! The breaker alone, over scripted upstreams, on the paused clock.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};

use super::{CircuitBreakerLayer, CircuitState};
use crate::classify::Class;
use crate::error::BoxError;
use crate::error::Error;
use crate::error::ErrorKind;
use crate::error::Phase;
use crate::error::RetryAdvice;
use crate::test_events::{field, Events};
use crate::timeout::AttemptTimeoutLayer;

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

/// Status 0: never answers.
const HANG: u16 = 0;

/// An upstream that answers with the status it is set to, and counts calls.
#[derive(Clone, Default)]
struct Upstream {
    status: Arc<AtomicU16>,
    calls: Arc<AtomicU32>,
}

impl Upstream {
    fn answering(status: u16) -> Self {
        let u = Self::default();
        u.set(status);
        u
    }

    fn set(&self, status: u16) {
        self.status.store(status, Ordering::SeqCst);
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    fn service(
        &self,
    ) -> impl Service<
        Request<()>,
        Response = Response<()>,
        Error = Infallible,
        Future = impl std::future::Future<Output = Result<Response<()>, Infallible>>,
    > + Clone {
        let u = self.clone();
        service_fn(move |_req: Request<()>| {
            u.calls.fetch_add(1, Ordering::SeqCst);
            let status = u.status.load(Ordering::SeqCst);
            async move {
                if status == HANG {
                    std::future::pending::<()>().await;
                }
                let status = StatusCode::from_u16(status).unwrap();
                Ok(Response::builder().status(status).body(()).unwrap())
            }
        })
    }
}

/// Sends one GET and waits for it.
async fn call<S>(svc: &mut S) -> Result<Response<()>, BoxError>
where
    S: Service<Request<()>, Response = Response<()>, Error = BoxError>,
{
    svc.ready().await?.call(Request::new(())).await
}

/// `n` calls in turn; how many failed with a circuit-open error.
async fn calls<S>(svc: &mut S, n: u32) -> u32
where
    S: Service<Request<()>, Response = Response<()>, Error = BoxError>,
{
    let mut refused = 0;
    for _ in 0..n {
        if let Err(e) = call(svc).await {
            if Error::from_box(e).kind() == ErrorKind::CircuitOpen {
                refused += 1;
            }
        }
    }
    refused
}

fn small() -> CircuitBreakerLayer {
    CircuitBreakerLayer::new()
        .min_throughput(10)
        .upstream("shipping")
}

fn open_error(e: BoxError) -> Error {
    let e = Error::from_box(e);
    assert_eq!(e.kind(), ErrorKind::CircuitOpen, "{e}");
    e
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn rejected_answers_never_open_it() {
    let up = Upstream::answering(404);
    let mut svc = small().layer(up.service());
    assert_eq!(calls(&mut svc, 200).await, 0);
    assert_eq!(up.calls(), 200);
    assert_eq!(svc.state(), CircuitState::Closed);
    // Nor do the other answers about the request: 408, 425, 409, 400, 501.
    for status in [408, 425, 409, 400, 501, 200] {
        up.set(status);
        assert_eq!(calls(&mut svc, 50).await, 0, "{status}");
    }
    assert_eq!(svc.state(), CircuitState::Closed);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn below_the_minimum_throughput_it_never_opens() {
    let up = Upstream::answering(500);
    let mut svc = CircuitBreakerLayer::new().layer(up.service());
    // 99 failures in 30 s: all through.
    for _ in 0..99 {
        call(&mut svc).await.unwrap();
        tokio::time::advance(300 * MS).await;
    }
    assert_eq!(svc.state(), CircuitState::Closed);
    // The first calls have slid out of the window: still under 100.
    tokio::time::advance(3 * S).await;
    call(&mut svc).await.unwrap();
    assert_eq!(svc.state(), CircuitState::Closed);
    assert_eq!(up.calls(), 100);
    // The 100th call in the window opens it.
    let up = Upstream::answering(500);
    let mut svc = CircuitBreakerLayer::new().layer(up.service());
    assert_eq!(calls(&mut svc, 100).await, 0);
    assert_eq!(svc.state(), CircuitState::Open);
    assert_eq!(calls(&mut svc, 10).await, 10);
    assert_eq!(up.calls(), 100);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_ratio_opens_it_at_the_threshold_not_below() {
    // 91 successes, 9 failures: 9 % of 100.
    let up = Upstream::answering(200);
    let mut svc = CircuitBreakerLayer::new().layer(up.service());
    calls(&mut svc, 91).await;
    up.set(503);
    calls(&mut svc, 9).await;
    assert_eq!(svc.state(), CircuitState::Closed);
    // One more: 10 of 101, still under 10 %.
    calls(&mut svc, 1).await;
    assert_eq!(svc.state(), CircuitState::Closed);
    // One more: 11 of 102: over.
    calls(&mut svc, 1).await;
    assert_eq!(svc.state(), CircuitState::Open);

    // 90 successes, 10 failures: exactly 10 % opens it.
    let up = Upstream::answering(200);
    let mut svc = CircuitBreakerLayer::new().layer(up.service());
    calls(&mut svc, 90).await;
    up.set(502);
    calls(&mut svc, 9).await;
    assert_eq!(svc.state(), CircuitState::Closed);
    calls(&mut svc, 1).await;
    assert_eq!(svc.state(), CircuitState::Open);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_error_says_what_happened_and_when_to_come_back() {
    // 60 successes, then 80 failures: 57 % of 140 calls.
    let up = Upstream::answering(200);
    let mut svc = CircuitBreakerLayer::new()
        .failure_ratio(0.5)
        .unwrap()
        .min_throughput(140)
        .upstream("shipping")
        .layer(up.service());
    calls(&mut svc, 60).await;
    up.set(500);
    assert_eq!(calls(&mut svc, 80).await, 0);
    assert_eq!(svc.state(), CircuitState::Open);

    tokio::time::advance(1800 * MS).await;
    let start = Instant::now();
    let e = open_error(call(&mut svc).await.unwrap_err());
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert!(e.is_not_sent());
    assert!(e.nothing_processed());
    assert!(!e.is_timeout());
    assert_eq!(e.upstream(), Some("shipping"));
    assert_eq!(e.limit(), Some(3200 * MS));
    assert_eq!(e.retry_advice(), RetryAdvice::After(3200 * MS));
    assert_eq!(
        e.to_string(),
        "shipping: circuit open for another 3.2 s after 57% of 140 calls failed"
    );
    // Found the same way in a wrapped error.
    #[derive(Debug)]
    struct Wrapper(Error);
    impl std::fmt::Display for Wrapper {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("client error")
        }
    }
    impl std::error::Error for Wrapper {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    let w = Error::from_box(Box::new(Wrapper(e)));
    assert_eq!(w.kind(), ErrorKind::CircuitOpen);
    assert!(w.is_not_sent());
    assert_eq!(w.retry_advice(), RetryAdvice::After(3200 * MS));
    assert_eq!(up.calls(), 140);

    // Under a second left: in milliseconds, rounded up.
    tokio::time::advance(3 * S - 1 * MS / 2).await;
    let e = open_error(call(&mut svc).await.unwrap_err());
    assert_eq!(
        e.to_string(),
        "shipping: circuit open for another 201 ms after 57% of 140 calls failed"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn half_open_lets_the_probes_through_and_no_more() {
    let up = Upstream::answering(500);
    let mut svc = small().layer(up.service());
    calls(&mut svc, 10).await;
    assert_eq!(svc.state(), CircuitState::Open);
    tokio::time::advance(5 * S).await;

    // The upstream hangs now: the three probes stay out.
    up.set(HANG);
    let mut probes = Vec::new();
    for _ in 0..3 {
        let mut svc = svc.clone();
        probes.push(tokio::spawn(async move { call(&mut svc).await }));
    }
    tokio::task::yield_now().await;
    assert_eq!(up.calls(), 13);
    assert_eq!(svc.state(), CircuitState::HalfOpen);
    // The others fail at once, and say why.
    for _ in 0..5 {
        let e = open_error(call(&mut svc).await.unwrap_err());
        assert!(e.is_not_sent());
        assert_eq!(e.retry_advice(), RetryAdvice::After(5 * S));
        assert_eq!(
            e.to_string(),
            "shipping: circuit half-open and its 3 probe(s) still out: not sent"
        );
    }
    assert_eq!(up.calls(), 13);
    // A dropped probe gives its place to the next call.
    probes.pop().unwrap().abort();
    tokio::task::yield_now().await;
    up.set(200);
    call(&mut svc).await.unwrap();
    assert_eq!(up.calls(), 14);
    assert_eq!(svc.state(), CircuitState::HalfOpen);
    for p in probes {
        p.abort();
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_probe_failure_opens_it_again_and_successes_close_it() {
    let up = Upstream::answering(503);
    let mut svc = small().layer(up.service());
    calls(&mut svc, 10).await;
    tokio::time::advance(5 * S).await;

    // The first probe fails: open again, for a whole break from now.
    call(&mut svc).await.unwrap();
    assert_eq!(svc.state(), CircuitState::Open);
    assert_eq!(up.calls(), 11);
    tokio::time::advance(2 * S).await;
    let e = open_error(call(&mut svc).await.unwrap_err());
    assert_eq!(e.limit(), Some(3 * S));
    assert_eq!(
        e.to_string(),
        "shipping: circuit open for another 3 s after a probe failed"
    );

    // Recovered: three probes in a row close it.
    up.set(200);
    tokio::time::advance(3 * S).await;
    for left in [
        CircuitState::HalfOpen,
        CircuitState::HalfOpen,
        CircuitState::Closed,
    ] {
        call(&mut svc).await.unwrap();
        assert_eq!(svc.state(), left);
    }
    assert_eq!(up.calls(), 14);
    // Closed afresh: the outage's failures are forgotten; one failure
    // among few calls does not open it.
    up.set(500);
    call(&mut svc).await.unwrap();
    assert_eq!(svc.state(), CircuitState::Closed);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn clones_share_one_breaker_and_each_service_has_its_own() {
    let up = Upstream::answering(500);
    let layer = small();
    let mut a = layer.layer(up.service());
    let mut b = a.clone();
    let mut other = layer.layer(up.service());
    calls(&mut a, 5).await;
    calls(&mut b, 5).await;
    assert_eq!(a.state(), CircuitState::Open);
    assert_eq!(calls(&mut b, 3).await, 3);
    assert_eq!(up.calls(), 10);
    // Another service from the same layer: its own breaker.
    assert_eq!(other.state(), CircuitState::Closed);
    assert_eq!(calls(&mut other, 1).await, 0);
    // Clones made while open are open too.
    let mut c = b.clone();
    assert_eq!(calls(&mut c, 1).await, 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn timeouts_and_refused_connections_count_and_the_classes_are_configurable() {
    // Attempts that time out count.
    let up = Upstream::answering(HANG);
    let mut svc = small().layer(AttemptTimeoutLayer::new(100 * MS).layer(up.service()));
    for _ in 0..10 {
        let e = Error::from_box(call(&mut svc).await.unwrap_err());
        assert_eq!(e.kind(), ErrorKind::AttemptTimeout);
    }
    assert_eq!(svc.state(), CircuitState::Open);

    // A refused connection counts.
    let refused = service_fn(|_req: Request<()>| async {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        Err::<Response<()>, _>(Error::connect(Box::new(io)))
    });
    let mut svc = small().layer(refused);
    calls(&mut svc, 10).await;
    assert_eq!(svc.state(), CircuitState::Open);

    // Only 5xx and timeouts: 503s and refusals do not count.
    let up = Upstream::answering(503);
    let mut svc = small()
        .failure_classes([Class::Unknown])
        .layer(up.service());
    assert_eq!(calls(&mut svc, 50).await, 0);
    assert_eq!(svc.state(), CircuitState::Closed);
    up.set(500);
    calls(&mut svc, 10).await;
    assert_eq!(svc.state(), CircuitState::Open);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_deadline_spent_before_the_attempt_is_not_the_upstreams_fault() {
    let expired = service_fn(|_req: Request<()>| async {
        Err::<Response<()>, _>(Error::deadline_exceeded(Phase::Start, Duration::ZERO))
    });
    let mut svc = small().layer(expired);
    calls(&mut svc, 100).await;
    assert_eq!(svc.state(), CircuitState::Closed);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn late_outcomes_of_calls_made_while_closed_are_no_probes() {
    // Ten calls hang for 10 s, past the break; ten others fail at once and
    // open the circuit.
    let up = Upstream::answering(HANG);
    let slow = small().layer(AttemptTimeoutLayer::new(10 * S).layer(up.service()));
    let mut hanging = Vec::new();
    for _ in 0..10 {
        let mut svc = slow.clone();
        hanging.push(tokio::spawn(async move { call(&mut svc).await }));
    }
    tokio::task::yield_now().await;
    up.set(500);
    let mut svc = slow.clone();
    calls(&mut svc, 10).await;
    assert_eq!(svc.state(), CircuitState::Open);
    // Half-open with three probes out when the slow ten time out.
    tokio::time::advance(5 * S).await;
    up.set(HANG);
    let mut probes = Vec::new();
    for _ in 0..3 {
        let mut svc = slow.clone();
        probes.push(tokio::spawn(async move { call(&mut svc).await }));
    }
    tokio::task::yield_now().await;
    assert_eq!(svc.state(), CircuitState::HalfOpen);
    tokio::time::sleep(5 * S).await;
    for h in hanging {
        assert!(h.await.unwrap().is_err());
    }
    // Their timeouts were of the closed circuit: still half-open.
    assert_eq!(svc.state(), CircuitState::HalfOpen);
    for p in probes {
        p.abort();
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_change_of_state_is_one_tracing_event() {
    let events = Events::under("tower_resend::breaker");
    let _second = Events::keep_callsites_open();
    let _guard = tracing::subscriber::set_default(events.clone());
    let up = Upstream::answering(500);
    let mut svc = small().probes(1).layer(up.service());
    calls(&mut svc, 12).await; // opens at the 10th; two refused
    tokio::time::advance(5 * S).await;
    calls(&mut svc, 1).await; // half-open; the probe fails: open again
    up.set(200);
    tokio::time::advance(5 * S).await;
    calls(&mut svc, 3).await; // half-open; the probe closes it
    let got = events.got();
    use tracing::Level;
    let want = [
        (
            Level::WARN,
            "circuit breaker opened: 100% of 10 calls failed",
        ),
        (Level::INFO, "circuit breaker half-open: probing"),
        (Level::WARN, "circuit breaker opened again: a probe failed"),
        (Level::INFO, "circuit breaker half-open: probing"),
        (Level::INFO, "circuit breaker closed: the probes succeeded"),
    ];
    assert_eq!(got.len(), want.len(), "{got:?}");
    for ((level, message, fields), (l, m)) in got.iter().zip(want) {
        assert_eq!(
            (*level, message.as_str(), field(fields, "upstream")),
            (l, m, Some("shipping"))
        );
    }
}

/// A gRPC upstream answering UNAVAILABLE (HTTP 200, `grpc-status: 14`):
/// with the default classifier, the breaker reads the gRPC status of a
/// gRPC request, so the failures open it; the same 200s to plain HTTP
/// requests are successes.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_default_classifier_reads_a_grpc_answer_as_grpc() {
    let calls_made = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&calls_made);
    let unavailable = service_fn(move |_req: Request<()>| {
        seen.fetch_add(1, Ordering::SeqCst);
        async {
            Ok::<_, Infallible>(
                Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", "14")
                    .body(())
                    .unwrap(),
            )
        }
    });
    let grpc = || {
        Request::post("http://ledger/bank.Ledger/Charge")
            .header("content-type", "application/grpc")
            .body(())
            .unwrap()
    };
    let mut svc = small().layer(unavailable.clone());
    for _ in 0..10 {
        let _ = svc.ready().await.unwrap().call(grpc()).await;
    }
    assert_eq!(svc.state(), CircuitState::Open);
    let e = open_error(svc.ready().await.unwrap().call(grpc()).await.unwrap_err());
    assert!(e.is_not_sent());
    assert_eq!(calls_made.load(Ordering::SeqCst), 10);

    // Plain HTTP requests: a 200 is a success, whatever its headers.
    let mut svc = small().layer(unavailable);
    assert_eq!(calls(&mut svc, 20).await, 0);
    assert_eq!(svc.state(), CircuitState::Closed);
}
