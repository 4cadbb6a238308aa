//! The gRPC service the server's tests put behind the layers: a ledger
//! whose `Charge` counts its runs (its effects), with prost messages
//! written by hand (no protoc).
#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use prost::Message;
use tonic::server::NamedService;
use tonic::Status;
use tonic_prost::ProstCodec;
use tower::Service;

/// `resend.test.ChargeRequest`.
#[derive(Clone, PartialEq, Message)]
pub struct ChargeRequest {
    /// What the handler does: `ok`, `slow` (works 1.5 s), `unavailable`,
    /// `marked` (FAILED_PRECONDITION marked nothing done), `hang` (works
    /// 10 s).
    #[prost(string, tag = "1")]
    pub account: String,
    #[prost(uint64, tag = "2")]
    pub amount: u64,
}

/// `resend.test.Balance`.
#[derive(Clone, PartialEq, Message)]
pub struct Balance {
    #[prost(uint64, tag = "1")]
    pub amount: u64,
    /// The run that answered: a replay says the first run's.
    #[prost(uint64, tag = "2")]
    pub run: u64,
}

pub const CHARGE: &str = "/resend.test.Ledger/Charge";

/// The Ledger service: counts its runs (its effects).
#[derive(Clone, Default)]
pub struct Ledger {
    pub runs: Arc<AtomicUsize>,
}

impl NamedService for Ledger {
    const NAME: &'static str = "resend.test.Ledger";
}

impl Service<Request<tonic::body::Body>> for Ledger {
    type Response = Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Answering;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<tonic::body::Body>) -> Self::Future {
        let runs = Arc::clone(&self.runs);
        answer(req, move |msg| charge(runs, msg))
    }
}

/// The ledger's `Charge`: one run counted, then what the account says.
async fn charge(
    runs: Arc<AtomicUsize>,
    req: ChargeRequest,
) -> Result<tonic::Response<Balance>, Status> {
    let run = runs.fetch_add(1, Ordering::SeqCst) as u64 + 1;
    match req.account.as_str() {
        "slow" => tokio::time::sleep(Duration::from_millis(1500)).await,
        "hang" => tokio::time::sleep(Duration::from_secs(10)).await,
        "unavailable" => return Err(Status::unavailable("try later")),
        "marked" => {
            let mut status = Status::failed_precondition("frozen");
            status
                .metadata_mut()
                .insert("idempotent-nothing-done", "true".parse().unwrap());
            return Err(status);
        }
        _ => {}
    }
    Ok(tonic::Response::new(Balance {
        amount: req.amount,
        run,
    }))
}

/// What a ledger service's `call` returns.
pub type Answering =
    Pin<Box<dyn Future<Output = Result<Response<tonic::body::Body>, Infallible>> + Send>>;

/// Answers `req`, a unary `Charge`, with `charge`: the body of a ledger
/// service's `call`.
pub fn answer<F, Fut>(req: Request<tonic::body::Body>, charge: F) -> Answering
where
    F: FnOnce(ChargeRequest) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<tonic::Response<Balance>, Status>> + Send + 'static,
{
    Box::pin(async move {
        let handler = tower::service_fn(move |req: tonic::Request<ChargeRequest>| {
            charge.clone()(req.into_inner())
        });
        let mut grpc = tonic::server::Grpc::new(ProstCodec::<Balance, ChargeRequest>::default());
        Ok(grpc.unary(handler, req).await)
    })
}
