//! [`Pace`]: takes each call's place in the quota before it goes.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tokio::time::Instant;
use tower_service::Service;

use super::future::ResponseFuture;
use super::pace::Admit;
use super::shared::{Shared, Ticket};
use super::PaceLayer;
use crate::deadline::Deadline;
use crate::error::{BoxError, Error};

/// Paces the calls to `S` by the quota its answers state; made by a
/// [`PaceLayer`].
#[derive(Clone, Debug)]
pub struct Pace<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Pace<S> {
    /// Paces the calls to `inner` with `layer`'s settings and state.
    pub fn new(inner: S, layer: PaceLayer) -> Self {
        Self {
            inner,
            shared: layer.shared,
        }
    }

    /// A layer that makes this service ([`PaceLayer::new`]).
    pub fn layer() -> PaceLayer {
        PaceLayer::new()
    }

    /// The service it paces.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The service it paces.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The service it paces.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for Pace<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // (Looked up only for a call that waits, or asks Redis.)
        let deadline_of =
            |req: &Request<ReqB>| Deadline::of(req.extensions()).map(Deadline::instant);
        let now = Instant::now();
        #[cfg(feature = "quota-redis")]
        if self.shared.asks_redis(now) {
            // Redis says where its place is: the slow path, as a wait.
            let clone = self.inner.clone();
            let service = std::mem::replace(&mut self.inner, clone);
            let deadline = deadline_of(&req);
            return ResponseFuture::asking(service, req, Arc::clone(&self.shared), deadline);
        }
        let t = self.shared.ns(now);
        match self.shared.admit_at(now, t, || deadline_of(&req)) {
            Admit::Go => {
                let ticket = Ticket::at(Arc::clone(&self.shared), t);
                ResponseFuture::sent(self.inner.call(req), ticket)
            }
            Admit::Wait { until, reserved } => {
                // The readied service goes with the call; this one takes
                // its clone's place (tower's `limit/concurrency`).
                let clone = self.inner.clone();
                let service = std::mem::replace(&mut self.inner, clone);
                let ticket = reserved.then(|| Ticket::new(Arc::clone(&self.shared), until));
                let deadline = deadline_of(&req);
                ResponseFuture::waiting(
                    until,
                    service,
                    req,
                    Arc::clone(&self.shared),
                    deadline,
                    ticket,
                )
            }
            Admit::Refuse(wait) => ResponseFuture::refused(Error::quota_spent(wait).into()),
        }
    }
}
