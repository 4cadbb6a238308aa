//! A keyed request's way to its handler, in both modes: the body read and
//! the key claimed in the caller's future, then the handler started under
//! its hold and handed to [`Work`], which runs it to its end and keeps it.
//! At each step the rules ([`body_read`], [`found`]) say what to do; the
//! backend does the I/O of its mode.

use std::borrow::Cow;
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
/// request's `span`, where its answer's status goes.
pub(crate) async fn keyed<St, S, B, RB>(
    shared: Arc<Shared<St>>,
    inner: S,
    parts: Parts,
    body: B,
    keyed: Keyed,
    span: tracing::Span,
) -> Answering<RB, S::Error>
where
    St: Backend,
    S: Handler<B, RB>,
    B: RequestBody,
    RB: ResponseBody,
{
    let answered = claim_then_run(shared, inner, parts, body, keyed)
        .instrument(span.clone())
        .await;
    if let Ok(resp) = &answered {
        telemetry::answered(&span, resp.status());
    }
    answered
}

async fn claim_then_run<St, S, B, RB>(
    shared: Arc<Shared<St>>,
    mut inner: S,
    mut parts: Parts,
    body: B,
    keyed: Keyed,
) -> Answering<RB, S::Error>
where
    St: Backend,
    S: Handler<B, RB>,
    B: RequestBody,
    RB: ResponseBody,
{
    let started_at = Instant::now();
    let config = &shared.config;
    let protocol = Protocol::of(&parts.headers);
    let span = tracing::Span::current();
    let refuse = |answer: Answer| {
        telemetry::outcome(&span, config.stats.metrics(), Outcome::of(&answer));
        Ok(answer.response(protocol))
    };

    let mut body = std::pin::pin!(body);
    let (read, bytes) = match read_capped(&mut body, config.request_cap).await {
        Ok(Read {
            bytes, whole: true, ..
        }) => (BodyRead::Read, bytes),
        Ok(_) => (
            BodyRead::TooLarge {
                cap: config.request_cap,
            },
            Bytes::new(),
        ),
        Err(e) => {
            tracing::debug!(error = %e, "request body failed");
            (BodyRead::Failed, Bytes::new())
        }
    };
    match body_read(read) {
        OnBody::Claim => {}
        OnBody::Refuse(answer) => return refuse(answer),
    }

    let fingerprint = request::fingerprint(&parts, &bytes);
    let claim = KeyClaim {
        scope: &keyed.scope,
        key: &keyed.key,
        fingerprint,
        ttl: config.lease_for(keyed.deadline.map(|d| d.remaining())),
        deadline: keyed.deadline,
    };
    let Claimed { found: begun, hold } = St::claim(&shared, &claim).await;
    if let Err(e) = &begun {
        tracing::warn!(error = %e, "idempotency store unavailable: failing closed");
    }
    let begun = Found {
        found: begun,
        fingerprint,
        retry_after: config.retry_after,
    };
    // A hold dropped on the way out gives the key back (if the store may
    // have granted it).
    let mut hold = match found(begun) {
        OnFound::Run => hold,
        OnFound::Replay(stored) => {
            tracing::debug!(key = keyed.key.as_str(), "replaying a stored response");
            telemetry::outcome(&span, config.stats.metrics(), Outcome::Replayed);
            return Ok(replay(*stored));
        }
        OnFound::Refuse(answer) => return refuse(answer),
    };
    telemetry::outcome(&span, config.stats.metrics(), Outcome::Ran);

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
    work.run_to_its_end(hold, handler).await
}

/// An unsafe request without a key, on a backend that holds those too (the
/// transactional mode): the handler runs to its end, in a hold with no
/// record.
pub(crate) async fn transact<St, S, B, RB>(
    shared: Arc<Shared<St>>,
    mut inner: S,
    mut parts: Parts,
    body: B,
    deadline: Option<Deadline>,
) -> Answering<RB, S::Error>
where
    St: Backend,
    S: Handler<B, RB>,
    B: RequestBody,
    RB: ResponseBody,
{
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
}

#[cfg(test)]
#[path = "keyed_tests.rs"]
mod tests;
