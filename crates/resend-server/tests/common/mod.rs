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
use http_body_util::{BodyExt, Full};
use resend_server::store::{Fingerprint, LeaseToken, RecordKey, Ttl};
use resend_server::{Idempotency, IdempotencyLayer, MaybeBuffered, Store};
use tokio::sync::{Notify, Semaphore};
use tower::{Layer, Service, ServiceExt};

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

pub type Resp = Response<MaybeBuffered<Full<Bytes>>>;

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
    /// or the status in `x-status`; fails on `x-fail`; waits for the gate
    /// on `x-wait`; sleeps `x-sleep-ms`.
    pub fn service(
        &self,
    ) -> impl Service<
        Request<MaybeBuffered<Full<Bytes>>>,
        Response = Response<Full<Bytes>>,
        Error = resend::BoxError,
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
                let wait = req.headers().contains_key("x-wait");
                let fail = req.headers().contains_key("x-fail");
                let hop = req.headers().contains_key("x-hop");
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
                let mut resp = Response::new(Full::new(Bytes::from(format!(
                    "run {n}: {}",
                    String::from_utf8_lossy(&body)
                ))));
                *resp.status_mut() = StatusCode::from_u16(status).unwrap();
                resp.headers_mut().insert("x-run", n.into());
                if hop {
                    resp.headers_mut()
                        .insert("keep-alive", HeaderValue::from_static("timeout=5"));
                }
                Ok(resp)
            }
        })
    }
}

pub fn layer<St: Store>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
}

pub fn post(key: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post("/orders?x=1")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

pub async fn call<S>(svc: &S, req: Request<Full<Bytes>>) -> Result<Resp, resend::BoxError>
where
    S: Service<Request<Full<Bytes>>, Response = Resp, Error = resend::BoxError> + Clone,
{
    svc.clone().oneshot(req).await
}

/// Sends `req` on a task of its own, marked to wait at the handler's gate,
/// and returns once the handler has started on it (so its lease is taken).
pub async fn start_held<S>(
    h: &Handler,
    s: &S,
    mut req: Request<Full<Bytes>>,
) -> tokio::task::JoinHandle<Result<Resp, resend::BoxError>>
where
    S: Service<Request<Full<Bytes>>, Response = Resp, Error = resend::BoxError>
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

fn svc<St: Store>(
    h: &Handler,
    layer: IdempotencyLayer<St>,
) -> Idempotency<
    impl Service<
            Request<MaybeBuffered<Full<Bytes>>>,
            Response = Response<Full<Bytes>>,
            Error = resend::BoxError,
            Future = impl Send,
        > + Clone
        + Send
        + 'static,
    St,
> {
    layer.layer(h.service())
}

// ---- the rules ----

pub async fn key_syntax<St: Store>(store: St) {
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

pub async fn required_key<St: Store>(store: St) {
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

pub async fn replay<St: Store>(store: St) {
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

pub async fn fingerprint_mismatch<St: Store>(store: St) {
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
    S: Service<Request<Full<Bytes>>, Response = Resp, Error = resend::BoxError> + Clone,
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

pub async fn failures_drop_the_lease<St: Store>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    // A handler error.
    let key = unique("err");
    let mut failing = post(&key, "a");
    failing.headers_mut().insert("x-fail", "1".parse().unwrap());
    assert!(call(&s, failing).await.is_err());
    assert_eq!(
        call(&s, post(&key, "a")).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(h.runs(), 2);
    // A 5xx and a 429.
    for code in ["500", "503", "429"] {
        let key = unique("5xx");
        let mut r = post(&key, "a");
        r.headers_mut().insert("x-status", code.parse().unwrap());
        assert_eq!(call(&s, r).await.unwrap().status().as_str(), code);
        let again = call(&s, post(&key, "a")).await.unwrap();
        assert_eq!(again.status(), StatusCode::CREATED, "after {code}");
        assert!(again.headers().get("idempotent-replayed").is_none());
    }
    assert_eq!(h.runs(), 8);
}

pub async fn cancellation_drops_the_lease<St: Store>(store: St) {
    let h = Handler::default();
    let s = svc(&h, layer(store));
    let key = unique("cancel");
    let task = start_held(&h, &s, post(&key, "a")).await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    // The lease is dropped in the background; a retry runs.
    let r = until_not_conflict(&s, || post(&key, "a")).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(text(r).await, "run 2: a");
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
    assert_eq!(
        store
            .begin(&rk, fp, &LeaseToken::random(), ttl)
            .await
            .unwrap(),
        resend_server::store::Begin::Acquired
    );
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

/// The fingerprint the layer computes for `req`, found by asking a memory
/// store what a request left in it.
pub async fn fingerprint_of(req: &Request<Full<Bytes>>) -> Fingerprint {
    #[derive(Clone, Default)]
    struct Spy(Arc<Mutex<Option<Fingerprint>>>);
    impl Store for Spy {
        fn begin(
            &self,
            _: &RecordKey<'_>,
            fp: Fingerprint,
            _: &LeaseToken,
            _: Ttl,
        ) -> impl std::future::Future<
            Output = Result<resend_server::store::Begin, resend_server::StoreError>,
        > + Send {
            *self.0.lock().unwrap() = Some(fp);
            std::future::ready(Err(resend_server::StoreError::new("spy")))
        }
        fn complete(
            &self,
            _: &RecordKey<'_>,
            _: &LeaseToken,
            _: &resend_server::store::StoredResponse,
            _: Ttl,
        ) -> impl std::future::Future<Output = Result<(), resend_server::StoreError>> + Send
        {
            std::future::ready(Ok(()))
        }
        fn release(
            &self,
            _: &RecordKey<'_>,
            _: &LeaseToken,
        ) -> impl std::future::Future<Output = Result<(), resend_server::StoreError>> + Send
        {
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

pub async fn records_expire<St: Store>(store: St, ttl: Duration) {
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

pub async fn tenants_are_scoped<St: Store>(store: St) {
    let h = Handler::default();
    // Default scope: the Authorization header.
    let s = svc(&h, layer(store.clone()));
    let key = unique("tenant");
    let as_ = |who: &str| {
        let mut r = post(&key, "a");
        r.headers_mut()
            .insert("authorization", format!("Bearer {who}").parse().unwrap());
        r
    };
    assert_eq!(
        text(call(&s, as_("alice")).await.unwrap()).await,
        "run 1: a"
    );
    let bob = call(&s, as_("bob")).await.unwrap();
    assert!(bob.headers().get("idempotent-replayed").is_none());
    assert_eq!(text(bob).await, "run 2: a");
    let alice = call(&s, as_("alice")).await.unwrap();
    assert_eq!(alice.headers()["idempotent-replayed"], "true");
    assert_eq!(text(alice).await, "run 1: a");
    // A scope function of the server's choosing.
    let t = svc(
        &h,
        layer(store).scope_with(|p| {
            p.headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        }),
    );
    let key = unique("tenant2");
    let as_tenant = |who: &'static str| {
        let mut r = post(&key, "b");
        r.headers_mut().insert("x-tenant", who.parse().unwrap());
        r
    };
    assert_eq!(
        text(call(&t, as_tenant("A")).await.unwrap()).await,
        "run 3: b"
    );
    assert_eq!(
        text(call(&t, as_tenant("B")).await.unwrap()).await,
        "run 4: b"
    );
    assert_eq!(
        text(call(&t, as_tenant("A")).await.unwrap()).await,
        "run 3: b"
    );
}

pub async fn safe_methods_pass_through<St: Store>(store: St) {
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

pub async fn body_caps<St: Store>(store: St) {
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
pub async fn fifty_at_once<St: Store>(store: St) {
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
pub async fn store_down<St: Store>(store: St) {
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
            failures_drop_the_lease cancellation_drops_the_lease tenants_are_scoped
            safe_methods_pass_through body_caps fifty_at_once);
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
