use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderName, Request, Response};
use tokio::time::Instant;
use tower_resend::deadline::{parse_grpc_timeout, parse_millis, server::TimeLedger, GRPC_TIMEOUT};
use tower_resend::Deadline;
use tower_service::Service;

use super::attribution::{Attribution, ErrorSource};
use super::future::ResponseFuture;
use crate::body::MaybeBuffered;
use crate::problems::Protocol;

/// Middleware that runs each request inside the caller's deadline; see
/// [`InboundDeadlineLayer`](super::InboundDeadlineLayer).
#[derive(Clone, Debug)]
pub struct InboundDeadline<S> {
    pub(crate) inner: S,
    pub(crate) config: Config,
}

impl<S> InboundDeadline<S> {
    /// Wraps `inner`, bounding every request by `max`.
    pub const fn new(inner: S, max: Duration) -> Self {
        Self {
            inner,
            config: Config {
                max,
                default: max,
                http_header: None,
            },
        }
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

/// What an [`InboundDeadline`] is configured with.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) max: Duration,
    pub(crate) default: Duration,
    pub(crate) http_header: Option<HeaderName>,
}

impl Config {
    /// The caller's budget, bounded by the maximum; the default when there
    /// is none or it cannot be read.
    fn budget<B>(&self, req: &Request<B>) -> Duration {
        let parsed = if let Some(v) = req.headers().get(GRPC_TIMEOUT) {
            Some(parse_grpc_timeout(v.as_bytes()).map_err(|e| ("grpc-timeout", e)))
        } else {
            self.http_header.as_ref().and_then(|name| {
                req.headers()
                    .get(name)
                    .map(|v| parse_millis(v.as_bytes()).map_err(|e| (name.as_str(), e)))
            })
        };
        match parsed {
            Some(Ok(budget)) => budget.min(self.max),
            Some(Err((header, e))) => {
                tracing::warn!(header, error = %e, "malformed deadline header ignored; the server default applies");
                self.default.min(self.max)
            }
            None => self.default.min(self.max),
        }
    }
}

impl<S, B, RB> Service<Request<B>> for InboundDeadline<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
{
    type Response = Response<MaybeBuffered<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, Request<B>, RB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let start = Instant::now();
        let budget = self.config.budget(&req);
        let deadline = Deadline::of(req.extensions())
            .map_or(Deadline::after(budget), |d| d.min(Deadline::after(budget)));
        let protocol = Protocol::of(req.headers());
        if deadline.is_expired() {
            tracing::warn!(
                ?budget,
                "the caller's budget was spent before the handler ran"
            );
            let a = Attribution {
                source: ErrorSource::Deadline,
                name: None,
                budget: Some(budget),
                elapsed: Duration::ZERO,
                snapshot: Default::default(),
            };
            return ResponseFuture::expired(a.response(protocol));
        }
        req.extensions_mut().insert(deadline);
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(
            inner,
            req,
            deadline,
            TimeLedger::new(),
            start,
            budget,
            protocol,
        )
    }
}
