//! A keyed request's way to its handler, in both modes: the body read and
//! the key claimed in the caller's future, then the handler started under
//! its hold and handed to [`Work`], which runs it to its end and keeps it.
//! At each step the rules ([`body_read`], [`found`]) say what to do; the
//! backend does the I/O of its mode.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower_resend::{BoxError, Deadline};
use tower_service::Service;
use tracing::Instrument;

use super::backend::{Backend, Claimed, KeyClaim};
use super::config::Shared;
use super::future::Boxed;
use super::request::{self, Key};
use super::response::replay;
use super::rules::{body_read, found, unavailable, BodyRead, Found, OnBody, OnFound};
use super::telemetry::{self, Outcome};
use super::work::{Answering, ResponseBody, Work};
use crate::body::{read_capped, MaybeBuffered, Read};
use crate::problems::{Answer, Protocol};

/// The handler: the inner service, on the request with its body read (or
/// not), sent to another task.
pub(crate) trait Handler<B, RB>:
    Service<
        Request<MaybeBuffered<B>>,
        Response = Response<RB>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
}

impl<T, B, RB> Handler<B, RB> for T
where
    T: Service<Request<MaybeBuffered<B>>, Response = Response<RB>> + Send + 'static,
    T::Future: Send + 'static,
    T::Error: Send + 'static,
{
}

/// A request body the layer takes: bytes, with an error it can box.
pub(crate) trait RequestBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<T> RequestBody for T
where
    T: Body<Data = Bytes> + Send + 'static,
    T::Error: Into<BoxError>,
{
}

/// What the layer knows of a keyed request when the service hands it on.
pub(crate) struct Keyed {
    pub(crate) scope: Cow<'static, str>,
    pub(crate) key: Key,
    pub(crate) deadline: Option<Deadline>,
}

/// A keyed request: its body read, its key claimed, then (if it is this
/// request's) the handler run to its end, the caller there or not; in the
/// request's `span`, where its answer's status goes. Boxed: the service's
/// response future holds it as one pointer.
///
/// What a keyed request boxes is kept to blocks of at most 1 KiB: this
/// one, the handler's, the work's once the key is claimed, and its end's
/// and keeping step's once the handler has answered. glibc serves blocks
/// of up to 1,032 bytes from a per-thread cache, and a larger one from its
/// shared lists under the arena's lock, after a pass over its free chunks,
/// which a busy two-core server pays for on every request
/// (`server_throughput`'s waiting row: 0.79-0.80 of no layer with two
/// boxes of 2.0 and 2.8 KB, 0.82-0.87 with five of 1 KB at most). So the
/// steps are functions returning an async block (an `async fn` keeps each
/// of its parameters twice), each step's locals in a block of their own,
/// and the later steps boxed when they come. The tests in `keyed_tests.rs`
/// and `work_tests.rs` hold the sizes.
pub(crate) fn keyed<St, S, B, RB>(
    shared: Arc<Shared<St>>,
    inner: S,
    parts: Parts,
    body: B,
    keyed: Keyed,
    span: tracing::Span,
) -> Boxed<RB, S::Error>
where
    St: Backend,
    S: Handler<B, RB>,
    B: RequestBody,
    RB: ResponseBody,
{
    let run = claim_then_run(shared, inner, parts, body, keyed);
    // A span no subscriber wants is not entered and left on every poll.
    if span.is_disabled() {
        return Box::pin(run);
    }
    Box::pin(run.instrument(span))
}

// An async block rather than an `async fn`, which keeps each of its
// parameters twice: this future is boxed on every keyed request.
#[allow(clippy::manual_async_fn)]
fn claim_then_run<St, S, B, RB>(
    shared: Arc<Shared<St>>,
    mut inner: S,
    mut parts: Parts,
    body: B,
    keyed: Keyed,
) -> impl Future<Output = Answering<RB, S::Error>>
where
    St: Backend,
    S: Handler<B, RB>,
    B: RequestBody,
    RB: ResponseBody,
{
    async move {
        let started_at = Instant::now();
        let protocol = Protocol::of(&parts.headers);

        // (Each step in a block of its own, so that what it needs is not
        // kept in this future while the next one waits.)
        let bytes = {
            let mut body = std::pin::pin!(body);
            let cap = shared.config.request_cap;
            let (read, bytes) = match read_capped(&mut body, cap).await {
                Ok(Read {
                    bytes, whole: true, ..
                }) => (BodyRead::Read, bytes),
                Ok(_) => (BodyRead::TooLarge { cap }, Bytes::new()),
                Err(e) => {
                    tracing::debug!(error = %e, "request body failed");
                    (BodyRead::Failed, Bytes::new())
                }
            };
            match body_read(read) {
                OnBody::Claim => bytes,
                OnBody::Refuse(answer) => return refused(&shared, protocol, answer),
            }
        };

        // A hold dropped on the way out gives the key back (if the store may
        // have granted it).
        let mut hold = {
            let claim = KeyClaim {
                scope: &keyed.scope,
                key: &keyed.key,
                fingerprint: request::fingerprint(&parts, &bytes),
                ttl: shared
                    .config
                    .lease_for(keyed.deadline.map(|d| d.remaining())),
                deadline: keyed.deadline,
            };
            let Claimed { found: begun, hold } = St::claim(&shared, &claim).await;
            if let Err(e) = &begun {
                tracing::warn!(error = %e, "idempotency store unavailable: failing closed");
            }
            let begun = Found {
                found: begun,
                fingerprint: claim.fingerprint,
                retry_after: shared.config.retry_after,
            };
            match found(begun) {
                OnFound::Run => hold,
                OnFound::Replay(stored) => {
                    tracing::debug!(key = keyed.key.as_str(), "replaying a stored response");
                    let answer = replay(*stored);
                    let span = tracing::Span::current();
                    telemetry::outcome(&span, shared.config.stats.metrics(), Outcome::Replayed);
                    telemetry::answered(&span, answer.status());
                    return Ok(answer);
                }
                OnFound::Refuse(answer) => return refused(&shared, protocol, answer),
            }
        };
        telemetry::outcome(
            &tracing::Span::current(),
            shared.config.stats.metrics(),
            Outcome::Ran,
        );

        // From here on the work is the layer's: it runs to its end, bounded by
        // the inbound deadline.
        St::start(&mut hold, &mut parts.extensions);
        let req = Request::from_parts(parts, MaybeBuffered::full(bytes));
        // The handler's outbound calls derive their keys from this one, and
        // keep the inbound deadline, wherever the work goes on.
        // Boxed where it is made: moved into the work as a pointer, whatever
        // the size of the service's future.
        let handler = Box::pin(tower_resend::idempotency::derive_keys(
            keyed.scope,
            keyed.key.header_value().clone(),
            tower_resend::deadline::carry(inner.call(req)),
        ));
        let work = Work {
            shared: Arc::clone(&shared),
            protocol,
            deadline: keyed.deadline,
            ledger: tower_resend::deadline::server::current_ledger(),
            started_at,
            key: Some(keyed.key),
        };
        let answered = work.run_to_its_end(hold, handler).await;
        if let Ok(resp) = &answered {
            telemetry::answered(&tracing::Span::current(), resp.status());
        }
        answered
    }
}

/// The layer's own answer to a keyed request, counted and noted on its
/// span (the current one).
fn refused<St, RB, E>(shared: &Shared<St>, protocol: Protocol, answer: Answer) -> Answering<RB, E> {
    let span = tracing::Span::current();
    telemetry::outcome(&span, shared.config.stats.metrics(), Outcome::of(&answer));
    let response = answer.response(protocol);
    telemetry::answered(&span, response.status());
    Ok(response)
}

/// An unsafe request without a key, on a backend that holds those too (the
/// transactional mode): the handler runs to its end, in a hold with no
/// record.
pub(crate) fn transact<St, S, B, RB>(
    shared: Arc<Shared<St>>,
    mut inner: S,
    mut parts: Parts,
    body: B,
    deadline: Option<Deadline>,
) -> Boxed<RB, S::Error>
where
    St: Backend,
    S: Handler<B, RB>,
    B: RequestBody,
    RB: ResponseBody,
{
    Box::pin(async move {
        let started_at = Instant::now();
        let protocol = Protocol::of(&parts.headers);
        let mut hold = match St::transact(&shared).await {
            Ok(hold) => hold,
            Err(e) => {
                tracing::warn!(error = %e, "idempotency store unavailable: failing closed");
                return Ok(unavailable(&e).response(protocol));
            }
        };
        St::start(&mut hold, &mut parts.extensions);
        let req = Request::from_parts(parts, MaybeBuffered::inner(body));
        let handler = Box::pin(tower_resend::deadline::carry(inner.call(req)));
        let work = Work {
            shared,
            protocol,
            deadline,
            ledger: tower_resend::deadline::server::current_ledger(),
            started_at,
            key: None,
        };
        work.run_to_its_end(hold, handler).await
    })
}

#[cfg(test)]
#[path = "keyed_tests.rs"]
mod tests;
