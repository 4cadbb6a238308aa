//! End to end: a tower-resend client stack (deadline, Idempotency-Key, retries,
//! attempt timeout) calls an axum server with the IdempotencyLayer through a
//! fault injector that, after the work is done, either holds the response
//! until the client gives up or resets the connection. 1000 logical POSTs
//! must end with exactly 1000 effects, and every client must see the right
//! answer, at once or after sending its call again as its clear error
//! advises — on each store. Real clock (the stores are real servers),
//! loopback only, bounded.
#![allow(clippy::print_stderr)]

mod common;
#[cfg(feature = "postgres")]
#[path = "support/pg.rs"]
mod pg;
#[path = "support/runner.rs"]
mod runner;
#[path = "support/serve.rs"]
mod serve;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use tokio::sync::Semaphore;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_resend::retry::Backoff;
use tower_resend::{
    deadline::CallDeadlineLayer, idempotency::SetIdempotencyKeyLayer, retry::RetryLayer,
    timeout::AttemptTimeoutLayer, Error, RetryAdvice,
};
use tower_resend_server::{IdempotencyLayer, Store};

const CALLS: usize = 1000;
const CONCURRENCY: usize = 50;

#[derive(Clone, Default)]
struct Effects(Arc<Mutex<HashMap<String, usize>>>);

async fn charge(State(effects): State<Effects>, headers: HeaderMap, body: Bytes) -> String {
    let order = String::from_utf8_lossy(&body).into_owned();
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    assert!(!key.is_empty(), "every POST carries a key");
    *effects.0.lock().unwrap().entry(order.clone()).or_default() += 1;
    format!("charged {order}")
}

/// After the inner service has answered (the work is done), every 5th
/// response is held until the client gives up, and every 5th is replaced by
/// a reset connection.
#[derive(Clone)]
struct Faults<S> {
    inner: S,
    seen: Arc<AtomicUsize>,
}

#[derive(Debug)]
struct Reset;
impl std::fmt::Display for Reset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected reset")
    }
}
impl std::error::Error for Reset {}

impl<S, B> Service<Request<B>> for Faults<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Reset;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Reset>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Reset>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        let inner = self.inner.clone();
        Box::pin(async move {
            let resp = inner.oneshot(req).await.unwrap_or_else(|e| match e {});
            match n % 5 {
                1 => std::future::pending().await,
                2 => Err(Reset),
                _ => Ok(resp),
            }
        })
    }
}

async fn serve<St: Store>(store: St, effects: Effects) -> SocketAddr {
    let scope = common::unique("e2e");
    let app = Router::new()
        .route("/charges", post(charge))
        .with_state(effects)
        .layer(IdempotencyLayer::new(store).scope_with(move |_| scope.clone()));
    let svc = Faults {
        inner: app,
        seen: Arc::default(),
    };
    serve::serve(svc).await
}

async fn run<St: Store>(store: St) {
    let effects = Effects::default();
    let addr = serve(store, effects.clone()).await;
    let client = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(30)).upstream("payments"))
        .layer(SetIdempotencyKeyLayer::new())
        .layer(
            RetryLayer::new()
                .no_budget()
                .seed(7)
                .max_attempts(12)
                .backoff(
                    Backoff::new(Duration::from_millis(5), 2.0, Duration::from_millis(50)).unwrap(),
                ),
        )
        .layer(AttemptTimeoutLayer::new(Duration::from_millis(250)))
        .service(tower_resend::hyper_client(Duration::from_secs(1)));

    let limit = Arc::new(Semaphore::new(CONCURRENCY));
    let mut tasks = Vec::with_capacity(CALLS);
    for i in 0..CALLS {
        let client = client.clone();
        let limit = limit.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = limit.acquire_owned().await.unwrap();
            let req = Request::post(format!("http://{addr}/charges"))
                .body(Full::new(Bytes::from(format!("order-{i}"))))
                .unwrap();
            match client.oneshot(req).await {
                Ok(resp) => {
                    assert!(resp.status().is_success(), "order-{i}: {}", resp.status());
                    let body = resp.into_body().collect().await.unwrap().to_bytes();
                    assert_eq!(body, format!("charged order-{i}"));
                    Ok(())
                }
                Err(e) => Err(Error::from_box(e)),
            }
        }));
    }
    let mut failed = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        if let Err(e) = t.await.unwrap() {
            failed.push((i, e));
        }
    }
    let followed = follow_advice(addr, &failed).await;
    let effects = effects.0.lock().unwrap();
    let total: usize = effects.values().sum();
    assert_eq!(effects.len(), CALLS, "every order was charged");
    assert_eq!(total, CALLS, "exactly one effect per logical POST");
    assert!(effects.values().all(|&n| n == 1));
    eprintln!(
        "{CALLS} POSTs: {CALLS} effects; {followed} sent again as their errors advised ({:?})",
        failed.first().map(|(_, e)| e.to_string())
    );
    // The first round's errors stay rare with 12 attempts (3 of 1000
    // beside a busy loop taking one of two cores).
    assert!(failed.len() <= CALLS / 100, "{} failed", failed.len());
}

/// What a job runner does with a call that failed: sent again under its
/// key as its error advises ([`RetryAdvice::SameKey`] or
/// [`RetryAdvice::After`]), through the same faults, more patiently, until
/// it gets its 2xx with the first run's answer. On a busy machine a good
/// share of the 250 ms attempts time out on the scheduler rather than on
/// the faults, and a call can run out of its 12; the key's record answers
/// it later, and no key runs twice. How many were sent again.
async fn follow_advice(addr: SocketAddr, failed: &[(usize, Error)]) -> usize {
    let client = runner::patient_client();
    let mut tasks = Vec::new();
    for (i, e) in failed {
        let advice = e.retry_advice();
        assert!(
            matches!(advice, RetryAdvice::SameKey(_) | RetryAdvice::After(_)),
            "order-{i} failed with advice that is not to send again: {e}"
        );
        let key = e
            .idempotency_key()
            .expect("a keyed call's error names its key");
        let req = Request::post(format!("http://{addr}/charges"))
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(format!("order-{i}"))))
            .unwrap();
        let (client, i) = (client.clone(), *i);
        tasks.push(tokio::spawn(async move {
            let resp = client.oneshot(req).await.map_err(Error::from_box);
            let resp = resp.unwrap_or_else(|e| panic!("order-{i}, sent again: {e}"));
            assert!(resp.status().is_success(), "order-{i}: {}", resp.status());
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body, format!("charged order-{i}"));
        }));
    }
    let sent = tasks.len();
    for t in tasks {
        t.await.unwrap();
    }
    sent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_exactly_once_under_faults() {
    run(tower_resend_server::MemoryStore::new()).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_exactly_once_under_faults() {
    let url = std::env::var("RESEND_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let store = tower_resend_server::RedisStore::open(&url)
        .unwrap()
        .prefix(format!("resend-test:{}:", common::unique("e2e")));
    if common::in_ci() || store_reachable(store.clone()).await {
        run(store).await;
    } else {
        eprintln!("WARNING: Redis at {url} is unreachable: test SKIPPED");
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_exactly_once_under_faults() {
    let url = pg::url();
    let store = tower_resend_server::PostgresStore::with_table(
        pg::pool(&url, 16),
        "resend_idempotency_test",
    )
    .unwrap();
    match store.migrate().await {
        Ok(()) => run(store).await,
        Err(e) if common::in_ci() => panic!("PostgreSQL at {url}: {e}, and CI is set"),
        Err(e) => eprintln!("WARNING: PostgreSQL at {url} is unusable ({e}): test SKIPPED"),
    }
}

/// True if the store answers at all.
#[allow(dead_code)]
async fn store_reachable<St: Store>(store: St) -> bool {
    use tower_resend_server::store::{Claim, Fingerprint, LeaseToken, RecordKey, Ttl};
    let probe = common::unique("probe");
    let key = RecordKey {
        scope: "probe",
        key: &probe,
    };
    let claim = Claim {
        key,
        fingerprint: Fingerprint([0; 32]),
        token: LeaseToken::random(),
    };
    let ttl = Ttl {
        lease: Duration::from_secs(1),
        record: Duration::from_secs(1),
    };
    let ok = tokio::time::timeout(Duration::from_secs(3), store.begin(&claim, ttl))
        .await
        .is_ok_and(|r| r.is_ok());
    if ok {
        let _ = store.release(&claim).await;
    }
    ok
}
