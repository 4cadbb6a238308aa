//! [`Idempotency`]: the service. A request that is not the layer's passes
//! straight through; a keyed one takes the boxed path of
//! [`keyed`](super::keyed).

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_resend::{BoxError, Deadline};
use tower_service::Service;

use super::backend::Backend;
use super::config::{Anonymous, Config, Shared};
use super::future::ResponseFuture;
use super::keyed::{self, Keyed};
use super::request;
use super::rules::{self, Arrival, KeyHeader, OnArrival};
use super::stats::IdempotencyStats;
use super::telemetry::{self, Outcome};
use crate::body::MaybeBuffered;
use crate::problems::Protocol;

/// Middleware that deduplicates requests by `Idempotency-Key`; see
/// [`IdempotencyLayer`](crate::IdempotencyLayer).
#[derive(Clone, Debug)]
pub struct Idempotency<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S, St: Backend> Idempotency<S, St> {
    pub(crate) fn from_parts(inner: S, store: St, config: Config) -> Self {
        Self {
            inner,
            shared: Arc::new(Shared { store, config }),
        }
    }

    /// What the layer counted (shared by every service the layer made).
    pub fn stats(&self) -> IdempotencyStats {
        self.shared.config.stats.clone()
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, St, B, RB> Service<Request<B>> for Idempotency<S, St>
where
    S: Service<Request<MaybeBuffered<B>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Backend,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + Unpin + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<MaybeBuffered<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        if rules::is_idempotent(req.method()) {
            return ResponseFuture::passthrough(self.inner.call(req.map(MaybeBuffered::inner)));
        }
        let (parts, body) = req.into_parts();
        let config = &self.shared.config;
        // The work is bounded by the inbound deadline: the request's own, or
        // the ambient scope's (read here, inside it).
        let deadline = Deadline::of(&parts.extensions);
        let (key, anonymous) = match request::key(&parts) {
            Ok(Some(key)) => {
                let (scope, anonymous) = request::scope(&parts, &config.scope);
                let keyed = Keyed {
                    scope,
                    key,
                    deadline,
                };
                (KeyHeader::Present(keyed), anonymous)
            }
            Ok(None) => (KeyHeader::Absent, false),
            Err(reason) => (KeyHeader::Malformed(reason), false),
        };
        let arrival = Arrival {
            mode: St::MODE,
            method: parts.method.clone(),
            required: matches!(key, KeyHeader::Absent)
                && config.require.as_ref().is_some_and(|r| r(&parts)),
            key,
            anonymous,
            refuse_anonymous: config.anonymous == Anonymous::Refuse,
        };
        let shared = Arc::clone(&self.shared);
        match rules::arrived(arrival) {
            OnArrival::ReadBody(keyed) => {
                let inner = self.take_readied();
                let span = telemetry::request_span(&parts.method);
                ResponseFuture::keyed(keyed::keyed(shared, inner, parts, body, keyed, span))
            }
            OnArrival::Transact => {
                let inner = self.take_readied();
                ResponseFuture::keyed(keyed::transact(shared, inner, parts, body, deadline))
            }
            OnArrival::Refuse(answer) => {
                // A malformed, missing (when required) or anonymous key:
                // its own span and count, as every keyed request's outcome.
                let span = telemetry::request_span(&parts.method);
                telemetry::outcome(&span, config.stats.metrics(), Outcome::of(&answer));
                telemetry::answered(&span, answer.kind().status());
                span.in_scope(|| {
                    tracing::debug!(code = answer.kind().code(), "keyed request refused")
                });
                ResponseFuture::ready(answer.response(Protocol::of(&parts.headers)))
            }
            OnArrival::Pass => {
                let req = Request::from_parts(parts, MaybeBuffered::inner(body));
                ResponseFuture::passthrough(self.inner.call(req))
            }
        }
    }
}

impl<S: Clone, St> Idempotency<S, St> {
    /// The readied inner service, which goes with the request; a clone
    /// stays.
    fn take_readied(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}
