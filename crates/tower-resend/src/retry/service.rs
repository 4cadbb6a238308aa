use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tokio::time::Instant;
use tower_service::Service;

use super::call::Call;
use super::future::ResponseFuture;
use super::layer::Shared;
use super::policy::gate;
use super::{CallOptions, NoRetry, RetryLayer};
use crate::body::Replay;
use crate::classify::{Classify, HttpClassifier, RequestFacts};
use crate::deadline::Deadline;
use crate::error::BoxError;
use crate::vocab::{RetryInCharge, Tried};

/// Middleware that retries safely; see [`RetryLayer`].
pub struct Retry<S, C = HttpClassifier> {
    inner: S,
    shared: Arc<Shared<S, C>>,
}

impl<S: std::fmt::Debug, C: std::fmt::Debug> std::fmt::Debug for Retry<S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("shared", &self.shared)
            .finish()
    }
}

impl<S: Clone, C> Clone for Retry<S, C> {
    #[inline]
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S> Retry<S> {
    /// A [`RetryLayer`] with the defaults.
    pub fn layer() -> RetryLayer {
        RetryLayer::new()
    }
}

impl<S, C> Retry<S, C> {
    pub(crate) fn from_shared(inner: S, shared: Arc<Shared<S, C>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, C, ReqB, ResB> Service<Request<ReqB>> for Retry<S, C>
where
    ReqB: Replay<Sent = ReqB>,
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    C: Classify<ResB>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, S, ReqB, C, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        if self.shared.fleet && req.extensions().get::<Tried>().is_none() {
            // The instances this call uses, shared by its attempts.
            req.extensions_mut().insert(Tried::default());
        }
        let ext = req.extensions();
        let own = ext.get::<Deadline>().copied();
        // Most requests carry nothing but the deadline a deadline layer
        // wrote: then neither marker below can be there, and two lookups
        // are saved.
        let only_deadline = ext.len() == usize::from(own.is_some());
        if !only_deadline && RetryInCharge::of(ext).is_some() {
            // An outer retry layer is in charge of this request.
            let req = req.map(Replay::send_once);
            return ResponseFuture::passthrough(self.inner.call(req));
        }
        let allowed = only_deadline || ext.get::<NoRetry>().is_none();
        // The caller's extensions beyond the deadline: overrides, and the
        // key resend chose (looked up only when there are any).
        let (options, key) = if only_deadline {
            (CallOptions::new(), None)
        } else {
            (
                ext.get::<CallOptions>().copied().unwrap_or_default(),
                ext.get::<crate::idempotency::GeneratedKey>()
                    .map(|k| k.0.clone()),
            )
        };
        let now = Instant::now();
        // The request's deadline (a deadline layer's, or the caller's own),
        // and the ambient one.
        let deadline = Deadline::with_ambient(own);
        let shared = Arc::clone(&self.shared);
        let replay_safe = shared.classifier.is_replay_safe(&RequestFacts::of(&req));
        if let Some(budget) = &shared.budget {
            budget.deposit();
        }
        let marker = RetryInCharge {
            attempt_timeout: options.attempt_timeout,
            read_ahead: replay_safe && allowed,
        };
        let (parts, body) = req.into_parts();
        // The first attempt sends a copy of the body, and the body is kept
        // for the next (none: it is sent once, and not replayed).
        let (first, kept) = keep(body, shared.policy.replay_cap, allowed);
        let mut attempt = Request::from_parts(parts, first);
        marker.mark(attempt.extensions_mut());
        let mut call = Call::new(
            &attempt,
            marker,
            own,
            key,
            kept,
            shared,
            replay_safe,
            allowed,
            deadline,
            options,
            now,
        );
        match gate(now, deadline, call.shared.throttle.as_ref()) {
            Ok(bin) => call.throttle_bin = bin,
            // Not sent: the deadline passed before the call began, or the
            // throttle turned it away.
            Err(why) => return ResponseFuture::unsent(call, why),
        }
        // The layers below, and the transport, call inside the attempt's span.
        let future = {
            let _span = call.attempt.enter();
            self.inner.call(attempt)
        };
        ResponseFuture::first(future, call)
    }
}

/// The body the first attempt sends, and the one kept for later attempts:
/// none when retries are off, or when the body is known to be larger than
/// `cap` (it is sent once, and not replayed).
fn keep<B: Replay<Sent = B>>(body: B, cap: usize, retries: bool) -> (B, Option<B>) {
    if !retries || body.size_hint().lower() > cap as u64 {
        return (body.send_once(), None);
    }
    let kept = body.keep(cap);
    match kept.try_copy() {
        Some(first) => (first, Some(kept)),
        None => (kept, None),
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU32, Ordering};

    use bytes::Bytes;
    use http::StatusCode;
    use http_body_util::Empty;
    use tower::{service_fn, Layer, ServiceExt};

    use super::*;
    use crate::classify::Classification;
    use crate::error::Error;

    /// HTTP classification, but only `/safe` is replay-safe, whatever the
    /// method.
    #[derive(Clone, Debug)]
    struct OnlySafePath;

    impl<B> Classify<B> for OnlySafePath {
        fn classify_response(&self, req: &RequestFacts<'_>, resp: &Response<B>) -> Classification {
            HttpClassifier::new().classify_response(req, resp)
        }

        fn classify_error(
            &self,
            req: &RequestFacts<'_>,
            err: &(dyn std::error::Error + 'static),
        ) -> Classification {
            Classify::<B>::classify_error(&HttpClassifier::new(), req, err)
        }

        fn is_replay_safe(&self, req: &RequestFacts<'_>) -> bool {
            req.uri().path() == "/safe"
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_classifier_decides_replay_safety() {
        let calls = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&calls);
        let upstream = service_fn(move |_req: Request<Empty<Bytes>>| {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            let status = if n.is_multiple_of(2) {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::OK
            };
            async move { Ok::<_, Infallible>(Response::builder().status(status).body(()).unwrap()) }
        });
        let client = RetryLayer::new()
            .classifier(OnlySafePath)
            .no_budget()
            .seed(1)
            .layer(upstream);

        // A POST the classifier calls replay-safe: the 500 is retried.
        let req = Request::post("http://up/safe").body(Empty::new()).unwrap();
        let resp = client.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(calls.load(Ordering::SeqCst), 2);

        // A GET it does not: the 500 may have been processed, so it stops.
        let req = Request::get("http://up/other").body(Empty::new()).unwrap();
        let err = Error::from_box(client.oneshot(req).await.unwrap_err());
        assert!(err.is_outcome_unknown(), "{err}");
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    /// The attempt headers one request carried: `grpc-previous-rpc-attempts`
    /// and `x-attempt`.
    type Seen = Arc<std::sync::Mutex<Vec<(Option<String>, Option<String>)>>>;
    type Ready200 = std::future::Ready<Result<Response<()>, Infallible>>;

    /// An upstream that answers 503 twice, then 200, and records the
    /// attempt headers it saw.
    fn flaky_recording(
        seen: Seen,
    ) -> impl Service<
        Request<Empty<Bytes>>,
        Response = Response<()>,
        Error = Infallible,
        Future = Ready200,
    > + Clone {
        service_fn(move |req: Request<Empty<Bytes>>| {
            let header = |name: &str| {
                req.headers()
                    .get(name)
                    .map(|v| v.to_str().unwrap_or("?").to_owned())
            };
            let mut seen = seen.lock().unwrap();
            seen.push((header("grpc-previous-rpc-attempts"), header("x-attempt")));
            let status = if seen.len() < 3 {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            std::future::ready(Ok(Response::builder().status(status).body(()).unwrap()))
        })
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn later_attempts_say_how_many_came_before() {
        let name = http::HeaderName::from_static("x-attempt");

        // HTTP, with the header configured: none on the first attempt, then 1, 2.
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let client = RetryLayer::new()
            .attempt_header(name.clone())
            .no_budget()
            .seed(1)
            .layer(flaky_recording(Arc::clone(&seen)));
        let req = Request::get("http://up/x").body(Empty::new()).unwrap();
        assert_eq!(client.oneshot(req).await.unwrap().status(), StatusCode::OK);
        let got: Vec<_> = seen.lock().unwrap().iter().map(|s| s.1.clone()).collect();
        assert_eq!(got, [None, Some("1".into()), Some("2".into())]);
        assert!(seen.lock().unwrap().iter().all(|s| s.0.is_none()));

        // HTTP without it: nothing is added.
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let client = RetryLayer::new()
            .no_budget()
            .seed(1)
            .layer(flaky_recording(Arc::clone(&seen)));
        let req = Request::get("http://up/x").body(Empty::new()).unwrap();
        assert_eq!(client.oneshot(req).await.unwrap().status(), StatusCode::OK);
        assert_eq!(seen.lock().unwrap().len(), 3);
        assert!(seen
            .lock()
            .unwrap()
            .iter()
            .all(|s| s.0.is_none() && s.1.is_none()));

        // gRPC: always `grpc-previous-rpc-attempts`, never the HTTP header.
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let client = RetryLayer::new()
            .attempt_header(name)
            .no_budget()
            .seed(1)
            .layer(flaky_recording(Arc::clone(&seen)));
        let req = Request::put("http://up/pkg.Svc/Method")
            .header("content-type", "application/grpc")
            .body(Empty::new())
            .unwrap();
        assert_eq!(client.oneshot(req).await.unwrap().status(), StatusCode::OK);
        let got: Vec<_> = seen.lock().unwrap().iter().map(|s| s.0.clone()).collect();
        assert_eq!(got, [None, Some("1".into()), Some("2".into())]);
        assert!(seen.lock().unwrap().iter().all(|s| s.1.is_none()));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn no_retry_and_an_outer_retry_are_seen_whatever_else_is_there() {
        use crate::retry::{Attempts, NoRetry, Stop};

        // The extensions a request may carry: alone, with a deadline, with a
        // deadline and a caller's own entry (each path of the lookups).
        #[derive(Clone)]
        struct Mine;
        let with = |deadline: bool, mine: bool| {
            let mut req = Request::get("http://up/x").body(Empty::new()).unwrap();
            if deadline {
                req.extensions_mut()
                    .insert(Deadline::after(std::time::Duration::from_secs(10)));
            }
            if mine {
                req.extensions_mut().insert(Mine);
            }
            req
        };
        // Sends `req` through a fresh retry layer over the 503, 503, 200
        // upstream; the response and the attempts the upstream saw.
        async fn send(req: Request<Empty<Bytes>>) -> (Response<()>, usize) {
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let client = RetryLayer::new()
                .no_budget()
                .seed(1)
                .layer(flaky_recording(Arc::clone(&seen)));
            let resp = client.oneshot(req).await.unwrap();
            let n = seen.lock().unwrap().len();
            (resp, n)
        }
        for (deadline, mine) in [(false, false), (true, false), (true, true), (false, true)] {
            let case = format!("deadline {deadline}, mine {mine}");

            // Plain: retried through 503, 503 to the 200.
            let (resp, sent) = send(with(deadline, mine)).await;
            assert_eq!((resp.status(), sent), (StatusCode::OK, 3), "{case}");

            // With NoRetry: one attempt, the 503 comes back.
            let mut req = with(deadline, mine);
            req.extensions_mut().insert(NoRetry);
            let (resp, sent) = send(req).await;
            assert_eq!(
                (resp.status(), sent),
                (StatusCode::SERVICE_UNAVAILABLE, 1),
                "{case}"
            );
            let history = resp.extensions().get::<Attempts>().unwrap();
            assert_eq!(history.stop(), Stop::Disabled, "{case}");

            // Marked as under an outer retry layer: this one passes the
            // request through, once, and leaves the history to the outer one.
            let mut req = with(deadline, mine);
            RetryInCharge {
                attempt_timeout: None,
                read_ahead: false,
            }
            .mark(req.extensions_mut());
            let (resp, sent) = send(req).await;
            assert_eq!(
                (resp.status(), sent),
                (StatusCode::SERVICE_UNAVAILABLE, 1),
                "{case}"
            );
            assert!(resp.extensions().get::<Attempts>().is_none(), "{case}");
        }
    }

    /// A request whose deadline has already passed is not sent: the retry
    /// layer checks it as it sends the first attempt, and a timeout layer
    /// below (which, seeing the retry in charge, does not look again)
    /// never gets it.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_spent_deadline_sends_nothing() {
        let calls = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&calls);
        let upstream = service_fn(move |_req: Request<Empty<Bytes>>| {
            seen.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok::<_, Infallible>(Response::new(())))
        });
        let client = RetryLayer::new().no_budget().layer(
            crate::timeout::AttemptTimeoutLayer::new(std::time::Duration::from_secs(1))
                .layer(upstream),
        );
        let mut req = Request::get("http://up/x").body(Empty::new()).unwrap();
        req.extensions_mut()
            .insert(Deadline::after(std::time::Duration::ZERO));
        let err = Error::from_box(client.oneshot(req).await.unwrap_err());
        assert!(err.is_deadline_exceeded(), "{err}");
        assert_eq!(err.phase(), Some(crate::error::Phase::Start));
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }
}
