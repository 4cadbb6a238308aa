//! Benchmarks of tower-resend (`cargo bench -p tower-resend-benches`); results and the
//! commands that reproduce them are in BENCHMARKS.md at the workspace root.
//! This library holds what the benchmarks share, and the simulator of the
//! stack at scale ([`sim`], the `storm` bench).

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt;
use http_body_util::Empty;
use tower::{Service, ServiceExt};

pub mod sim;

/// The response body of the in-process benchmarks.
pub type Body = Empty<bytes::Bytes>;

/// An upstream that answers 200 at once, whatever the request body.
#[derive(Clone, Copy, Debug)]
pub struct Instant200;

impl<B> Service<Request<B>> for Instant200 {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<B>) -> Self::Future {
        ready(Ok(Response::new(Body::new())))
    }
}

/// An upstream that answers at once, 200, stating a quota it will not
/// run out of in the IETF fields, as a paced API does on every answer.
#[derive(Clone, Copy, Debug)]
pub struct Quota200;

impl<B> Service<Request<B>> for Quota200 {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<B>) -> Self::Future {
        let mut resp = Response::new(Body::new());
        let h = resp.headers_mut();
        h.insert(
            "ratelimit-policy",
            http::HeaderValue::from_static("\"default\";q=1000000000000;w=1"),
        );
        h.insert(
            "ratelimit",
            http::HeaderValue::from_static("\"default\";r=999999999999;t=1"),
        );
        ready(Ok(resp))
    }
}

/// tower's retry with the simplest policy a user would write: clone the
/// request, retry 5xx and errors up to `left` times.
#[derive(Clone, Copy, Debug)]
pub struct CloneAndRetry {
    /// Retries left.
    pub left: usize,
}

impl<B: Clone, R, E> tower::retry::Policy<Request<B>, Response<R>, E> for CloneAndRetry {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Request<B>,
        result: &mut Result<Response<R>, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(r) if !r.status().is_server_error() => None,
            _ if self.left > 0 => {
                self.left -= 1;
                Some(ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        Some(req.clone())
    }
}

/// A stand-in for the per-call data the design makes resend carry, for the
/// like-for-like comparisons: the `Deadline` written on each request and a
/// small history written on each response (resend writes its `Attempts`).
/// tower's layers do neither.
pub mod carried {
    use std::time::Duration;

    use http::{Request, Response};

    /// What a response carries about the call: attempts, time, first status.
    #[derive(Clone, Copy, Debug)]
    pub struct History {
        /// Attempts made.
        pub attempts: u32,
        /// Time the call took.
        pub elapsed: Duration,
        /// Status of the first attempt.
        pub first: Option<u16>,
    }

    /// Writes a 10 s `Deadline` on the request, as tower-resend's CallDeadlineLayer does.
    pub fn deadline<B>(mut req: Request<B>) -> Request<B> {
        req.extensions_mut()
            .insert(tower_resend::Deadline::after(Duration::from_secs(10)));
        req
    }

    /// Writes a one-attempt `History` on the response.
    pub fn history<B>(mut resp: Response<B>) -> Response<B> {
        let first = Some(resp.status().as_u16());
        resp.extensions_mut().insert(History {
            attempts: 1,
            elapsed: Duration::ZERO,
            first,
        });
        resp
    }
}

/// The in-process variants, built the same way by every benchmark that
/// compares them: each over [`Instant200`], each a service to clone per call.
pub mod variants {
    use std::time::Duration;

    use http::{Request, Response};
    use tower::{BoxError, Service, ServiceBuilder};
    use tower_resend::{deadline::CallDeadlineLayer, timeout::AttemptTimeoutLayer};

    use super::{carried, Body, CloneAndRetry, Instant200};

    /// A service of the in-process benchmarks.
    pub trait Variant:
        Service<Request<Body>, Response = Response<Self::Body>, Error = Self::Err> + Clone
    {
        /// The response body.
        type Body;
        /// The error.
        type Err: std::fmt::Debug;
    }

    impl<S, B, E> Variant for S
    where
        S: Service<Request<Body>, Response = Response<B>, Error = E> + Clone,
        E: std::fmt::Debug,
    {
        type Body = B;
        type Err = E;
    }

    /// tower's `Timeout` (5 s).
    pub fn tower_timeout() -> impl Variant {
        ServiceBuilder::new()
            .timeout(Duration::from_secs(5))
            .service(Instant200)
    }

    /// tower's `Timeout` after writing the `Deadline` extension that
    /// tower-resend's CallDeadlineLayer writes (comparison only).
    pub fn tower_timeout_ext() -> impl Variant {
        ServiceBuilder::new()
            .map_request(carried::deadline::<Body>)
            .timeout(Duration::from_secs(5))
            .service(Instant200)
    }

    /// tower-resend's `CallDeadlineLayer` (10 s) and `AttemptTimeoutLayer` (5 s).
    pub fn resend_deadline_attempt() -> impl Variant {
        ServiceBuilder::new()
            .layer(CallDeadlineLayer::new(Duration::from_secs(10)))
            .layer(AttemptTimeoutLayer::new(Duration::from_secs(5)))
            .service(Instant200)
    }

    /// tower's `Timeout` (10 s), `Retry` with [`CloneAndRetry`] (2 retries)
    /// and `Timeout` (5 s).
    pub fn tower_retry() -> impl Variant<Err = BoxError> {
        ServiceBuilder::new()
            .timeout(Duration::from_secs(10))
            .retry(CloneAndRetry { left: 2 })
            .timeout(Duration::from_secs(5))
            .service(Instant200)
    }

    /// [`tower_retry`] after writing what resend carries per call: a
    /// `Deadline` on the request, a history on the response (comparison only).
    pub fn tower_retry_ext() -> impl Variant {
        ServiceBuilder::new()
            .map_request(carried::deadline)
            .map_response(carried::history)
            .service(tower_retry())
    }

    /// The full `tower_resend::stack()` with its defaults, named.
    pub fn stack() -> impl Variant {
        tower_resend::stack().name("bench").service(Instant200)
    }

    /// [`stack`] with nothing read ahead (`read_ahead(0)`).
    pub fn stack_no_read_ahead() -> impl Variant {
        tower_resend::stack()
            .name("bench")
            .read_ahead(0)
            .service(Instant200)
    }

    /// [`stack`] with adaptive client-side throttling on.
    pub fn stack_throttled() -> impl Variant {
        tower_resend::stack()
            .name("bench")
            .adaptive_throttling()
            .service(Instant200)
    }

    /// [`stack`] paced by the quota every answer states (never near spent),
    /// over [`Quota200`](super::Quota200).
    pub fn stack_paced() -> impl Variant {
        tower_resend::stack()
            .name("bench")
            .pace(tower_resend::quota::PaceLayer::new())
            .service(super::Quota200)
    }

    /// [`stack`] over [`Quota200`](super::Quota200), not paced: the same
    /// answers, read by nobody.
    pub fn stack_quota_unpaced() -> impl Variant {
        tower_resend::stack().name("bench").service(super::Quota200)
    }

    /// [`stack`] with the circuit breaker on, with its defaults.
    pub fn stack_breaker() -> impl Variant {
        tower_resend::stack()
            .name("bench")
            .circuit_breaker()
            .service(Instant200)
    }
}

/// tower's retry policy as a tower user writes it for the same behaviour
/// as the stack: 5xx and errors retried, `left` more times, after
/// `backoff`; with `budget`, tower's `TpsBudget` (a deposit per success, a
/// withdrawal per retry). The simulator's `Client::TowerRetry` and
/// `three_down`'s tower column.
#[derive(Clone, Debug)]
pub struct TowerRetry<K> {
    /// Retries left.
    pub left: u32,
    /// The waits between attempts.
    pub backoff: K,
    /// tower's retry budget, if any.
    pub budget: Option<std::sync::Arc<tower::retry::budget::TpsBudget>>,
}

impl<K, R, E> tower::retry::Policy<Request<Body>, Response<R>, E> for TowerRetry<K>
where
    K: tower::retry::backoff::Backoff,
{
    type Future = K::Future;

    fn retry(
        &mut self,
        _: &mut Request<Body>,
        result: &mut Result<Response<R>, E>,
    ) -> Option<Self::Future> {
        use tower::retry::budget::Budget;
        match result {
            Ok(r) if !r.status().is_server_error() => {
                if let Some(budget) = &self.budget {
                    budget.deposit();
                }
                None
            }
            _ if self.left > 0 && self.budget.as_ref().is_none_or(|b| b.withdraw()) => {
                self.left -= 1;
                Some(self.backoff.next_backoff())
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Request<Body>) -> Option<Request<Body>> {
        Some(req.clone())
    }
}

/// tower's exponential backoff as the tower columns use it: 100 ms to 5 s,
/// jittered by `rng`.
pub fn tower_backoff<R>(rng: R) -> tower::retry::backoff::ExponentialBackoff<R>
where
    R: tower::util::rng::Rng + Clone,
{
    use tower::retry::backoff::{ExponentialBackoffMaker, MakeBackoff};
    ExponentialBackoffMaker::new(Duration::from_millis(100), Duration::from_secs(5), 1.0, rng)
        .expect("a valid backoff")
        .make_backoff()
}

/// A stack as a caller that only keeps each answer's status, boxed so that
/// every column of a bench has one type.
pub fn statuses<S, RB>(
    stack: S,
) -> tower::util::BoxCloneService<Request<Body>, http::StatusCode, tower::BoxError>
where
    S: Service<Request<Body>, Response = Response<RB>, Error = tower_resend::Error>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    use tower::ServiceExt;
    tower::util::BoxCloneService::new(
        stack
            .map_response(|r| r.status())
            .map_err(tower::BoxError::from),
    )
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sends `concurrency * per_task` GETs to `uri` through clones of `svc`
/// (`concurrency` tasks, each `per_task` requests in turn, every body read
/// in full) and returns how long it took.
pub async fn send_batch<S, B>(
    svc: S,
    uri: http::Uri,
    concurrency: usize,
    per_task: usize,
) -> Duration
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: http_body::Body + Send,
    B::Error: std::fmt::Debug,
    B::Data: Send,
{
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let svc = svc.clone();
        let uri = uri.clone();
        tasks.spawn(async move {
            for _ in 0..per_task {
                let req = Request::get(uri.clone())
                    .body(Body::new())
                    .expect("request");
                let resp = svc.clone().oneshot(req).await.expect("answered");
                resp.into_body().collect().await.expect("body");
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("task");
    }
    start.elapsed()
}

/// Keyed POSTs on loopback for the server benches: an axum server on
/// 127.0.0.1, and tasks that send to it, each request with a fresh key.
pub mod keyed {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    use bytes::Bytes;
    use http::Request;
    use http_body_util::{BodyExt, Full};
    use tokio::net::TcpListener;
    use tokio::task::JoinHandle;
    use tower::ServiceExt;

    /// Serves `app` on 127.0.0.1 (a port of its own); its `/orders` URL.
    pub async fn serve(app: axum::Router) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("its address");
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/orders")
    }

    /// `concurrency` tasks POSTing to a URL through a client, one after the
    /// other each, until stopped; every key new (unique to this load:
    /// stores keep the earlier ones), every answer a success, read whole.
    #[derive(Debug)]
    pub struct Load {
        count: Arc<AtomicU64>,
        stop: Arc<AtomicBool>,
        tasks: Vec<JoinHandle<()>>,
    }

    impl Load {
        /// Starts the senders.
        pub fn start(
            client: &tower_resend::connect::HyperClient,
            url: &str,
            concurrency: usize,
        ) -> Self {
            let count = Arc::new(AtomicU64::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let run = uuid::Uuid::new_v4().simple().to_string();
            let tasks = (0..concurrency)
                .map(|w| {
                    let (client, count, stop, url, run) = (
                        client.clone(),
                        count.clone(),
                        stop.clone(),
                        url.to_owned(),
                        run.clone(),
                    );
                    tokio::spawn(async move {
                        let mut i = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            i += 1;
                            let req = Request::post(&url)
                                .header("idempotency-key", format!("{run}-{w}-{i}"))
                                .body(Full::new(Bytes::from_static(
                                    b"{\"sku\":\"abc\",\"qty\":1}",
                                )))
                                .expect("a request");
                            let resp = client.clone().oneshot(req).await.expect("an answer");
                            assert!(resp.status().is_success(), "{url}: {}", resp.status());
                            resp.into_body().collect().await.expect("its body");
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            Self { count, stop, tasks }
        }

        /// The answers so far.
        pub fn answered(&self) -> u64 {
            self.count.load(Ordering::Relaxed)
        }

        /// Stops the tasks, once their requests in flight are answered.
        pub async fn stop(self) {
            self.stop.store(true, Ordering::Relaxed);
            for t in self.tasks {
                t.await.expect("a sender");
            }
        }
    }
}

/// A hyper-util client over plain HTTP, as the loopback benches build it.
pub type Bare =
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Body>;

/// `client`, sending every request to `authority` (one instance, for
/// tower's balancer, which needs a service per instance).
#[derive(Clone, Debug)]
pub struct To {
    /// The instance.
    pub authority: http::uri::Authority,
    /// The client that takes the requests there.
    pub client: Bare,
}

impl Service<Request<Body>> for To {
    type Response = <Bare as Service<Request<Body>>>::Response;
    type Error = <Bare as Service<Request<Body>>>::Error;
    type Future = <Bare as Service<Request<Body>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.client.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = req.uri().path_and_query().cloned();
        if let Ok(uri) = http::Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
        self.client.call(req)
    }
}
