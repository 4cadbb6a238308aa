//! A tonic server for the gRPC suites, with its messages written by hand
//! (prost, no protoc), scripted call by call, and the requests and answers
//! of its two methods framed by hand.
#![allow(dead_code)] // each test binary uses part of it, or none

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use prost::Message;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::Service;
use tower_resend::tonic::grpc_status;

use super::CONNECT_TIMEOUT;

// The service, written by hand as protoc would have generated it:
//
//     package resend.test;
//     service Ledger {
//       rpc GetBalance(ChargeRequest) returns (Balance);  // idempotent
//       rpc Charge(ChargeRequest) returns (Balance);      // not idempotent
//     }

/// `resend.test.ChargeRequest`.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct ChargeRequest {
    #[prost(string, tag = "1")]
    pub(crate) account: String,
    #[prost(uint64, tag = "2")]
    pub(crate) amount: u64,
}

/// `resend.test.Balance`.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct Balance {
    #[prost(uint64, tag = "1")]
    pub(crate) amount: u64,
}

pub(crate) const SERVICE: &str = "resend.test.Ledger";
pub(crate) const GET_BALANCE: &str = "/resend.test.Ledger/GetBalance";
pub(crate) const CHARGE: &str = "/resend.test.Ledger/Charge";

/// What the server does with one call.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Do {
    /// Answers through tonic's server codec: a Balance, `grpc-status: 0` in
    /// the trailers.
    Answer,
    /// A trailers-only answer with this status and, if given,
    /// `grpc-retry-pushback-ms`.
    Status(Code, Option<&'static str>),
    /// Does the work (one effect), then never answers.
    WorkThenHang,
    /// Never answers.
    Hang,
}

/// One call as the server received it.
#[derive(Clone, Debug)]
pub(crate) struct Arrival {
    pub(crate) at: Instant,
    pub(crate) path: String,
    pub(crate) grpc_timeout: Option<Duration>,
    pub(crate) key: Option<String>,
    /// `grpc-previous-rpc-attempts`, as sent.
    pub(crate) previous: Option<String>,
}

#[derive(Debug, Default)]
pub(crate) struct Record {
    arrivals: Vec<Arrival>,
    effects: usize,
}

pub(crate) type ScriptFn = Arc<dyn Fn(usize, &str) -> Do + Send + Sync>;

/// The Ledger service: scripted by the arrival's index and path.
#[derive(Clone)]
pub(crate) struct Ledger {
    record: Arc<Mutex<Record>>,
    script: ScriptFn,
}

pub(crate) fn lock(record: &Mutex<Record>) -> MutexGuard<'_, Record> {
    record.lock().unwrap_or_else(PoisonError::into_inner)
}

impl NamedService for Ledger {
    const NAME: &'static str = SERVICE;
}

impl Service<Request<tonic::body::Body>> for Ledger {
    type Response = Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<tonic::body::Body>) -> Self::Future {
        let path = req.uri().path().to_owned();
        let grpc_timeout = req.headers().get("grpc-timeout").map(|v| {
            tower_resend::deadline::parse_grpc_timeout(v.as_bytes()).expect("a valid grpc-timeout")
        });
        let key = req
            .headers()
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let previous = req
            .headers()
            .get("grpc-previous-rpc-attempts")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let n = {
            let mut r = lock(&self.record);
            r.arrivals.push(Arrival {
                at: Instant::now(),
                path: path.clone(),
                grpc_timeout,
                key,
                previous,
            });
            r.arrivals.len() - 1
        };
        let what = (self.script)(n, &path);
        let record = Arc::clone(&self.record);
        Box::pin(async move {
            match what {
                Do::Answer => {
                    let handler =
                        tower::service_fn(|req: tonic::Request<ChargeRequest>| async move {
                            Ok::<_, Status>(tonic::Response::new(Balance {
                                amount: req.into_inner().amount,
                            }))
                        });
                    let mut grpc =
                        tonic::server::Grpc::new(ProstCodec::<Balance, ChargeRequest>::default());
                    Ok(grpc.unary(handler, req).await)
                }
                Do::Status(code, pushback) => {
                    let mut resp = Status::new(code, "scripted").into_http::<tonic::body::Body>();
                    if let Some(ms) = pushback {
                        resp.headers_mut()
                            .insert("grpc-retry-pushback-ms", HeaderValue::from_static(ms));
                    }
                    Ok(resp)
                }
                Do::WorkThenHang => {
                    lock(&record).effects += 1;
                    std::future::pending().await
                }
                Do::Hang => std::future::pending().await,
            }
        })
    }
}

/// A tonic server on 127.0.0.1 (port chosen by the OS), stopped when dropped.
pub(crate) struct GrpcServer {
    pub(crate) addr: SocketAddr,
    record: Arc<Mutex<Record>>,
    task: JoinHandle<()>,
}

impl GrpcServer {
    pub(crate) async fn start(script: impl Fn(usize, &str) -> Do + Send + Sync + 'static) -> Self {
        let incoming = TcpIncoming::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind 127.0.0.1:0")
            .with_nodelay(Some(true));
        let addr = incoming.local_addr().expect("local address");
        let record = Arc::new(Mutex::new(Record::default()));
        let svc = Ledger {
            record: Arc::clone(&record),
            script: Arc::new(script),
        };
        let task = tokio::spawn(async move {
            let _ = Server::builder().serve_with_incoming(svc, incoming).await;
        });
        Self { addr, record, task }
    }

    pub(crate) fn arrivals(&self) -> Vec<Arrival> {
        lock(&self.record).arrivals.clone()
    }

    pub(crate) fn arrival_count(&self) -> usize {
        lock(&self.record).arrivals.len()
    }

    pub(crate) fn effects(&self) -> usize {
        lock(&self.record).effects
    }

    pub(crate) fn channel(&self) -> Channel {
        channel_to(self.addr)
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A channel as a production client would set it up: a connect timeout,
/// TCP_NODELAY, no `Endpoint::timeout` (tower-resend's limits bound the calls).
pub(crate) fn channel_to(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("a valid endpoint")
        .tcp_nodelay(true)
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_lazy()
}

/// A unary gRPC request for `path`, framed by hand, as a generated client
/// sends it (the channel adds scheme and authority).
pub(crate) fn call(path: &str, key: Option<&str>) -> Request<tonic::body::Body> {
    let msg = ChargeRequest {
        account: "acct-7".to_owned(),
        amount: 100,
    }
    .encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + msg.len());
    frame.put_u8(0);
    frame.put_u32(u32::try_from(msg.len()).expect("a small message"));
    frame.put_slice(&msg);
    let mut req = Request::post(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.body(tonic::body::Body::new(Full::new(frame.freeze())))
        .expect("a valid request")
}

/// Reads a unary answer: the Balance and the status from the trailers.
pub(crate) async fn answer<B>(resp: Response<B>) -> (Balance, Option<Code>)
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let collected = resp.into_body().collect().await.expect("the body arrives");
    let code = collected.trailers().and_then(grpc_status);
    let bytes = collected.to_bytes();
    let balance = Balance::decode(bytes.get(5..).expect("a framed message")).expect("a Balance");
    (balance, code)
}
