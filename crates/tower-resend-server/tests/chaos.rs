//! Chaos: exactly one effect per key (DESIGN sections 7 and 8).
//!
//! 1000 logical POSTs, each with one `Idempotency-Key` reused on every
//! retry, go from a tower-resend client stack (deadline, key, retries, a 400 ms
//! attempt timeout, pooled HTTP/1 connections) through a fault-injecting TCP
//! proxy to an axum server whose handler sits behind the `IdempotencyLayer`.
//! The handler records its effect first, then works 0 to 600 ms, so a good
//! share of the work outlives the caller's attempt. The proxy loses answers
//! (`FIN` or `RST` after the work), holds them past the attempt timeout, or
//! cuts connections while the handler runs. Every order must be charged
//! exactly once, every 2xx must carry the first run's answer, the calls
//! whose first round failed are sent again as their errors advise (with the
//! same key) and then get through, and the run must end in bounded time — on the memory store,
//! on Redis, on a three-node Redis Cluster the test starts on loopback
//! (`support/redis_cluster.rs`) and on PostgreSQL. Real clock (the stores
//! are real servers), loopback only.
#![allow(clippy::print_stderr)]

#[cfg(feature = "postgres")]
#[path = "support/pg.rs"]
mod pg;
#[cfg(feature = "redis")]
#[path = "support/redis_cluster.rs"]
mod redis_cluster;
#[cfg(feature = "redis")]
#[path = "support/redis.rs"]
mod redis_server;
#[path = "support/runner.rs"]
mod runner;
#[path = "support/serve.rs"]
mod serve;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use serve::serve;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_resend::retry::{Attempts, Backoff};
use tower_resend::{
    deadline::CallDeadlineLayer, idempotency::SetIdempotencyKeyLayer, retry::RetryLayer,
    timeout::AttemptTimeoutLayer, Error, RetryAdvice,
};
use tower_resend_server::store::{Begin, Claim, LeaseState, StoredResponse, Ttl};
use tower_resend_server::{IdempotencyLayer, IdempotencyStats, Store, StoreError};
use tower_resend_testkit::{Fault, FaultProxy};

/// Logical calls per store.
const CALLS: usize = 1000;
/// Calls in flight at once.
const CONCURRENCY: usize = 100;
/// The client's attempt timeout: shorter than a good share of the work.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(400);
/// The longest the handler works.
const MAX_WORK_MS: u64 = 600;
/// The bound on one store's whole run.
const RUN_BOUND: Duration = Duration::from_secs(40);

/// A unique name, so runs sharing a Redis or PostgreSQL never meet.
fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

/// One chaos run at a time in this binary. Each is sized to load the
/// machine on its own (1000 calls, 100 at once, a server, a proxy, a pool
/// of its own on the one PostgreSQL). Two at once on two cores, with one of
/// them busy elsewhere, starve each other's store calls to half a second
/// and more: a lease of 1 s then lapses before the response is stored (the
/// lease mode's limit, which the README states and `leases_lost` reports),
/// and the runs take past their bound. That is the machine, not the faults
/// these runs inject.
async fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ONE.lock().await
}

/// True when a missing service must fail the run (CI) rather than skip.
fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

/// What the handler did: runs per order, and handlers at work right now.
#[derive(Clone, Default)]
struct Effects {
    runs: Arc<Mutex<HashMap<String, usize>>>,
    working: Arc<AtomicUsize>,
}

/// How long the handler works on `order` (`order-N`): 0 to 600 ms, spread
/// by a seeded generator, the same on every run.
fn work_for(order: &str) -> Duration {
    let n: u64 = order
        .strip_prefix("order-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    Duration::from_millis(fastrand::Rng::with_seed(n ^ 0x5eed).u64(0..=MAX_WORK_MS))
}

/// Counts a handler at work for as long as it lives, also when its task is
/// cut.
struct Working(Arc<AtomicUsize>);

impl Working {
    fn new(n: &Arc<AtomicUsize>) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Self(n.clone())
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The handler: the effect first (the card is charged), then the work.
async fn charge(State(effects): State<Effects>, body: Bytes) -> String {
    let _working = Working::new(&effects.working);
    let order = String::from_utf8_lossy(&body).into_owned();
    let run = {
        let mut runs = effects.runs.lock().unwrap();
        let n = runs.entry(order.clone()).or_default();
        *n += 1;
        *n
    };
    tokio::time::sleep(work_for(&order)).await;
    format!("charged {order} run {run}")
}

/// The faults the proxy's plan handed out, by kind.
#[derive(Default)]
struct Plan {
    pass: AtomicU64,
    fin: AtomicU64,
    rst: AtomicU64,
    delay: AtomicU64,
    cut: AtomicU64,
}

impl Plan {
    /// The fault of connection `index`: most pass; the others lose the
    /// answer after the work (`FIN` or `RST`), hold it past the attempt
    /// timeout, or cut the connection a few tens of ms after the request
    /// (while the handler runs). Seeded by the index: the same plan on every
    /// run.
    fn fault(&self, index: u64) -> Fault {
        let mut rng = fastrand::Rng::with_seed(index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 7);
        let (counter, fault) = match rng.u32(0..100) {
            0..=64 => (&self.pass, Fault::Pass),
            65..=72 => (&self.fin, Fault::DropResponseFin),
            73..=80 => (&self.rst, Fault::DropResponseRst),
            81..=90 => (
                &self.delay,
                Fault::Delay(Duration::from_millis(rng.u64(450..=900))),
            ),
            _ => (
                &self.cut,
                Fault::CutAfter(Duration::from_millis(rng.u64(10..=60))),
            ),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        fault
    }

    fn summary(&self) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "connections {}: pass {}, fin {}, rst {}, delay {}, cut {}",
            get(&self.pass) + get(&self.fin) + get(&self.rst) + get(&self.delay) + get(&self.cut),
            get(&self.pass),
            get(&self.fin),
            get(&self.rst),
            get(&self.delay),
            get(&self.cut)
        )
    }

    fn faults(&self) -> u64 {
        [&self.fin, &self.rst, &self.delay, &self.cut]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

/// The store under test, with its calls counted: the report says how
/// often leases were renewed while the work ran.
#[derive(Clone)]
struct Counted<St> {
    inner: St,
    calls: Arc<Calls>,
}

#[derive(Default)]
struct Calls {
    begin: AtomicU64,
    renew: AtomicU64,
    complete: AtomicU64,
    release: AtomicU64,
}

impl Calls {
    fn summary(&self) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "store calls: begin {}, renew {}, complete {}, release {}",
            get(&self.begin),
            get(&self.renew),
            get(&self.complete),
            get(&self.release)
        )
    }
}

impl<St: Store> Store for Counted<St> {
    fn begin(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        self.calls.begin.fetch_add(1, Ordering::Relaxed);
        self.inner.begin(claim, ttl)
    }

    fn renew(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        self.calls.renew.fetch_add(1, Ordering::Relaxed);
        self.inner.renew(claim, ttl)
    }

    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        self.calls.complete.fetch_add(1, Ordering::Relaxed);
        self.inner.complete(claim, response, ttl)
    }

    fn release(&self, claim: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.calls.release.fetch_add(1, Ordering::Relaxed);
        self.inner.release(claim)
    }
}

/// How one logical call ended.
enum Outcome {
    /// A 2xx: its body, whether it was a replay, and the attempts made.
    Success {
        body: Bytes,
        replayed: bool,
        attempts: u32,
    },
    /// Another final status.
    Status(http::StatusCode),
    /// A clear error from the client.
    Error(Error),
}

/// Serves `app` behind the fault proxy and sends it the [`CALLS`] logical
/// POSTs (`order-N`, [`CONCURRENCY`] at a time) through a tower-resend client
/// stack (a key per call, retries, the [`ATTEMPT_TIMEOUT`]); then waits
/// until no handler is `working` (work detached from a caller that went
/// away may still run, and a late second run must be seen too). How each
/// call ended, in order, and the proxy's plan. Bounded by [`RUN_BOUND`].
async fn send_through_faults(
    name: &str,
    app: Router,
    working: &AtomicUsize,
) -> (Vec<Outcome>, Arc<Plan>, SocketAddr) {
    let server = serve(app).await;
    let plan = Arc::new(Plan::default());
    let proxy = FaultProxy::start(server, {
        let plan = plan.clone();
        move |index| plan.fault(index)
    })
    .await
    .unwrap();
    let addr = proxy.addr();
    let client = ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(25)).upstream("payments"))
        .layer(SetIdempotencyKeyLayer::new())
        .layer(
            RetryLayer::new()
                .no_budget()
                .seed(7)
                .max_attempts(12)
                .backoff(
                    Backoff::new(Duration::from_millis(5), 2.0, Duration::from_millis(100))
                        .unwrap(),
                ),
        )
        .layer(AttemptTimeoutLayer::new(ATTEMPT_TIMEOUT))
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let limit = Arc::new(Semaphore::new(CONCURRENCY));
    let calls = async {
        let mut tasks = Vec::with_capacity(CALLS);
        for i in 0..CALLS {
            let (client, limit) = (client.clone(), limit.clone());
            tasks.push(tokio::spawn(async move {
                let _permit = limit.acquire_owned().await.unwrap();
                let req = Request::post(format!("http://{addr}/charges"))
                    .body(Full::new(Bytes::from(format!("order-{i}"))))
                    .unwrap();
                outcome_of(client.oneshot(req).await).await
            }));
        }
        let mut outcomes = Vec::with_capacity(CALLS);
        for t in tasks {
            outcomes.push(t.await.unwrap());
        }
        while working.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        outcomes
    };
    match tokio::time::timeout(RUN_BOUND, calls).await {
        Ok(outcomes) => (outcomes, plan, server),
        Err(_) => panic!(
            "{name}: {CALLS} calls did not end within {RUN_BOUND:?} (handlers still working: {}; {})",
            working.load(Ordering::SeqCst),
            plan.summary()
        ),
    }
}

/// What a job runner does with the first round's failures: each call whose
/// error advises sending it again ([`RetryAdvice::SameKey`], or
/// [`RetryAdvice::After`]) is sent again under its key, straight to the server (its faults over,
/// as a runner's later try finds them), until it gets a 2xx or its own
/// bound. The server's record of the key answers: the calls still get
/// through, whatever the first round met (a busy machine included), and
/// no key runs twice. Each replaced outcome counts in `followed`.
async fn follow_advice(server: SocketAddr, outcomes: &mut [Outcome], followed: &mut usize) {
    let client = runner::patient_client();
    let limit = Arc::new(Semaphore::new(CONCURRENCY));
    let mut tasks = Vec::new();
    for (i, outcome) in outcomes.iter().enumerate() {
        let Outcome::Error(e) = outcome else { continue };
        let advice = e.retry_advice();
        let again = matches!(advice, RetryAdvice::SameKey(_) | RetryAdvice::After(_));
        let Some(key) = e.idempotency_key().filter(|_| again) else {
            continue;
        };
        let (client, limit, key) = (client.clone(), limit.clone(), key.to_owned());
        tasks.push((
            i,
            tokio::spawn(async move {
                let _permit = limit.acquire_owned().await.unwrap();
                let req = Request::post(format!("http://{server}/charges"))
                    .header("idempotency-key", key)
                    .body(Full::new(Bytes::from(format!("order-{i}"))))
                    .unwrap();
                outcome_of(client.oneshot(req).await).await
            }),
        ));
    }
    let all = async {
        for (i, task) in tasks {
            outcomes[i] = task.await.unwrap();
            *followed += 1;
        }
    };
    if tokio::time::timeout(RUN_BOUND, all).await.is_err() {
        panic!("the advised resends did not end within {RUN_BOUND:?}");
    }
}

/// How a call ended, its body read.
async fn outcome_of<B>(result: Result<http::Response<B>, tower_resend::BoxError>) -> Outcome
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<tower_resend::BoxError>,
{
    match result {
        Ok(resp) if resp.status().is_success() => {
            let replayed = resp.headers().contains_key("idempotent-replayed");
            let attempts = resp.extensions().get::<Attempts>().map_or(0, Attempts::len);
            match resp.into_body().collect().await {
                Ok(body) => Outcome::Success {
                    body: body.to_bytes(),
                    replayed,
                    attempts,
                },
                Err(e) => Outcome::Error(Error::from_box(e.into())),
            }
        }
        Ok(resp) => Outcome::Status(resp.status()),
        Err(e) => Outcome::Error(Error::from_box(e)),
    }
}

/// The whole chaos run on `store`.
async fn run<St: Store>(name: &str, store: St) {
    let _alone = alone().await;
    let started = Instant::now();
    let effects = Effects::default();
    let store_calls = Arc::new(Calls::default());
    let store = Counted {
        inner: store,
        calls: store_calls.clone(),
    };
    let layer = IdempotencyLayer::new(store)
        .scope_with({
            let scope = unique("chaos");
            move |_| scope.clone()
        })
        // Renewed every third of it: the longer runs renew their lease.
        .lease(Duration::from_secs(1))
        .retry_after(Duration::from_secs(1))
        .store_timeout(Duration::from_secs(2));
    let stats = layer.stats();
    let app = Router::new()
        .route("/charges", post(charge))
        .with_state(effects.clone())
        .layer(layer);
    let (mut outcomes, plan, server) = send_through_faults(name, app, &effects.working).await;
    let first_round = successes(&outcomes);
    let mut followed = 0;
    follow_advice(server, &mut outcomes, &mut followed).await;
    let elapsed = started.elapsed();
    let report = Report {
        effects: &effects,
        outcomes: &outcomes,
        plan: &plan,
        stats: &stats,
        calls: &store_calls,
        elapsed,
        first_round,
        followed,
    };
    report.check(name);
}

/// What a run left, to check.
struct Report<'a> {
    effects: &'a Effects,
    outcomes: &'a [Outcome],
    plan: &'a Plan,
    stats: &'a IdempotencyStats,
    calls: &'a Calls,
    elapsed: Duration,
    /// 2xx answers in the first round, through the faults.
    first_round: usize,
    /// Calls sent again as their errors advised.
    followed: usize,
}

/// The 2xx answers among `outcomes`.
fn successes(outcomes: &[Outcome]) -> usize {
    outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Success { .. }))
        .count()
}

impl Report<'_> {
    /// The assertions, and the one-line summary.
    fn check(&self, name: &str) {
        let Report {
            effects,
            outcomes,
            plan,
            stats,
            calls,
            elapsed,
            first_round,
            followed,
        } = self;
        let runs = effects.runs.lock().unwrap();
        let twice: Vec<_> = runs.iter().filter(|(_, &n)| n > 1).collect();
        assert!(
            twice.is_empty(),
            "{name}: orders charged more than once: {twice:?}"
        );
        let (mut ok, mut replays, mut attempts, mut errors, mut statuses) =
            (0, 0, 0, Vec::new(), Vec::new());
        for (i, outcome) in outcomes.iter().enumerate() {
            let order = format!("order-{i}");
            match outcome {
                Outcome::Success {
                    body,
                    replayed,
                    attempts: made,
                } => {
                    ok += 1;
                    replays += usize::from(*replayed);
                    attempts += *made as usize;
                    assert_eq!(
                        runs.get(&order),
                        Some(&1),
                        "{name}: {order} ended 2xx, so it was charged exactly once"
                    );
                    assert_eq!(
                        body,
                        &format!("charged {order} run 1"),
                        "{name}: {order}: a 2xx carries the first run's answer"
                    );
                }
                Outcome::Status(status) => statuses.push((order, *status)),
                Outcome::Error(e) => errors.push((order, e.to_string())),
            }
        }
        let effects_total: usize = runs.values().sum();
        eprintln!(
        "chaos[{name}]: {CALLS} calls in {elapsed:.1?}: {effects_total} effects on {} orders, 0 twice; \
         {first_round} 2xx in the first round, {followed} sent again as advised; \
         {ok} 2xx ({replays} replays, {:.2} attempts each); {} clear errors {:?}; {} other statuses {:?}; \
         {} faults ({}); {}; {stats:?}",
        runs.len(),
        attempts as f64 / ok.max(1) as f64,
        errors.len(),
        errors.first(),
        statuses.len(),
        statuses.first(),
        plan.faults(),
        plan.summary(),
        calls.summary(),
    );
        // Liveness, as a job runner sees it: after following the advice,
        // the calls got through. Not a count of first-round successes,
        // which falls when the machine is busy (attempts time out on the
        // scheduler, not on the work), while this holds.
        assert!(
            errors.len() + statuses.len() <= CALLS / 100,
            "{name}: too many calls ended without a 2xx after following their advice: {errors:?} {statuses:?}"
        );
        assert_eq!(stats.leases_lost(), 0, "{name}: {stats:?}");
        assert_eq!(stats.unstored(), 0, "{name}: {stats:?}");
        assert!(plan.faults() > 0, "{name}: the proxy injected no fault");
        // Work longer than a third of the lease renewed it.
        assert!(
            calls.renew.load(Ordering::Relaxed) > 0,
            "{name}: no lease was renewed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_one_effect_per_key_under_chaos() {
    run("memory", tower_resend_server::MemoryStore::new()).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_one_effect_per_key_under_chaos() {
    let url = redis_server::url();
    if !redis_server::reachable(&url).await {
        return;
    }
    let store = tower_resend_server::RedisStore::open(&url)
        .unwrap()
        .prefix(format!("resend-test:{}:", unique("chaos")));
    run("redis", store).await;
}

/// The same run on a three-node Redis Cluster started by this binary: the
/// records of the 1000 keys spread over the three nodes' slots.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_store_one_effect_per_key_under_chaos() {
    let Some(cluster) = redis_cluster::cluster() else {
        return;
    };
    let prefix = format!("resend-test:{}:", unique("chaos-cluster"));
    let store =
        tower_resend_server::RedisStore::cluster(cluster.connection().await).prefix(&*prefix);
    run("redis-cluster", store).await;
    let on_node: Vec<usize> = cluster
        .ports()
        .into_iter()
        .map(|port| cluster.keys_on(port, &prefix).len())
        .collect();
    eprintln!("chaos[redis-cluster]: records by node {on_node:?}");
    assert!(
        on_node.iter().all(|&n| n > 0),
        "records by node {on_node:?}"
    );
    assert_eq!(on_node.iter().sum::<usize>(), CALLS, "one record per key");
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_one_effect_per_key_under_chaos() {
    let url = pg::url();
    let store = tower_resend_server::PostgresStore::with_table(
        pg::pool(&url, 16),
        "resend_idempotency_test",
    )
    .unwrap();
    match tokio::time::timeout(Duration::from_secs(5), store.migrate()).await {
        Ok(Ok(())) => run("postgres", store).await,
        Ok(Err(e)) if in_ci() => panic!("PostgreSQL at {url}: {e}, and CI is set"),
        Err(_) if in_ci() => panic!("PostgreSQL at {url} does not answer, and CI is set"),
        other => eprintln!("WARNING: PostgreSQL at {url} is unusable ({other:?}): test SKIPPED"),
    }
}

/// The transactional mode under the same chaos: the handler charges the
/// order by a row written in the transaction the layer lends it (with the
/// run's id), then works while holding it; the record commits with the row.
/// A run rolled back leaves no row, so "charged once" is counted in the
/// database: exactly one committed row per order, and every 2xx carries the
/// id of that row's run.
#[cfg(all(feature = "postgres", feature = "axum"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_transactional_one_effect_per_key_under_chaos() {
    use tower_resend_server::IdempotentTx;

    const EFFECTS: &str = "resend_chaos_tx_effects";
    let url = pg::url();
    let name = unique("chaos-tx");
    let pool = pg::named_pool(&url, 40, &name);
    let backend =
        tower_resend_server::PostgresStore::with_table(pool.clone(), "resend_idempotency_test")
            .unwrap()
            .transactional();
    let ready = async {
        backend.migrate().await?;
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {EFFECTS} (run text PRIMARY KEY, test text NOT NULL, ord text NOT NULL)"
        ))
        .execute(&pool)
        .await
        .map_err(|e| StoreError::with_source("effects table", e))
    };
    match tokio::time::timeout(Duration::from_secs(5), ready).await {
        Ok(Ok(_)) => {}
        other if in_ci() => panic!("PostgreSQL at {url}: {other:?}, and CI is set"),
        other => {
            eprintln!("WARNING: PostgreSQL at {url} is unusable ({other:?}): test SKIPPED");
            return;
        }
    }
    let _alone = alone().await;
    let started = Instant::now();
    let test = unique("tx");
    let working = Arc::new(AtomicUsize::new(0));
    let charge = {
        let (test, working) = (test.clone(), working.clone());
        move |mut tx: IdempotentTx, body: Bytes| {
            let (test, working) = (test.clone(), working.clone());
            async move {
                let _working = Working::new(&working);
                let order = String::from_utf8_lossy(&body).into_owned();
                let run = uuid::Uuid::new_v4().simple().to_string();
                let charged = sqlx::query(&format!(
                    "INSERT INTO {EFFECTS} (run, test, ord) VALUES ($1, $2, $3)"
                ))
                .bind(&run)
                .bind(&test)
                .bind(&order)
                .execute(&mut *tx)
                .await;
                if let Err(e) = charged {
                    return Err((http::StatusCode::SERVICE_UNAVAILABLE, e.to_string()));
                }
                tokio::time::sleep(work_for(&order)).await;
                Ok(format!("charged {order} run {run}"))
            }
        }
    };
    let layer = IdempotencyLayer::new(backend)
        .scope_with({
            let scope = unique("chaos");
            move |_| scope.clone()
        })
        .retry_after(Duration::from_secs(1))
        .store_timeout(Duration::from_secs(2));
    let stats = layer.stats();
    let app = Router::new().route("/charges", post(charge)).layer(layer);
    let (mut outcomes, plan, server) = send_through_faults("postgres-tx", app, &working).await;
    let first_round = successes(&outcomes);
    let mut followed = 0;
    follow_advice(server, &mut outcomes, &mut followed).await;
    let elapsed = started.elapsed();
    // Every transaction the layer began has ended: none of the pool's
    // connections is left inside one (an aborted one refuses every
    // statement of its next user: 25P02).
    assert_eq!(
        pg::idle_in_transaction(&pool, &name).await,
        0,
        "postgres-tx: connections of the user's pool left inside a transaction"
    );
    // What committed: one row per order, at most.
    let rows: Vec<(String, String)> =
        sqlx::query_as(&format!("SELECT ord, run FROM {EFFECTS} WHERE test = $1"))
            .bind(&test)
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut committed: HashMap<String, Vec<String>> = HashMap::new();
    for (ord, run) in rows {
        committed.entry(ord).or_default().push(run);
    }
    let twice: Vec<_> = committed.iter().filter(|(_, r)| r.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "postgres-tx: orders committed twice: {twice:?}"
    );
    let (mut ok, mut replays, mut failed) = (0, 0, Vec::new());
    for (i, outcome) in outcomes.iter().enumerate() {
        let order = format!("order-{i}");
        match outcome {
            Outcome::Success { body, replayed, .. } => {
                ok += 1;
                replays += usize::from(*replayed);
                let runs = committed.get(&order).map(Vec::as_slice).unwrap_or(&[]);
                assert_eq!(
                    runs.len(),
                    1,
                    "postgres-tx: {order} ended 2xx, so it committed once"
                );
                assert_eq!(
                    body,
                    &format!("charged {order} run {}", runs[0]),
                    "postgres-tx: {order}: a 2xx carries the committed run's answer"
                );
            }
            Outcome::Status(s) => failed.push((order, s.to_string())),
            Outcome::Error(e) => failed.push((order, e.to_string())),
        }
    }
    eprintln!(
        "chaos[postgres-tx]: {CALLS} calls in {elapsed:.1?}: {} orders committed, 0 twice; {first_round} 2xx in the first round, \
         {followed} sent again as advised; {ok} 2xx ({replays} replays); \
         {} without a 2xx {:?}; {} faults ({}); {stats:?}",
        committed.len(),
        failed.len(),
        failed.first(),
        plan.faults(),
        plan.summary(),
    );
    assert!(
        failed.len() <= CALLS / 100,
        "postgres-tx: too many calls ended without a 2xx after following their advice: {failed:?}"
    );
    assert!(
        plan.faults() > 0,
        "postgres-tx: the proxy injected no fault"
    );
}
