use std::task::{Context, Poll};

use http::Request;
use tower_service::Service;

use super::ResponseFuture;
use crate::body::Replay;
use crate::breaker::{BreakerSlot, NoBreaker, WrapsBreaker};
use crate::classify::HttpClassifier;
use crate::deadline::{CallDeadline, DeadlineHeader};
use crate::error::{BoxError, Error};
use crate::fleet::{self, FleetSlot, NoFleet};
use crate::hedge::{self, HedgeSlot, NoHedge};
use crate::idempotency::SetIdempotencyKey;
use crate::quota::{self, NoPace, PaceSlot};
use crate::read_ahead::ReadAhead;
use crate::retry::Retry;
use crate::timeout::AttemptTimeout;

pub(super) type Inner<S, C, B, F, H, P> = CallDeadline<
    SetIdempotencyKey<
        Retry<
            <B as WrapsBreaker>::Service<
                <H as hedge::WrapsHedge>::Service<
                    <P as quota::WrapsPace>::Service<
                        DeadlineHeader<
                            <F as fleet::WrapsFleet>::Service<AttemptTimeout<ReadAhead<S>>, C>,
                        >,
                    >,
                    C,
                >,
            >,
            C,
        >,
    >,
>;

/// The composed stack, outside in: [`CallDeadlineLayer`](crate::deadline::CallDeadlineLayer),
/// [`SetIdempotencyKeyLayer`](crate::idempotency::SetIdempotencyKeyLayer), [`RetryLayer`](crate::retry::RetryLayer), the [`CircuitBreakerLayer`](crate::breaker::CircuitBreakerLayer) if
/// one was added (`B`; none by default, and then no layer at all), the
/// [`HedgeLayer`](crate::hedge::HedgeLayer) if hedging is on (`H`; off by default, and then no
/// layer at all), the pacing layer if one was given (`P`; none by default, and then no layer
/// at all; feature `quota`), [`DeadlineHeaderLayer`](crate::deadline::DeadlineHeaderLayer), the [`FleetLayer`](crate::fleet::FleetLayer) if one was given (`F`; none by
/// default, and then no layer at all), [`AttemptTimeoutLayer`](crate::timeout::AttemptTimeoutLayer), the
/// [`ReadAheadLayer`](crate::read_ahead::ReadAheadLayer), then the transport. Its error is always a
/// [`tower_resend::Error`](Error).
pub struct Stack<S, C = HttpClassifier, B = NoBreaker, F = NoFleet, H = NoHedge, P = NoPace>
where
    B: BreakerSlot,
    F: FleetSlot,
    H: HedgeSlot,
    P: PaceSlot,
{
    inner: Inner<S, C, B, F, H, P>,
    /// The retry layer's replay cap: how much of a stream body is kept.
    replay_cap: usize,
}

impl<S, C, B, F, H, P> Clone for Stack<S, C, B, F, H, P>
where
    B: BreakerSlot,
    F: FleetSlot,
    H: HedgeSlot,
    P: PaceSlot,
    Inner<S, C, B, F, H, P>: Clone,
{
    #[inline]
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            replay_cap: self.replay_cap,
        }
    }
}

impl<S, C, B, F, H, P> std::fmt::Debug for Stack<S, C, B, F, H, P>
where
    B: BreakerSlot,
    F: FleetSlot,
    H: HedgeSlot,
    P: PaceSlot,
    Inner<S, C, B, F, H, P>: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack").field("inner", &self.inner).finish()
    }
}

impl<S, C, B, F, H, P, ReqB> Service<Request<ReqB>> for Stack<S, C, B, F, H, P>
where
    B: BreakerSlot,
    F: FleetSlot,
    H: HedgeSlot,
    P: PaceSlot,
    ReqB: Replay,
    Inner<S, C, B, F, H, P>: Service<Request<ReqB::Sent>, Error = BoxError>,
{
    // (`Response<DeadlineBody<_>>`, named through the inner service: a type
    // parameter here that only the inner service's response fixes would
    // make every layer above a stack prove the whole stack again.)
    type Response = <Inner<S, C, B, F, H, P> as Service<Request<ReqB::Sent>>>::Response;
    type Error = Error;
    type Future = ResponseFuture<<Inner<S, C, B, F, H, P> as Service<Request<ReqB::Sent>>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner.poll_ready(cx).map_err(Error::from_box)
    }

    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        // The key, chosen here rather than by the key layer inside (which
        // then finds it and does nothing), so that an error of the call —
        // the deadline's too, which fires outside the key layer — can say
        // which key a retry must carry.
        let key = self.inner.get_ref().write_key(&mut req).map(Box::new);
        // The body as the layers below send it: in memory as it is, a
        // stream kept (up to the cap) for replays.
        let cap = self.replay_cap;
        let req = req.map(|body| {
            if body.size_hint().lower() > cap as u64 {
                body.send_once()
            } else {
                body.keep(cap)
            }
        });
        ResponseFuture::new(self.inner.call(req), key)
    }
}

impl<S, C, B: BreakerSlot, F: FleetSlot, H: HedgeSlot, P: PaceSlot> Stack<S, C, B, F, H, P> {
    pub(super) fn new(inner: Inner<S, C, B, F, H, P>, replay_cap: usize) -> Self {
        Self { inner, replay_cap }
    }

    /// The stack with its type erased, for a struct field: a
    /// [`BoxStack`](super::BoxStack) of requests of body `ReqB`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resend::stack::BoxStack;
    ///
    /// let inventory: BoxStack<String> = tower_resend::stack()
    ///     .name("inventory")
    ///     .service(tower_resend::hyper_client(Duration::from_secs(1)))
    ///     .boxed();
    /// # let _ = inventory;
    /// ```
    pub fn boxed<ReqB, ResB>(self) -> super::BoxStack<ReqB>
    where
        Self: Service<Request<ReqB>, Response = http::Response<ResB>, Error = Error>
            + Clone
            + Send
            + Sync
            + 'static,
        <Self as Service<Request<ReqB>>>::Future: Send + 'static,
        ResB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        super::boxed(self)
    }
}
