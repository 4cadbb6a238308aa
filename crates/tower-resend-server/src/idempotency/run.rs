//! A keyed request, start to end, around the rules of [`rules`](super::rules):
//! the body read and the key claimed; the handler run under renewals of its
//! lease and the inbound deadline; its end kept.

use std::borrow::Cow;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use tokio::time::{Instant, Sleep};
use tower_resend::deadline::{Snapshot, TimeLedger};
use tower_resend::{BoxError, Deadline};

use super::backend::{Handler, Keyed, RequestBody, ResponseBody};
use super::future::{handler_started, Slow};
use super::held;
use super::layer::Config;
use super::renewals::{has_come, Ticket};
use super::request::{self, Key, IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED};
use super::response::{json_error, retry_later};
use super::rules::{self, Ended, OnBegin, OnEnd, OnRenew, OnStore};
use super::service::{with_timeout, Shared};
use super::telemetry::{self, timed, Op, Outcome};
use super::NothingDone;
use crate::body::{read_capped, MaybeBuffered};
use crate::deadline::Attribution;
use crate::problems::Problem;
use crate::store::{
    Begin, Claim, Fingerprint, LeaseState, LeaseToken, RecordKey, Store, StoreError,
    StoredResponse, Ttl,
};

/// Where a keyed request stands with its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// It holds no lease (not yet, or no longer).
    Idle,
    /// It may hold one: `begin` is under way, or its answer was lost. A
    /// drop releases it.
    Claiming,
    /// The handler has started: the lease is kept until the end is stored,
    /// and never released on a drop (a holder that dies leaves it to
    /// expire: the work may have been done).
    Running,
    /// Releasing it (nothing was done): a drop releases it again.
    Releasing,
}

/// A keyed request's claim on its key, with what it needs to renew,
/// complete or release it. A guard dropped while it may hold a lease it
/// must give back releases it in the background (bounded by the store
/// timeout).
pub(crate) struct LeaseGuard<St: Store> {
    shared: Arc<Shared<St>>,
    scope: Cow<'static, str>,
    key: Key,
    token: LeaseToken,
    fingerprint: Fingerprint,
    /// The lease, sized from the deadline, and the record's life.
    ttl: Ttl,
    deadline: Option<Deadline>,
    /// When it began, for the 504 of a handler the deadline cuts: read
    /// only when there is a deadline (no clock is read otherwise).
    started_at: Option<Instant>,
    /// A gRPC request: its deadline's end is said the gRPC way.
    grpc: bool,
    /// Where the request's time goes (its deadline scope's), for the 504
    /// of a handler the deadline cuts.
    ledger: Option<TimeLedger>,
    phase: Phase,
    /// The request's span (disabled without a subscriber that wants it).
    span: tracing::Span,
}

impl<St: Store> LeaseGuard<St> {
    pub(crate) fn new(shared: Arc<Shared<St>>, keyed: Keyed) -> Self {
        let Keyed {
            scope,
            key,
            deadline,
            grpc,
        } = keyed;
        let ttl = shared.config.lease_for(deadline.map(|d| d.remaining()));
        Self {
            shared,
            scope,
            key,
            token: LeaseToken::random(),
            fingerprint: Fingerprint([0; 32]),
            ttl,
            deadline,
            started_at: deadline.map(|_| Instant::now()),
            grpc,
            ledger: None,
            phase: Phase::Idle,
            span: tracing::Span::none(),
        }
    }

    fn config(&self) -> &Config {
        &self.shared.config
    }

    /// Records what became of the request, on its span and metrics.
    fn outcome(&self, outcome: Outcome) {
        telemetry::outcome(&self.span, self.config().stats.metrics(), outcome);
    }

    /// Where the time went, as of now.
    fn snapshot(&self) -> Snapshot {
        self.ledger
            .as_ref()
            .map(TimeLedger::snapshot)
            .unwrap_or_default()
    }

    fn claim(&self) -> Claim<'_> {
        Claim {
            key: RecordKey {
                scope: &self.scope,
                key: self.key.as_str(),
            },
            fingerprint: self.fingerprint,
            token: self.token,
        }
    }

    /// Renews the lease, bounded by the store timeout.
    async fn renew(&self) -> Result<LeaseState, StoreError> {
        let claim = self.claim();
        let renew = with_timeout(
            self.config().store_timeout,
            self.shared.store.renew(&claim, self.ttl),
        );
        timed(self.config().stats.metrics(), Op::Renew, renew).await
    }

    fn renewed(&self, found: &Result<LeaseState, StoreError>) {
        match (rules::on_renew(found), found) {
            (OnRenew::Renewed, _) => {}
            (OnRenew::Lost, _) => {
                self.config().stats.count_lease_lost();
                tracing::error!(
                    key = self.key.as_str(),
                    "idempotency lease taken over while its handler still works: another run of this key may have happened"
                );
            }
            (OnRenew::Retry, Err(e)) => {
                tracing::warn!(error = %e, key = self.key.as_str(), "could not renew an idempotency lease; trying again");
            }
            (OnRenew::Retry, Ok(_)) => {}
        }
    }

    /// Drops the lease, bounded by the store timeout. The phase stays
    /// `Releasing` until the store has answered, so a drop mid-way releases
    /// it again.
    async fn release(&mut self) {
        self.phase = Phase::Releasing;
        let claim = self.claim();
        let release = with_timeout(
            self.config().store_timeout,
            self.shared.store.release(&claim),
        );
        let released = timed(self.config().stats.metrics(), Op::Release, release).await;
        if let Err(e) = released {
            tracing::warn!(error = %e, key = self.key.as_str(), "could not drop an idempotency lease; it will expire");
        }
        self.phase = Phase::Idle;
    }
}

impl<St: Store> Drop for LeaseGuard<St> {
    fn drop(&mut self) {
        if !matches!(self.phase, Phase::Claiming | Phase::Releasing) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // The guard is going: its scope moves to the task; the `Arc` of the
        // store and the key (a handle to shared bytes) are cloned.
        let scope = std::mem::take(&mut self.scope);
        let (shared, key, token, fingerprint) = (
            Arc::clone(&self.shared),
            self.key.clone(),
            self.token,
            self.fingerprint,
        );
        tracing::debug!(
            key = key.as_str(),
            "keyed request dropped before its handler ran: dropping its idempotency lease"
        );
        runtime.spawn(async move {
            let claim = Claim {
                key: RecordKey {
                    scope: &scope,
                    key: key.as_str(),
                },
                fingerprint,
                token,
            };
            let timeout = shared.config.store_timeout;
            let release = with_timeout(timeout, shared.store.release(&claim));
            let metrics = shared.config.stats.metrics();
            if let Err(e) = timed(metrics, Op::Release, release).await {
                tracing::warn!(error = %e, "could not drop an idempotency lease; it will expire");
            }
        });
    }
}

/// A keyed request, start to end: the body read and the key claimed
/// ([`claim`]), then the handler run and its end kept ([`work`]).
///
/// What is boxed per request is kept small, in two boxes of under 1 KiB
/// each rather than one of 2 KiB: this one (the request's head, the guard,
/// the claim) and `work`'s (the handler's future, then the storing of its
/// response), made once the key is claimed. An allocator serves small
/// blocks from a per-thread cache; glibc's serves none over 1,032 bytes
/// that way, and a larger block costs a pass over its free lists under the
/// arena's lock, shared with the other threads: more, on a busy two-core
/// server, than the second box costs. Each step is a function returning an
/// async block (an `async fn` would hold each parameter twice), and each
/// is awaited once, so their states share room.
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
pub(crate) fn run<S, St, B, RB>(
    inner: S,
    mut guard: LeaseGuard<St>,
    parts: http::request::Parts,
    body: B,
) -> Slow<RB, S::Error>
where
    S: Handler<B, RB>,
    St: Store,
    B: RequestBody,
    RB: ResponseBody,
{
    use tracing::Instrument;
    guard.span = telemetry::request_span(&parts.method);
    let span = guard.span.clone();
    let run = async move {
        let bytes = match claim(&mut guard, &parts, body).await {
            Claimed::Run(bytes) => bytes,
            Claimed::Answer(response) => {
                telemetry::answered(&guard.span, response.status());
                return Ok(response);
            }
        };
        // (Written into its box where it is made, rather than made on the
        // stack and copied in.)
        let work = Box::write(
            Box::new_uninit(),
            work::<S, St, B, RB>(&mut guard, inner, parts, bytes),
        );
        let result = Pin::from(work).await;
        if let Ok(response) = &result {
            telemetry::answered(&guard.span, response.status());
        }
        result
    };
    // A span no subscriber wants is not entered and left on every poll.
    // (With tracing's `log` feature, which sqlx turns on, a disabled span
    // would still be entered, to tell the `log` crate at TRACE: those lines
    // are all that is left out. The layer's events still reach it.)
    if span.is_disabled() {
        Pin::from(Box::write(Box::new_uninit(), run))
    } else {
        Box::pin(run.instrument(span))
    }
}

/// The handler run under its lease ([`Supervised`]), and its end kept
/// ([`settle`]; the unusual ends by [`settle_otherwise`]).
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
fn work<'a, S, St, B, RB>(
    guard: &'a mut LeaseGuard<St>,
    mut inner: S,
    parts: http::request::Parts,
    bytes: Bytes,
) -> impl Future<Output = Result<Response<MaybeBuffered<RB>>, S::Error>> + Send + 'a
where
    S: Handler<B, RB>,
    St: Store,
    B: RequestBody,
    RB: ResponseBody,
{
    async move {
        // From here on the work is the layer's: a caller that goes away
        // does not cancel it (see `ResponseFuture`), and the lease is never
        // given back on a drop.
        guard.phase = Phase::Running;
        handler_started();
        let (scope, key) = (guard.scope.clone(), guard.key.header_value().clone());
        let req = Request::from_parts(parts, MaybeBuffered::full(bytes));
        // The handler's outbound calls derive their keys from this one, and
        // keep the inbound deadline, wherever the work goes on.
        let handler = tower_resend::idempotency::derive_keys(
            scope,
            key,
            tower_resend::deadline::carry(inner.call(req)),
        );
        guard.ledger = tower_resend::deadline::current_ledger();
        let ended = Supervised::new(guard, handler).await;
        // (The handler's end is taken apart by functions that consume it,
        // so that no part of it is kept while the rest is awaited.)
        let resp = match to_store(ended) {
            Ok(resp) => resp,
            // Rarer ends, in a box of their own when they come.
            Err(ended) => return Box::pin(settle_otherwise(guard, ended)).await,
        };
        settle(guard, resp).await
    }
}

/// The handler's response, when it is one to store ([`OnEnd::StoreResponse`]);
/// otherwise how the handler ended.
#[allow(clippy::type_complexity)]
fn to_store<RB, E>(
    ended: Supervision<Result<Response<RB>, E>>,
) -> Result<Response<RB>, Supervision<Result<Response<RB>, E>>> {
    match ended {
        Supervision::Done(Ok(resp)) if rules::on_end(answered(&resp)) == OnEnd::StoreResponse => {
            Ok(resp)
        }
        ended => Err(ended),
    }
}

/// How a handler that answered `resp` ended, for [`rules::on_end`].
fn answered<RB>(resp: &Response<RB>) -> Ended {
    Ended::Answered {
        status: resp.status(),
        nothing_done: resp.extensions().get::<NothingDone>().is_some(),
    }
}

/// What [`claim`] ends with: the lease taken (and the body read), or an
/// answer of the layer's own.
enum Claimed<RB> {
    Run(Bytes),
    Answer(Response<MaybeBuffered<RB>>),
}

/// A keyed request's body, read whole (up to `cap` bytes) before its key is
/// claimed: the fingerprint hashes it, and the handler gets it from memory.
/// Or what the request is answered with when it cannot be: 413 over the
/// cap, 400 when the body fails; nothing has run.
pub(super) async fn read_keyed_body<B, RB>(
    body: B,
    cap: usize,
) -> Result<Bytes, (Outcome, Response<MaybeBuffered<RB>>)>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(body);
    match read_capped(&mut body, cap).await {
        Ok((bytes, true)) => Ok(bytes),
        Ok((_, false)) => Err((
            Outcome::TooLarge,
            json_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                &format!("a request with an idempotency key may have at most {cap} bytes of body"),
            ),
        )),
        Err(e) => {
            tracing::debug!(error = %e, "request body failed");
            Err((
                Outcome::BadRequest,
                json_error(
                    StatusCode::BAD_REQUEST,
                    "request_body_failed",
                    "the request body could not be read",
                ),
            ))
        }
    }
}

/// Reads the request's body (up to the cap), and claims its key.
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
fn claim<'a, St, B, RB>(
    guard: &'a mut LeaseGuard<St>,
    parts: &'a http::request::Parts,
    body: B,
) -> impl Future<Output = Claimed<RB>> + Send + 'a
where
    St: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    async move {
        let bytes = match read_keyed_body(body, guard.config().request_cap).await {
            Ok(bytes) => bytes,
            Err((outcome, answer)) => {
                guard.outcome(outcome);
                return Claimed::Answer(answer);
            }
        };
        guard.fingerprint = request::fingerprint(parts, &bytes);
        let found = begin(guard).await;
        let answer = match rules::on_begin(found, guard.fingerprint) {
            OnBegin::Run => {
                guard.outcome(Outcome::Ran);
                return Claimed::Run(bytes);
            }
            // The store's answer was lost: it may have granted the lease,
            // which the guard releases as it goes (`Claiming`).
            OnBegin::Unavailable(e) => {
                guard.outcome(Outcome::StoreUnavailable);
                return Claimed::Answer(unavailable(&e));
            }
            OnBegin::Replay(response) => {
                tracing::debug!(key = guard.key.as_str(), "replaying a stored response");
                guard.outcome(Outcome::Replayed);
                replay(response)
            }
            OnBegin::InProgress => {
                guard.outcome(Outcome::InProgress);
                retry_later(
                    StatusCode::CONFLICT,
                    "idempotency_key_in_progress",
                    "a request with this idempotency key is in progress; retry later",
                    guard.config().retry_after,
                )
            }
            OnBegin::Mismatch => {
                guard.outcome(Outcome::Mismatch);
                json_error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_reused",
                    "this idempotency key was used with another request (method, path or body differ)",
                )
            }
        };
        guard.phase = Phase::Idle;
        Claimed::Answer(answer)
    }
}

/// What the key holds: a response this process holds for a store that did
/// not take it answers first; otherwise the store, asked for the lease
/// (bounded by the store timeout).
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
fn begin<St: Store>(
    guard: &mut LeaseGuard<St>,
) -> impl Future<Output = Result<Begin, StoreError>> + Send + '_ {
    async move {
        // (`Claiming` from here: an answer held here is a replay, which
        // sets the phase back.)
        guard.phase = Phase::Claiming;
        let claim = guard.claim();
        // (A statement of its own, so that the answer it looked for is not
        // kept while the store is awaited.)
        if let Some(held) = guard.config().held.answer(&claim.key) {
            return Ok(held);
        }
        let begin = with_timeout(
            guard.config().store_timeout,
            guard.shared.store.begin(&claim, guard.ttl),
        );
        timed(guard.config().stats.metrics(), Op::Begin, begin).await
    }
}

pub(crate) fn unavailable<B>(e: &StoreError) -> Response<MaybeBuffered<B>> {
    tracing::warn!(error = %e, "idempotency store unavailable: failing closed");
    retry_later(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency_store_unavailable",
        "the idempotency store cannot be reached; nothing was done",
        Duration::from_secs(1),
    )
}

/// How a supervised future ended.
pub(crate) enum Supervision<T> {
    Done(T),
    Panicked,
    /// Cut by the deadline: where the time went, as of the cut (taken
    /// before the future is dropped, which ends the work it was doing).
    DeadlineCut(Snapshot),
}

pin_project_lite::pin_project! {
    #[project = SupervisedProj]
    /// Runs `fut` (the handler, then the reading of its response's body)
    /// under its lease: renews the lease every third of it, for as long as
    /// `fut` runs, and cuts `fut` when the inbound deadline runs out. `fut`
    /// is polled first, so an answer that is ready wins a tie with the
    /// clock; nothing keeps time until `fut` has waited, so a handler that
    /// answers at once costs none. Without a deadline, the layer's ticker
    /// ([`Renewals`](super::renewals::Renewals)) wakes it to renew; with
    /// one, or with no ticker, a timer of its own.
    pub(crate) struct Supervised<'a, St: Store, F> {
        #[pin]
        fut: F,
        guard: &'a LeaseGuard<St>,
        renew_at: Option<Instant>,
        timer: Option<Pin<Box<Sleep>>>,
        // Its registration with the layer's ticker.
        ticket: Option<Registered>,
        renewing: Option<Pin<Box<dyn Future<Output = Result<LeaseState, StoreError>> + Send + 'a>>>,
    }

    impl<'a, St: Store, F> PinnedDrop for Supervised<'a, St, F> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(registered) = this.ticket.take() {
                this.guard.config().renewals.unregister(registered.ticket);
            }
        }
    }
}

/// A [`Supervised`]'s registration with the layer's ticker.
#[derive(Clone, Copy)]
struct Registered {
    ticket: Ticket,
    /// The tick at which its next renewal is due.
    due: u32,
    /// The task that made it (its waker's data): the registration is
    /// changed only when another task polls, as when the work goes on in a
    /// task of its own after its caller left.
    task: usize,
}

impl<'a, St: Store, F: Future> Supervised<'a, St, F> {
    pub(crate) fn new(guard: &'a LeaseGuard<St>, fut: F) -> Self {
        Self {
            fut,
            guard,
            renew_at: None,
            timer: None,
            ticket: None,
            renewing: None,
        }
    }
}

impl<St: Store, F: Future> Future for Supervised<'_, St, F> {
    type Output = Supervision<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // A panic is caught here, so that it ends the operation like an
        // error (its end is kept) rather than leave the lease to expire and
        // the work to run again.
        match poll_catching(this.fut.as_mut(), cx) {
            Poll::Ready(Ok(out)) => return Poll::Ready(Supervision::Done(out)),
            Poll::Pending => {}
            Poll::Ready(Err(what)) => {
                tracing::error!(panic = %what, key = this.guard.key.as_str(), "a keyed handler panicked");
                return Poll::Ready(Supervision::Panicked);
            }
        }
        let guard = *this.guard;
        let every = guard.ttl.lease / 3;
        if guard.deadline.is_none() && this.timer.is_none() {
            // Woken by the ticker (or the handler): a renewal is started
            // when it is due, two ticks after the last (the ticker ticks
            // at least twice a renewal's period).
            let renewals = &guard.config().renewals;
            let task = cx.waker().data().addr();
            let Some(ticket) = this.ticket.as_mut() else {
                *this.ticket = renewals
                    .register(cx.waker(), every / 2)
                    .map(|ticket| Registered {
                        ticket,
                        due: renewals.ticks().wrapping_add(2),
                        task,
                    });
                if this.ticket.is_some() {
                    return Poll::Pending;
                }
                return self_timed(this, cx, None);
            };
            loop {
                if let Some(renewing) = this.renewing.as_mut() {
                    if let Poll::Ready(found) = renewing.as_mut().poll(cx) {
                        *this.renewing = None;
                        guard.renewed(&found);
                    }
                }
                let now = renewals.ticks();
                if !has_come(ticket.due, now) || this.renewing.is_some() {
                    break;
                }
                ticket.due = now.wrapping_add(2);
                *this.renewing = Some(Box::pin(guard.renew()));
            }
            if ticket.task != task {
                renewals.update(ticket.ticket, cx.waker());
                ticket.task = task;
            }
            if renewals.is_ticking() {
                return Poll::Pending;
            }
            // The ticker ended with its runtime: a timer of its own from
            // here on, and a renewal at once (the last may be two ticks
            // old).
            renewals.unregister(ticket.ticket);
            *this.ticket = None;
            return self_timed(this, cx, Some(Instant::now()));
        }
        self_timed(this, cx, None)
    }
}

/// A [`Supervised`] that keeps time with a timer of its own (a deadline
/// to cut it at, or no ticker): polls its renewal and its timer. `renew_at`
/// is when the next renewal is due, if it is not known yet.
fn self_timed<'a, St: Store, F: Future>(
    this: SupervisedProj<'_, 'a, St, F>,
    cx: &mut Context<'_>,
    renew_at: Option<Instant>,
) -> Poll<Supervision<F::Output>> {
    let guard = *this.guard;
    let every = guard.ttl.lease / 3;
    if renew_at.is_some() {
        *this.renew_at = renew_at;
    }
    loop {
        if let Some(renewing) = this.renewing.as_mut() {
            if let Poll::Ready(found) = renewing.as_mut().poll(cx) {
                *this.renewing = None;
                guard.renewed(&found);
            }
        }
        let renew_at = *this.renew_at.get_or_insert_with(|| Instant::now() + every);
        let deadline = guard.deadline.map(|d| d.instant());
        let wake = deadline.map_or(renew_at, |d| d.min(renew_at));
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(wake)));
        if timer.deadline() != wake {
            timer.as_mut().reset(wake);
        }
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        if deadline.is_some_and(|d| d <= wake) {
            return Poll::Ready(Supervision::DeadlineCut(guard.snapshot()));
        }
        // A renewal is due: start it, unless the last one still runs.
        *this.renew_at = Some(wake + every);
        if this.renewing.is_none() {
            *this.renewing = Some(Box::pin(guard.renew()));
        }
    }
}

/// The end of a keyed request whose handler answered a response to keep
/// ([`OnEnd::StoreResponse`]): its body read (up to the cap, under the
/// lease and the deadline), then the response stored (held and stored later
/// if the store does not take it), and passed on. It is worked on where it
/// lies, and taken apart only once nothing is awaited any more.
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
fn settle<'a, St, RB, E>(
    guard: &'a mut LeaseGuard<St>,
    mut resp: Response<RB>,
) -> impl Future<Output = Result<Response<MaybeBuffered<RB>>, E>> + Send + 'a
where
    St: Store,
    RB: ResponseBody,
    E: Send + 'a,
{
    async move {
        let status = resp.status();
        let (headers, lent) = lend_headers(resp.headers_mut(), &guard.config().per_caller);
        let cap = guard.config().response_cap;
        let read = Supervised::new(guard, read_capped(resp.body_mut(), cap)).await;
        let (bytes, whole) = match body_read(read, &guard.key) {
            Ok(read) => read,
            Err((end, cut)) => return Ok(Box::pin(keep(guard, rules::on_end(end), cut)).await),
        };
        // The body is lent to the record too (a clone of `Bytes` made from a
        // `Vec` would allocate), and taken back below; a body past the cap
        // is not stored, and what was read of it goes on first.
        let (body, prefix) = if whole {
            (bytes, Bytes::new())
        } else {
            (Bytes::new(), bytes)
        };
        let done = StoredResponse {
            status,
            headers,
            body,
            body_omitted: !whole,
        };
        let done = store(guard, done).await;
        let (mut parts, body) = resp.into_parts();
        if let Lent::Yes { length } = lent {
            parts.headers = done.headers;
            if let Some(length) = length {
                parts.headers.insert(http::header::CONTENT_LENGTH, length);
            }
        }
        if whole {
            return Ok(Response::from_parts(parts, MaybeBuffered::full(done.body)));
        }
        Ok(Response::from_parts(
            parts,
            MaybeBuffered::chain(prefix, body),
        ))
    }
}

/// Whether a response's headers were lent to its record (and its
/// `content-length` set aside meanwhile), or copied.
enum Lent {
    Yes { length: Option<HeaderValue> },
    No,
}

/// The headers a response is stored with. Usually no header but
/// `content-length` (which axum sets on every body of known size) is left
/// out: then the response's own headers are lent to the record while it is
/// stored, that one set aside, and no copy is made. Otherwise a copy
/// without the ones left out.
fn lend_headers(headers: &mut HeaderMap, per_caller: &[HeaderName]) -> (HeaderMap, Lent) {
    let mut length = false;
    for name in headers.keys() {
        if !is_unstored(name, per_caller) {
            continue;
        }
        // (One value: `remove` below takes them all, and gives back one.)
        if name != http::header::CONTENT_LENGTH || headers.get_all(name).iter().nth(1).is_some() {
            return (stored_headers(headers, per_caller), Lent::No);
        }
        length = true;
    }
    let mut lent = std::mem::take(headers);
    let length = if length {
        lent.remove(http::header::CONTENT_LENGTH)
    } else {
        None
    };
    (lent, Lent::Yes { length })
}

/// The body of a response to store, read (and whether it ended within the
/// cap); or how its reading ended, and when the deadline cut it, as of when.
#[allow(clippy::type_complexity)]
fn body_read(
    read: Supervision<Result<(Bytes, bool), BoxError>>,
    key: &Key,
) -> Result<(Bytes, bool), (Ended, Snapshot)> {
    match read {
        Supervision::Done(Ok(read)) => Ok(read),
        Supervision::Done(Err(e)) => {
            tracing::warn!(error = %e, key = key.as_str(), "a keyed response's body failed after its head");
            Err((Ended::BodyFailed, Snapshot::default()))
        }
        Supervision::Panicked => Err((Ended::Panicked, Snapshot::default())),
        Supervision::DeadlineCut(cut) => Err((Ended::DeadlineCut, cut)),
    }
}

/// The end of a keyed request whose handler did not answer a response to
/// keep: the lease released (nothing was done), or a response of the
/// layer's own kept ([`keep`]) for a handler that failed, panicked or was
/// cut by the deadline.
async fn settle_otherwise<St, RB, E>(
    guard: &mut LeaseGuard<St>,
    ended: Supervision<Result<Response<RB>, E>>,
) -> Result<Response<MaybeBuffered<RB>>, E>
where
    St: Store,
    RB: ResponseBody,
{
    let end = match &ended {
        Supervision::Done(Ok(resp)) => answered(resp),
        Supervision::Done(Err(_)) => Ended::Failed,
        Supervision::Panicked => Ended::Panicked,
        Supervision::DeadlineCut(_) => Ended::DeadlineCut,
    };
    match (rules::on_end(end), ended) {
        (OnEnd::Release, Supervision::Done(result)) => {
            guard.release().await;
            result.map(|resp| resp.map(MaybeBuffered::inner))
        }
        (kept, ended) => {
            let (cut, error) = match ended {
                Supervision::DeadlineCut(cut) => (cut, None),
                Supervision::Done(Err(e)) => (Snapshot::default(), Some(e)),
                _ => (Snapshot::default(), None),
            };
            let answer = keep(guard, kept, cut).await;
            // A handler's error still reaches its first caller as it is.
            error.map_or(Ok(answer), Err)
        }
    }
}

/// Stores `done` for the key, and gives it back.
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
fn store<St: Store>(
    guard: &mut LeaseGuard<St>,
    done: StoredResponse,
) -> impl Future<Output = StoredResponse> + Send + '_ {
    async move {
        let found = {
            let claim = guard.claim();
            let complete = with_timeout(
                guard.config().store_timeout,
                guard.shared.store.complete(&claim, &done, guard.ttl),
            );
            timed(guard.config().stats.metrics(), Op::Complete, complete).await
        };
        match rules::on_store(&found) {
            OnStore::Stored => {}
            OnStore::LeaseLost => {
                guard.config().stats.count_lease_lost();
                tracing::error!(key = guard.key.as_str(), "idempotency lease taken over before the response could be stored: another run of this key may have happened");
            }
            OnStore::Hold => {
                if let Err(e) = &found {
                    tracing::warn!(error = %e, key = guard.key.as_str(), "could not store an idempotent response: it is held, and stored in the background");
                }
                let claim = guard.claim();
                held::store_later(
                    &guard.shared.store,
                    guard.config(),
                    &claim,
                    done.clone(),
                    guard.ttl,
                );
            }
        }
        guard.phase = Phase::Idle;
        done
    }
}

/// Keeps a response of the layer's own as the key's end (`kept`: a failure
/// or the deadline's 504, saying where the time went as of the `cut`), and
/// answers with it.
async fn keep<St: Store, RB>(
    guard: &mut LeaseGuard<St>,
    kept: OnEnd,
    cut: Snapshot,
) -> Response<MaybeBuffered<RB>> {
    let record = match kept {
        OnEnd::StoreFailure(code) => failure(code),
        OnEnd::StoreDeadline => deadline_cut(guard, cut),
        // (Not what `on_end` says of a failure; kept as the worst case.)
        OnEnd::StoreResponse | OnEnd::Release => failure("handler_failed"),
    };
    answer(store(guard, record).await)
}

/// A 500 of the layer's own, kept as the operation's end: the handler
/// started, so the work may have been done.
pub(crate) fn failure(code: &'static str) -> StoredResponse {
    let message = match code {
        "response_lost" => "the operation ran, but its response was lost; it will not run again under this key",
        "handler_panicked" => "the operation failed unexpectedly and may have run in part; it will not run again under this key",
        _ => "the operation failed and may have run in part; it will not run again under this key",
    };
    Problem::new(StatusCode::INTERNAL_SERVER_ERROR, code, message).stored()
}

/// The deadline's 504, kept as the operation's end: it says where the time
/// went (as of the `cut`), as the inbound deadline layer's does.
fn deadline_cut<St: Store>(guard: &LeaseGuard<St>, cut: Snapshot) -> StoredResponse {
    tracing::warn!(
        key = guard.key.as_str(),
        "the inbound deadline cut a keyed handler: its 504 is kept as the operation's end"
    );
    let started_at = guard.started_at.unwrap_or_else(Instant::now);
    deadline_response(started_at, guard.deadline, guard.grpc, cut)
}

/// The 504 of a request that began at `started_at` and whose `deadline`
/// ran out, saying where the time went (`snapshot`, taken at the cut,
/// before the handler was dropped: the work it was doing is the work
/// named), as the inbound deadline layer's does; the gRPC way for a gRPC
/// request.
pub(crate) fn deadline_response(
    started_at: Instant,
    deadline: Option<Deadline>,
    grpc: bool,
    snapshot: Snapshot,
) -> StoredResponse {
    let elapsed = started_at.elapsed();
    let budget = deadline.map_or(elapsed, |d| {
        d.instant().saturating_duration_since(started_at)
    });
    Attribution::from_snapshot(snapshot, budget, elapsed).stored(grpc)
}

/// Polls `fut`, catching a panic: `Err` with its message.
pub(crate) fn poll_catching<F: Future>(
    fut: Pin<&mut F>,
    cx: &mut Context<'_>,
) -> Poll<Result<F::Output, String>> {
    match catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
        Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
        Ok(Poll::Pending) => Poll::Pending,
        Err(panic) => Poll::Ready(Err(panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default())),
    }
}

/// The response of a record, as the first caller gets it.
pub(crate) fn answer<B>(stored: StoredResponse) -> Response<MaybeBuffered<B>> {
    let mut resp = Response::new(MaybeBuffered::full(stored.body));
    *resp.status_mut() = stored.status;
    *resp.headers_mut() = stored.headers;
    resp
}

/// The response of a record, replayed.
pub(crate) fn replay<B>(stored: StoredResponse) -> Response<MaybeBuffered<B>> {
    let omitted = stored.body_omitted;
    let mut resp = answer(stored);
    resp.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if omitted {
        resp.headers_mut()
            .insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("true"));
    }
    resp
}

/// Left out of stored responses: hop-by-hop headers, `content-length`,
/// `Set-Cookie` and the configured per-caller headers. (Standard names are
/// matched on their text: a standard name's text is a table lookup, and no
/// array of names is built and dropped on every call.)
pub(crate) fn is_unstored(name: &HeaderName, per_caller: &[HeaderName]) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
            | "set-cookie"
    ) || per_caller.contains(name)
}

/// The headers a response is stored with: a copy without the ones left
/// out, made in one pass.
pub(crate) fn stored_headers(headers: &HeaderMap, per_caller: &[HeaderName]) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if !is_unstored(name, per_caller) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::backend::Keyed;
    use crate::{IdempotencyLayer, MemoryStore};
    use http::Request;
    use http_body_util::{BodyExt, Full};
    use tower::{Layer, Service, ServiceExt};

    /// A response with `content-length` and `extra` as headers, through the
    /// layer (response cap `cap`), then replayed.
    async fn first_and_replay(
        cap: usize,
        extra: Option<(&'static str, &'static str)>,
    ) -> [Response<MaybeBuffered<Full<Bytes>>>; 2] {
        let handler = tower::service_fn(move |_: Request<MaybeBuffered<Full<Bytes>>>| async move {
            let mut resp = Response::new(Full::new(Bytes::from_static(b"hello")));
            let h = resp.headers_mut();
            h.insert("content-type", HeaderValue::from_static("text/plain"));
            h.insert("content-length", HeaderValue::from_static("5"));
            h.insert("x-a", HeaderValue::from_static("1"));
            if let Some((n, v)) = extra {
                h.insert(n, HeaderValue::from_static(v));
            }
            Ok::<_, std::convert::Infallible>(resp)
        });
        let svc = IdempotencyLayer::new(MemoryStore::new())
            .response_cap(cap)
            .layer(handler);
        let req = || {
            Request::post("/x")
                .header("idempotency-key", "k")
                .body(Full::new(Bytes::new()))
                .unwrap()
        };
        let first = svc.clone().oneshot(req()).await.unwrap();
        let again = svc.oneshot(req()).await.unwrap();
        [first, again]
    }

    async fn body(resp: Response<MaybeBuffered<Full<Bytes>>>) -> Bytes {
        resp.into_body().collect().await.unwrap().to_bytes()
    }

    /// The handler's headers reach the first caller as it set them (its
    /// `content-length` as the body's exact size, which hyper writes), and
    /// the replay carries them without the hop-by-hop ones.
    #[tokio::test]
    async fn headers_reach_the_first_caller_and_the_replay() {
        let [first, again] = first_and_replay(1024, None).await;
        assert_eq!(first.headers()["content-type"], "text/plain");
        assert_eq!(first.headers()["x-a"], "1");
        assert_eq!(first.body().size_hint().exact(), Some(5));
        // Its `content-length`, set aside while the record was made, is
        // given back.
        assert_eq!(first.headers()["content-length"], "5");
        assert_eq!(body(first).await, "hello");
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["x-a"], "1");
        assert!(again.headers().get("content-length").is_none());
        assert_eq!(body(again).await, "hello");

        // Another hop-by-hop header: the first caller gets it, the replay
        // does not.
        let [first, again] = first_and_replay(1024, Some(("connection", "close"))).await;
        assert_eq!(first.headers()["connection"], "close");
        assert_eq!(first.headers()["content-length"], "5");
        assert_eq!(body(first).await, "hello");
        assert!(again.headers().get("connection").is_none());
        assert_eq!(again.headers()["x-a"], "1");
        assert_eq!(body(again).await, "hello");
    }

    /// A body past the cap goes on to the first caller whole, with the
    /// length the handler gave it.
    #[tokio::test]
    async fn a_body_past_the_cap_keeps_its_length() {
        let [first, again] = first_and_replay(3, None).await;
        assert_eq!(first.headers()["content-length"], "5");
        assert_eq!(first.headers()["x-a"], "1");
        assert_eq!(body(first).await, "hello");
        assert_eq!(again.headers()["idempotent-body-omitted"], "true");
        assert_eq!(body(again).await, "");
    }

    /// A store that counts its clones.
    #[derive(Debug)]
    struct Counted(MemoryStore, std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Clone for Counted {
        fn clone(&self) -> Self {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Self(self.0.clone(), self.1.clone())
        }
    }

    impl Store for Counted {
        fn begin(
            &self,
            claim: &Claim<'_>,
            ttl: Ttl,
        ) -> impl std::future::Future<Output = Result<Begin, StoreError>> + Send {
            self.0.begin(claim, ttl)
        }

        fn renew(
            &self,
            claim: &Claim<'_>,
            ttl: Ttl,
        ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
            self.0.renew(claim, ttl)
        }

        fn complete(
            &self,
            claim: &Claim<'_>,
            response: &StoredResponse,
            ttl: Ttl,
        ) -> impl std::future::Future<Output = Result<LeaseState, StoreError>> + Send {
            self.0.complete(claim, response, ttl)
        }

        fn release(
            &self,
            claim: &Claim<'_>,
        ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
            self.0.release(claim)
        }
    }

    /// Neither a clone of the service (axum makes one per request) nor a
    /// keyed request clones the store: both share the layer's one `Arc`.
    #[tokio::test]
    async fn requests_and_service_clones_share_the_store() {
        let clones = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let store = Counted(MemoryStore::new(), clones.clone());
        let handler = tower::service_fn(|_: Request<MaybeBuffered<Full<Bytes>>>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        let svc = IdempotencyLayer::new(store).layer(handler);
        let before = clones.load(std::sync::atomic::Ordering::Relaxed);
        for i in 0..10 {
            let req = Request::post("/x")
                .header("idempotency-key", format!("k{i}"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = svc.clone().oneshot(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
        }
        assert_eq!(clones.load(std::sync::atomic::Ordering::Relaxed), before);
    }

    /// What a keyed request boxes is two blocks of at most 1 KiB each (the
    /// claim's, then the handler's), with a handler whose future takes as
    /// much room as an axum route's: glibc serves blocks of up to 1,032
    /// bytes from a per-thread cache, and a larger one (the 2 KiB of one box)
    /// from its shared lists, under a lock, which cost a two-core server
    /// more than the second box does.
    #[tokio::test]
    async fn a_keyed_requests_boxes_stay_within_a_kibibyte() {
        let layer = IdempotencyLayer::new(MemoryStore::new());
        let shared = Arc::new(Shared {
            store: MemoryStore::new(),
            config: layer.config().clone(),
        });
        let request = || {
            Request::post("/x")
                .header("idempotency-key", "k")
                .body(Full::new(Bytes::new()))
                .unwrap()
                .into_parts()
        };
        let guard = |parts: &http::request::Parts| {
            let keyed = Keyed {
                scope: Cow::Borrowed("anonymous"),
                key: request::key(parts).unwrap().unwrap(),
                deadline: None,
                grpc: false,
            };
            LeaseGuard::new(Arc::clone(&shared), keyed)
        };
        // An axum route's future holds the request until it is first polled:
        // 480 bytes in all.
        let handler = tower::service_fn(|req: Request<MaybeBuffered<Full<Bytes>>>| async move {
            let room = [0u8; 200];
            tokio::task::yield_now().await;
            std::hint::black_box((&room, &req));
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
        });
        let (parts, body) = request();
        let mut probe = handler;
        let handler_room = std::mem::size_of_val(&probe.call(Request::from_parts(
            parts,
            MaybeBuffered::full(Bytes::new()),
        )));
        assert!(handler_room >= 480, "{handler_room}");

        let (parts, _) = request();
        let claim = run(handler, guard(&parts), parts, body);
        let claim = &*claim;
        let (parts, _) = request();
        let mut held = guard(&parts);
        let work = work::<_, _, Full<Bytes>, _>(&mut held, handler, parts, Bytes::new());
        for (what, room) in [
            ("claim", std::mem::size_of_val(claim)),
            ("work", std::mem::size_of_val(&work)),
        ] {
            assert!(room <= 1024, "{what}: {room} bytes");
        }
    }

    #[test]
    fn stored_headers_leave_out_hop_by_hop_and_per_caller_ones() {
        let mut h = HeaderMap::new();
        for (n, v) in [
            ("connection", "keep-alive"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "close"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("trailer", "x-sum"),
            ("upgrade", "h2c"),
            ("content-length", "3"),
            ("content-type", "text/plain"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("x-session", "s"),
            ("x-custom", "yes"),
        ] {
            h.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let mut want = HeaderMap::new();
        for (n, v) in [("content-type", "text/plain"), ("x-custom", "yes")] {
            want.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let per_caller = [HeaderName::from_static("x-session")];
        assert_eq!(stored_headers(&h, &per_caller), want);
        assert!(is_unstored(&HeaderName::from_static("set-cookie"), &[]));
        assert!(!is_unstored(&HeaderName::from_static("x-session"), &[]));
    }
}
