//! Paused-clock tests of the deadline and attempt layers together.

use std::convert::Infallible;
use std::future::pending;
use std::time::Duration;

use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tokio::time::{advance, Instant};
use tokio_test::{assert_pending, assert_ready};
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};

use crate::deadline::{scope, CallDeadlineLayer, Deadline};
use crate::error::{Error, ErrorKind, Phase};
use crate::timeout::AttemptTimeoutLayer;

const MS: Duration = Duration::from_millis(1);

fn silent() -> impl tower_service::Service<
    Request<()>,
    Response = Response<Full<bytes::Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(|_req: Request<()>| pending::<Result<Response<Full<bytes::Bytes>>, Infallible>>())
}

/// An upstream that records the deadline it saw and answers after `delay`.
fn answering_after(
    delay: Duration,
) -> impl tower_service::Service<
    Request<()>,
    Response = Response<Option<Deadline>>,
    Error = Infallible,
> + Clone {
    service_fn(move |req: Request<()>| async move {
        tokio::time::sleep(delay).await;
        Ok::<_, Infallible>(Response::new(req.extensions().get::<Deadline>().copied()))
    })
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_silent_service_fails_at_the_deadline() {
    let svc = CallDeadlineLayer::new(Duration::from_secs(1)).layer(silent());
    let start = Instant::now();
    let err = Error::from_box(svc.oneshot(Request::new(())).await.unwrap_err());
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(err.phase(), Some(Phase::Attempt));
    assert_eq!(err.elapsed(), Some(Duration::from_secs(1)));
    assert!(!err.is_not_sent());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_deadline_is_not_a_moment_early() {
    let svc = CallDeadlineLayer::new(Duration::from_secs(1)).layer(silent());
    let mut fut = tokio_test::task::spawn(svc.oneshot(Request::new(())));
    assert_pending!(fut.poll());
    advance(999 * MS).await;
    assert_pending!(fut.poll());
    advance(MS).await;
    let err = Error::from_box(assert_ready!(fut.poll()).unwrap_err());
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
}

/// An upstream that answers 503 to its first call, then is never ready
/// again.
#[derive(Clone)]
struct BusyAfterOne(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl tower_service::Service<Request<http_body_util::Empty<bytes::Bytes>>> for BusyAfterOne {
    type Response = Response<()>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<()>, Infallible>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        if self.0.load(std::sync::atomic::Ordering::SeqCst) {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(Ok(()))
        }
    }

    fn call(&mut self, _req: Request<http_body_util::Empty<bytes::Bytes>>) -> Self::Future {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        let resp = Response::builder().status(503).body(()).unwrap();
        std::future::ready(Ok(resp))
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_retry_still_waiting_at_the_deadline_says_it_was_waiting() {
    let svc = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(3)).upstream("shipping"))
        .layer(crate::retry::RetryLayer::new().no_budget().seed(1))
        .service(BusyAfterOne(Default::default()));
    let start = Instant::now();
    let req = Request::get("http://shipping/")
        .body(http_body_util::Empty::new())
        .unwrap();
    let err = Error::from_box(svc.oneshot(req).await.unwrap_err());
    assert_eq!(start.elapsed(), Duration::from_secs(3));
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(err.phase(), Some(Phase::Waiting));
    assert_eq!(err.upstream(), Some("shipping"));
    assert_eq!(err.elapsed(), Some(Duration::from_secs(3)));
    // The retry layer's error: it knows the 503 that came before.
    assert_eq!(err.attempts(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn attempt_timeout_fires_first_as_attempt_timeout() {
    let svc = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(1)))
        .layer(AttemptTimeoutLayer::new(400 * MS))
        .service(silent());
    let start = Instant::now();
    let err = Error::from_box(svc.oneshot(Request::new(())).await.unwrap_err());
    assert_eq!(start.elapsed(), 400 * MS);
    assert_eq!(err.kind(), ErrorKind::AttemptTimeout);
    assert_eq!(err.limit(), Some(400 * MS));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_300ms_left_the_attempt_gets_300ms_and_the_deadline_is_blamed() {
    let own_deadline = Deadline::after(Duration::from_millis(300));
    let svc = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(1)))
        .layer(AttemptTimeoutLayer::new(400 * MS))
        .service(silent());
    let mut req = Request::new(());
    req.extensions_mut().insert(own_deadline);
    let start = Instant::now();
    let err = Error::from_box(svc.oneshot(req).await.unwrap_err());
    assert_eq!(start.elapsed(), 300 * MS);
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(err.phase(), Some(Phase::Attempt));
    assert_eq!(err.elapsed(), Some(300 * MS));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn attempt_layer_alone_respects_the_time_left() {
    // Only the attempt layer: the deadline comes from the ambient scope.
    let svc = AttemptTimeoutLayer::new(400 * MS).layer(silent());
    let start = Instant::now();
    let err = scope(Deadline::after(250 * MS), svc.oneshot(Request::new(())))
        .await
        .unwrap_err();
    let err = Error::from_box(err);
    assert_eq!(start.elapsed(), 250 * MS);
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_ambient_deadline_shorter_than_total_wins() {
    let svc =
        CallDeadlineLayer::new(Duration::from_secs(10)).layer(answering_after(Duration::ZERO));
    let ambient = Deadline::after(Duration::from_secs(2));
    let seen = scope(ambient, svc.clone().oneshot(Request::new(())))
        .await
        .unwrap()
        .into_body()
        .into_inner();
    assert_eq!(seen, Some(ambient));

    // And it is enforced, not just written down.
    let slow = CallDeadlineLayer::new(Duration::from_secs(10)).layer(silent());
    let start = Instant::now();
    let err = scope(ambient, slow.oneshot(Request::new(())))
        .await
        .unwrap_err();
    assert_eq!(Error::from_box(err).kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_longer_ambient_deadline_does_not_extend_total() {
    let svc = CallDeadlineLayer::new(Duration::from_secs(1)).layer(answering_after(Duration::ZERO));
    let start = Instant::now();
    let seen = scope(
        Deadline::after(Duration::from_secs(60)),
        svc.oneshot(Request::new(())),
    )
    .await
    .unwrap()
    .into_body()
    .into_inner();
    assert_eq!(seen, Some(Deadline::at(start + Duration::from_secs(1))));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_request_deadline_is_never_extended() {
    let svc =
        CallDeadlineLayer::new(Duration::from_secs(10)).layer(answering_after(Duration::ZERO));
    let own = Deadline::after(Duration::from_millis(500));
    let mut req = Request::new(());
    req.extensions_mut().insert(own);
    let seen = svc.oneshot(req).await.unwrap().into_body().into_inner();
    assert_eq!(seen, Some(own));

    // A shorter total shrinks the request's own deadline.
    let svc =
        CallDeadlineLayer::new(Duration::from_millis(100)).layer(answering_after(Duration::ZERO));
    let mut req = Request::new(());
    req.extensions_mut().insert(own);
    let start = Instant::now();
    let seen = svc.oneshot(req).await.unwrap().into_body().into_inner();
    assert_eq!(seen, Some(Deadline::at(start + 100 * MS)));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_spent_budget_sends_nothing() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = {
        let calls = calls.clone();
        service_fn(move |_req: Request<()>| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(())) }
        })
    };
    let spent = Deadline::after(10 * MS);
    advance(20 * MS).await;
    let mut req = Request::new(());
    req.extensions_mut().insert(spent);
    let err = CallDeadlineLayer::new(Duration::from_secs(1))
        .layer(counted.clone())
        .oneshot(req)
        .await
        .unwrap_err();
    let err = Error::from_box(err);
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(err.phase(), Some(Phase::Start));
    assert!(err.is_not_sent());

    let mut req = Request::new(());
    req.extensions_mut().insert(spent);
    let err = AttemptTimeoutLayer::new(Duration::from_secs(1))
        .layer(counted)
        .oneshot(req)
        .await
        .unwrap_err();
    assert!(Error::from_box(err).is_not_sent());
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_ready_response_wins_a_tie_with_the_clock() {
    let svc = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(1)))
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(1)))
        .service(answering_after(Duration::from_secs(1)));
    assert!(svc.oneshot(Request::new(())).await.is_ok());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_body_is_read_under_the_deadline() {
    // Headers at once, then a body that never ends.
    let trickle =
        service_fn(|_req: Request<()>| async { Ok::<_, Infallible>(Response::new(Never)) });
    let svc = CallDeadlineLayer::new(Duration::from_secs(1)).layer(trickle);
    let start = Instant::now();
    let resp = svc.oneshot(Request::new(())).await.unwrap();
    let err = resp.into_body().collect().await.unwrap_err();
    let err = Error::from_box(err);
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(err.phase(), Some(Phase::Body));
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_body_error_becomes_a_transport_error_that_may_have_been_processed() {
    let broken = service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(OneThenError { sent: false }))
    });
    let resp = CallDeadlineLayer::new(Duration::from_secs(1))
        .upstream("up")
        .layer(broken)
        .oneshot(Request::new(()))
        .await
        .unwrap();
    let err = Error::from_box(resp.into_body().collect().await.unwrap_err());
    assert_eq!(err.kind(), ErrorKind::Transport);
    assert!(!err.is_not_sent());
    assert_eq!(err.phase(), Some(Phase::Body));
    assert_eq!(err.upstream(), Some("up"));
}

/// A body that never yields.
struct Never;
impl http_body::Body for Never {
    type Data = bytes::Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        std::task::Poll::Pending
    }
}

/// One data frame, then a connection reset.
struct OneThenError {
    sent: bool,
}
impl http_body::Body for OneThenError {
    type Data = bytes::Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        if std::mem::replace(&mut self.sent, true) {
            std::task::Poll::Ready(Some(Err(std::io::ErrorKind::ConnectionReset.into())))
        } else {
            std::task::Poll::Ready(Some(Ok(http_body::Frame::data(bytes::Bytes::from_static(
                b"par",
            )))))
        }
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn outbound_calls_are_recorded_in_the_ambient_ledger() {
    use crate::deadline::server::{scope_with_ledger, Source, TimeLedger};
    let ledger = TimeLedger::new();
    let svc = CallDeadlineLayer::new(Duration::from_secs(10))
        .upstream("shipping")
        .layer(answering_after(Duration::from_millis(250)));
    let call = scope_with_ledger(
        Deadline::after(Duration::from_secs(2)),
        ledger.clone(),
        svc.oneshot(Request::new(())),
    );
    let watch = async {
        advance(100 * MS).await;
        tokio::task::yield_now().await;
        let running = ledger.snapshot();
        let now = running.running().cloned().expect("the call is in flight");
        assert_eq!((now.source, &*now.name), (Source::Upstream, "shipping"));
    };
    let (result, ()) = tokio::join!(call, watch);
    result.unwrap();
    let done = ledger.snapshot();
    assert!(done.active.is_empty());
    assert_eq!(done.finished[0].spent, 250 * MS);
}

/// A gRPC request, with `grpc-timeout` if given.
fn grpc_request(grpc_timeout: Option<&'static str>) -> Request<()> {
    let mut req = Request::post("/pkg.Svc/Method")
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .body(())
        .unwrap();
    if let Some(t) = grpc_timeout {
        req.headers_mut()
            .insert(crate::deadline::GRPC_TIMEOUT, t.parse().unwrap());
    }
    req
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_callers_own_timeout_is_the_calls_deadline_when_it_is_sooner() {
    let start = Instant::now();
    for (header, total, want) in [
        // tonic's `set_timeout(500 ms)` under a 3 s budget: 500 ms.
        (Some("500000u"), 3000 * MS, 500 * MS),
        (Some("2S"), 3000 * MS, 2000 * MS),
        // The budget is sooner: the budget.
        (Some("10S"), 3000 * MS, 3000 * MS),
        // None, or malformed: ignored.
        (None, 3000 * MS, 3000 * MS),
        (Some("soon"), 3000 * MS, 3000 * MS),
        (Some("123456789m"), 3000 * MS, 3000 * MS),
        // The largest value there is does not overflow.
        (Some("99999999H"), 3000 * MS, 3000 * MS),
    ] {
        let svc = CallDeadlineLayer::new(total).layer(answering_after(Duration::ZERO));
        let resp = svc.oneshot(grpc_request(header)).await.unwrap();
        let seen = resp.into_body().into_inner().expect("a deadline");
        assert_eq!(seen, Deadline::at(start + want), "{header:?}");
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_timeout_on_a_request_that_is_not_grpc_is_not_read() {
    let start = Instant::now();
    let mut req = Request::new(());
    req.headers_mut()
        .insert(crate::deadline::GRPC_TIMEOUT, "100m".parse().unwrap());
    let svc = CallDeadlineLayer::new(Duration::from_secs(1)).layer(answering_after(Duration::ZERO));
    let seen = svc.oneshot(req).await.unwrap().into_body().into_inner();
    assert_eq!(seen, Some(Deadline::at(start + Duration::from_secs(1))));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_callers_timeout_ends_the_call_and_each_attempt_carries_what_is_left_of_it() {
    use crate::deadline::{parse_grpc_timeout, DeadlineHeaderLayer, GRPC_TIMEOUT};
    use std::sync::{Arc, Mutex};

    // Stands in for a retry layer: attempts at 0, 200 and 400 ms, each
    // given up after 100 ms, the request's head kept from the caller (with
    // its grpc-timeout of 500 ms); the deadline cuts the call at 500 ms.
    let sent = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&sent);
    let upstream = DeadlineHeaderLayer::new().layer(service_fn(move |req: Request<()>| {
        let at = Instant::now();
        let header = req.headers()[GRPC_TIMEOUT].clone();
        seen.lock().unwrap().push((at, header));
        pending::<Result<Response<()>, Infallible>>()
    }));
    let retrying = service_fn(move |req: Request<()>| {
        let upstream = upstream.clone();
        async move {
            let (parts, ()) = req.into_parts();
            for _ in 0..3 {
                let req = Request::from_parts(parts.clone(), ());
                let attempt = upstream.clone().oneshot(req);
                let _ = tokio::time::timeout(100 * MS, attempt).await;
                tokio::time::sleep(100 * MS).await;
            }
            upstream.oneshot(Request::from_parts(parts, ())).await
        }
    });
    let svc = CallDeadlineLayer::new(Duration::from_secs(3)).layer(retrying);

    let start = Instant::now();
    let err = Error::from_box(
        svc.oneshot(grpc_request(Some("500000u")))
            .await
            .unwrap_err(),
    );
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(start.elapsed(), 500 * MS);
    let sent = sent.lock().unwrap();
    assert_eq!(sent.len(), 3, "the third attempt is cut by the deadline");
    for (at, header) in sent.iter() {
        let budget = parse_grpc_timeout(header.as_bytes()).unwrap();
        let left = 500 * MS - (*at - start);
        // Never the caller's stale 500 ms again: what is left, less the margin.
        assert_eq!(budget, left - crate::deadline::DEFAULT_MARGIN, "{header:?}");
    }
}
