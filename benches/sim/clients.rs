//! The columns' clients, each built once per client process as a user
//! builds it: tower's retry over tower's p2c balancer, with and without
//! tower's budget, and `tower_resend::stack()` over that balancer, over a
//! fleet, throttled, with a limit per instance, and with a total limit.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use futures_util::Stream;
use http::uri::{Authority, Parts, Scheme};
use http::{Request, Response, StatusCode, Uri};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::discover::Change;
use tower::load::{CompleteOnResponse, PendingRequestsDiscover};
use tower::retry::budget::TpsBudget;
use tower::util::BoxCloneService;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};
use tower_resend::fleet::{FleetLayer, InstanceLimit};

use super::instance::Answer;
use super::script::{self, Script};
use super::transport::{Transport, DEADLINE_HEADER};
use super::Model;
use crate::{statuses, Body, TowerRetry};

/// What a caller calls: a call's answer is its status.
pub(crate) type ClientService = BoxCloneService<Request<Body>, StatusCode, BoxError>;

/// What the callers of one client process call through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Client {
    /// tower's `Retry` (3 attempts: 5xx and errors retried after tower's
    /// exponential backoff, 100 ms to 5 s, no budget) between tower's
    /// `Timeout`s (the call's 3 s, each attempt's 1 s), over tower's
    /// `p2c::Balance` (by pending requests) behind a `Buffer`.
    TowerRetry,
    /// The same, drawing on tower's `TpsBudget` with its defaults (10 s,
    /// 10 retries a second at least, 20 % of calls), deposited on each
    /// answer that is not a 5xx.
    TowerBudget,
    /// `tower_resend::stack()` with the same attempts and limits, its
    /// defaults otherwise (its retry budget, backoff and overload floor),
    /// writing the time left in the header the servers read, over the same
    /// balancer: the stack as a user with a balancer of their own builds it.
    Stack,
    /// `stack().fleet(FleetLayer::resolved(..))` over the transport: each
    /// attempt picks its instance (p2c among those the call has not used),
    /// instances that keep failing set aside.
    StackFleet,
    /// [`Client::StackFleet`] with `.adaptive_throttling()`.
    StackThrottled,
    /// [`Client::StackFleet`] with a limit per instance
    /// (`FleetLayer::limit(InstanceLimit::adaptive())`): attempts beyond
    /// what an instance's latency says it can take are not sent, and a
    /// call that finds every instance it could use at its limit fails at
    /// once, as at capacity.
    StackLimited,
    /// [`Client::StackFleet`] with a limit on the process's attempts in
    /// flight to the whole fleet (`FleetLayer::limit_total(InstanceLimit::adaptive())`):
    /// attempts beyond what the fleet's latency says it can take fail at
    /// once, as at capacity.
    StackTotal,
}

impl Client {
    /// Every client, in the tables' order.
    pub const ALL: [Client; 7] = [
        Client::TowerRetry,
        Client::TowerBudget,
        Client::Stack,
        Client::StackFleet,
        Client::StackThrottled,
        Client::StackLimited,
        Client::StackTotal,
    ];

    /// Its name in tables, pictures and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Client::TowerRetry => "tower-retry",
            Client::TowerBudget => "tower-retry+budget",
            Client::Stack => "stack-p2c",
            Client::StackFleet => "stack-fleet",
            Client::StackThrottled => "stack-fleet+throttle",
            Client::StackLimited => "stack-fleet+limit",
            Client::StackTotal => "stack-fleet+total",
        }
    }

    /// The client of that name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Builds one client process's `client` over `transport`.
pub(crate) async fn build(
    client: Client,
    model: &Model,
    script: &Arc<Script>,
    transport: Transport,
    seed: u64,
) -> ClientService {
    match client {
        Client::TowerRetry => {
            tower_retry(model, balancer(model, script, transport, seed), None, seed)
        }
        Client::TowerBudget => {
            let budget = Arc::new(TpsBudget::default());
            tower_retry(
                model,
                balancer(model, script, transport, seed),
                Some(budget),
                seed,
            )
        }
        Client::Stack => {
            statuses(stack(model, seed).service(balancer(model, script, transport, seed)))
        }
        Client::StackFleet => statuses(
            stack(model, seed)
                .fleet(fleet(model, script).await)
                .service(transport),
        ),
        Client::StackThrottled => statuses(
            stack(model, seed)
                .adaptive_throttling()
                .fleet(fleet(model, script).await)
                .service(transport),
        ),
        Client::StackLimited => statuses(
            stack(model, seed)
                .fleet(fleet(model, script).await.limit(InstanceLimit::adaptive()))
                .service(transport),
        ),
        Client::StackTotal => statuses(
            stack(model, seed)
                .fleet(
                    fleet(model, script)
                        .await
                        .limit_total(InstanceLimit::adaptive()),
                )
                .service(transport),
        ),
    }
}

/// The stack's settings in every stack column.
fn stack(model: &Model, seed: u64) -> tower_resend::stack::StackBuilder {
    tower_resend::stack()
        .name("upstream")
        .total(model.total)
        .attempt_timeout(model.attempt_timeout)
        .max_attempts(model.attempts)
        .deadline_header(DEADLINE_HEADER)
        .seed(seed)
}

/// A fleet kept to the script's DNS answer, read every `model.refresh`.
async fn fleet(model: &Model, script: &Arc<Script>) -> FleetLayer {
    let script = Arc::clone(script);
    let resolve = move || {
        let addrs = script
            .resolve(Instant::now())
            .into_iter()
            .map(script::address)
            .collect();
        std::future::ready(Ok(addrs))
    };
    FleetLayer::resolved(Scheme::HTTP, resolve, model.refresh)
        .await
        .expect("the script resolves to the fleet")
}

/// A seeded generator for tower's balancer and backoff. Clones share it:
/// tower's retry clones its policy, and so its backoff, for every call,
/// and a generator cloned with its state would give every call the same
/// jitter.
#[derive(Clone, Debug)]
struct Seeded(Arc<Mutex<fastrand::Rng>>);

impl Seeded {
    fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(fastrand::Rng::with_seed(seed))))
    }
}

impl tower::util::rng::Rng for Seeded {
    fn next_u64(&mut self) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .u64(..)
    }
}

fn tower_retry<S>(
    model: &Model,
    balanced: S,
    budget: Option<Arc<TpsBudget>>,
    seed: u64,
) -> ClientService
where
    S: Service<Request<Body>, Response = Response<Body>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let backoff = crate::tower_backoff(Seeded::new(seed.rotate_left(7)));
    let policy = TowerRetry {
        left: model.attempts.saturating_sub(1),
        backoff,
        budget,
    };
    let svc = ServiceBuilder::new()
        .timeout(model.total)
        .retry(policy)
        .timeout(model.attempt_timeout)
        .service(balanced)
        .map_response(|r: Response<Body>| r.status());
    BoxCloneService::new(svc)
}

/// One instance, for tower's balancer: the transport, every request sent
/// to its address.
#[derive(Clone, Debug)]
struct Endpoint {
    authority: Authority,
    transport: Transport,
}

impl Service<Request<Body>> for Endpoint {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Answer;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Answer {
        let mut parts = Parts::default();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = req.uri().path_and_query().cloned();
        if let Ok(uri) = Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
        self.transport.call(req)
    }
}

type Changes = Pin<Box<dyn Stream<Item = Result<Change<usize, Endpoint>, Infallible>> + Send>>;
type Balanced = Balance<PendingRequestsDiscover<Changes>, Request<Body>>;

/// tower's p2c balancer (by pending requests) over the script's DNS
/// answer, read every `model.refresh` as a user's `Discover` would, behind
/// the `Buffer` it needs to be cloned.
fn balancer(
    model: &Model,
    script: &Arc<Script>,
    transport: Transport,
    seed: u64,
) -> Buffer<Request<Body>, <Balanced as Service<Request<Body>>>::Future> {
    let (tx, rx) = mpsc::unbounded_channel();
    let endpoint = move |i: usize| Endpoint {
        authority: script::address(i)
            .to_string()
            .parse()
            .expect("an authority"),
        transport: transport.clone(),
    };
    let mut known = script.resolve(Instant::now());
    for &i in &known {
        let _ = tx.send(Change::Insert(i, endpoint(i)));
    }
    let (script, every) = (Arc::clone(script), model.refresh);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let now = script.resolve(Instant::now());
            let gone = known.iter().filter(|i| !now.contains(i));
            let new = now.iter().filter(|i| !known.contains(i));
            let changes: Vec<_> = gone
                .map(|&i| Change::Remove(i))
                .chain(new.map(|&i| Change::Insert(i, endpoint(i))))
                .collect();
            for change in changes {
                if tx.send(change).is_err() {
                    return; // the balancer is gone
                }
            }
            known = now;
        }
    });
    let changes: Changes = Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|change| (Ok(change), rx))
    }));
    let discover = PendingRequestsDiscover::new(changes, CompleteOnResponse::default());
    Buffer::new(Balance::from_rng(discover, Seeded::new(seed)), 1024)
}
