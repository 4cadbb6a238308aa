//! Load shedding that refuses retries first.
//!
//! When a server is past its capacity, every retry its callers send takes a
//! slot a first attempt needed, and goodput collapses. [`ShedLayer`] bounds
//! the work running at once, keeps a short queue, and at capacity refuses
//! retries before first attempts: a retry (a request whose
//! `grpc-previous-rpc-attempts` or `resend-previous-attempts` says attempts
//! came before it, as tower-resend's client sends them) waits behind every
//! first attempt, and is the first to go when the queue is full; a first
//! attempt is refused only when no retry is waiting to make room. A request
//! whose deadline (the [`InboundDeadlineLayer`](crate::InboundDeadlineLayer)'s,
//! or the ambient one) would pass in the queue is refused at once.
//!
//! A refusal is a [`request_shed`](crate::problems#request_shed) problem:
//! 503 with a `Retry-After` of the time the queue takes to drain at the
//! pace work has been finishing (whole seconds, at least one), or over gRPC
//! UNAVAILABLE with `grpc-retry-pushback-ms` to the millisecond; nothing ran.
//! A caller's retry handling (tower-resend's spreads the waits over half as
//! much again) then spreads the comebacks. [`ShedLayer::stats`] counts what
//! was run and shed.
//!
//! Order: outside the [`IdempotencyLayer`](crate::IdempotencyLayer) (a shed
//! request claims no key), inside the `InboundDeadlineLayer` (whose deadline
//! it reads):
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower::{service_fn, ServiceBuilder};
//! use tower_resend_server::{IdempotencyLayer, InboundDeadlineLayer, MemoryStore, ShedLayer};
//!
//! let shed = ShedLayer::new(64);
//! let server = ServiceBuilder::new()
//!     .layer(InboundDeadlineLayer::new(Duration::from_secs(10)))
//!     .layer(shed.clone())
//!     .layer(IdempotencyLayer::new(MemoryStore::new()))
//!     .service(service_fn(|_: Request<String>| async {
//!         Ok::<_, std::convert::Infallible>(Response::new(String::from("charged")))
//!     }));
//! # let _ = server;
//! assert_eq!(shed.stats().shed(), 0);
//! ```

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, HeaderName, Request, Response};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower_layer::Layer;
use tower_resend::retry::{GRPC_PREVIOUS_RPC_ATTEMPTS, RESEND_PREVIOUS_ATTEMPTS};
use tower_resend::Deadline;
use tower_service::Service;

use crate::body::MaybeBuffered;
use crate::problems::{Problem, ProblemType, Protocol};

/// The wait a refusal names before any work has finished to measure.
const FIRST_GUESS: Duration = Duration::from_millis(100);

/// Bounds the work running at once, and at capacity sheds retries first;
/// see the [module docs](self).
///
/// Clones share one capacity, queue and count: build one per server (or per
/// route group that shares a resource), and layer its clones.
#[derive(Clone)]
pub struct ShedLayer {
    state: Arc<State>,
}

impl fmt::Debug for ShedLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShedLayer")
            .field("max_concurrent", &self.state.max_concurrent)
            .field("max_queue", &self.state.max_queue)
            .finish_non_exhaustive()
    }
}

impl ShedLayer {
    /// At most `max_concurrent` requests running at once (at least one),
    /// and as many waiting.
    pub fn new(max_concurrent: usize) -> Self {
        let max_concurrent = max_concurrent.max(1);
        Self::build(max_concurrent, max_concurrent, RESEND_PREVIOUS_ATTEMPTS)
    }

    fn build(max_concurrent: usize, max_queue: usize, header: HeaderName) -> Self {
        Self {
            state: Arc::new(State {
                max_concurrent,
                max_queue,
                attempt_header: header,
                lanes: Mutex::new(Lanes {
                    running: 0,
                    first: VecDeque::new(),
                    retries: VecDeque::new(),
                    service_time: None,
                }),
                counts: Counts::default(),
            }),
        }
    }

    /// At most `n` requests waiting for a slot (0: none wait; a request
    /// finding every slot taken is refused). Default: as many as run.
    #[must_use]
    pub fn max_queue(self, n: usize) -> Self {
        Self::build(
            self.state.max_concurrent,
            n,
            self.state.attempt_header.clone(),
        )
    }

    /// Reads an HTTP request's count of earlier attempts from `name`
    /// instead of `resend-previous-attempts` (gRPC's
    /// `grpc-previous-rpc-attempts` is always read).
    #[must_use]
    pub fn attempt_header(self, name: HeaderName) -> Self {
        Self::build(self.state.max_concurrent, self.state.max_queue, name)
    }

    /// What the layer's services have run and shed so far.
    pub fn stats(&self) -> ShedStats {
        let c = &self.state.counts;
        ShedStats {
            admitted: c.admitted.load(Relaxed),
            shed_first: c.shed_first.load(Relaxed),
            shed_retries: c.shed_retries.load(Relaxed),
            shed_deadline: c.shed_deadline.load(Relaxed),
        }
    }
}

impl<S> Layer<S> for ShedLayer {
    type Service = Shed<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Shed {
            inner,
            state: Arc::clone(&self.state),
        }
    }
}

/// What a [`ShedLayer`] has run and shed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShedStats {
    /// Requests let through to the service.
    pub admitted: u64,
    /// First attempts refused: every slot and queue place taken, and no
    /// retry waiting to give way.
    pub shed_first: u64,
    /// Retries refused, or sent away from the queue to make room for a
    /// first attempt.
    pub shed_retries: u64,
    /// Requests refused because their deadline would pass in the queue.
    pub shed_deadline: u64,
}

impl ShedStats {
    /// Every request refused.
    pub fn shed(&self) -> u64 {
        self.shed_first + self.shed_retries + self.shed_deadline
    }
}

#[derive(Default)]
struct Counts {
    admitted: AtomicU64,
    shed_first: AtomicU64,
    shed_retries: AtomicU64,
    shed_deadline: AtomicU64,
}

struct State {
    max_concurrent: usize,
    max_queue: usize,
    attempt_header: HeaderName,
    lanes: Mutex<Lanes>,
    counts: Counts,
}

/// The slots taken and the requests waiting, first attempts ahead of
/// retries.
struct Lanes {
    running: usize,
    first: VecDeque<oneshot::Sender<Admission>>,
    retries: VecDeque<oneshot::Sender<Admission>>,
    /// How long work has been taking (a moving average), for the waits.
    service_time: Option<Duration>,
}

/// A waiting request's turn: a slot, or a refusal naming the wait.
type Admission = Result<Slot, Duration>;

impl Lanes {
    fn waiting(&self) -> usize {
        self.first.len() + self.retries.len()
    }

    /// How long the work ahead of the `ahead`-th request in the queue (0
    /// for the first) takes to drain.
    fn wait_for(&self, ahead: usize, max_concurrent: usize) -> Duration {
        let per_round = self.service_time.unwrap_or(FIRST_GUESS);
        let rounds = u32::try_from(ahead / max_concurrent + 1).unwrap_or(u32::MAX);
        per_round.saturating_mul(rounds)
    }
}

impl State {
    fn lanes(&self) -> MutexGuard<'_, Lanes> {
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot at once, a place in the queue, or a refusal with the wait to
    /// name.
    fn admit(
        self: &Arc<Self>,
        retry: bool,
        deadline: Option<Deadline>,
    ) -> Result<Result<Slot, oneshot::Receiver<Admission>>, (Refusal, Duration)> {
        let mut lanes = self.lanes();
        if lanes.running < self.max_concurrent && lanes.waiting() == 0 {
            lanes.running += 1;
            return Ok(Ok(self.slot()));
        }
        let ahead = if retry {
            lanes.waiting()
        } else {
            lanes.first.len()
        };
        let wait = lanes.wait_for(ahead, self.max_concurrent);
        if deadline.is_some_and(|d| d.remaining() <= wait) {
            return Err((Refusal::Deadline, wait));
        }
        if lanes.waiting() >= self.max_queue {
            if retry {
                return Err((Refusal::Retry, wait));
            }
            // A first attempt takes the place of the last retry waiting.
            match lanes.retries.pop_back() {
                Some(sent_away) => {
                    let drain = lanes.wait_for(lanes.waiting(), self.max_concurrent);
                    self.counts.shed_retries.fetch_add(1, Relaxed);
                    let _ = sent_away.send(Err(drain));
                }
                None => return Err((Refusal::First, wait)),
            }
        }
        let (tx, rx) = oneshot::channel();
        if retry {
            lanes.retries.push_back(tx);
        } else {
            lanes.first.push_back(tx);
        }
        Ok(Err(rx))
    }

    fn slot(self: &Arc<Self>) -> Slot {
        Slot {
            state: Arc::clone(self),
            started: Instant::now(),
        }
    }

    /// A slot is free again, after work of `took`: it goes to the first
    /// attempt waiting longest, else to the retry waiting longest.
    fn free(self: &Arc<Self>, took: Duration) {
        let mut lanes = self.lanes();
        lanes.service_time = Some(match lanes.service_time {
            // A moving average over about the last eight.
            Some(avg) => (avg * 7 + took) / 8,
            None => took,
        });
        loop {
            let next = match lanes.first.pop_front() {
                Some(next) => next,
                None => match lanes.retries.pop_front() {
                    Some(next) => next,
                    None => {
                        lanes.running -= 1;
                        return;
                    }
                },
            };
            // The slot passes on (running stays). A request that stopped
            // waiting drops what it is sent: its slot comes back here.
            // (One gone between the look and the send drops the slot,
            // which frees it again.)
            if !next.is_closed() {
                drop(lanes);
                let _ = next.send(Ok(self.slot()));
                return;
            }
        }
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    First,
    Retry,
    Deadline,
}

/// A slot taken: freed when dropped.
struct Slot {
    state: Arc<State>,
    started: Instant,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.state.free(self.started.elapsed());
    }
}

/// Middleware that bounds concurrent work and sheds retries first; see
/// [`ShedLayer`].
#[derive(Clone)]
pub struct Shed<S> {
    inner: S,
    state: Arc<State>,
}

impl<S> fmt::Debug for Shed<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shed")
            .field("max_concurrent", &self.state.max_concurrent)
            .finish_non_exhaustive()
    }
}

/// True when `headers` say attempts came before this one.
fn is_retry(headers: &HeaderMap, http: &HeaderName) -> bool {
    [&GRPC_PREVIOUS_RPC_ATTEMPTS, http].into_iter().any(|name| {
        headers
            .get(name)
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
            .and_then(|v| v.trim().parse::<u32>().ok())
            .is_some_and(|n| n > 0)
    })
}

fn refused<B>(why: Refusal, wait: Duration, protocol: Protocol) -> Response<MaybeBuffered<B>> {
    let detail = match why {
        Refusal::First | Refusal::Retry => {
            "the server is at capacity and shed this request; nothing was done, send it again after Retry-After"
        }
        Refusal::Deadline => {
            "the server is at capacity, and the request's deadline would pass before its turn; nothing was done"
        }
    };
    let wait = wait.max(Duration::from_millis(1));
    Problem::new(ProblemType::RequestShed, detail)
        .retry_after(wait)
        .response(protocol)
}

impl<S, B, RB> Service<Request<B>> for Shed<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
    RB: Send + 'static,
{
    type Response = Response<MaybeBuffered<RB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service made ready goes with this request; its clone stays.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let state = Arc::clone(&self.state);
        let retry = is_retry(req.headers(), &state.attempt_header);
        let deadline = match (req.extensions().get::<Deadline>(), Deadline::current()) {
            (Some(a), Some(b)) => Some((*a).min(b)),
            (a, b) => a.copied().or(b),
        };
        let protocol = Protocol::of(req.headers());
        let admitted = state.admit(retry, deadline);
        Box::pin(async move {
            let slot = match admitted {
                Ok(Ok(slot)) => slot,
                Ok(Err(turn)) => match turn.await {
                    Ok(Ok(slot)) => slot,
                    Ok(Err(wait)) => return Ok(refused(Refusal::Retry, wait, protocol)),
                    // (The layer's state outlives every sender.)
                    Err(_) => return Ok(refused(Refusal::Retry, FIRST_GUESS, protocol)),
                },
                Err((why, wait)) => {
                    let count = match why {
                        Refusal::First => &state.counts.shed_first,
                        Refusal::Retry => &state.counts.shed_retries,
                        Refusal::Deadline => &state.counts.shed_deadline,
                    };
                    count.fetch_add(1, Relaxed);
                    tracing::debug!(
                        ?why,
                        retry,
                        wait_ms = wait.as_millis() as u64,
                        "request shed"
                    );
                    return Ok(refused(why, wait, protocol));
                }
            };
            state.counts.admitted.fetch_add(1, Relaxed);
            let resp = inner.call(req).await;
            drop(slot);
            Ok(resp?.map(MaybeBuffered::inner))
        })
    }
}
