use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use tower_resend::{BoxError, Deadline};
use tower_service::Service;

use super::backend::{Backend, Keyed};
use super::future::ResponseFuture;
use super::layer::Config;
use super::request;
use super::response::json_error;
use super::rules::{self, Admit, KeyHeader};
use super::stats::IdempotencyStats;
use super::telemetry::Outcome;
use crate::body::MaybeBuffered;
use crate::store::StoreError;
use crate::IdempotencyLayer;

/// Middleware that deduplicates requests by `Idempotency-Key`; see
/// [`IdempotencyLayer`].
#[derive(Clone, Debug)]
pub struct Idempotency<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

/// The store and the config, behind the one `Arc` that each clone of the
/// service (axum makes one per request) and each keyed request's future
/// count: one count changed per clone, not one per field. Aligned to 128
/// bytes, so that the store and config, read by every request, do not
/// share a cache line with the counts, which both cores write.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Shared<St> {
    pub(crate) store: St,
    pub(crate) config: Config,
}

impl<S, St: Backend> Idempotency<S, St> {
    /// Wraps `inner` with the defaults of [`IdempotencyLayer::new`].
    pub fn new(inner: S, store: St) -> Self {
        tower_layer::Layer::layer(&IdempotencyLayer::new(store), inner)
    }

    /// An [`IdempotencyLayer`] over `store`.
    pub fn layer(store: St) -> IdempotencyLayer<St> {
        IdempotencyLayer::new(store)
    }

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
        let (key, found) = match request::key(&parts) {
            Ok(Some(key)) => (Some(key), KeyHeader::Present),
            Ok(None) => (None, KeyHeader::Absent),
            Err(reason) => (None, KeyHeader::Malformed(reason)),
        };
        let scope = key.as_ref().map(|_| request::scope(&parts, &config.scope));
        let admitted = rules::admit(&rules::Request {
            method: &parts.method,
            key: found,
            required: found == KeyHeader::Absent
                && config.require.as_ref().is_some_and(|r| r(&parts)),
            anonymous: scope.as_ref().is_some_and(|(_, anonymous)| *anonymous),
            refuse_anonymous: config.anonymous == super::Anonymous::Refuse,
        });
        let (key, (scope, _)) = match (admitted, key, scope) {
            (Admit::Keyed, Some(key), Some(scope)) => (key, scope),
            (Admit::Refuse(code, message), ..) => {
                // A malformed, missing (when required) or anonymous key:
                // its own span and count, as every keyed request's outcome.
                let span = super::telemetry::request_span(&parts.method);
                super::telemetry::outcome(&span, config.stats.metrics(), Outcome::BadRequest);
                super::telemetry::answered(&span, StatusCode::BAD_REQUEST);
                span.in_scope(|| tracing::debug!(code, "keyed request refused"));
                return ResponseFuture::ready(json_error(StatusCode::BAD_REQUEST, code, message));
            }
            (Admit::Pass, ..) if St::TAKES_UNKEYED => {
                let req = Request::from_parts(parts, MaybeBuffered::inner(body));
                let deadline = deadline_of(&req);
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                let run = St::unkeyed(Arc::clone(&self.shared), deadline, inner, req);
                return ResponseFuture::keyed(run);
            }
            _ => {
                let req = Request::from_parts(parts, MaybeBuffered::inner(body));
                return ResponseFuture::passthrough(self.inner.call(req));
            }
        };
        // The work is bounded by the inbound deadline: the request's own, or
        // the ambient scope's (read here, inside it).
        let deadline = deadline_in(&parts.extensions);
        // The readied service goes with the request; a clone stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let grpc = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let keyed = Keyed {
            scope,
            key,
            deadline,
            grpc,
        };
        ResponseFuture::keyed(St::keyed(
            Arc::clone(&self.shared),
            keyed,
            inner,
            parts,
            body,
        ))
    }
}

/// The inbound deadline of a request: its own, or the ambient scope's (read
/// in `call`, inside it), whichever is earlier.
fn deadline_in(extensions: &http::Extensions) -> Option<Deadline> {
    match (extensions.get::<Deadline>(), Deadline::current()) {
        (Some(a), Some(b)) => Some((*a).min(b)),
        (a, b) => a.copied().or(b),
    }
}

fn deadline_of<B>(req: &Request<B>) -> Option<Deadline> {
    deadline_in(req.extensions())
}

/// `fut`, given up after `limit`. A store that answers on the first poll
/// (the memory store always does) costs no timer; the timer, armed on the
/// first `Pending`, lives in a box of its own, so a request's future does
/// not carry its room.
pub(crate) fn with_timeout<F, T>(limit: std::time::Duration, fut: F) -> WithTimeout<F>
where
    F: std::future::Future<Output = Result<T, StoreError>>,
{
    WithTimeout {
        fut,
        limit,
        timer: None,
    }
}

pin_project_lite::pin_project! {
    pub(crate) struct WithTimeout<F> {
        #[pin]
        fut: F,
        limit: std::time::Duration,
        timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<F, T> std::future::Future for WithTimeout<F>
where
    F: std::future::Future<Output = Result<T, StoreError>>,
{
    type Output = Result<T, StoreError>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        // The store first, the clock second: an answer that is ready wins.
        if let Poll::Ready(r) = this.fut.poll(cx) {
            return Poll::Ready(r);
        }
        let limit = *this.limit;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                Poll::Ready(Err(StoreError::new(format!("no answer within {limit:?}"))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
