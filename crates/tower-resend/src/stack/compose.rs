//! How a builder's settings become a [`Stack`]: the layers in their order,
//! outside in, each given what it shares with the others (the retry
//! layer's classifier, budget and header, the fleet's roster), and the
//! builder as a tower [`Layer`].

use std::time::Duration;

use tower_layer::Layer;

use super::builder::StackBuilder;
use super::Stack;
use crate::breaker::BreakerSlot;
use crate::deadline::{CallDeadlineLayer, DeadlineHeader};
use crate::fleet::FleetSlot;
use crate::hedge::{HedgeLayer, HedgeSlot};
use crate::quota::PaceSlot;
use crate::read_ahead::{ReadAhead, ReadAheadLayer};
use crate::timeout::{AttemptTimeout, AttemptTimeoutLayer};

impl<C, B, F, H, P> StackBuilder<C, B, F, H, P> {
    /// Wraps `transport` (a hyper-util client, a reqwest adapter, a tonic
    /// channel) in the stack.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let client = tower_resend::hyper_client(Duration::from_secs(2));
    /// let inventory: tower_resend::stack::Stack<tower_resend::connect::HyperClient> =
    ///     tower_resend::stack().name("inventory").service(client);
    /// # let _ = inventory;
    /// ```
    pub fn service<S: Clone>(self, transport: S) -> Stack<S, C, B, F, H, P>
    where
        B: BreakerSlot,
        F: FleetSlot,
        H: HedgeSlot,
        P: PaceSlot,
        H::Service<P::Service<DeadlineHeader<F::Service<AttemptTimeout<ReadAhead<S>>, C>>>, C>:
            Clone,
        C: Clone,
    {
        let s = self.settings;
        let replay_cap = self.retry.kept_bytes();
        let total = match &s.name {
            Some(n) => CallDeadlineLayer::new(s.total).upstream(n.clone()),
            None => CallDeadlineLayer::new(s.total),
        };
        // Small bodies read ahead under the attempt timeout (which then
        // covers them too) and the breaker (which counts their breaks).
        let mut read_ahead = ReadAheadLayer::new(s.read_ahead_cap);
        if let Some(idle) = s.idle {
            read_ahead = read_ahead.idle_timeout(idle);
        }
        let inner = read_ahead.layer(transport);
        let inner = AttemptTimeoutLayer::new(s.attempt_timeout).layer(inner);
        // Each attempt and each hedged copy picks its instance, if the
        // upstream is a fleet; the retry layer then carries each call's
        // record of the instances it used.
        let inner = self.fleet.wrap(inner, self.retry.classifier.clone());
        let mut retry = self.retry;
        retry.fleet = F::IS_FLEET;
        // Each attempt tells the callee when the caller stops waiting for
        // it: the call's time left or the attempt's limit, the sooner.
        let inner = s.header.attempt_timeout(s.attempt_timeout).layer(inner);
        // Every attempt and hedged copy takes its place in the upstream's
        // stated quota (if paced), before the time left is written.
        let inner = self.pacing.wrap(inner);
        // Hedged copies below the breaker, which sees them as one call. (A
        // hedge layer that is not on sends one copy.)
        let hedge = s
            .hedge
            .unwrap_or_else(|| HedgeLayer::new(Duration::ZERO).max_copies(1).classifier(()));
        let mut hedge = hedge
            .classifier(retry.classifier.clone())
            .metrics(retry.metrics().clone(), s.name.clone())
            .attempt_header(retry.attempt_header.clone());
        if let Some(budget) = retry.budget.clone() {
            hedge = hedge.budget(budget);
        }
        let inner = H::wrap(hedge, inner);
        // The breaker (if any) inside the retry layer, so it sees every attempt.
        let inner = self
            .breaker
            .wrap(inner, s.name.as_ref(), retry, self.fleet.roster());
        let inner = s.keys.layer(inner);
        // Every wait inside is bounded by the deadline (the attempt
        // timeout, the retry's backoff and readiness waits): the deadline
        // layer arms no timer of its own.
        Stack::new(total.layer(inner).woken_inside(), replay_cap)
    }
}

/// The builder is a [`Layer`]: the same stack, with the same options and
/// the same [`tower_resend::Error`](crate::Error), in any `ServiceBuilder`.
///
/// ```
/// use std::time::Duration;
/// use tower::{service_fn, ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let upstream = service_fn(|_: http::Request<String>| async {
///     Ok::<_, tower_resend::BoxError>(http::Response::builder().status(503).body(String::new()).unwrap())
/// });
/// let svc = ServiceBuilder::new()
///     .map_request(|req: http::Request<String>| req) // any layers of yours
///     .layer(tower_resend::stack().name("shipping").max_attempts(2).total(Duration::from_secs(5)))
///     .service(upstream);
/// let resp = svc.oneshot(http::Request::new(String::new())).await.unwrap();
/// assert_eq!(resp.extensions().get::<tower_resend::retry::Attempts>().unwrap().len(), 2);
/// # }
/// ```
impl<S, C, B, F, H, P> Layer<S> for StackBuilder<C, B, F, H, P>
where
    S: Clone,
    C: Clone,
    B: BreakerSlot + Clone,
    F: FleetSlot + Clone,
    H: HedgeSlot + Clone,
    P: PaceSlot + Clone,
    H::Service<P::Service<DeadlineHeader<F::Service<AttemptTimeout<ReadAhead<S>>, C>>>, C>: Clone,
{
    type Service = Stack<S, C, B, F, H, P>;

    fn layer(&self, transport: S) -> Stack<S, C, B, F, H, P> {
        self.clone().service(transport)
    }
}
