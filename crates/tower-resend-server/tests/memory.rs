//! Every rule of the idempotency layer on the memory store, on tokio's
//! paused clock.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Layer, ServiceExt};
use tower_resend_server::store::{
    Begin, Claim, Fingerprint, LeaseState, LeaseToken, RecordKey, StoreError, StoredResponse, Ttl,
};
use tower_resend_server::{
    IdempotencyLayer, InboundDeadlineLayer, MaybeBuffered, MemoryStore, Store,
};

store_rules!((flavor = "current_thread", start_paused = true), async {
    Some(MemoryStore::new())
});

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stale_holder_cannot_touch_the_new_holders_lease() {
    common::a_stale_holder_cannot_touch_the_new_holders_lease(
        MemoryStore::new(),
        Duration::from_secs(30),
    )
    .await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn stale_lease_is_taken_over_after_it_expires() {
    common::stale_lease_taken_over(MemoryStore::new(), Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn records_expire_after_their_ttl() {
    common::records_expire(MemoryStore::new(), Duration::from_secs(24 * 3600)).await;
}

/// A store that cannot be reached: it fails at once (`hang: false`) or
/// never answers (`hang: true`).
#[derive(Clone, Copy)]
struct Broken {
    hang: bool,
}

impl Broken {
    async fn answer<T>(self) -> Result<T, StoreError> {
        if self.hang {
            std::future::pending().await
        } else {
            Err(StoreError::new("down"))
        }
    }
}

impl Store for Broken {
    fn begin(
        &self,
        _: &Claim<'_>,
        _: Ttl,
    ) -> impl std::future::Future<Output = Result<Begin, StoreError>> + Send {
        self.answer()
    }
    fn renew(
        &self,
        _: &Claim<'_>,
        _: Ttl,
    ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
        self.answer()
    }
    fn complete(
        &self,
        _: &Claim<'_>,
        _: &StoredResponse,
        _: Ttl,
    ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
        self.answer()
    }
    fn release(
        &self,
        _: &Claim<'_>,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.answer()
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_store_that_fails_or_hangs_gives_503_and_runs_nothing() {
    common::store_down(Broken { hang: false }).await;
    common::store_down(Broken { hang: true }).await;
    // A memory store full of live records refuses new keys the same way.
    let full = MemoryStore::new().max_records(1);
    let rk = RecordKey {
        scope: "x",
        key: "y",
    };
    let ttl = Ttl {
        lease: Duration::from_secs(60),
        record: Duration::from_secs(60),
    };
    let claim = Claim {
        key: rk,
        fingerprint: Fingerprint([0; 32]),
        token: LeaseToken::random(),
    };
    full.begin(&claim, ttl).await.unwrap();
    common::store_down(full).await;
}

/// Handler 8 s, lease 3 s, the caller gives up at 400 ms and retries.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_slow_handler_keeps_its_lease() {
    common::a_slow_handler_keeps_its_lease(
        MemoryStore::new(),
        Duration::from_secs(8),
        Duration::from_secs(3),
        Duration::from_millis(400),
    )
    .await;
}

/// The inbound deadline cuts a keyed handler: the caller gets the 504 that
/// says where the time went, and so does every retry (the work may have
/// run in part); the handler does not run again.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_handler_cut_by_the_deadline_keeps_its_504() {
    let h = common::Handler::default();
    let svc = InboundDeadlineLayer::new(Duration::from_secs(30))
        .layer(IdempotencyLayer::new(MemoryStore::new()).layer(h.service()));
    let req = || {
        let mut r = common::with(common::post("cut", "a"), "x-sleep-ms", "5000");
        r.headers_mut()
            .insert("grpc-timeout", "1S".parse().unwrap());
        r
    };
    let start = tokio::time::Instant::now();
    let first = svc.clone().oneshot(req()).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(first.status(), StatusCode::GATEWAY_TIMEOUT);
    // Let the detached work reach its own deadline and store its end.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let again = svc.clone().oneshot(req()).await.unwrap();
    assert_eq!(again.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["content-type"], "application/problem+json");
    let body: serde_json::Value =
        serde_json::from_slice(&again.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["error"], "deadline_exceeded");
    assert_eq!(body["status"], 504);
    assert_eq!(h.runs(), 1);
    // Past the deadline, the detached handler was cut: it ran no further.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(h.runs(), 1);
}

/// Inside a keyed handler, outbound calls get keys derived from the
/// inbound one: a re-run of the same operation (here: a fresh store, as
/// after a crash) sends the same keys downstream; another operation, others.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn outbound_keys_are_derived_from_the_inbound_key() {
    let sent: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let upstream = {
        let sent = sent.clone();
        tower_resend::idempotency::SetIdempotencyKeyLayer::new()
            .upstream("payments")
            .layer(tower::service_fn(move |req: Request<()>| {
                let sent = sent.clone();
                async move {
                    let key = req.headers()["idempotency-key"]
                        .to_str()
                        .unwrap()
                        .to_owned();
                    sent.lock().unwrap().push(key);
                    Ok::<_, std::convert::Infallible>(())
                }
            }))
    };
    let handler = tower::service_fn(move |_: Request<MaybeBuffered<Full<Bytes>>>| {
        let upstream = upstream.clone();
        async move {
            for _ in 0..2 {
                upstream
                    .clone()
                    .oneshot(Request::post("http://payments/charges").body(()).unwrap())
                    .await?;
            }
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("ok"))))
        }
    });
    let run = |store: MemoryStore, key: &'static str| {
        let svc = IdempotencyLayer::new(store).layer(handler.clone());
        async move {
            let req = Request::post("/orders")
                .header("idempotency-key", key)
                .header("authorization", "Bearer a")
                .body(Full::new(Bytes::new()))
                .unwrap();
            assert_eq!(svc.oneshot(req).await.unwrap().status(), StatusCode::OK);
        }
    };
    run(MemoryStore::new(), "order-1").await;
    run(MemoryStore::new(), "order-1").await;
    run(MemoryStore::new(), "order-2").await;
    let sent = sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 6);
    // The same operation sends the same two keys; the two calls differ.
    assert_eq!(sent[0..2], sent[2..4]);
    assert_ne!(sent[0], sent[1]);
    // Another operation, other keys.
    assert!(sent[4..].iter().all(|k| !sent[..4].contains(k)));
    assert!(sent.iter().all(|k| k.len() == 36));
}

/// A claim with its scope and key owned, for a store call answered later.
struct OwnedClaim {
    scope: String,
    key: String,
    fingerprint: Fingerprint,
    token: LeaseToken,
}

impl OwnedClaim {
    fn of(claim: &Claim<'_>) -> Self {
        Self {
            scope: claim.key.scope.to_owned(),
            key: claim.key.key.to_owned(),
            fingerprint: claim.fingerprint,
            token: claim.token,
        }
    }

    fn claim(&self) -> Claim<'_> {
        Claim {
            key: RecordKey {
                scope: &self.scope,
                key: &self.key,
            },
            fingerprint: self.fingerprint,
            token: self.token,
        }
    }
}

/// A memory store with faults of a slow or hung store: its `begin` answers
/// `begin_delay` after it took effect; its renewals and releases take
/// effect and answer `renew_delay` and `release_delay` after they are sent;
/// its next `hung_completes` completes and `hung_renews` renewals never
/// answer (nor take effect). It counts the releases sent and not yet
/// answered or given up.
#[derive(Clone, Default)]
struct Stalls {
    inner: MemoryStore,
    begin_delay: Duration,
    renew_delay: Duration,
    release_delay: Duration,
    hung_completes: Arc<AtomicUsize>,
    hung_renews: Arc<AtomicUsize>,
    releases_pending: Arc<AtomicUsize>,
}

/// Uses up one of `n`; false when none is left.
fn take_one(n: &AtomicUsize) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

/// Counts a release while its future lives.
struct Pending(Arc<AtomicUsize>);

impl Pending {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(count))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Store for Stalls {
    fn begin(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl std::future::Future<Output = Result<Begin, StoreError>> + Send {
        let begun = self.inner.begin(claim, ttl);
        let delay = self.begin_delay;
        async move {
            let begun = begun.await;
            tokio::time::sleep(delay).await;
            begun
        }
    }
    fn renew(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
        let (inner, claim) = (self.inner.clone(), OwnedClaim::of(claim));
        let (hangs, delay) = (take_one(&self.hung_renews), self.renew_delay);
        async move {
            if hangs {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(delay).await;
            inner.renew(&claim.claim(), ttl).await
        }
    }
    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
        let (inner, claim, response) =
            (self.inner.clone(), OwnedClaim::of(claim), response.clone());
        let hangs = take_one(&self.hung_completes);
        async move {
            if hangs {
                std::future::pending::<()>().await;
            }
            inner.complete(&claim.claim(), &response, ttl).await
        }
    }
    fn release(
        &self,
        claim: &Claim<'_>,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        let (inner, claim) = (self.inner.clone(), OwnedClaim::of(claim));
        let (pending, delay) = (Pending::new(&self.releases_pending), self.release_delay);
        async move {
            let _pending = pending;
            tokio::time::sleep(delay).await;
            inner.release(&claim.claim()).await
        }
    }
}

/// A caller that goes away while the lease of a "nothing done" answer is
/// being dropped does not leave the lease behind: the release finishes in
/// the background, and the retry runs at once (not 409 until it expires).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_release_cut_mid_await_still_releases() {
    let h = common::Handler::default();
    let store = Stalls {
        release_delay: Duration::from_millis(500),
        ..Stalls::default()
    };
    let svc = IdempotencyLayer::new(store).layer(h.service());
    let req = || common::with(common::post("rel", "a"), "x-nothing-done", "1");
    // The handler answers at once; the release takes 500 ms; the caller
    // gives up at 100 ms.
    let cut = tokio::time::timeout(Duration::from_millis(100), svc.clone().oneshot(req())).await;
    assert!(cut.is_err());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again = svc.oneshot(common::post("rel", "a")).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(again.headers().get("idempotent-replayed").is_none());
    assert_eq!(h.runs(), 2);
}

/// A caller that goes away while the store's answer to the claim is on its
/// way (the store took the lease; the answer is late) leaves no lease
/// behind: the request's guard, dropped while it may hold one, releases it
/// in the background, so the retry runs at once rather than get 409 until
/// the lease expires. (Nothing ran: the handler had not started.)
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_caller_gone_while_the_claim_is_answered_leaves_no_lease() {
    let h = common::Handler::default();
    let store = Stalls {
        begin_delay: Duration::from_millis(500),
        ..Stalls::default()
    };
    let svc = IdempotencyLayer::new(store).layer(h.service());
    // The claim is answered 500 ms after the store took the lease; the
    // caller gives up at 100 ms.
    let cut = tokio::time::timeout(
        Duration::from_millis(100),
        svc.clone().oneshot(common::post("late", "a")),
    )
    .await;
    assert!(cut.is_err());
    assert_eq!(h.runs(), 0);
    // The retry (its own claim answered late too) runs the work.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let again = svc.oneshot(common::post("late", "a")).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(again.headers().get("idempotent-replayed").is_none());
    assert_eq!(h.runs(), 1);
}

/// A layer with a 1 s store timeout over a store whose releases never
/// answer and whose claims are answered `begin_delay` late; and the count
/// of the releases sent and neither answered nor given up.
fn hung_releases(begin_delay: Duration) -> (IdempotencyLayer<Stalls>, Arc<AtomicUsize>) {
    let store = Stalls {
        begin_delay,
        release_delay: Duration::MAX,
        ..Stalls::default()
    };
    let pending = Arc::clone(&store.releases_pending);
    let layer = IdempotencyLayer::new(store).store_timeout(Duration::from_secs(1));
    (layer, pending)
}

/// The release a dropped request's guard spawns is bounded by the store
/// timeout, as every store call is: a store that never answers it does not
/// keep that task, and what the store holds for it, forever.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_release_spawned_on_a_drop_gives_up_at_the_store_timeout() {
    let h = common::Handler::default();
    let (layer, pending) = hung_releases(Duration::from_millis(500));
    let svc = layer.layer(h.service());
    // The caller gives up at 100 ms, while the claim's answer is on its
    // way: the guard, which may hold the lease, releases it in a task.
    let cut = tokio::time::timeout(
        Duration::from_millis(100),
        svc.oneshot(common::post("hung", "a")),
    )
    .await;
    assert!(cut.is_err());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        pending.load(Ordering::SeqCst),
        1,
        "the release was sent and waits on the store"
    );
    // One store timeout after it was sent, it is given up.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        pending.load(Ordering::SeqCst),
        0,
        "the release outlived the store timeout"
    );
    assert_eq!(h.runs(), 0);
}

/// Dropping the lease of a "nothing done" answer is bounded by the store
/// timeout too: a store that never answers the release delays the answer
/// by one store timeout, not forever.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_release_that_is_never_answered_delays_the_answer_by_one_store_timeout() {
    let h = common::Handler::default();
    let (layer, pending) = hung_releases(Duration::ZERO);
    let svc = layer.layer(h.service());
    let started = tokio::time::Instant::now();
    let req = common::with(common::post("hung-release", "a"), "x-nothing-done", "1");
    let answered = tokio::time::timeout(Duration::from_secs(60), svc.oneshot(req))
        .await
        .expect("a release the store never answers held the answer back")
        .unwrap();
    assert_eq!(answered.status(), StatusCode::CREATED);
    let took = started.elapsed();
    assert!(
        (Duration::from_secs(1)..Duration::from_millis(1010)).contains(&took),
        "answered after {took:?}"
    );
    assert_eq!(pending.load(Ordering::SeqCst), 0);
    assert_eq!(h.runs(), 1);
}

/// A store that never answers the response's `complete`, nor the first try
/// to store it again: the caller has its answer one store timeout after the
/// handler's, the response is held (a retry is replayed it), and stored
/// once the store answers, each try bounded by the store timeout.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_complete_the_store_never_answers_is_held_then_stored() {
    let h = common::Handler::default();
    let store = Stalls {
        hung_completes: Arc::new(AtomicUsize::new(2)),
        ..Stalls::default()
    };
    let layer = IdempotencyLayer::new(store).store_timeout(Duration::from_secs(1));
    let stats = layer.stats();
    let svc = layer.layer(h.service());
    let started = tokio::time::Instant::now();
    let first = tokio::time::timeout(
        Duration::from_secs(60),
        svc.clone().oneshot(common::post("hung-complete", "a")),
    )
    .await
    .expect("a complete the store never answers held the answer back")
    .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let took = started.elapsed();
    assert!(
        (Duration::from_secs(1)..Duration::from_millis(1010)).contains(&took),
        "answered after {took:?}"
    );
    assert_eq!(stats.held(), 1, "{stats:?}");
    let held = svc
        .clone()
        .oneshot(common::post("hung-complete", "a"))
        .await
        .unwrap();
    assert_eq!(held.headers()["idempotent-replayed"], "true");
    // The background task's first try hangs (given up after 1 s), its
    // second stores the response.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!((stats.stored_late(), stats.held()), (1, 0), "{stats:?}");
    let stored = svc
        .oneshot(common::post("hung-complete", "a"))
        .await
        .unwrap();
    assert_eq!(stored.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1);
}

/// A handler slower than its lease, on `store`, whose caller gives up at
/// 400 ms and retries every 400 ms, each retry reaching another process:
/// one run, 409s (the store's lease, renewed), then the replay. With
/// `deadline`, each request carries an inbound deadline that far off (the
/// lease is then renewed by a timer of the request's own, not the layer's
/// ticker).
async fn a_slow_handler_runs_once(
    store: Stalls,
    lease: Duration,
    store_timeout: Duration,
    deadline: Option<Duration>,
) {
    let h = common::Handler::default();
    let layer = |store| {
        IdempotencyLayer::new(store)
            .lease(lease)
            .store_timeout(store_timeout)
            .layer(h.service())
    };
    // The retries reach another process (a layer of its own on the same
    // store), which only the store's lease can hold off.
    let (svc, elsewhere) = (layer(store.clone()), layer(store));
    let req = || {
        let mut r = common::with(common::post("slow", "a"), "x-sleep-ms", "8000");
        if let Some(d) = deadline {
            r.extensions_mut().insert(tower_resend::Deadline::after(d));
        }
        r
    };
    let patience = Duration::from_millis(400);
    let start = tokio::time::Instant::now();
    assert!(tokio::time::timeout(patience, svc.clone().oneshot(req()))
        .await
        .is_err());
    let mut conflicts = 0;
    let replay = loop {
        assert!(start.elapsed() < Duration::from_secs(20), "no replay");
        let r = tokio::time::timeout(patience, elsewhere.clone().oneshot(req()))
            .await
            .expect("a retry hung")
            .unwrap();
        assert_eq!(h.runs(), 1, "ran again {:?} in", start.elapsed());
        if r.status() != StatusCode::CONFLICT {
            break r;
        }
        conflicts += 1;
        tokio::time::sleep(patience).await;
    };
    assert!(conflicts >= 10, "{conflicts} conflicts");
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

/// A renewal the store never answers is given up at the store timeout, and
/// the renewals go on: the lease outlives the 8 s handler (3 s lease).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_renewal_the_store_never_answers_does_not_end_the_renewals() {
    for deadline in [None, Some(Duration::from_secs(60))] {
        let store = Stalls {
            hung_renews: Arc::new(AtomicUsize::new(1)),
            ..Stalls::default()
        };
        let (lease, timeout) = (Duration::from_secs(3), Duration::from_millis(500));
        a_slow_handler_runs_once(store, lease, timeout, deadline).await;
    }
}

/// Renewals that take 500 ms to land still land before the lease lapses:
/// they are sent well ahead of its end (every third of it), not at it;
/// by the layer's ticker, and by a request's own timer under a deadline.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn renewals_slow_to_land_still_keep_the_lease() {
    for deadline in [None, Some(Duration::from_secs(60))] {
        let store = Stalls {
            renew_delay: Duration::from_millis(500),
            ..Stalls::default()
        };
        a_slow_handler_runs_once(
            store,
            Duration::from_secs(3),
            Duration::from_secs(1),
            deadline,
        )
        .await;
    }
}

/// A claim slow to answer (the store took it at once, its answer came
/// 1.5 s later: a slow store, a stalled process) takes nothing from the
/// renewals' margin: they are counted from when the claim was sent, so the
/// first goes out as the handler starts and lands (1.2 s later) before the
/// 3 s lease, counted from the claim, lapses. A duplicate sent at 3.2 s to
/// another process finds the key in progress, and the work runs once. (Counted from the
/// claim's answer, the first renewal went out at 2.5 s and landed at 3.7 s:
/// the duplicate took the key over at 3.2 s, and the handler ran twice.)
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_claim_slow_to_answer_leaves_its_renewals_the_lease() {
    let store = Stalls {
        begin_delay: Duration::from_millis(1500),
        renew_delay: Duration::from_millis(1200),
        ..Stalls::default()
    };
    let h = common::Handler::default();
    let layer = |store| {
        IdempotencyLayer::new(store)
            .lease(Duration::from_secs(3))
            .store_timeout(Duration::from_secs(2))
    };
    let layer_here = layer(store.clone());
    let stats = layer_here.stats();
    let svc = layer_here.layer(h.service());
    // The duplicate reaches another process, which only the store's lease
    // can hold off.
    let elsewhere = layer(store).layer(h.service());
    let req = || common::with(common::post("slow-claim", "a"), "x-sleep-ms", "3000");
    let start = tokio::time::Instant::now();
    let first = tokio::spawn({
        let first = svc.clone().oneshot(req());
        async move { (first.await, start.elapsed()) }
    });
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let duplicate = elsewhere.oneshot(req()).await.unwrap();
    assert_eq!(duplicate.status(), StatusCode::CONFLICT);
    let (first, answered_at) = first.await.unwrap();
    assert_eq!(first.unwrap().status(), StatusCode::CREATED);
    // The claim's 1.5 s, then the handler's 3 s.
    assert_eq!(answered_at, Duration::from_millis(4500));
    let replay = svc.clone().oneshot(req()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!((h.runs(), stats.leases_lost()), (1, 0));
}

/// A holder whose lease lapses while its handler still works (its
/// renewals never land: 3 s lease, 8 s handler) is not taken over by a
/// duplicate that reaches its own process: that process knows the work runs
/// and says so (409), whatever the store's lease says; the work runs once,
/// and its response is stored and replayed. (Before, the store granted the
/// lapsed key to the duplicate at 5 s, and the handler ran twice.) Another
/// process, which only the store can tell, is not covered: a second layer
/// on the same store takes the key over.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_holder_past_its_lease_is_not_taken_over_by_its_own_process() {
    let store = Stalls {
        hung_renews: Arc::new(AtomicUsize::new(usize::MAX)),
        ..Stalls::default()
    };
    let h = common::Handler::default();
    let layer = IdempotencyLayer::new(store.clone())
        .lease(Duration::from_secs(3))
        .store_timeout(Duration::from_secs(1));
    let stats = layer.stats();
    let svc = layer.layer(h.service());
    let req = || common::with(common::post("lapsed", "a"), "x-sleep-ms", "8000");
    let first = tokio::spawn(svc.clone().oneshot(req()));
    tokio::time::sleep(Duration::from_secs(5)).await;
    for _ in 0..3 {
        let duplicate = svc.clone().oneshot(req()).await.unwrap();
        assert_eq!(duplicate.status(), StatusCode::CONFLICT);
        assert!(duplicate.headers().contains_key("retry-after"));
    }
    assert_eq!(h.runs(), 1);
    // Another fingerprint under the key: 422, as the store would say.
    let other = common::with(common::post("lapsed", "b"), "x-sleep-ms", "8000");
    let other = svc.clone().oneshot(other).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let replay = svc.clone().oneshot(req()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1);
    assert_eq!((stats.leases_lost(), stats.unstored()), (0, 0));

    // Another process (a layer of its own on the same store) has only the
    // store to ask: past the lapsed lease, it runs the key again.
    let key = || common::with(common::post("lapsed-elsewhere", "a"), "x-sleep-ms", "8000");
    let first = tokio::spawn(svc.clone().oneshot(key()));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let elsewhere = IdempotencyLayer::new(store).layer(h.service());
    let taken = tokio::spawn(elsewhere.oneshot(key()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(h.runs(), 3);
    drop((first, taken));
}

/// The work is bounded by the earlier of the request's own deadline and
/// the ambient scope's (read where the layer is called): a handler that
/// outlives it is cut there, with a 504, or for a gRPC request the gRPC way
/// (`grpc-status` 4).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_earlier_of_the_requests_and_the_ambient_deadline_bounds_the_work() {
    let far = Some(Duration::from_secs(60));
    for (own, grpc) in [(None, false), (far, false), (far, true)] {
        let h = common::Handler::default();
        let svc = IdempotencyLayer::new(MemoryStore::new()).layer(h.service());
        let mut req = common::with(common::post("ambient", "a"), "x-sleep-ms", "5000");
        if let Some(d) = own {
            req.extensions_mut()
                .insert(tower_resend::Deadline::after(d));
        }
        if grpc {
            req.headers_mut().insert(
                http::header::CONTENT_TYPE,
                "application/grpc".parse().unwrap(),
            );
        }
        let start = tokio::time::Instant::now();
        let ambient = tower_resend::Deadline::after(Duration::from_secs(1));
        let resp = tower_resend::deadline::scope(ambient, svc.oneshot(req))
            .await
            .unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(1), "{own:?} {grpc}");
        if grpc {
            assert_eq!(resp.headers()["grpc-status"], "4");
        } else {
            assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT, "{own:?}");
        }
        assert_eq!(h.runs(), 1);
    }
}

/// A store whose `complete` lands but whose answers are lost on the way
/// back (a store paused past the store timeout: Redis under SIGSTOP), the
/// first `lost` times.
#[derive(Clone)]
struct AnswersLost {
    inner: MemoryStore,
    lost: Arc<AtomicUsize>,
}

impl Store for AnswersLost {
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

    async fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> Result<LeaseState, StoreError> {
        let stored = self.inner.complete(claim, response, ttl).await?;
        let lost = self
            .lost
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lost {
            return Err(StoreError::new("the answer was lost"));
        }
        Ok(stored)
    }

    fn release(
        &self,
        claim: &Claim<'_>,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.inner.release(claim)
    }
}

/// Issue 27: a store that stalled took the response, but its answers were
/// lost: the layer holds the response and tries again; the renewal it
/// sends between tries finds the holder's own finished record. That is the
/// response stored, not a lease lost: no ERROR, `leases_lost` stays 0 (it
/// counted one per key before, under Redis paused, though every key was
/// replayed and none ran twice).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_renewal_that_finds_its_own_stored_response_is_no_lost_lease() {
    let h = common::Handler::default();
    let store = AnswersLost {
        inner: MemoryStore::new(),
        lost: Arc::new(AtomicUsize::new(2)),
    };
    let layer = IdempotencyLayer::new(store).store_timeout(Duration::from_secs(1));
    let stats = layer.stats();
    let svc = layer.layer(h.service());
    let first = svc
        .clone()
        .oneshot(common::post("answers-lost", "a"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(stats.held(), 1, "{stats:?}");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        (stats.leases_lost(), stats.stored_late(), stats.held()),
        (0, 1, 0),
        "{stats:?}"
    );
    let again = svc
        .oneshot(common::post("answers-lost", "a"))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1);
}

/// A replay carries the first answer (status, body, its headers) but not
/// what described that exchange alone: no `Date` (the server writes the
/// replay's own), no request id, no rate-limit or timing headers, unless a
/// header is named to be replayed. And a key sent as a structured-field
/// string (`"k"`) is the same key as a bare `k`.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_replay_carries_the_answer_not_the_first_exchange() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = tower::service_fn(move |_req: Request<MaybeBuffered<Full<Bytes>>>| {
        let n = counted.fetch_add(1, Ordering::SeqCst);
        async move {
            let resp = Response::builder()
                .status(StatusCode::CREATED)
                .header("date", "Sat, 05 Dec 2026 10:00:00 GMT")
                .header("x-request-id", format!("req-{n}"))
                .header("ratelimit-remaining", "99")
                .header("server-timing", "db;dur=53")
                .header("x-order", "o-1")
                .body(Full::new(Bytes::from_static(b"created")))
                .unwrap();
            Ok::<_, std::convert::Infallible>(resp)
        }
    });
    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(handler);
    let post = |key: &str| {
        Request::post("/orders")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };

    let first = svc.clone().oneshot(post("k-1")).await.unwrap();
    assert_eq!(first.headers()["x-request-id"], "req-0");
    assert_eq!(first.headers()["date"], "Sat, 05 Dec 2026 10:00:00 GMT");

    // The same key, quoted: a replay.
    let again = svc.clone().oneshot(post("\"k-1\"")).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["x-order"], "o-1");
    for gone in [
        "date",
        "x-request-id",
        "ratelimit-remaining",
        "server-timing",
    ] {
        assert!(again.headers().get(gone).is_none(), "{gone} was replayed");
    }
    let body = again.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"created");

    // Named to be replayed, a header is.
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .replayed_header(http::header::DATE)
        .layer(tower::service_fn(
            |_req: Request<MaybeBuffered<Full<Bytes>>>| async {
                let resp = Response::builder()
                    .header("date", "Sat, 05 Dec 2026 10:00:00 GMT")
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                Ok::<_, std::convert::Infallible>(resp)
            },
        ));
    svc.clone().oneshot(post("\"k-2\"")).await.unwrap();
    let again = svc.oneshot(post("k-2")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["date"], "Sat, 05 Dec 2026 10:00:00 GMT");
}
