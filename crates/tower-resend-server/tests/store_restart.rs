//! The store dies right after the work and comes back: no key runs twice.
//!
//! Keyed requests start their handlers, which do their effect and wait on a
//! gate. While they wait the store goes away — a `redis-server` of the
//! test's own killed (it comes back EMPTY: no persistence), PostgreSQL
//! behind a proxy taken down (it comes back with its data), a memory store
//! whose writes of final responses fail — so the layer's final store write
//! fails once the gate opens. The first callers still get the first run's
//! response (held in memory); their retries get the held replay while the
//! store is down; another process over the same store gets 503 (or 409),
//! never a run. Once the store is back, the held responses land (counted as
//! stored late), and every key replays the first run's response from the
//! store itself. Each handler runs exactly once.
//!
//! A held response's lease is renewed while it waits for the store, so
//! another process gets 409 however long the store is away
//! (`a_held_response_keeps_its_lease_for_other_processes`).
#![allow(clippy::print_stderr)]

#[cfg(feature = "postgres")]
#[path = "support/pg.rs"]
mod pg;
#[cfg(feature = "redis")]
#[path = "support/redis.rs"]
mod redis_server;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};
use tower_resend_server::store::{Begin, Claim, LeaseState, StoredResponse, Ttl};
use tower_resend_server::{
    IdempotencyLayer, IdempotencyStats, MaybeBuffered, MemoryStore, Store, StoreError,
};

/// Keys per scenario.
const KEYS: usize = 20;
/// The bound on one scenario.
const BOUND: Duration = Duration::from_secs(20);
/// How long the store stays away, at least (the lease is 2 s).
const DOWN_FOR: Duration = Duration::from_millis(800);

/// A unique name, so runs sharing a Redis or PostgreSQL never meet.
fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

/// True when a missing service must fail the run (CI) rather than skip.
fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

type Req = Request<Full<Bytes>>;
type Resp = Response<MaybeBuffered<Full<Bytes>>>;

/// The handler: its runs per order, the handlers started, and the gate they
/// wait on after their effect.
#[derive(Clone)]
struct Handler {
    runs: Arc<Mutex<HashMap<String, usize>>>,
    started: Arc<AtomicUsize>,
    started_note: Arc<Notify>,
    gate: Arc<Semaphore>,
}

impl Handler {
    fn new() -> Self {
        Self {
            runs: Arc::default(),
            started: Arc::default(),
            started_note: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    fn runs_of(&self, order: &str) -> usize {
        self.runs.lock().unwrap().get(order).copied().unwrap_or(0)
    }

    fn total_runs(&self) -> usize {
        self.runs.lock().unwrap().values().sum()
    }

    /// Does the effect (counts the run), then waits at the gate, then
    /// answers 201 `run N: <order>`.
    fn service(
        &self,
    ) -> impl Service<
        Request<MaybeBuffered<Full<Bytes>>>,
        Response = Response<Full<Bytes>>,
        Error = tower_resend::BoxError,
        Future = impl Send,
    > + Clone
           + Send
           + 'static {
        let h = self.clone();
        tower::service_fn(move |req: Request<MaybeBuffered<Full<Bytes>>>| {
            let h = h.clone();
            async move {
                let body = req.into_body().collect().await?.to_bytes();
                let order = String::from_utf8_lossy(&body).into_owned();
                let run = {
                    let mut runs = h.runs.lock().unwrap();
                    let n = runs.entry(order.clone()).or_default();
                    *n += 1;
                    *n
                };
                h.started.fetch_add(1, Ordering::SeqCst);
                h.started_note.notify_waiters();
                h.gate.acquire().await?.forget();
                let mut resp = Response::new(Full::new(Bytes::from(format!("run {run}: {order}"))));
                *resp.status_mut() = StatusCode::CREATED;
                Ok(resp)
            }
        })
    }

    /// Waits (bounded) until `n` handlers have started.
    async fn wait_started(&self, n: usize) {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let note = self.started_note.notified();
                if self.started.load(Ordering::SeqCst) >= n {
                    return;
                }
                note.await;
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "only {} of {n} handlers started",
                self.started.load(Ordering::SeqCst)
            )
        });
    }
}

fn post(key: &str, order: &str) -> Req {
    Request::post("/orders")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(order.to_owned())))
        .unwrap()
}

async fn text(resp: Resp) -> String {
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

fn replayed(resp: &Resp) -> bool {
    resp.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// Takes a store away and gives it back.
trait Outage {
    /// The store dies (or its writes fail): from when this returns.
    fn down(&mut self) -> impl Future<Output = ()>;
    /// The store is back: from when this returns.
    fn up(&mut self) -> impl Future<Output = ()>;
}

/// The layer of one process over `store`: every test's layer settings.
fn layer<St: Store>(store: St, scope: &str) -> IdempotencyLayer<St> {
    let scope = scope.to_owned();
    IdempotencyLayer::new(store)
        .scope_with(move |_| scope.clone())
        .lease(Duration::from_secs(2))
        .store_timeout(Duration::from_millis(500))
}

/// The scenario. `store` is this process's store; `other` is another
/// process's store on the same records (its own connections, nothing held).
async fn scenario<St: Store>(name: &str, store: St, other: St, mut outage: impl Outage) {
    let began = Instant::now();
    let h = Handler::new();
    let scope = unique("restart");
    let this = layer(store, &scope);
    let stats: IdempotencyStats = this.stats();
    let svc = this.layer(h.service());
    let other = layer(other, &scope).layer(h.service());
    let keys: Vec<(String, String)> = (0..KEYS)
        .map(|i| (unique(&format!("k{i}")), format!("order-{i}")))
        .collect();

    let run = async {
        // The first callers: their handlers do their effect and wait.
        let first: Vec<_> = keys
            .iter()
            .map(|(key, order)| {
                let (svc, req) = (svc.clone(), post(key, order));
                tokio::spawn(async move { svc.oneshot(req).await })
            })
            .collect();
        h.wait_started(KEYS).await;

        // The store dies right after the work; then the handlers end.
        outage.down().await;
        let down_at = Instant::now();
        h.gate.add_permits(KEYS);
        for ((_, order), task) in keys.iter().zip(first) {
            let resp = task.await.unwrap().unwrap();
            assert_eq!(resp.status(), StatusCode::CREATED, "{name}: {order}");
            assert!(
                !replayed(&resp),
                "{name}: {order}: the first caller's own answer"
            );
            assert_eq!(text(resp).await, format!("run 1: {order}"), "{name}");
        }
        assert_eq!(
            stats.held(),
            KEYS as u64,
            "{name}: the store did not take the responses, so they are held ({stats:?})"
        );
        assert_eq!(stats.stored_late(), 0, "{name}: {stats:?}");

        // Retries while the store is down: the held replay (or 503), never a
        // second run; another process, which holds nothing: 503 (or 409 where
        // the store still answers reads), never a run. The other process's
        // calls go at once, each bounded by the store timeout.
        let elsewhere: Vec<_> = keys
            .iter()
            .map(|(key, order)| {
                let (other, req) = (other.clone(), post(key, order));
                tokio::spawn(async move { other.oneshot(req).await })
            })
            .collect();
        let (mut held_replays, mut unavailable) = (0, 0);
        for (key, order) in &keys {
            let resp = svc.clone().oneshot(post(key, order)).await.unwrap();
            match resp.status() {
                StatusCode::CREATED => {
                    assert!(replayed(&resp), "{name}: {order}: a retry is a replay");
                    assert_eq!(text(resp).await, format!("run 1: {order}"), "{name}");
                    held_replays += 1;
                }
                StatusCode::SERVICE_UNAVAILABLE => unavailable += 1,
                other => panic!("{name}: {order}: a retry while the store is down got {other}"),
            }
        }
        for ((_, order), task) in keys.iter().zip(elsewhere) {
            let resp = task.await.unwrap().unwrap();
            assert!(
                matches!(
                    resp.status(),
                    StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
                ),
                "{name}: {order}: another process while the store is down got {}",
                resp.status()
            );
        }
        assert_eq!(h.total_runs(), KEYS, "{name}: no retry ran the work again");
        // Down for a while (shorter than the lease): the first background
        // tries to store the held responses fail too.
        tokio::time::sleep(DOWN_FOR.saturating_sub(down_at.elapsed())).await;

        // The store comes back; every key answers, with the first run's
        // response, through this process...
        outage.up().await;
        let back = Instant::now();
        for (key, order) in &keys {
            let resp = until_answered(name, &svc, key, order).await;
            assert_eq!(resp.status(), StatusCode::CREATED, "{name}: {order}");
            assert!(replayed(&resp), "{name}: {order}");
            assert_eq!(text(resp).await, format!("run 1: {order}"), "{name}");
        }
        // ...the held responses land in the store...
        while stats.held() > 0 {
            assert!(
                back.elapsed() < Duration::from_secs(10),
                "{name}: held responses not stored 10 s after the store came back ({stats:?})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let landed = back.elapsed();
        // ...and the store itself answers for every key: another process,
        // which holds nothing, gets the replay. (Asked only now: until a
        // held response lands, nothing keeps its lease in the store — see
        // `a_held_response_keeps_its_lease_for_other_processes`.)
        for (key, order) in &keys {
            let resp = until_answered(name, &other, key, order).await;
            assert_eq!(resp.status(), StatusCode::CREATED, "{name}: {order}");
            assert!(replayed(&resp), "{name}: {order}: the store's record");
            assert_eq!(text(resp).await, format!("run 1: {order}"), "{name}");
        }
        (held_replays, unavailable, landed)
    };
    let (held_replays, unavailable, landed) =
        tokio::time::timeout(BOUND, run).await.unwrap_or_else(|_| {
            panic!("{name}: the scenario did not end within {BOUND:?} ({stats:?})")
        });

    for (_, order) in &keys {
        assert_eq!(h.runs_of(order), 1, "{name}: {order} ran exactly once");
    }
    assert_eq!(stats.stored_late(), KEYS as u64, "{name}: {stats:?}");
    assert_eq!(stats.unstored(), 0, "{name}: {stats:?}");
    assert_eq!(stats.leases_lost(), 0, "{name}: {stats:?}");
    assert_eq!(stats.held(), 0, "{name}: {stats:?}");
    eprintln!(
        "store_restart[{name}]: {KEYS} keys, {} runs; retries while down: {held_replays} held replays, \
         {unavailable} 503; held responses stored {landed:.1?} after the store came back; {stats:?}; {:.1?} in all",
        h.total_runs(),
        began.elapsed()
    );
}

/// Sends the key until the layer answers something other than 503 or 409
/// (bounded).
async fn until_answered<S>(name: &str, svc: &S, key: &str, order: &str) -> Resp
where
    S: Service<Req, Response = Resp, Error = tower_resend::BoxError> + Clone,
{
    for _ in 0..200 {
        let resp = svc.clone().oneshot(post(key, order)).await.unwrap();
        if !matches!(
            resp.status(),
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
        ) {
            return resp;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{name}: {order} still unanswered after 200 tries");
}

// ---- memory: a store whose final writes fail while a flag is set ----

/// A memory store whose `complete` fails while `failing` is set.
#[derive(Clone)]
struct Flaky {
    inner: MemoryStore,
    failing: Arc<AtomicBool>,
}

impl Store for Flaky {
    fn begin(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        self.inner.begin(claim, ttl)
    }

    fn renew(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        self.inner.renew(claim, ttl)
    }

    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        // (The memory store does its work when called, not when polled: it
        // is not called at all while failing.)
        let done = (!self.failing.load(Ordering::SeqCst))
            .then(|| self.inner.complete(claim, response, ttl));
        async move {
            match done {
                Some(done) => done.await,
                None => Err(StoreError::new("injected: the store refuses writes")),
            }
        }
    }

    fn release(&self, claim: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.release(claim)
    }
}

struct FlagOutage(Arc<AtomicBool>);

impl Outage for FlagOutage {
    async fn down(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
    async fn up(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_refusing_the_final_write_runs_no_key_twice() {
    let failing = Arc::new(AtomicBool::new(false));
    let store = Flaky {
        inner: MemoryStore::new(),
        failing: failing.clone(),
    };
    scenario("memory", store.clone(), store, FlagOutage(failing)).await;
}

// ---- Redis: a redis-server of our own, killed and restarted empty ----

/// A `redis-server` child process of this test, on a port of its own, with
/// no persistence. Dropping it kills it (also when the test fails).
#[cfg(feature = "redis")]
struct RedisChild {
    port: u16,
    child: Option<std::process::Child>,
}

/// A free loopback port below Linux's ephemeral range (32768 up): the
/// server is restarted on it after a kill, and a port of that range could
/// meanwhile be taken as the local port of some outbound connection, which
/// the restarted server could then not bind. Port 0's pick if none is found.
#[cfg(feature = "redis")]
fn restartable_port() -> u16 {
    (0..200)
        .map(|_| fastrand::u16(20_000..32_000))
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .unwrap_or_else(|| {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        })
}

#[cfg(feature = "redis")]
impl RedisChild {
    /// Starts `redis-server` on a free loopback port and waits until it
    /// answers `PING`; `None` if there is no `redis-server` to start.
    async fn start() -> Option<Self> {
        let port = restartable_port();
        let mut redis = Self { port, child: None };
        match redis.spawn() {
            Ok(()) => Some(redis),
            Err(e) if in_ci() => panic!("cannot start redis-server: {e}, and CI is set"),
            Err(e) => {
                eprintln!("WARNING: cannot start redis-server ({e}): test SKIPPED");
                None
            }
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        assert!(self.child.is_none(), "redis-server already runs");
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(std::env::temp_dir())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits (bounded) until the server answers `PING`.
    async fn ready(&mut self) {
        let url = self.url();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if redis_server::pings(&url, Duration::from_millis(500)).await {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("redis-server on port {} exited: {status}", self.port);
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} does not answer PING",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the server (SIGKILL, by its pid) and reaps it.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(feature = "redis")]
impl Drop for RedisChild {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(feature = "redis")]
impl Outage for RedisChild {
    async fn down(&mut self) {
        self.kill();
    }
    async fn up(&mut self) {
        self.spawn().expect("restart redis-server");
        self.ready().await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_after_the_work_and_restarted_empty_runs_no_key_twice() {
    let Some(mut redis) = RedisChild::start().await else {
        return;
    };
    redis.ready().await;
    let open = |url: &str| {
        tower_resend_server::RedisStore::open(url)
            .unwrap()
            .prefix("resend-test:restart:")
    };
    let (store, other) = (open(&redis.url()), open(&redis.url()));
    scenario("redis", store, other, redis).await;
}

// ---- PostgreSQL: behind a proxy taken down and brought back ----

#[cfg(feature = "postgres")]
struct ProxyOutage(tower_resend_testkit::FaultProxy);

#[cfg(feature = "postgres")]
impl Outage for ProxyOutage {
    async fn down(&mut self) {
        self.0.down();
    }
    async fn up(&mut self) {
        self.0.up();
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_unreachable_after_the_work_runs_no_key_twice() {
    const TABLE: &str = "resend_idempotency_test";
    let target: std::net::SocketAddr = "127.0.0.1:5432".parse().unwrap();
    let proxy = tower_resend_testkit::FaultProxy::pass(target)
        .await
        .unwrap();
    let url = pg::with_port(&pg::url(), proxy.addr().port());
    let store = tower_resend_server::PostgresStore::with_table(pg::pool(&url, 8), TABLE).unwrap();
    match tokio::time::timeout(Duration::from_secs(5), store.migrate()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) if in_ci() => panic!("PostgreSQL at {target}: {e}, and CI is set"),
        Err(_) if in_ci() => panic!("PostgreSQL at {target} does not answer, and CI is set"),
        other => {
            eprintln!("WARNING: PostgreSQL at {target} is unusable ({other:?}): test SKIPPED");
            return;
        }
    }
    let other = tower_resend_server::PostgresStore::with_table(pg::pool(&url, 8), TABLE).unwrap();
    scenario("postgres", store, other, ProxyOutage(proxy)).await;
}

// ---- a held response keeps its lease ----

/// While this process holds a response that the store refuses, the lease
/// stays this process's ("held in memory ... and stored in the background,
/// with the lease kept, until it lands"): the background task renews it at
/// each try that does not store, so another process sharing the store gets
/// 409, not a second run. (Without the renewals, the lease expired `lease`
/// after the handler's last renewal, and another process's `begin` took the
/// key over and ran the work again.)
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_held_response_keeps_its_lease_for_other_processes() {
    let failing = Arc::new(AtomicBool::new(true));
    let store = Flaky {
        inner: MemoryStore::new(),
        failing: failing.clone(),
    };
    let h = Handler::new();
    h.gate.add_permits(10);
    let scope = unique("held-lease");
    let this = layer(store.clone(), &scope);
    let stats = this.stats();
    let this = this.layer(h.service());
    let other = layer(store, &scope).layer(h.service());

    // The work is done; the store refuses its response: held.
    let first = this.clone().oneshot(post("k", "order-1")).await.unwrap();
    assert_eq!(text(first).await, "run 1: order-1");
    assert_eq!(stats.held(), 1, "{stats:?}");
    // Within the lease (2 s), another process is told to wait.
    let early = other.clone().oneshot(post("k", "order-1")).await.unwrap();
    assert_eq!(early.status(), StatusCode::CONFLICT);
    // Long past the lease, with the store still refusing the response (but
    // answering everything else), and this process alive, holding it: asked
    // every half second for 20 s, so that no gap between the background
    // task's tries (its backoff grows) lets the lease lapse.
    for step in 1..=40 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(stats.held(), 1, "{stats:?}");
        let late = other.clone().oneshot(post("k", "order-1")).await.unwrap();
        let status = late.status();
        let body = text(late).await;
        assert_eq!(
            h.runs_of("order-1"),
            1,
            "another process ran the key again {} ms in, while this one held its response: {status} {body:?} ({stats:?})",
            step * 500
        );
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
    }
}
