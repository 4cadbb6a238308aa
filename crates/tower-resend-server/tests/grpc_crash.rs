//! DESIGN section 7's crash rule over gRPC, end to end across a real
//! process crash: A (a tonic server, keyed, on the PostgreSQL store) calls
//! B (the tonic ledger, keyed, on the memory store) through a tower-resend
//! stack with `idempotency_keys()` over a tonic `Channel`. A's process is
//! killed after B did its work; the caller's retry meets a new process of
//! A, which says UNAVAILABLE "in progress" with a pushback until the dead
//! holder's lease expires, then runs A again, whose derived key makes B
//! replay: B's work ran once. (`crash.rs` is the same over HTTP, on Redis.)
//!
//! B runs in the test process; A in a child process (`support/child.rs`),
//! this binary run again with `--ignored --exact a_grpc_server_child`. Real
//! clock, loopback only, ports from 127.0.0.1:0, bounded by a timeout
//! around everything. Without PostgreSQL (`RESEND_PG_URL`, default the
//! local server): skipped with a warning, or failed when `CI` is set.
#![cfg(feature = "postgres")]
#![allow(clippy::print_stderr)]

#[path = "support/child.rs"]
mod child;
#[path = "support/ledger.rs"]
mod ledger;
#[path = "support/pg.rs"]
mod pg;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use child::{
    exit_with_the_test, is_derived, say, ChildServer, A_LEASE, LINE_WAIT, RETRY_FOR, SCENARIO,
};
use http::uri::PathAndQuery;
use http::{Request, Response};
use ledger::{Balance, ChargeRequest, Ledger, CHARGE};
use tokio::time::{sleep, timeout, Instant};
use tonic::metadata::MetadataMap;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::util::MapErr;
use tower::{Service, ServiceBuilder};
use tower_resend::tonic::{into_status, TonicTransport};
use tower_resend_server::{IdempotencyLayer, MemoryStore, PostgresStore};

/// The child's mode: `hang` or `normal`. Unset: not a child.
const ENV_MODE: &str = "RESEND_GRPC_CRASH_MODE";
/// B's address, `127.0.0.1:<port>`.
const ENV_B_ADDR: &str = "RESEND_GRPC_CRASH_B";
/// The PostgreSQL A's records are in.
const ENV_PG: &str = "RESEND_PG_URL";
/// A's table of records, the same for both of A's processes.
const TABLE: &str = "resend_grpc_crash";

fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("a valid endpoint")
        .connect_lazy()
}

/// Serves `service` behind `layers` on 127.0.0.1 (port chosen by the OS)
/// until the runtime ends. A macro: tonic's bounds on a layered server are
/// not worth spelling out for two uses.
macro_rules! serve_grpc {
    ($layers:expr, $service:expr) => {{
        let incoming = TcpIncoming::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind 127.0.0.1:0")
            .with_nodelay(Some(true));
        let addr = incoming.local_addr().expect("local address");
        let router = Server::builder().layer($layers).add_service($service);
        tokio::spawn(async move {
            let _ = router.serve_with_incoming(incoming).await;
        });
        addr
    }};
}

// ---------------------------------------------------------------- B ----

/// B: the ledger (its runs are its effects) and the Idempotency-Key of
/// every request it received.
async fn start_b() -> (Ledger, Arc<Mutex<Vec<String>>>, SocketAddr) {
    let ledger = Ledger::default();
    let keys = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&keys);
    let layers = ServiceBuilder::new()
        .map_request(move |req: Request<tonic::body::Body>| {
            let key = req.headers().get("idempotency-key");
            let key = key.and_then(|v| v.to_str().ok()).unwrap_or("");
            seen.lock().unwrap().push(key.to_owned());
            req
        })
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let addr = serve_grpc!(layers, ledger.clone());
    (ledger, keys, addr)
}

// ---------------------------------------------------------------- A ----

type ToB =
    MapErr<tower_resend::stack::Stack<TonicTransport<Channel>>, fn(tower_resend::Error) -> Status>;

/// A's `Charge`: charges B through tower-resend (the key derived from A's
/// inbound one), then hangs (`hang`) or answers B's balance, with B's
/// `idempotent-replayed` as `x-b-replayed`.
#[derive(Clone)]
struct A {
    b: tonic::client::Grpc<ToB>,
    hang: bool,
}

impl NamedService for A {
    const NAME: &'static str = "resend.test.Ledger";
}

impl Service<Request<tonic::body::Body>> for A {
    type Response = Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = ledger::Answering;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<tonic::body::Body>) -> Self::Future {
        let a = self.clone();
        ledger::answer(req, move |msg| a.charge_b(msg))
    }
}

impl A {
    async fn charge_b(mut self, msg: ChargeRequest) -> Result<tonic::Response<Balance>, Status> {
        self.b
            .ready()
            .await
            .map_err(|e| Status::unknown(e.to_string()))?;
        let codec = ProstCodec::<ChargeRequest, Balance>::default();
        let path = PathAndQuery::from_static(CHARGE);
        let resp = self.b.unary(tonic::Request::new(msg), path, codec).await?;
        let replayed = resp.metadata().get("idempotent-replayed").cloned();
        if self.hang {
            say("B-CALLED");
            // The crash happens in here.
            std::future::pending::<()>().await;
        }
        let mut answer = tonic::Response::new(resp.into_inner());
        if let Some(v) = replayed {
            answer.metadata_mut().insert("x-b-replayed", v);
        }
        Ok(answer)
    }
}

/// Not a test: the entry point of service A's process, which the test
/// starts by running this binary again with `--ignored --exact
/// a_grpc_server_child` and [`ENV_MODE`] set. Run any other way (no
/// [`ENV_MODE`], as under `cargo test -- --include-ignored`), it returns at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the entry point of service A's child process, run by `a_grpc_server_killed_*`"]
async fn a_grpc_server_child() {
    let Ok(mode) = std::env::var(ENV_MODE) else {
        eprintln!("a_grpc_server_child: {ENV_MODE} is unset, so this is not a child");
        return;
    };
    let hang = match mode.as_str() {
        "hang" => true,
        "normal" => false,
        other => panic!("{ENV_MODE}={other:?}: expected `hang` or `normal`"),
    };
    let need = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is unset"));
    let (b_addr, pg_url) = (need(ENV_B_ADDR), need(ENV_PG));
    exit_with_the_test("a_grpc_server_child");

    let store = PostgresStore::with_table(pg::pool(&pg_url, 4), TABLE).unwrap();
    let stack = tower_resend::stack()
        .name("b")
        .total(Duration::from_secs(5))
        .attempt_timeout(Duration::from_secs(2))
        .idempotency_keys()
        .service(TonicTransport::new(channel(b_addr.parse().unwrap())));
    let b = tonic::client::Grpc::new(MapErr::new(stack, into_status as fn(_) -> _));
    let layers = ServiceBuilder::new().layer(IdempotencyLayer::new(store).lease(A_LEASE));
    let addr = serve_grpc!(layers, A { b, hang });
    say(&format!("LISTENING {}", addr.port()));
    std::future::pending::<()>().await;
}

async fn start_a(name: &'static str, mode: &str, b: SocketAddr) -> ChildServer {
    let envs = [
        (ENV_MODE, mode.to_owned()),
        (ENV_B_ADDR, b.to_string()),
        (ENV_PG, pg::url()),
    ];
    ChildServer::start(name, "a_grpc_server_child", &envs).await
}

// ----------------------------------------------------------- caller ----

/// The caller's keyed `Charge` by tonic's own client: A's balance and
/// metadata, or its status.
async fn charge(port: u16, key: &str) -> Result<(Balance, MetadataMap), Status> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut grpc = tonic::client::Grpc::new(channel(addr));
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(e.to_string()))?;
    let mut req = tonic::Request::new(ChargeRequest {
        account: "ok".into(),
        amount: 3,
    });
    req.metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    let codec = ProstCodec::<ChargeRequest, Balance>::default();
    let call = grpc.unary(req, PathAndQuery::from_static(CHARGE), codec);
    let resp = timeout(LINE_WAIT, call).await.expect("A answers in time")?;
    let (metadata, balance, _) = resp.into_parts();
    Ok((balance, metadata))
}

/// Sends the keyed call again while A says the key is in progress (the
/// dead holder's lease has not expired), for at most [`RETRY_FOR`]; gives
/// the first other answer and how many "in progress" came before it.
async fn retry_through_in_progress(
    a: &ChildServer,
    key: &str,
) -> (Result<(Balance, MetadataMap), Status>, usize) {
    let give_up = Instant::now() + RETRY_FOR;
    let mut in_progress = 0;
    loop {
        let answer = charge(a.port, key).await;
        match &answer {
            Err(s) if s.code() == Code::Unavailable && s.message().contains("in progress") => {
                assert_eq!(s.metadata().get("grpc-retry-pushback-ms").unwrap(), "1000");
            }
            _ => return (answer, in_progress),
        }
        in_progress += 1;
        assert!(
            Instant::now() < give_up,
            "A still says in progress after {RETRY_FOR:?} ({in_progress} tries): \
             the dead holder's {A_LEASE:?} lease was never replaced"
        );
        sleep(Duration::from_millis(100)).await;
    }
}

// ------------------------------------------------------------- test ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_server_killed_after_b_worked_is_rerun_and_b_replays() {
    let store = PostgresStore::with_table(pg::pool(&pg::url(), 2), TABLE).unwrap();
    if !pg::migrated(&store).await {
        return;
    }
    timeout(SCENARIO, scenario())
        .await
        .unwrap_or_else(|_| panic!("the gRPC crash scenario took more than {SCENARIO:?}"));
}

async fn scenario() {
    let started = Instant::now();
    let (b, b_keys, b_addr) = start_b().await;
    let b_runs = || b.runs.load(Ordering::SeqCst);
    let key = format!("order-{}", uuid::Uuid::new_v4().simple());

    // A's first process takes the call, has B do the work, and hangs
    // before answering.
    let mut a1 = start_a("A1", "hang", b_addr).await;
    let first = tokio::spawn({
        let (port, key) = (a1.port, key.clone());
        async move { charge(port, &key).await }
    });
    a1.wait_for("B-CALLED").await;
    assert_eq!(b_runs(), 1);
    let keys = b_keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 1);
    assert!(is_derived(&keys[0]), "B got a derived key: {keys:?}");

    // The crash: A's process dies while it holds the lease.
    a1.kill().await;
    let lost = timeout(LINE_WAIT, first)
        .await
        .expect("the caller's first call ends with A's death")
        .unwrap();
    assert!(lost.is_err(), "A died before it answered: {lost:?}");

    // The caller retries on a new process of A, same store, same key, same
    // message: in progress until the dead lease expires, then A runs again.
    let a2 = start_a("A2", "normal", b_addr).await;
    let (answer, in_progress) = retry_through_in_progress(&a2, &key).await;
    let (balance, metadata) = answer.expect("A's re-run answers");
    assert!(
        metadata.get("idempotent-replayed").is_none(),
        "A ran again; nothing of A's was stored to replay"
    );
    assert_eq!(balance, Balance { amount: 3, run: 1 }, "B's first run");
    assert_eq!(metadata.get("x-b-replayed").unwrap(), "true");

    // B: its work ran once; it got the same derived key twice.
    assert_eq!(b_runs(), 1, "B's work ran once");
    let keys = b_keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(keys[1], keys[0], "the re-run derived the same key");

    // Again on the same key: A's own stored answer, trailers and all; B is
    // not called.
    let (again, metadata) = charge(a2.port, &key).await.expect("A's replay");
    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again, balance);
    assert_eq!(b_keys.lock().unwrap().len(), 2);

    // Control: another inbound key derives another key, and B works again.
    let other_key = format!("order-{}", uuid::Uuid::new_v4().simple());
    let (other, metadata) = charge(a2.port, &other_key).await.expect("another order");
    assert_eq!(other.run, 2);
    assert!(metadata.get("x-b-replayed").is_none());
    assert_eq!(b_runs(), 2);
    let keys = b_keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(is_derived(&keys[2]));
    assert_ne!(keys[2], keys[0]);

    eprintln!(
        "gRPC crash scenario: {in_progress} x in progress before A's re-run, {:?} in all",
        started.elapsed()
    );
    drop(a2);
}
