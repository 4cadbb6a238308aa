//! The rules of DESIGN section 7, written once, run on every store.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::type_complexity,
    clippy::print_stderr
)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use tokio::sync::{Notify, Semaphore};
use tower::{Layer, Service, ServiceExt};
use tower_resend_server::idempotency::Backend;
use tower_resend_server::store::{
    Begin, Claim, Fingerprint, LeaseState, LeaseToken, RecordKey, StoreError, StoredResponse, Ttl,
};
use tower_resend_server::{Idempotency, IdempotencyLayer, MaybeBuffered, NothingDone, Store};

/// A unique key prefix, so tests sharing a Redis or PostgreSQL never meet.
pub fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

/// True when a missing service must fail the run (CI) rather than skip.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

/// What the test handler saw and did.
#[derive(Clone)]
pub struct Handler {
    pub runs: Arc<AtomicUsize>,
    pub started: Arc<Notify>,
    pub gate: Arc<Semaphore>,
    pub bodies: Arc<Mutex<Vec<Bytes>>>,
}

/// The handler's response body: a full one, or one that fails after its
/// first bytes (`x-body-fail`).
pub type HBody = BoxBody<Bytes, tower_resend::BoxError>;
pub type Resp = Response<MaybeBuffered<HBody>>;

/// A body that sends `part`, then fails.
struct Failing(Option<Bytes>);

impl http_body::Body for Failing {
    type Data = Bytes;
    type Error = tower_resend::BoxError;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(Some(match self.0.take() {
            Some(part) => Ok(http_body::Frame::data(part)),
            None => Err("the body broke".into()),
        }))
    }
}

#[derive(Debug)]
pub struct HandlerFailed;
impl std::fmt::Display for HandlerFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("handler failed")
    }
}
impl std::error::Error for HandlerFailed {}

impl Default for Handler {
    fn default() -> Self {
        Self {
            runs: Arc::default(),
            started: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
            bodies: Arc::default(),
        }
    }
}

impl Handler {
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// A handler that counts its runs and echoes the body with status 201,
    /// or the status in `x-status`; fails on `x-fail`; panics on `x-panic`;
    /// marks its answer `NothingDone` on `x-nothing-done`; answers a body
    /// that breaks after its head on `x-body-fail`; sets a cookie on
    /// `x-set-cookie`; waits for the gate on `x-wait`; sleeps `x-sleep-ms`.
    pub fn service(
        &self,
    ) -> impl Service<
        Request<MaybeBuffered<Full<Bytes>>>,
        Response = Response<HBody>,
        Error = tower_resend::BoxError,
        Future = impl Send,
    > + Clone
           + Send
           + 'static {
        let h = self.clone();
        tower::service_fn(move |req: Request<MaybeBuffered<Full<Bytes>>>| {
            let h = h.clone();
            async move {
                let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
                h.started.notify_one();
                let has = |name: &str| req.headers().contains_key(name);
                let (wait, fail, hop) = (has("x-wait"), has("x-fail"), has("x-hop"));
                let (panics, nothing_done) = (has("x-panic"), has("x-nothing-done"));
                let (body_fails, cookie) = (has("x-body-fail"), has("x-set-cookie"));
                let sleep = req
                    .headers()
                    .get("x-sleep-ms")
                    .and_then(|v| v.to_str().ok()?.parse().ok());
                let status = req
                    .headers()
                    .get("x-status")
                    .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
                    .unwrap_or(201);
                let body = req.into_body().collect().await?.to_bytes();
                h.bodies.lock().unwrap().push(body.clone());
                if wait {
                    h.gate.acquire().await?.forget();
                }
                if let Some(ms) = sleep {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                if fail {
                    return Err(HandlerFailed.into());
                }
                assert!(!panics, "the handler was told to panic");
                let text = Bytes::from(format!("run {n}: {}", String::from_utf8_lossy(&body)));
                let body = if body_fails {
                    Failing(Some(text)).boxed()
                } else {
                    Full::new(text).map_err(|e| match e {}).boxed()
                };
                let mut resp = Response::new(body);
                *resp.status_mut() = StatusCode::from_u16(status).unwrap();
                resp.headers_mut().insert("x-run", n.into());
                if hop {
                    resp.headers_mut()
                        .insert("keep-alive", HeaderValue::from_static("timeout=5"));
                }
                if cookie {
                    resp.headers_mut()
                        .insert("set-cookie", HeaderValue::from_static("csrf=secret-of-run"));
                }
                if nothing_done {
                    resp.extensions_mut().insert(NothingDone);
                }
                Ok(resp)
            }
        })
    }
}

pub fn layer<St: Backend>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
}

pub fn post(key: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post("/orders?x=1")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

pub async fn call<S>(svc: &S, req: Request<Full<Bytes>>) -> Result<Resp, tower_resend::BoxError>
where
    S: Service<Request<Full<Bytes>>, Response = Resp, Error = tower_resend::BoxError> + Clone,
{
    svc.clone().oneshot(req).await
}

/// Sends `req` on a task of its own, marked to wait at the handler's gate,
/// and returns once the handler has started on it (so its lease is taken).
pub async fn start_held<S>(
    h: &Handler,
    s: &S,
    mut req: Request<Full<Bytes>>,
) -> tokio::task::JoinHandle<Result<Resp, tower_resend::BoxError>>
where
    S: Service<Request<Full<Bytes>>, Response = Resp, Error = tower_resend::BoxError>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
{
    req.headers_mut()
        .insert("x-wait", HeaderValue::from_static("1"));
    let started = h.started.notified();
    let task = tokio::spawn({
        let s = s.clone();
        async move { call(&s, req).await }
    });
    started.await;
    task
}

pub async fn text(resp: Resp) -> String {
    String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap()
}

pub fn svc<St: Backend>(
    h: &Handler,
    layer: IdempotencyLayer<St>,
) -> Idempotency<
    impl Service<
            Request<MaybeBuffered<Full<Bytes>>>,
            Response = Response<HBody>,
            Error = tower_resend::BoxError,
            Future = impl Send,
        > + Clone
        + Send
        + 'static,
    St,
> {
    layer.layer(h.service())
}

// ---- the rules ----

pub async fn key_syntax<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let long = format!("{}{}", unique("k"), "x".repeat(255));
    for bad in ["has space", "tab\there", long.as_str()] {
        let req = Request::post("/orders")
            .header(
                "idempotency-key",
                http::HeaderValue::from_bytes(bad.as_bytes()).unwrap(),
            )
            .body(Full::new(Bytes::new()))
            .unwrap();
        assert_eq!(
            call(&s, req).await.unwrap().status(),
            StatusCode::BAD_REQUEST,
            "{bad:?}"
        );
    }
    assert_eq!(h.runs(), 0);
    // 255 visible characters are fine; X-Idempotency-Key works too.
    let mut ok = unique("k");
    ok.push_str(&"~".repeat(255 - ok.len()));
    assert_eq!(
        call(&s, post(&ok, "a")).await.unwrap().status(),
        StatusCode::CREATED
    );
    let x = unique("x");
    let req = || {
        Request::post("/orders?x=1")
            .header("x-idempotency-key", &x)
            .body(Full::new(Bytes::from_static(b"a")))
            .unwrap()
    };
    assert_eq!(call(&s, req()).await.unwrap().status(), StatusCode::CREATED);
    let again = call(&s, req()).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 2);
}

pub async fn required_key<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(
        &h,
        layer(store).require_key_when(|p| p.uri.path() == "/payments"),
    );
    let req = |path: &str| Request::post(path).body(Full::new(Bytes::new())).unwrap();
    assert_eq!(
        call(&s, req("/payments")).await.unwrap().status(),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(h.runs(), 0);
    assert_eq!(
        call(&s, req("/orders")).await.unwrap().status(),
        StatusCode::CREATED
    );
    // Safe methods never need one.
    let get = Request::get("/payments")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(call(&s, get).await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(h.runs(), 2);
}

pub async fn replay<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let key = unique("replay");
    let first = call(&s, post(&key, "hello")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    // The response goes out with its own headers (lent to the store while it
    // is stored).
    assert_eq!(first.headers()["x-run"], "1");
    assert_eq!(text(first).await, "run 1: hello");
    for _ in 0..3 {
        let again = call(&s, post(&key, "hello")).await.unwrap();
        assert_eq!(again.status(), StatusCode::CREATED);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["x-run"], "1");
        assert_eq!(text(again).await, "run 1: hello");
    }
    assert_eq!(h.runs(), 1);
    // A hop-by-hop header goes out with the first response only.
    let hop_key = unique("replay-hop");
    let mut hop = post(&hop_key, "hop");
    hop.headers_mut()
        .insert("x-hop", HeaderValue::from_static("1"));
    let first = call(&s, hop).await.unwrap();
    assert_eq!(first.headers()["keep-alive"], "timeout=5");
    assert_eq!(first.headers()["x-run"], "2");
    let again = call(&s, post(&hop_key, "hop")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["x-run"], "2");
    assert!(again.headers().get("keep-alive").is_none());
    assert_eq!(h.runs(), 2);
    // The handler got the body back.
    assert_eq!(h.bodies.lock().unwrap()[0], "hello");
    // 4xx answers are final too, and stored.
    let k4 = unique("four");
    let req = || {
        let mut r = post(&k4, "x");
        r.headers_mut().insert("x-status", "404".parse().unwrap());
        r
    };
    assert_eq!(
        call(&s, req()).await.unwrap().status(),
        StatusCode::NOT_FOUND
    );
    let again = call(&s, req()).await.unwrap();
    assert_eq!(again.status(), StatusCode::NOT_FOUND);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 3);
}

pub async fn in_progress_conflict<St: Store>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let key = unique("busy");
    let running = start_held(&h, &s, post(&key, "a")).await;
    let busy = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    assert_eq!(busy.headers()["retry-after"], "1");
    // Another fingerprint while in progress: 422.
    assert_eq!(
        call(&s, post(&key, "b")).await.unwrap().status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    h.gate.add_permits(1);
    assert_eq!(
        running.await.unwrap().unwrap().status(),
        StatusCode::CREATED
    );
    let after = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(after.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1);
}

pub async fn fingerprint_mismatch<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let key = unique("fp");
    assert_eq!(
        call(&s, post(&key, "a")).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(
        call(&s, post(&key, "b")).await.unwrap().status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let other_path = Request::post("/orders?x=2")
        .header("idempotency-key", &key)
        .body(Full::new(Bytes::from_static(b"a")))
        .unwrap();
    assert_eq!(
        call(&s, other_path).await.unwrap().status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let other_method = Request::patch("/orders?x=1")
        .header("idempotency-key", &key)
        .body(Full::new(Bytes::from_static(b"a")))
        .unwrap();
    assert_eq!(
        call(&s, other_method).await.unwrap().status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(h.runs(), 1);
}

/// Retries `f` until it gives something other than 409, a bounded number of times.
pub async fn until_not_conflict<S>(s: &S, mk: impl Fn() -> Request<Full<Bytes>>) -> Resp
where
    S: Service<Request<Full<Bytes>>, Response = Resp, Error = tower_resend::BoxError> + Clone,
{
    for _ in 0..200 {
        let r = call(s, mk()).await.unwrap();
        if r.status() != StatusCode::CONFLICT {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("still 409 after 200 tries");
}

/// `req` with the header `name` set.
pub fn with(
    mut req: Request<Full<Bytes>>,
    name: &'static str,
    value: &str,
) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert(name, HeaderValue::from_str(value).unwrap());
    req
}

/// Once the handler has started, its end is kept — 5xx, errors, panics and
/// lost bodies included — and replayed; only a response that says nothing
/// was done (`NothingDone`, or a 429) drops the lease, so a retry runs.
pub async fn what_is_kept<St: Store>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let mut runs = 0;
    // Final responses, 5xx included: stored and replayed; no second run.
    for code in ["500", "502", "503", "504", "400"] {
        let key = unique("kept");
        let first = call(&s, with(post(&key, "a"), "x-status", code))
            .await
            .unwrap();
        runs += 1;
        assert_eq!(first.status().as_str(), code);
        let again = call(&s, post(&key, "a")).await.unwrap();
        assert_eq!(again.status().as_str(), code, "replay of {code}");
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["x-run"], runs.to_string().as_str());
        assert_eq!(h.runs(), runs, "{code} must not run again");
    }
    // Nothing was done: a 429, or any response marked NothingDone.
    for (header, value) in [("x-status", "429"), ("x-nothing-done", "1")] {
        let key = unique("nothing");
        let mut first = with(post(&key, "a"), header, value);
        first.headers_mut().insert(
            "x-status",
            if header == "x-status" { "429" } else { "503" }
                .parse()
                .unwrap(),
        );
        let first = call(&s, first).await.unwrap();
        runs += 1;
        assert!(first.status().as_u16() >= 429);
        let again = call(&s, post(&key, "a")).await.unwrap();
        runs += 1;
        assert_eq!(again.status(), StatusCode::CREATED, "after {header}");
        assert!(again.headers().get("idempotent-replayed").is_none());
        assert_eq!(h.runs(), runs);
    }
    // A handler error reaches its first caller as it is; the key's end is a
    // 500 saying so, and the handler does not run again.
    let key = unique("err");
    assert!(call(&s, with(post(&key, "a"), "x-fail", "1"))
        .await
        .is_err());
    runs += 1;
    let again = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(again.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert!(text(again).await.contains("handler_failed"));
    // A panic: a 500 for the first caller and the replays.
    let key = unique("panic");
    let first = call(&s, with(post(&key, "a"), "x-panic", "1"))
        .await
        .unwrap();
    runs += 1;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(text(first).await.contains("handler_panicked"));
    let again = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(again.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    // A 201 whose body fails after its head: stored as a 500 saying the
    // response was lost; the work is not run again.
    let key = unique("lost");
    let first = call(&s, with(post(&key, "a"), "x-body-fail", "1"))
        .await
        .unwrap();
    runs += 1;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(text(first).await.contains("response_lost"));
    let again = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(again.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert!(text(again).await.contains("response_lost"));
    assert_eq!(h.runs(), runs);
}

/// A caller that goes away (its connection dropped, its attempt timed out)
/// does not cancel the work: the handler runs to its end, the retry gets
/// 409 while it runs and the stored response after.
pub async fn a_caller_that_goes_away_does_not_cancel_the_work<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let key = unique("gone");
    let task = start_held(&h, &s, post(&key, "a")).await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let busy = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    assert_eq!(h.runs(), 1);
    h.gate.add_permits(1);
    let r = until_not_conflict(&s, || post(&key, "a")).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(text(r).await, "run 1: a");
    assert_eq!(h.runs(), 1);
}

/// A handler slower than its lease (`work` against `lease`), whose caller
/// gives up at `patience` and retries, each retry reaching another process:
/// the lease is renewed while it works,
/// so it runs once; the retries get 409, then the replay.
pub async fn a_slow_handler_keeps_its_lease<St: Store>(
    store: St,
    work: Duration,
    lease: Duration,
    patience: Duration,
) {
    let h = Handler::default();
    let s = svc(&h, layer(store.clone()).lease(lease));
    // The retries reach another process (a layer of its own on the same
    // store), which only the store's lease, renewed, can hold off.
    let elsewhere = svc(&h, layer(store).lease(lease));
    let key = unique("slow");
    let req = || with(post(&key, "a"), "x-sleep-ms", &work.as_millis().to_string());
    let start = tokio::time::Instant::now();
    assert!(tokio::time::timeout(patience, call(&s, req()))
        .await
        .is_err());
    let (mut conflicts, mut answer) = (0, None);
    while start.elapsed() < work * 3 {
        match tokio::time::timeout(patience, call(&elsewhere, req())).await {
            Ok(r) if r.as_ref().unwrap().status() == StatusCode::CONFLICT => conflicts += 1,
            Ok(r) => {
                answer = Some(r.unwrap());
                break;
            }
            Err(_) => panic!("a retry hung"),
        }
        tokio::time::sleep(patience).await;
    }
    let r = answer.expect("the replay");
    assert!(conflicts >= 2, "{conflicts} conflicts");
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1, "one run, however long it takes");
}

/// Every pair of callers with different credentials (bearer, basic, cookie,
/// API key, none): the second, sending the first's key and body, is never
/// replayed the first's response; `Set-Cookie` is never replayed, even to
/// its own caller.
pub async fn callers_never_see_each_others_responses<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store.clone()));
    let callers: [(&str, &str); 8] = [
        ("authorization", "Bearer alice"),
        ("authorization", "Bearer bob"),
        ("authorization", "Basic YWxpY2U6cHc="),
        ("cookie", "session=alice"),
        ("cookie", "session=bob"),
        ("x-api-key", "key-alice"),
        ("x-api-key", "key-bob"),
        ("", ""),
    ];
    let as_ = |who: (&str, &str), key: &str| {
        let mut r = with(post(key, "same"), "x-set-cookie", "1");
        if !who.0.is_empty() {
            r.headers_mut().insert(
                http::HeaderName::from_bytes(who.0.as_bytes()).unwrap(),
                who.1.parse().unwrap(),
            );
        }
        r
    };
    let mut leaks = Vec::new();
    for (i, &x) in callers.iter().enumerate() {
        for (j, &y) in callers.iter().enumerate() {
            if i == j {
                continue;
            }
            let key = unique("pair");
            let first = call(&s, as_(x, &key)).await.unwrap();
            assert_eq!(first.headers()["set-cookie"], "csrf=secret-of-run");
            let run = first.headers()["x-run"].clone();
            let other = call(&s, as_(y, &key)).await.unwrap();
            if other.headers().contains_key("idempotent-replayed")
                || other.headers()["x-run"] == run
            {
                leaks.push((x, y));
            }
            // The first caller's own replay: its response, without the cookie.
            let own = call(&s, as_(x, &key)).await.unwrap();
            assert_eq!(own.headers()["idempotent-replayed"], "true");
            assert_eq!(own.headers()["x-run"], run);
            assert!(own.headers().get("set-cookie").is_none());
        }
    }
    assert!(leaks.is_empty(), "cross-caller replays: {leaks:?}");
    // A scope function of the server's choosing.
    let t = svc(
        &h,
        layer(store.clone()).scope_with(|p| {
            p.headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        }),
    );
    let key = unique("tenant");
    let as_tenant = |who: &'static str| with(post(&key, "b"), "x-tenant", who);
    let a = call(&t, as_tenant("A")).await.unwrap().headers()["x-run"].clone();
    let b = call(&t, as_tenant("B")).await.unwrap().headers()["x-run"].clone();
    assert_ne!(a, b);
    assert_eq!(
        call(&t, as_tenant("A")).await.unwrap().headers()["x-run"],
        a
    );
    // Callers without credentials refused, when so configured.
    let strict = svc(
        &h,
        layer(store).anonymous(tower_resend_server::idempotency::Anonymous::Refuse),
    );
    let before = h.runs();
    let anon = call(&strict, post(&unique("anon"), "x")).await.unwrap();
    assert_eq!(anon.status(), StatusCode::BAD_REQUEST);
    assert!(text(anon)
        .await
        .contains("idempotency_key_needs_credentials"));
    let known = call(&strict, as_(callers[0], &unique("known")))
        .await
        .unwrap();
    assert_eq!(known.status(), StatusCode::CREATED);
    assert_eq!(h.runs(), before + 1);
}

/// A store that fails `complete` while `failing` is set.
#[derive(Clone)]
pub struct FlakyComplete<St> {
    pub inner: St,
    pub failing: Arc<std::sync::atomic::AtomicBool>,
}

impl<St: Store> Store for FlakyComplete<St> {
    fn begin(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl std::future::Future<Output = Result<Begin, StoreError>> + Send {
        self.inner.begin(claim, ttl)
    }
    fn renew(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
        self.inner.renew(claim, ttl)
    }
    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
        let inner = (!self.failing.load(Ordering::SeqCst))
            .then(|| self.inner.complete(claim, response, ttl));
        async move {
            match inner {
                Some(inner) => inner.await,
                None => Err(StoreError::new("down after the work")),
            }
        }
    }
    fn release(
        &self,
        claim: &Claim<'_>,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.inner.release(claim)
    }
}

/// The store fails when the work is done: the response reaches its caller,
/// is held (this process answers the key from it: replays, never a second
/// run), and is stored in the background once the store answers again; then
/// any process replays it from the store.
pub async fn a_store_write_that_fails_after_the_work_is_held_and_retried<St: Store>(store: St) {
    let h = Handler::default();
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flaky = FlakyComplete {
        inner: store.clone(),
        failing: failing.clone(),
    };
    let l = layer(flaky);
    let stats = l.stats();
    let s = svc(&h, l);
    let key = unique("held");
    let first = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(text(first).await, "run 1: a");
    for _ in 0..3 {
        let again = call(&s, post(&key, "a")).await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(text(again).await, "run 1: a");
    }
    // Another fingerprint: 422, as the store would say.
    assert_eq!(
        call(&s, post(&key, "b")).await.unwrap().status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(h.runs(), 1);
    assert_eq!((stats.held(), stats.stored_late()), (1, 0));
    failing.store(false, Ordering::SeqCst);
    for _ in 0..500 {
        if stats.stored_late() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        (
            stats.held(),
            stats.stored_late(),
            stats.unstored(),
            stats.leases_lost()
        ),
        (0, 1, 0, 0),
        "{stats:?}"
    );
    // A fresh layer (another process) finds the record in the store.
    let other = svc(&h, layer(store));
    let replay = call(&other, post(&key, "a")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(text(replay).await, "run 1: a");
    assert_eq!(h.runs(), 1);
}

/// Settings at their extremes are clamped, never a store that answers 503
/// or 409 forever; a lease asked to be zero still excludes.
pub async fn extreme_settings_still_work<St: Store>(store: St) {
    let h = Handler::default();
    let s = svc(
        &h,
        layer(store.clone())
            .lease(Duration::MAX)
            .record_ttl(Duration::MAX),
    );
    let key = unique("max");
    assert_eq!(
        call(&s, post(&key, "a")).await.unwrap().status(),
        StatusCode::CREATED
    );
    let again = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let z = svc(
        &h,
        layer(store)
            .lease(Duration::ZERO)
            .record_ttl(Duration::ZERO),
    );
    let key = unique("zero");
    let running = start_held(&h, &z, post(&key, "a")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        call(&z, post(&key, "a")).await.unwrap().status(),
        StatusCode::CONFLICT
    );
    h.gate.add_permits(1);
    assert_eq!(
        running.await.unwrap().unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(h.runs(), 2);
}

/// A holder that died without a word (a crashed process): its lease is
/// taken over once it expires, and not before.
pub async fn stale_lease_taken_over<St: Store>(store: St, lease: Duration) {
    let h = Handler::default();
    let s = svc(
        &h,
        layer(store.clone())
            .lease(lease)
            .scope_with(|_| "stale".into()),
    );
    let key = unique("stale");
    // Write the dead holder's lease straight into the store, with the
    // fingerprint the request will have.
    let fp = fingerprint_of(&post(&key, "a")).await;
    let rk = RecordKey {
        scope: "stale",
        key: &key,
    };
    let ttl = Ttl {
        lease,
        record: Duration::from_secs(60),
    };
    let claim = Claim {
        key: rk,
        fingerprint: fp,
        token: LeaseToken::random(),
    };
    assert_eq!(store.begin(&claim, ttl).await.unwrap(), Begin::Acquired);
    assert_eq!(
        call(&s, post(&key, "a")).await.unwrap().status(),
        StatusCode::CONFLICT
    );
    assert_eq!(h.runs(), 0);
    tokio::time::sleep(lease + Duration::from_millis(20)).await;
    let r = until_not_conflict(&s, || post(&key, "a")).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(h.runs(), 1);
}

/// A holder whose lease expired and was taken over (a process paused, or
/// cut off from the store, past its lease) can no longer touch the key: its
/// renew and its complete find the lease lost and write nothing, and its
/// release leaves the new holder's lease; the new holder's response is the
/// one kept, and a stale complete after it does not replace it. (The
/// atomic "if still mine" of the `Store` contract, on each store.)
pub async fn a_stale_holder_cannot_touch_the_new_holders_lease<St: Store>(
    store: St,
    lease: Duration,
) {
    let key = unique("taken-over");
    let claim = || Claim {
        key: RecordKey {
            scope: "takeover",
            key: &key,
        },
        fingerprint: Fingerprint([7; 32]),
        token: LeaseToken::random(),
    };
    let (stale, new, other) = (claim(), claim(), claim());
    let ttl = Ttl {
        lease,
        record: Duration::from_secs(60),
    };
    let response = |body: &'static str| StoredResponse {
        status: StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Bytes::from_static(body.as_bytes()),
        body_omitted: false,
        trailers: None,
    };
    let in_progress = |found: Begin| matches!(found, Begin::InProgress { .. });
    assert_eq!(store.begin(&stale, ttl).await.unwrap(), Begin::Acquired);
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    assert_eq!(store.begin(&new, ttl).await.unwrap(), Begin::Acquired);

    assert_eq!(store.renew(&stale, ttl).await.unwrap(), LeaseState::Lost);
    store.release(&stale).await.unwrap();
    assert!(
        in_progress(store.begin(&other, ttl).await.unwrap()),
        "the stale holder's release left the new holder's lease"
    );
    // The stale holder's complete, which finds the lease lost.
    let stale_complete = || async {
        assert_eq!(
            store
                .complete(&stale, &response("stale"), ttl)
                .await
                .unwrap(),
            LeaseState::Lost
        );
    };
    stale_complete().await;
    assert!(
        in_progress(store.begin(&other, ttl).await.unwrap()),
        "the stale holder's response was not stored"
    );

    assert_eq!(store.renew(&new, ttl).await.unwrap(), LeaseState::Held);
    assert_eq!(
        store.complete(&new, &response("new"), ttl).await.unwrap(),
        LeaseState::Held
    );
    // The new holder's complete again (its first answer was lost on the
    // way): it finds its own record, stored.
    assert_eq!(
        store.complete(&new, &response("new"), ttl).await.unwrap(),
        LeaseState::Held,
        "a holder's repeated complete was told its lease is lost"
    );
    // A renewal of the new holder's that lands after its complete (sent
    // before it, to a store that stalled: Redis paused) finds the holder's
    // own finished record: its response is stored, no lease is lost, and
    // nothing is written. The stale holder's still finds the lease lost.
    assert_eq!(
        store.renew(&new, ttl).await.unwrap(),
        LeaseState::Completed,
        "a renewal that crossed its own complete cried wolf"
    );
    assert_eq!(store.renew(&stale, ttl).await.unwrap(), LeaseState::Lost);
    stale_complete().await;
    store.release(&stale).await.unwrap();
    match store.begin(&other, ttl).await.unwrap() {
        Begin::Completed { response: kept, .. } => assert_eq!(*kept, response("new")),
        found => panic!("the new holder's response is kept, found {found:?}"),
    }
}

/// The fingerprint the layer computes for `req`, found by asking a memory
/// store what a request left in it.
pub async fn fingerprint_of(req: &Request<Full<Bytes>>) -> Fingerprint {
    #[derive(Clone, Default)]
    struct Spy(Arc<Mutex<Option<Fingerprint>>>);
    impl Store for Spy {
        fn begin(
            &self,
            claim: &Claim<'_>,
            _: Ttl,
        ) -> impl std::future::Future<Output = Result<Begin, StoreError>> + Send {
            *self.0.lock().unwrap() = Some(claim.fingerprint);
            std::future::ready(Err(StoreError::new("spy")))
        }
        fn renew(
            &self,
            _: &Claim<'_>,
            _: Ttl,
        ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
            std::future::ready(Ok(LeaseState::Held))
        }
        fn complete(
            &self,
            _: &Claim<'_>,
            _: &StoredResponse,
            _: Ttl,
        ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
            std::future::ready(Ok(LeaseState::Held))
        }
        fn release(
            &self,
            _: &Claim<'_>,
        ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
            std::future::ready(Ok(()))
        }
    }
    let spy = Spy::default();
    let s = svc(&Handler::default(), layer(spy.clone()));
    let mut copy = Request::builder()
        .method(req.method())
        .uri(req.uri())
        .body(req.body().clone())
        .unwrap();
    *copy.headers_mut() = req.headers().clone();
    let _ = call(&s, copy).await;
    let fp = spy.0.lock().unwrap().take().unwrap();
    fp
}

/// A lease the store loses while its handler works (Redis restarted
/// without persistence, a row purged) is written anew by the holder's next
/// renewal, so a retry gets 409, not a second run. `lose(scope, key)` takes
/// the record out of the store behind the layer's back; `present(scope,
/// key)` tells whether it is there. Waits on the real clock (the store's),
/// for the renewal, a tenth of the lease at a time, at most 20 leases.
pub async fn a_lost_lease_is_written_anew_by_its_renewal<St, L, P>(
    store: St,
    lease: Duration,
    lose: L,
    present: P,
) where
    St: Store,
    L: AsyncFnOnce(&str, &str),
    P: AsyncFn(&str, &str) -> bool,
{
    let h = Handler::default();
    let scope = unique("lost");
    let s = {
        let scope = scope.clone();
        svc(
            &h,
            layer(store).lease(lease).scope_with(move |_| scope.clone()),
        )
    };
    let key = unique("lost");
    let first = start_held(&h, &s, post(&key, "a")).await;
    assert!(present(&scope, &key).await, "the lease was taken");
    // (`lose` checks that it took the record out: a renewal may write it
    // anew at once.)
    lose(&scope, &key).await;
    let lost_at = tokio::time::Instant::now();
    while !present(&scope, &key).await {
        assert!(
            lost_at.elapsed() < lease * 20,
            "the holder's renewals never wrote its lost lease anew"
        );
        tokio::time::sleep(lease / 10).await;
    }
    let again = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(again.status(), StatusCode::CONFLICT);
    h.gate.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let replay = call(&s, post(&key, "a")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1);
}

pub async fn records_expire<St: Backend>(store: St, ttl: Duration) {
    let h = Handler::default();
    let s = svc(&h, layer(store).record_ttl(ttl));
    let key = unique("expire");
    assert_eq!(
        text(call(&s, post(&key, "a")).await.unwrap()).await,
        "run 1: a"
    );
    assert_eq!(
        text(call(&s, post(&key, "a")).await.unwrap()).await,
        "run 1: a"
    );
    tokio::time::sleep(ttl + Duration::from_millis(20)).await;
    assert_eq!(
        text(call(&s, post(&key, "a")).await.unwrap()).await,
        "run 2: a"
    );
}

pub async fn safe_methods_pass_through<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let key = unique("get");
    for m in [http::Method::GET, http::Method::PUT, http::Method::DELETE] {
        for _ in 0..2 {
            let req = Request::builder()
                .method(m.clone())
                .uri("/x")
                .header("idempotency-key", &key)
                .body(Full::new(Bytes::new()))
                .unwrap();
            let r = call(&s, req).await.unwrap();
            assert!(r.headers().get("idempotent-replayed").is_none());
        }
    }
    // POST without a key passes through too.
    for _ in 0..2 {
        let req = Request::post("/x").body(Full::new(Bytes::new())).unwrap();
        assert_eq!(call(&s, req).await.unwrap().status(), StatusCode::CREATED);
    }
    assert_eq!(h.runs(), 8);
}

pub async fn body_caps<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store).request_cap(8).response_cap(10));
    let key = unique("big");
    let big = Request::post("/x")
        .header("idempotency-key", &key)
        .body(Full::new(Bytes::from_static(b"123456789")))
        .unwrap();
    assert_eq!(
        call(&s, big).await.unwrap().status(),
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(h.runs(), 0);
    // A response larger than the cap reaches the first caller whole; a
    // replay says its body was not kept.
    let req = || {
        Request::post("/x")
            .header("idempotency-key", &key)
            .body(Full::new(Bytes::from_static(b"12345678")))
            .unwrap()
    };
    let first = call(&s, req()).await.unwrap();
    assert_eq!(text(first).await, "run 1: 12345678");
    let again = call(&s, req()).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["idempotent-body-omitted"], "true");
    assert_eq!(again.headers()["x-run"], "1");
    assert_eq!(text(again).await, "");
    assert_eq!(h.runs(), 1);
}

/// 50 requests at once with one key: the handler runs once; every other
/// caller gets 409 or the replay.
pub async fn fifty_at_once<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let key = unique("fifty");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let s = s.clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let mut r = post(&key, "x");
            r.headers_mut().insert("x-sleep-ms", "50".parse().unwrap());
            call(&s, r).await.unwrap()
        }));
    }
    let mut tally: HashMap<&str, usize> = HashMap::new();
    for t in tasks {
        let r = t.await.unwrap();
        let what = match (r.status(), r.headers().contains_key("idempotent-replayed")) {
            (StatusCode::CREATED, false) => "ran",
            (StatusCode::CREATED, true) => "replayed",
            (StatusCode::CONFLICT, _) => "conflict",
            (other, _) => panic!("unexpected {other}"),
        };
        if r.status() == StatusCode::CREATED {
            assert_eq!(text(r).await, "run 1: x");
        }
        *tally.entry(what).or_default() += 1;
    }
    assert_eq!(tally.get("ran"), Some(&1), "{tally:?}");
    assert_eq!(tally.values().sum::<usize>(), 50);
    assert_eq!(h.runs(), 1, "the handler must run exactly once");
}

/// A store that cannot be reached: 503, nothing runs.
pub async fn store_down<St: Backend>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store).store_timeout(Duration::from_secs(2)));
    let r = call(&s, post(&unique("down"), "a")).await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(h.runs(), 0);
    // Requests without a key are not the store's business.
    let plain = Request::post("/x").body(Full::new(Bytes::new())).unwrap();
    assert_eq!(call(&s, plain).await.unwrap().status(), StatusCode::CREATED);
}

/// Generates one test per rule for a store made by `$make` (an async block
/// giving `Option<store>`; `None` skips).
#[macro_export]
macro_rules! store_rules {
    ($attrs:tt, $make:expr) => {
        $crate::store_rules!(@each $attrs $make;
            key_syntax required_key replay in_progress_conflict fingerprint_mismatch
            what_is_kept a_caller_that_goes_away_does_not_cancel_the_work
            callers_never_see_each_others_responses
            a_store_write_that_fails_after_the_work_is_held_and_retried
            extreme_settings_still_work safe_methods_pass_through body_caps fifty_at_once);
    };
    (@each $attrs:tt $make:expr; $($rule:ident)*) => {
        $(
            #[tokio::test $attrs]
            async fn $rule() {
                if let Some(store) = $make.await {
                    common::$rule(store).await;
                }
            }
        )*
    };
}

#[allow(unused)]
fn _unused(_: Infallible) {}
