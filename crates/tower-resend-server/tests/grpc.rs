//! The idempotency layer on a real tonic server (`Server::builder().layer(..)`),
//! on loopback, called by tonic's own client and by tower-resend's tonic
//! stack: stored answers keep their trailers (also when the store goes away
//! after the work), the layer's own answers are gRPC statuses
//! (trailers-only), and what says "nothing was done" frees the key. Prost
//! messages written by hand (no protoc), on tokio's paused clock.

#[path = "support/ledger.rs"]
mod ledger;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::uri::PathAndQuery;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use ledger::{Balance, ChargeRequest, Ledger, CHARGE};
use prost::Message;
use tokio::task::JoinHandle;
use tonic::metadata::MetadataMap;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::{ServiceBuilder, ServiceExt};
use tower_resend::tonic::TonicTransport;
use tower_resend_server::idempotency::{Anonymous, Backend};
use tower_resend_server::store::{Begin, Claim, LeaseState, StoredResponse, Ttl};
use tower_resend_server::{IdempotencyLayer, InboundDeadlineLayer, MemoryStore, Store, StoreError};

/// A tonic server on 127.0.0.1 (port chosen by the OS) behind the layers,
/// stopped when dropped.
struct GrpcServer {
    addr: SocketAddr,
    runs: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl GrpcServer {
    /// The layers as a tonic server takes them: the inbound deadline
    /// outside, the idempotency layer inside.
    async fn start<St: Backend>(layer: IdempotencyLayer<St>) -> Self {
        let incoming = TcpIncoming::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind 127.0.0.1:0")
            .with_nodelay(Some(true));
        let addr = incoming.local_addr().expect("local address");
        let ledger = Ledger::default();
        let runs = Arc::clone(&ledger.runs);
        let layers = ServiceBuilder::new()
            .layer(InboundDeadlineLayer::new(Duration::from_secs(30)))
            .layer(layer);
        let task = tokio::spawn(async move {
            let _ = Server::builder()
                .layer(layers)
                .add_service(ledger)
                .serve_with_incoming(incoming)
                .await;
        });
        Self { addr, runs, task }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn channel(&self) -> Channel {
        Endpoint::from_shared(format!("http://{}", self.addr))
            .expect("a valid endpoint")
            .tcp_nodelay(true)
            .connect_lazy()
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn charge(account: &str, amount: u64) -> ChargeRequest {
    ChargeRequest {
        account: account.to_owned(),
        amount,
    }
}

/// A unary call by tonic's own client, with `key` (and a `grpc-timeout` of
/// `timeout`) in its metadata: the balance, or the status with its
/// metadata (headers and trailers).
async fn tonic_call(
    channel: Channel,
    msg: ChargeRequest,
    key: Option<&str>,
    timeout: Option<Duration>,
) -> Result<(Balance, MetadataMap), Status> {
    let mut req = tonic::Request::new(msg);
    if let Some(key) = key {
        req.metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    if let Some(t) = timeout {
        req.set_timeout(t);
    }
    unary(channel, req).await
}

/// A keyed unary call by tonic's own client, as the caller `who` (a
/// credential's metadata name and value; none when the name is empty).
async fn tonic_call_as(
    channel: Channel,
    msg: ChargeRequest,
    key: &str,
    who: (&'static str, &str),
) -> Result<(Balance, MetadataMap), Status> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    if !who.0.is_empty() {
        req.metadata_mut().insert(who.0, who.1.parse().unwrap());
    }
    unary(channel, req).await
}

async fn unary(
    channel: Channel,
    req: tonic::Request<ChargeRequest>,
) -> Result<(Balance, MetadataMap), Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("the channel connects");
    let codec = ProstCodec::<ChargeRequest, Balance>::default();
    let resp = grpc
        .unary(req, PathAndQuery::from_static(CHARGE), codec)
        .await?;
    let (metadata, balance, _) = resp.into_parts();
    Ok((balance, metadata))
}

/// A unary request framed by hand, as a generated client sends it.
fn framed(msg: &ChargeRequest, key: &str) -> Request<tonic::body::Body> {
    let msg = msg.encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + msg.len());
    frame.put_u8(0);
    frame.put_u32(u32::try_from(msg.len()).unwrap());
    frame.put_slice(&msg);
    Request::post(CHARGE)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(tonic::body::Body::new(Full::new(frame.freeze())))
        .unwrap()
}

/// An answer on the wire: its headers, its message (if any) and its
/// trailers.
struct Wire {
    headers: http::HeaderMap,
    message: Option<Balance>,
    trailers: Option<http::HeaderMap>,
}

async fn wire<B>(resp: Response<B>) -> Wire
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.expect("the body arrives");
    let trailers = collected.trailers().cloned();
    let bytes = collected.to_bytes();
    let message = bytes
        .get(5..)
        .map(|m| Balance::decode(m).expect("a Balance"));
    Wire {
        headers: parts.headers,
        message,
        trailers,
    }
}

/// 1. The first answer and its replay both end with `grpc-status: 0` in
/// their trailers and carry the same message; the replay says it is one;
/// the work ran once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_first_answer_and_its_replay_keep_their_trailers() {
    let server = GrpcServer::start(IdempotencyLayer::new(MemoryStore::new())).await;
    let mut answers = Vec::new();
    for _ in 0..2 {
        let resp = server
            .channel()
            .oneshot(framed(&charge("ok", 7), "order-1"))
            .await
            .expect("an answer");
        answers.push(wire(resp).await);
    }
    let [first, replay] = [&answers[0], &answers[1]];
    for w in [first, replay] {
        let trailers = w.trailers.as_ref().expect("trailers");
        assert_eq!(trailers["grpc-status"], "0");
        assert_eq!(w.message, Some(Balance { amount: 7, run: 1 }));
    }
    assert!(first.headers.get("idempotent-replayed").is_none());
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.headers["content-type"], "application/grpc");
    assert_eq!(server.runs(), 1);
    // tonic's own client reads the replay as the answer it is.
    let (balance, metadata) = tonic_call(server.channel(), charge("ok", 7), Some("order-1"), None)
        .await
        .expect("the replay is an answer");
    assert_eq!(balance, Balance { amount: 7, run: 1 });
    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(server.runs(), 1);
}

/// 2 and 3. A duplicate while the first still runs: tonic's client sees the
/// documented retryable status, UNAVAILABLE with a pushback (never
/// INTERNAL, never an HTTP 409); tower-resend's stack retries it after the
/// pushback and ends in the replay; the work ran once.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_duplicate_while_the_first_runs_is_unavailable_with_a_pushback() {
    let server = GrpcServer::start(IdempotencyLayer::new(MemoryStore::new())).await;
    let first = tokio::spawn(tonic_call(
        server.channel(),
        charge("slow", 5),
        Some("order-2"),
        None,
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;

    let status = tonic_call(server.channel(), charge("slow", 5), Some("order-2"), None)
        .await
        .expect_err("the first still runs");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("in progress"), "{status:?}");
    assert_eq!(
        status.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "1000"
    );

    let stack = tower_resend::stack()
        .max_attempts(5)
        .seed(1)
        .service(TonicTransport::new(server.channel()));
    let started = tokio::time::Instant::now();
    let resp = stack
        .oneshot(framed(&charge("slow", 5), "order-2"))
        .await
        .expect("retried into the replay");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let w = wire(resp).await;
    assert_eq!(w.headers["idempotent-replayed"], "true");
    assert_eq!(w.message, Some(Balance { amount: 5, run: 1 }));
    assert_eq!(w.trailers.unwrap()["grpc-status"], "0");
    let (balance, _) = first.await.unwrap().expect("the first answers");
    assert_eq!(balance.run, 1);
    assert_eq!(server.runs(), 1);
}

/// A handler slower than its lease keeps it for as long as it runs: a
/// duplicate to another server long after the lease would have lapsed
/// (three lease lives in) is still told the first runs, and replays its
/// end once it has one.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_handler_slower_than_its_lease_runs_once() {
    let store = MemoryStore::new();
    let layer = |store| IdempotencyLayer::new(store).lease(Duration::from_millis(300));
    let server = GrpcServer::start(layer(store.clone())).await;
    // The duplicate reaches another server on the same store, which only
    // the store's lease, renewed, can hold off.
    let elsewhere = GrpcServer::start(layer(store)).await;
    let first = tokio::spawn(tonic_call(
        server.channel(),
        charge("slow", 4),
        Some("order-slow"),
        None,
    ));
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let status = tonic_call(
        elsewhere.channel(),
        charge("slow", 4),
        Some("order-slow"),
        None,
    )
    .await
    .expect_err("the first still runs");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("in progress"), "{status:?}");

    let (balance, _) = first.await.unwrap().expect("the first answers");
    assert_eq!(balance.run, 1);
    let (replayed, metadata) = tonic_call(
        server.channel(),
        charge("slow", 4),
        Some("order-slow"),
        None,
    )
    .await
    .expect("the replay");
    assert_eq!(replayed, Balance { amount: 4, run: 1 });
    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(server.runs() + elsewhere.runs(), 1);
}

/// A memory store that refuses its first `refusals` final writes (the
/// store went away after the work), never answers a renewal when
/// `renewals_hang` (each given up at the layer's store timeout: a lease
/// that lapses while its handler works), and answers everything else.
#[derive(Clone)]
struct Faulty {
    inner: MemoryStore,
    refusals: Arc<AtomicUsize>,
    renewals_hang: bool,
}

impl Store for Faulty {
    async fn begin(&self, c: &Claim<'_>, ttl: Ttl) -> Result<Begin, StoreError> {
        self.inner.begin(c, ttl).await
    }
    async fn renew(&self, c: &Claim<'_>, ttl: Ttl) -> Result<LeaseState, StoreError> {
        if self.renewals_hang {
            std::future::pending::<()>().await;
        }
        self.inner.renew(c, ttl).await
    }
    async fn complete(
        &self,
        c: &Claim<'_>,
        r: &StoredResponse,
        ttl: Ttl,
    ) -> Result<LeaseState, StoreError> {
        let refuse = self
            .refusals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refuse {
            return Err(StoreError::new("gone after the work"));
        }
        self.inner.complete(c, r, ttl).await
    }
    async fn release(&self, c: &Claim<'_>) -> Result<(), StoreError> {
        self.inner.release(c).await
    }
}

/// A lease that lapsed while its handler works (its renewals never land:
/// a 300 ms lease, a 1.5 s handler) is not taken over by a duplicate that
/// reaches the server running the work: UNAVAILABLE "in progress", and
/// INVALID_ARGUMENT for another payload, as the store would have said while
/// the lease held; the work runs once, and its answer is replayed.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_duplicate_past_a_lapsed_lease_is_told_the_work_runs() {
    let store = Faulty {
        inner: MemoryStore::new(),
        refusals: Arc::default(),
        renewals_hang: true,
    };
    let layer = IdempotencyLayer::new(store)
        .lease(Duration::from_millis(300))
        .store_timeout(Duration::from_millis(100));
    let server = GrpcServer::start(layer).await;
    let call = |amount| {
        tonic_call(
            server.channel(),
            charge("slow", amount),
            Some("lapsed"),
            None,
        )
    };
    let first = tokio::spawn(call(4));
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let status = call(4).await.expect_err("the first still runs");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("in progress"), "{status:?}");
    let status = call(9).await.expect_err("another payload");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(server.runs(), 1);

    let (balance, _) = first.await.unwrap().expect("the first answers");
    assert_eq!(balance.run, 1);
    let (replayed, metadata) = call(4).await.expect("the replay");
    assert_eq!(replayed, Balance { amount: 4, run: 1 });
    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(server.runs(), 1);
}

/// 4. The same key with another payload: INVALID_ARGUMENT, which
/// tower-resend's stack does not retry (one attempt).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn another_payload_under_the_same_key_is_invalid_argument() {
    let server = GrpcServer::start(IdempotencyLayer::new(MemoryStore::new())).await;
    tonic_call(server.channel(), charge("ok", 1), Some("order-3"), None)
        .await
        .expect("the first runs");
    let status = tonic_call(server.channel(), charge("ok", 2), Some("order-3"), None)
        .await
        .expect_err("another payload");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("another request"), "{status:?}");

    let stack = tower_resend::stack().service(TonicTransport::new(server.channel()));
    let resp = stack
        .oneshot(framed(&charge("ok", 3), "order-3"))
        .await
        .expect("an answer");
    let attempts = resp
        .extensions()
        .get::<tower_resend::retry::Attempts>()
        .expect("the history")
        .len();
    assert_eq!(attempts, 1, "not retried");
    assert_eq!(resp.headers()["grpc-status"], "3");
    assert_eq!(server.runs(), 1);
}

/// 5. UNAVAILABLE from the handler says nothing was done, and so does a
/// status marked so in its metadata: neither is kept, the retry runs the
/// handler again, and the caller is told so (`idempotent-nothing-done:
/// true`, which tower-resend's client reads), whoever said it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn nothing_done_frees_the_key() {
    let server = GrpcServer::start(IdempotencyLayer::new(MemoryStore::new())).await;
    for (account, code, key) in [
        ("unavailable", Code::Unavailable, "order-5a"),
        ("marked", Code::FailedPrecondition, "order-5b"),
    ] {
        let before = server.runs();
        for _ in 0..2 {
            let status = tonic_call(server.channel(), charge(account, 1), Some(key), None)
                .await
                .expect_err("the handler's status");
            assert_eq!(status.code(), code, "{status:?}");
            assert!(status.metadata().get("idempotent-replayed").is_none());
            assert_eq!(
                status
                    .metadata()
                    .get("idempotent-nothing-done")
                    .map(|v| v.to_str().unwrap()),
                Some("true"),
                "{status:?}"
            );
        }
        assert_eq!(server.runs(), before + 2, "{account}: run again");
    }
}

/// 6. A `grpc-timeout` shorter than the handler: DEADLINE_EXCEEDED; and the
/// key's end is that, replayed as DEADLINE_EXCEEDED.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_timeout_shorter_than_the_handler_is_deadline_exceeded() {
    // One store for the server on loopback and the same stack in process.
    let store = MemoryStore::new();
    let server = GrpcServer::start(IdempotencyLayer::new(store.clone())).await;
    // (Sent to the server's own stack in process: a tonic channel reads
    // `grpc-timeout` too, and would give up on its own at the same
    // instant, saying CANCELLED.)
    let stack = ServiceBuilder::new()
        .layer(InboundDeadlineLayer::new(Duration::from_secs(30)))
        .layer(IdempotencyLayer::new(store.clone()))
        .service(tonic::service::Routes::new(Ledger {
            runs: Arc::clone(&server.runs),
        }));
    let mut req = framed(&charge("hang", 1), "order-6");
    req.headers_mut()
        .insert("grpc-timeout", http::HeaderValue::from_static("500m"));
    let started = tokio::time::Instant::now();
    let cut = wire(stack.oneshot(req).await.expect("an answer")).await;
    assert_eq!(started.elapsed(), Duration::from_millis(500));
    assert_eq!(cut.headers["grpc-status"], "4", "{:?}", cut.headers);
    assert!(cut.headers.contains_key("grpc-message"));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let status = tonic_call(server.channel(), charge("hang", 1), Some("order-6"), None)
        .await
        .expect_err("the kept end");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(
        status.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    // tower-resend's stack tells the replay from a fresh cut: it stops at
    // once and advises verifying, not resending under the key.
    let stack = tower_resend::stack().service(TonicTransport::new(server.channel()));
    let err = stack
        .oneshot(framed(&charge("hang", 1), "order-6"))
        .await
        .map(|resp| resp.headers().clone())
        .expect_err("a replayed cut is outcome unknown");
    assert_eq!(err.kind(), tower_resend::ErrorKind::OutcomeUnknown, "{err}");
    assert_eq!(err.retry_advice(), tower_resend::RetryAdvice::VerifyFirst);
    assert_eq!(err.attempts(), 1, "{err}");
    assert_eq!(server.runs(), 1);
}

/// A store that cannot answer.
#[derive(Clone)]
struct Down;

impl Store for Down {
    async fn begin(&self, _: &Claim<'_>, _: Ttl) -> Result<Begin, StoreError> {
        Err(StoreError::new("down"))
    }
    async fn renew(&self, _: &Claim<'_>, _: Ttl) -> Result<LeaseState, StoreError> {
        Err(StoreError::new("down"))
    }
    async fn complete(
        &self,
        _: &Claim<'_>,
        _: &StoredResponse,
        _: Ttl,
    ) -> Result<LeaseState, StoreError> {
        Err(StoreError::new("down"))
    }
    async fn release(&self, _: &Claim<'_>) -> Result<(), StoreError> {
        Err(StoreError::new("down"))
    }
}

/// 7. The layer's refusals in gRPC form, trailers-only, each saying why: a
/// malformed key INVALID_ARGUMENT, a body over the cap RESOURCE_EXHAUSTED
/// not to be retried (pushback -1), a store that is down UNAVAILABLE with a
/// pushback. Nothing ran.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_layers_refusals_are_grpc_statuses() {
    let server = GrpcServer::start(IdempotencyLayer::new(MemoryStore::new()).request_cap(16)).await;
    let bad = tonic_call(server.channel(), charge("ok", 1), Some("has space"), None)
        .await
        .expect_err("a malformed key");
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("visible ASCII"), "{bad:?}");

    let big = charge(&"x".repeat(64), 1);
    let large = tonic_call(server.channel(), big, Some("order-7"), None)
        .await
        .expect_err("over the cap");
    assert_eq!(large.code(), Code::ResourceExhausted, "{large:?}");
    assert!(large.message().contains("at most 16 bytes"), "{large:?}");
    assert_eq!(
        large.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "-1"
    );
    assert_eq!(server.runs(), 0);

    let down = GrpcServer::start(IdempotencyLayer::new(Down)).await;
    let status = tonic_call(down.channel(), charge("ok", 1), Some("order-8"), None)
        .await
        .expect_err("the store is down");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("cannot be reached"), "{status:?}");
    assert_eq!(
        status.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "1000"
    );
    assert_eq!(down.runs(), 0);
}

/// Keys are scoped by the caller's credentials over gRPC as over HTTP:
/// callers presenting different `authorization` or `x-api-key` metadata,
/// or none, under one key and one payload, each get their own run, never
/// another's answer; each one's repeat is its own replay. With
/// [`Anonymous::Refuse`], a keyed call without credentials is
/// UNAUTHENTICATED and nothing runs.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn grpc_callers_never_see_each_others_answers() {
    let server = GrpcServer::start(IdempotencyLayer::new(MemoryStore::new())).await;
    let callers: [(&'static str, &str); 5] = [
        ("authorization", "Bearer alice"),
        ("authorization", "Bearer bob"),
        ("x-api-key", "key-alice"),
        ("x-api-key", "key-bob"),
        ("", ""),
    ];
    let mut leaks = Vec::new();
    let mut pairs = 0;
    for (i, &x) in callers.iter().enumerate() {
        for (j, &y) in callers.iter().enumerate() {
            if i == j {
                continue;
            }
            let key = format!("pair-{i}-{j}");
            let call = |who| tonic_call_as(server.channel(), charge("ok", 3), &key, who);
            let (first, _) = call(x).await.expect("x's first call");
            let (other, metadata) = call(y).await.expect("y's call");
            if other.run == first.run || metadata.get("idempotent-replayed").is_some() {
                leaks.push((x, y));
            }
            let (own, metadata) = call(x).await.expect("x's repeat");
            assert_eq!(own, first, "x's repeat is x's own answer");
            assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
            pairs += 1;
        }
    }
    assert!(leaks.is_empty(), "cross-caller replays: {leaks:?}");
    assert_eq!(server.runs(), 2 * pairs, "each caller of a pair ran once");

    let refusing = IdempotencyLayer::new(MemoryStore::new()).anonymous(Anonymous::Refuse);
    let server = GrpcServer::start(refusing).await;
    let status = tonic_call(server.channel(), charge("ok", 1), Some("order-a"), None)
        .await
        .expect_err("no credentials");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("credentials"), "{status:?}");
    let who = ("authorization", "Bearer carol");
    let (answer, _) = tonic_call_as(server.channel(), charge("ok", 1), "order-a", who)
        .await
        .expect("with credentials it runs");
    assert_eq!(answer.run, 1);
    assert_eq!(server.runs(), 1);
}

/// 8. A gRPC caller that gives up mid-handler (drops the call, no
/// `grpc-timeout`) cancels nothing: the handler runs on to its end, and a
/// retry under the same key gets its answer replayed, trailers and all,
/// with one run.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_caller_that_gives_up_mid_handler_cancels_nothing() {
    let server = GrpcServer::start(IdempotencyLayer::new(MemoryStore::new())).await;
    let gave_up = tokio::time::timeout(
        Duration::from_millis(500),
        tonic_call(server.channel(), charge("slow", 9), Some("order-9"), None),
    )
    .await;
    assert!(gave_up.is_err(), "the caller gave up before the answer");
    assert_eq!(server.runs(), 1);
    // Past the handler's 1.5 s: its end was kept.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let resp = server
        .channel()
        .oneshot(framed(&charge("slow", 9), "order-9"))
        .await
        .expect("an answer");
    let w = wire(resp).await;
    assert_eq!(w.headers["idempotent-replayed"], "true");
    assert_eq!(w.trailers.as_ref().expect("trailers")["grpc-status"], "0");
    assert_eq!(w.message, Some(Balance { amount: 9, run: 1 }));
    assert_eq!(server.runs(), 1);
}

/// 9. A store that goes away after the work: the first caller still gets
/// its answer with its trailers; a retry while the response is held (not
/// yet stored) gets it replayed from this process, trailers and all; once
/// the store takes it, the replay comes from the store, the same. One run.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_store_gone_after_the_work_still_replays_with_trailers() {
    let store = Faulty {
        inner: MemoryStore::new(),
        refusals: Arc::new(AtomicUsize::new(3)),
        renewals_hang: false,
    };
    let refusals = Arc::clone(&store.refusals);
    let server = GrpcServer::start(IdempotencyLayer::new(store)).await;
    let ask = || async {
        let resp = server
            .channel()
            .oneshot(framed(&charge("ok", 4), "order-10"))
            .await
            .expect("an answer");
        wire(resp).await
    };

    // Each answer: the first run's message, ending `grpc-status: 0`.
    let the_first_runs = |w: &Wire| {
        assert_eq!(w.trailers.as_ref().expect("trailers")["grpc-status"], "0");
        assert_eq!(w.message, Some(Balance { amount: 4, run: 1 }));
    };

    let first = ask().await;
    the_first_runs(&first);
    assert!(
        refusals.load(Ordering::SeqCst) > 0,
        "still held, not stored"
    );

    let held = ask().await;
    assert_eq!(held.headers["idempotent-replayed"], "true");
    the_first_runs(&held);

    // The background writes get through (100 ms, then 200, 400 ...).
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(refusals.load(Ordering::SeqCst), 0);
    let stored = ask().await;
    assert_eq!(stored.headers["idempotent-replayed"], "true");
    the_first_runs(&stored);
    assert_eq!(server.runs(), 1);
}
