//! The router: one fully built service per route, picked per request.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::Request;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::pick::Picker;

/// One service per route, and a fallback for the requests no route
/// matches: the request's route is picked per call, and the call goes
/// through a clone of that route's service (as axum's `Router` and tower's
/// `Steer` do). Built by [`Routes::service`](super::Routes::service) and
/// [`ServiceConfig::service`](crate::service_config::ServiceConfig::service);
/// its error is the routes' (a [`tower_resend::Error`](crate::Error) for
/// stacks).
///
/// Readiness is checked per call, on the route's own clone:
/// [`poll_ready`](Service::poll_ready) is always ready, and the call's
/// future makes the clone ready before it sends, so a route whose
/// transport is busy never holds up another.
pub struct PerRoute<S> {
    picker: Arc<Picker>,
    /// One per route, then the fallback.
    services: Arc<[S]>,
}

impl<S> Clone for PerRoute<S> {
    fn clone(&self) -> Self {
        Self {
            picker: Arc::clone(&self.picker),
            services: Arc::clone(&self.services),
        }
    }
}

impl<S> std::fmt::Debug for PerRoute<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerRoute")
            .field("picker", &self.picker)
            .field("routes", &(self.services.len() - 1))
            .finish()
    }
}

impl<S> PerRoute<S> {
    /// The routes' stacks with their type erased, for a struct field: a
    /// [`BoxStack`](crate::stack::BoxStack) (see [`boxed`](crate::stack::boxed)).
    pub fn boxed<ReqB, ResB>(self) -> crate::stack::BoxStack<ReqB>
    where
        Self: Service<Request<ReqB>, Response = http::Response<ResB>, Error = crate::error::Error>
            + Send
            + Sync
            + 'static,
        <Self as Service<Request<ReqB>>>::Future: Send + 'static,
        ResB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        ResB::Error: Into<crate::error::BoxError>,
    {
        crate::stack::boxed(self)
    }

    /// A router over `routes` (in the order the picker numbers them) and
    /// `fallback`.
    pub(crate) fn new(picker: Picker, routes: Vec<S>, fallback: S) -> Self {
        let mut services = routes;
        services.push(fallback);
        Self {
            picker: Arc::new(picker),
            services: services.into(),
        }
    }

    /// The service of the request's route, or the fallback's.
    fn service_for<B>(&self, req: &Request<B>) -> &S {
        let last = self.services.len() - 1;
        let i = self.picker.pick(req).unwrap_or(last);
        &self.services[i.min(last)]
    }
}

impl<S, B> Service<Request<B>> for PerRoute<S>
where
    S: Service<Request<B>> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S, Request<B>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let svc = self.service_for(&req).clone();
        ResponseFuture {
            state: State::NotReady {
                svc,
                req: Some(req),
            },
        }
    }
}

pin_project! {
    /// Response future of [`PerRoute`]: makes the route's clone ready, then
    /// its call.
    pub struct ResponseFuture<S, Req>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S, Req>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, Req>
    where
        S: Service<Req>,
    {
        NotReady { svc: S, req: Option<Req> },
        Called { #[pin] fut: S::Future },
    }
}

impl<S, Req> std::fmt::Debug for ResponseFuture<S, Req>
where
    S: Service<Req>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, Req> Future for ResponseFuture<S, Req>
where
    S: Service<Req>,
{
    type Output = Result<S::Response, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::NotReady { svc, req } => {
                    ready!(svc.poll_ready(cx))?;
                    let Some(req) = req.take() else {
                        // (Polled again after it ended: cannot happen
                        // through `Called`.)
                        return Poll::Pending;
                    };
                    let fut = svc.call(req);
                    this.state.set(State::Called { fut });
                }
                StateProj::Called { fut } => return fut.poll(cx),
            }
        }
    }
}
