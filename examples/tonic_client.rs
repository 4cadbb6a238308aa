//! tower-resend's guarantees over gRPC: a tonic server on 127.0.0.1, a tonic
//! `Channel` wrapped in tower-resend's stack (which recognises gRPC by itself; the
//! gRPC classifier is named only to declare an idempotent method), and a
//! client written as tonic generates them. Messages are written by hand with
//! prost (no protoc). No outside services; a few seconds.
//!
//! `cargo run --example tonic_client`
#![allow(clippy::print_stdout)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use examples::ms;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderValue, Request, Response};
use tokio::time::Instant;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic::Status;
use tonic_prost::ProstCodec;
use tower::util::MapErr;
use tower::Service;
use tower_resend::classify::GrpcClassifier;
use tower_resend::tonic::{into_status, resend_error, TonicTransport};
use tower_resend::BoxError;

// package ledger;
// service Ledger {
//   rpc GetBalance(Account) returns (Balance);   // idempotent
//   rpc Charge(Charge) returns (Balance);        // not idempotent
// }

/// `ledger.Account`.
#[derive(Clone, PartialEq, prost::Message)]
struct Account {
    #[prost(string, tag = "1")]
    id: String,
}

/// `ledger.Charge`.
#[derive(Clone, PartialEq, prost::Message)]
struct Charge {
    #[prost(string, tag = "1")]
    account: String,
    #[prost(uint64, tag = "2")]
    cents: u64,
}

/// `ledger.Balance`.
#[derive(Clone, PartialEq, prost::Message)]
struct Balance {
    #[prost(uint64, tag = "1")]
    cents: u64,
}

const GET_BALANCE: &str = "/ledger.Ledger/GetBalance";
const CHARGE: &str = "/ledger.Ledger/Charge";

/// The client, as `tonic-build` would generate it.
#[derive(Debug, Clone)]
struct LedgerClient<T> {
    inner: tonic::client::Grpc<T>,
}

impl<T> LedgerClient<T>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<BoxError>,
    T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
{
    fn new(inner: T) -> Self {
        Self {
            inner: tonic::client::Grpc::new(inner),
        }
    }

    async fn get_balance(
        &mut self,
        req: tonic::Request<Account>,
    ) -> Result<tonic::Response<Balance>, Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| Status::unknown(format!("service was not ready: {}", e.into())))?;
        let path = PathAndQuery::from_static(GET_BALANCE);
        self.inner.unary(req, path, ProstCodec::default()).await
    }

    async fn charge(
        &mut self,
        req: tonic::Request<Charge>,
    ) -> Result<tonic::Response<Balance>, Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| Status::unknown(format!("service was not ready: {}", e.into())))?;
        let path = PathAndQuery::from_static(CHARGE);
        self.inner.unary(req, path, ProstCodec::default()).await
    }
}

/// The flaky ledger: GetBalance answers UNAVAILABLE twice, then the balance
/// (for "acct-slow", never); Charge answers RESOURCE_EXHAUSTED with a
/// pushback of 300 ms once, then charges; a charge for "acct-slow" does the
/// work and never answers.
#[derive(Clone, Default)]
struct Ledger {
    balance_calls: Arc<AtomicUsize>,
    charge_calls: Arc<AtomicUsize>,
    charged: Arc<AtomicUsize>,
}

impl NamedService for Ledger {
    const NAME: &'static str = "ledger.Ledger";
}

impl Service<Request<tonic::body::Body>> for Ledger {
    type Response = Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<tonic::body::Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let timeout = req
                .headers()
                .get("grpc-timeout")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .to_owned();
            if req.uri().path() == GET_BALANCE {
                let n = this.balance_calls.fetch_add(1, Ordering::SeqCst);
                println!("   server: GetBalance #{} (grpc-timeout {timeout})", n + 1);
                if n < 2 {
                    return Ok(Status::unavailable("warming up").into_http());
                }
                let handler = tower::service_fn(|req: tonic::Request<Account>| async move {
                    if req.into_inner().id == "acct-slow" {
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, Status>(tonic::Response::new(Balance { cents: 12_500 }))
                });
                let mut grpc = tonic::server::Grpc::new(ProstCodec::<Balance, Account>::default());
                return Ok(grpc.unary(handler, req).await);
            }
            let n = this.charge_calls.fetch_add(1, Ordering::SeqCst);
            println!("   server: Charge #{} (grpc-timeout {timeout})", n + 1);
            if n == 0 {
                let mut resp = Status::resource_exhausted("slow down").into_http();
                resp.headers_mut()
                    .insert("grpc-retry-pushback-ms", HeaderValue::from_static("300"));
                return Ok(resp);
            }
            let charged = Arc::clone(&this.charged);
            let handler = tower::service_fn(move |req: tonic::Request<Charge>| {
                let charged = Arc::clone(&charged);
                async move {
                    let charge = req.into_inner();
                    charged.fetch_add(1, Ordering::SeqCst);
                    if charge.account == "acct-slow" {
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, Status>(tonic::Response::new(Balance {
                        cents: 12_500 - charge.cents,
                    }))
                }
            });
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Balance, Charge>::default());
            Ok(grpc.unary(handler, req).await)
        })
    }
}

fn show(status: &Status) -> String {
    match resend_error(status) {
        Some(e) => format!("{:?}: {e}", status.code()),
        None => format!("{:?}: {}", status.code(), status.message()),
    }
}

#[tokio::main]
async fn main() -> Result<(), tower_resend::BoxError> {
    let incoming =
        TcpIncoming::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?.with_nodelay(Some(true));
    let addr = incoming.local_addr()?;
    let ledger = Ledger::default();
    let charged = Arc::clone(&ledger.charged);
    tokio::spawn(Server::builder().serve_with_incoming(ledger, incoming));
    println!("ledger listening on {addr}\n");

    // The channel: a connect timeout, TCP_NODELAY, no Endpoint::timeout
    // (the stack's deadline bounds calls, and goes out as grpc-timeout).
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .connect_lazy();
    let stack = tower_resend::stack()
        .name("ledger")
        .total(Duration::from_secs(3))
        .attempt_timeout(Duration::from_millis(800))
        .retry(|r| {
            r.overload_floor(Duration::from_millis(200))
                .classifier(GrpcClassifier::new().idempotent(GET_BALANCE))
        })
        .service(TonicTransport::new(channel));
    // The stack's errors reach the client as the gRPC statuses that say the same.
    let mut client = LedgerClient::new(MapErr::new(stack, into_status));

    // 1. An idempotent method through two UNAVAILABLEs.
    let t = Instant::now();
    println!("1. GetBalance (on the idempotent allowlist)");
    let balance = client
        .get_balance(tonic::Request::new(Account {
            id: "acct-7".to_owned(),
        }))
        .await?;
    println!(
        "   -> {} cents after {}: UNAVAILABLE is retried for an allowlisted method,\n      each attempt with what is left of the 3 s deadline as grpc-timeout.",
        balance.get_ref().cents,
        ms(t.elapsed())
    );
    if let Some(attempts) = balance.extensions().get::<tower_resend::retry::Attempts>() {
        println!("   attempts: {attempts}\n");
    }

    // 2. RESOURCE_EXHAUSTED with grpc-retry-pushback-ms: 300.
    let t = Instant::now();
    println!("2. Charge 2500 cents (not idempotent)");
    let balance = client
        .charge(tonic::Request::new(Charge {
            account: "acct-7".to_owned(),
            cents: 2_500,
        }))
        .await?;
    println!(
        "   -> {} cents after {}: RESOURCE_EXHAUSTED was not processed, so even a\n      charge is retried, after the server's 300 ms pushback.\n",
        balance.get_ref().cents,
        ms(t.elapsed())
    );

    // 3. A charge that did the work, then never answered.
    let t = Instant::now();
    println!("3. Charge for acct-slow (not idempotent, no key)");
    let before = charged.load(Ordering::SeqCst);
    let status = client
        .charge(tonic::Request::new(Charge {
            account: "acct-slow".to_owned(),
            cents: 100,
        }))
        .await
        .expect_err("the server never answers");
    println!("   -> after {}: {}", ms(t.elapsed()), show(&status));
    println!(
        "   charges made: {} (sent once: the outcome is unknown, verify before resending)\n",
        charged.load(Ordering::SeqCst) - before
    );

    // 4. The caller's own timeout, set with tonic.
    let t = Instant::now();
    println!("4. GetBalance for acct-slow with tonic's set_timeout(500 ms), under the 3 s budget");
    let mut req = tonic::Request::new(Account {
        id: "acct-slow".to_owned(),
    });
    req.set_timeout(Duration::from_millis(500));
    let status = client
        .get_balance(req)
        .await
        .expect_err("the server never answers");
    println!("   -> after {}: {}", ms(t.elapsed()), show(&status));
    println!(
        "   the caller's 500 ms is the call's deadline, and went out as what was left of it.\n"
    );

    // 5. Nothing listens: not sent, so safe to retry.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let nowhere = Endpoint::from_shared(format!("http://{closed}"))?
        .tcp_nodelay(true)
        .connect_lazy();
    // No classifier named: the stack recognises gRPC by itself.
    let replica = tower_resend::stack()
        .name("ledger-replica")
        .service(TonicTransport::new(nowhere));
    let mut lost = LedgerClient::new(MapErr::new(replica, into_status));
    let t = Instant::now();
    println!("5. Charge against a closed port");
    let status = lost
        .charge(tonic::Request::new(Charge {
            account: "acct-7".to_owned(),
            cents: 100,
        }))
        .await
        .expect_err("nothing listens");
    println!("   -> after {}: {}", ms(t.elapsed()), show(&status));
    println!("   the channel could not connect, so nothing was sent: retried although a charge.");
    Ok(())
}
