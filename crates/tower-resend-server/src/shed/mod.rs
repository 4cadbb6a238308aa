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
//! was run and shed, and gives the limit.
//!
//! The limit is fixed ([`ShedLayer::new`]) or found from latency
//! ([`ShedLayer::adaptive`], with an [`AdaptiveLimit`]: a gradient between a
//! floor and a ceiling, which raises the limit while the work's time holds
//! and cuts it, once per congestion event, when the time climbs):
//!
//! ```
//! use tower_resend_server::shed::{AdaptiveLimit, ShedLayer};
//!
//! // Finds how much may run at once, between 8 and 512.
//! let shed = ShedLayer::adaptive(AdaptiveLimit::between(8, 512));
//! # let _ = shed;
//! ```
//!
//! Order: outside the [`IdempotencyLayer`] (a shed
//! request claims no key, and the work the limit bounds is the handler's),
//! inside the `InboundDeadlineLayer` (whose deadline it reads). Given the
//! idempotency layer ([`ShedLayer::replays_from`]), a keyed retry it would
//! shed is answered from its key's record first: a caller coming back for
//! the answer of work that already ran gets its replay, the cheapest answer
//! the server has, not a shed. A keyed request's shed says that this
//! attempt was not processed (an earlier one under its key may have been).
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tower::{service_fn, ServiceBuilder};
//! use tower_resend_server::{IdempotencyLayer, InboundDeadlineLayer, MemoryStore, ShedLayer};
//!
//! let idempotency = IdempotencyLayer::new(MemoryStore::new());
//! let shed = ShedLayer::new(64).replays_from(&idempotency);
//! let server = ServiceBuilder::new()
//!     .layer(InboundDeadlineLayer::new(Duration::from_secs(10)))
//!     .layer(shed.clone())
//!     .layer(idempotency)
//!     .service(service_fn(|_: Request<String>| async {
//!         Ok::<_, std::convert::Infallible>(Response::new(String::from("charged")))
//!     }));
//! # let _ = server;
//! assert_eq!(shed.stats().shed(), 0);
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderMap, HeaderName, Request, Response};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_resend::retry::{GRPC_PREVIOUS_RPC_ATTEMPTS, RESEND_PREVIOUS_ATTEMPTS};
use tower_resend::Deadline;
use tower_service::Service;

use crate::body::MaybeBuffered;
use crate::idempotency::{Backend, IdempotencyLayer, IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY};

mod lanes;
mod limit;
#[cfg(feature = "otel")]
mod metrics;

mod replay;

use lanes::{Admit, Permit, Refusal, State, FIRST_GUESS};
pub use limit::AdaptiveLimit;
use limit::{Gradient, Limit};
use replay::Refusing;
pub use replay::{NoReplays, Replays, ShedReplays};

/// Bounds the work running at once, and at capacity sheds retries first;
/// see the [module docs](self).
///
/// Clones share one limit, queue and count: build one per server (or per
/// route group that shares a resource), and layer its clones.
#[derive(Clone)]
pub struct ShedLayer<R = NoReplays> {
    shared: Arc<Shared>,
    replays: R,
}

/// A layer's settings, and the state its services share.
#[derive(Clone)]
struct Shared {
    max_queue: Option<usize>,
    attempt_header: HeaderName,
    state: Arc<State>,
}

impl<R> fmt::Debug for ShedLayer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShedLayer")
            .field("limit", &self.shared.state.limit())
            .field("max_queue", &self.shared.max_queue)
            .finish_non_exhaustive()
    }
}

impl ShedLayer {
    /// At most `max_concurrent` requests running at once (at least one),
    /// and as many waiting.
    pub fn new(max_concurrent: usize) -> Self {
        Self::with_limit(Limit::Fixed(max_concurrent.max(1)))
    }

    /// A limit the layer finds from how long the work takes, between
    /// `settings`' floor and ceiling. As many wait as run while the limit
    /// climbs from its start, then half as many (the limit itself lets a
    /// queue form in the service, up to the tolerance); see
    /// [`max_queue`](Self::max_queue).
    ///
    /// The algorithm is a gradient on latency, in the manner of Envoy's
    /// adaptive concurrency filter and Netflix's concurrency-limits. The
    /// time of each piece of work that ran to its end (from its slot to its
    /// response) is a sample; over windows of at least
    /// [`window`](AdaptiveLimit::window) (100 ms) and ten samples, the mean
    /// of the work admitted in the window is compared with the lowest mean
    /// seen (the work's own time, without a queue):
    ///
    /// - slower by more than the [`tolerance`](AdaptiveLimit::tolerance)
    ///   (1.5 times): a congestion event. The limit is scaled by lowest /
    ///   now, at most halved: by Little's law, the work the service did at
    ///   once, its capacity. The next window counts only work admitted
    ///   after the cut, so one event cuts once;
    /// - otherwise, if the limit was reached in the window, it grows by its
    ///   square root (from 64, by 8): the allowance that finds the capacity
    ///   when it grows;
    /// - before the first congestion event (slow start), it grows by one
    ///   for each piece of work within the tolerance while the limit is
    ///   reached (doubling each round trip, as TCP's slow start), in windows
    ///   of ten samples, so a cold server finds its load quickly;
    /// - a cut that did not bring the latency down, or congestion at the
    ///   floor, says the latency is not this queue's: the work itself got
    ///   slower, and its new time is the one compared with from then on.
    ///
    /// So under overload the limit saws between the capacity and the
    /// tolerance above it, and finds a capacity that changes within a
    /// second or two. Why a gradient and not Vegas: Vegas moves the limit
    /// by a few requests a window, so a capacity halved takes many windows
    /// to find, with a queue all along; the gradient lands on it in one
    /// cut. Retries and hedges are shed before first attempts as under a
    /// fixed limit.
    ///
    /// ```
    /// use tower_resend_server::shed::{AdaptiveLimit, ShedLayer};
    ///
    /// let shed = ShedLayer::adaptive(AdaptiveLimit::between(8, 512));
    /// // Nothing measured yet: the initial limit.
    /// assert_eq!(shed.stats().limit, 20);
    /// ```
    pub fn adaptive(settings: AdaptiveLimit) -> Self {
        Self::with_limit(Limit::Adaptive(Gradient::new(settings, Instant::now())))
    }

    fn with_limit(limit: Limit) -> Self {
        Self {
            shared: Arc::new(Shared {
                max_queue: None,
                attempt_header: RESEND_PREVIOUS_ATTEMPTS,
                state: Arc::new(State::new(limit)),
            }),
            replays: NoReplays,
        }
    }
}

impl<R> ShedLayer<R> {
    /// Answers a keyed retry the layer would shed from its key's record,
    /// through `idempotency` (the layer this one sits outside of): a key
    /// with a stored answer gets its replay rather than a shed (the replay
    /// is the cheapest answer the server has, and the caller came back for
    /// it: its earlier attempt did the work, and lost the answer on the
    /// way); a key whose work still runs gets its 409, and any other key is
    /// shed as before (claimed and given back at once; nothing runs). Only
    /// retries are asked about (a request that says attempts came before
    /// it): a first attempt's key has no answer yet. [`ShedStats::replayed`]
    /// counts them.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http::{Request, Response};
    /// use tower::{service_fn, ServiceBuilder};
    /// use tower_resend_server::{IdempotencyLayer, InboundDeadlineLayer, MemoryStore, ShedLayer};
    ///
    /// let idempotency = IdempotencyLayer::new(MemoryStore::new());
    /// let shed = ShedLayer::new(64).replays_from(&idempotency);
    /// let server = ServiceBuilder::new()
    ///     .layer(InboundDeadlineLayer::new(Duration::from_secs(10)))
    ///     .layer(shed)
    ///     .layer(idempotency)
    ///     .service(service_fn(|_: Request<String>| async {
    ///         Ok::<_, std::convert::Infallible>(Response::new(String::from("charged")))
    ///     }));
    /// # let _ = server;
    /// ```
    pub fn replays_from<St: Backend>(
        self,
        idempotency: &IdempotencyLayer<St>,
    ) -> ShedLayer<Replays<St>> {
        ShedLayer {
            shared: self.shared,
            replays: Replays::new(idempotency),
        }
    }

    /// At most `n` requests waiting for a slot (0: none wait; a request
    /// finding every slot taken is refused). Default: as many as run under
    /// a fixed limit; under an adaptive one, as many while it climbs from
    /// its start, then half as many.
    #[must_use]
    pub fn max_queue(mut self, n: usize) -> Self {
        Arc::make_mut(&mut self.shared).max_queue = Some(n);
        self
    }

    /// Reads an HTTP request's count of earlier attempts from `name`
    /// instead of `resend-previous-attempts` (gRPC's
    /// `grpc-previous-rpc-attempts` is always read).
    #[must_use]
    pub fn attempt_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.shared).attempt_header = name;
        self
    }

    /// Records the layer's counts and its limit as metrics on instruments
    /// made from `meter` (your meter provider's), observed at each
    /// collection while the layer lives. Default: none.
    ///
    /// | instrument | kind, unit | value | attributes |
    /// |---|---|---|---|
    /// | `resend.server.shed.limit` | gauge, `{request}` | [`ShedStats::limit`] | |
    /// | `resend.server.shed.admitted` | counter, `{request}` | [`ShedStats::admitted`] | |
    /// | `resend.server.shed.refused` | counter, `{request}` | requests refused | `resend.shed.reason` (`first`, `retry`, `deadline`) |
    ///
    /// ```
    /// use tower_resend_server::shed::{AdaptiveLimit, ShedLayer};
    ///
    /// let meter = opentelemetry::global::meter("tower-resend-server");
    /// let shed = ShedLayer::adaptive(AdaptiveLimit::new()).meter(&meter);
    /// # let _ = shed;
    /// ```
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(self, meter: &opentelemetry::metrics::Meter) -> Self {
        metrics::observe(meter, Arc::downgrade(&self.shared.state));
        self
    }

    /// What the layer's services have run and shed so far, and the limit
    /// now.
    pub fn stats(&self) -> ShedStats {
        self.shared.state.stats()
    }
}

impl State {
    fn stats(&self) -> ShedStats {
        let c = &self.counts;
        ShedStats {
            admitted: c.admitted.load(Relaxed),
            shed_first: c.shed_first.load(Relaxed),
            shed_retries: c.shed_retries.load(Relaxed),
            shed_deadline: c.shed_deadline.load(Relaxed),
            limit: self.limit(),
            replayed: c.replayed.load(Relaxed),
        }
    }
}

impl<S, R: Clone> Layer<S> for ShedLayer<R> {
    type Service = Shed<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        Shed {
            inner,
            shared: Arc::clone(&self.shared),
            replays: self.replays.clone(),
        }
    }
}

/// What a [`ShedLayer`] has run and shed, and its limit.
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
    /// The requests that may run at once now: the fixed limit, or where
    /// the adaptive one stands.
    pub limit: usize,
    /// Keyed retries the layer would have shed, answered by their key's
    /// record instead ([`ShedLayer::replays_from`]): a replay, or a 409
    /// while the work still runs. Not in [`shed`](Self::shed).
    pub replayed: u64,
}

impl ShedStats {
    /// Every request refused.
    pub fn shed(&self) -> u64 {
        self.shed_first + self.shed_retries + self.shed_deadline
    }
}

/// Middleware that bounds concurrent work and sheds retries first; see
/// [`ShedLayer`].
#[derive(Clone)]
pub struct Shed<S, R = NoReplays> {
    inner: S,
    shared: Arc<Shared>,
    replays: R,
}

impl<S, R> fmt::Debug for Shed<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shed")
            .field("limit", &self.shared.state.limit())
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

impl<S, R, B, RB> Service<Request<B>> for Shed<S, R>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    R: ShedReplays<B>,
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
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = &self.shared;
        let state = Arc::clone(&shared.state);
        let retry = is_retry(req.headers(), &shared.attempt_header);
        let deadline = Deadline::of(req.extensions());
        let admitted = state.admit(retry, deadline, shared.max_queue);
        let replays = self.replays.clone();
        Box::pin(async move {
            let (why, wait) = match admitted {
                Admit::Run(slot) => return run(&state, inner, req, slot).await,
                Admit::Wait(turn) => match turn.await {
                    Ok(Ok(slot)) => return run(&state, inner, req, slot).await,
                    // Sent away to make room for a first attempt.
                    Ok(Err(wait)) => (Refusal::Retry, wait),
                    // (The layer's state outlives every sender.)
                    Err(_) => (Refusal::Retry, FIRST_GUESS),
                },
                Admit::Refuse(why, wait) => (why, wait),
            };
            // The one place a request is refused.
            let refusing = Refusing {
                why,
                wait,
                retry,
                keyed: has_key(req.headers()),
            };
            Ok(replays.answer(&state, req, refusing).await)
        })
    }
}

/// `req` run in `slot`.
async fn run<S, B, RB>(
    state: &State,
    mut inner: S,
    req: Request<B>,
    slot: Permit,
) -> Result<Response<MaybeBuffered<RB>>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
{
    state.counts.admitted.fetch_add(1, Relaxed);
    let resp = inner.call(req).await;
    slot.finished();
    Ok(resp?.map(MaybeBuffered::inner))
}

/// True when the request carries an Idempotency-Key.
fn has_key(headers: &HeaderMap) -> bool {
    headers.contains_key(IDEMPOTENCY_KEY) || headers.contains_key(X_IDEMPOTENCY_KEY)
}
