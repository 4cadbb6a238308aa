//! The HTTP route table: method and path prefix, each with its policy.

use std::time::Duration;

use http::Method;

use super::per_route::PerRoute;
use super::pick::{HttpTable, Picker};
use crate::breaker::BreakerSlot;
use crate::deadline::DeadlineHeader;
use crate::fleet::FleetSlot;
use crate::hedge::Hedging;
use crate::quota::PaceSlot;
use crate::read_ahead::ReadAhead;
use crate::retry::Backoff;
use crate::stack::{Stack, StackBuilder};
use crate::timeout::AttemptTimeout;

/// What a route changes of the stack it is built from: each setting left
/// unset keeps the base [`StackBuilder`]'s.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::routes::RoutePolicy;
///
/// // Reports may take a minute and be tried twice; searches are hedged.
/// let reports = RoutePolicy::new().total(Duration::from_secs(60)).max_attempts(2);
/// let search = RoutePolicy::new().hedge(Duration::from_millis(50), 2);
/// # let _ = (reports, search);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoutePolicy {
    pub(crate) total: Option<Duration>,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) max_attempts: Option<u32>,
    pub(crate) backoff: Option<Backoff>,
    /// (delay, copies in all).
    pub(crate) hedge: Option<(Duration, u32)>,
}

impl RoutePolicy {
    /// Changes nothing: the base stack's settings.
    pub const fn new() -> Self {
        Self {
            total: None,
            attempt_timeout: None,
            max_attempts: None,
            backoff: None,
            hedge: None,
        }
    }

    /// The deadline budget of a call ([`StackBuilder::total`]).
    #[must_use]
    pub const fn total(mut self, total: Duration) -> Self {
        self.total = Some(total);
        self
    }

    /// The limit of one attempt ([`StackBuilder::attempt_timeout`]).
    #[must_use]
    pub const fn attempt_timeout(mut self, per_attempt: Duration) -> Self {
        self.attempt_timeout = Some(per_attempt);
        self
    }

    /// Attempts in all, the first included ([`StackBuilder::max_attempts`]);
    /// 1 turns retries off.
    #[must_use]
    pub const fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// The backoff between attempts ([`StackBuilder::backoff`]).
    #[must_use]
    pub const fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// Hedges replay-safe calls: a backup `after` the last copy, at most
    /// `copies` in all ([`StackBuilder::hedge`],
    /// [`StackBuilder::hedge_copies`]).
    #[must_use]
    pub const fn hedge(mut self, after: Duration, copies: u32) -> Self {
        self.hedge = Some((after, copies));
        self
    }

    /// `base` with this policy's settings.
    pub(crate) fn apply<C, B, F, P>(
        &self,
        mut base: StackBuilder<C, B, F, Hedging, P>,
    ) -> StackBuilder<C, B, F, Hedging, P> {
        if let Some(total) = self.total {
            base = base.total(total);
        }
        if let Some(limit) = self.attempt_timeout {
            base = base.attempt_timeout(limit);
        }
        if let Some(n) = self.max_attempts {
            base = base.max_attempts(n);
        }
        if let Some(backoff) = self.backoff {
            base = base.backoff(backoff);
        }
        if let Some((after, copies)) = self.hedge {
            base = base.hedge(after).hedge_copies(copies);
        }
        base
    }
}

/// A route: the requests it takes, and its policy.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Route {
    /// `None`: every method.
    pub(crate) method: Option<Method>,
    pub(crate) prefix: Box<str>,
    pub(crate) policy: RoutePolicy,
}

/// A table of routes by method and path prefix, each with its own
/// [`RoutePolicy`] over one base stack: [`service`](Self::service) builds
/// one stack per route, all over clones of one transport and sharing what
/// the base shares (its retry budget, its breaker, its throttle), and a
/// [`PerRoute`] that sends each request through its route's stack (the
/// base's for requests no route takes).
///
/// The longest matching prefix wins (whole segments: `/orders` takes
/// `/orders/7`, not `/ordersX`); on equal prefixes a route for the
/// request's method wins over one for every method, then the first added.
///
/// ```
/// use std::time::Duration;
/// use http::Method;
/// use tower_resend::routes::{RoutePolicy, Routes};
/// use tower::{service_fn, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let upstream = service_fn(|_req: http::Request<String>| async {
///     Ok::<_, tower_resend::BoxError>(http::Response::builder().status(503).body(String::new()).unwrap())
/// });
/// let routes = Routes::new()
///     .route(Method::GET, "/reports", RoutePolicy::new().max_attempts(5))
///     .route(Method::GET, "/live", RoutePolicy::new().max_attempts(1));
/// let api = routes.service(tower_resend::stack().name("api").no_budget(), upstream);
///
/// let attempts = |resp: http::Response<_>| resp.extensions().get::<tower_resend::retry::Attempts>().unwrap().len();
/// let get = |path: &str| http::Request::get(path).body(String::new()).unwrap();
/// assert_eq!(attempts(api.clone().oneshot(get("/reports/7")).await.unwrap()), 5);
/// assert_eq!(attempts(api.clone().oneshot(get("/live")).await.unwrap()), 1);
/// assert_eq!(attempts(api.clone().oneshot(get("/other")).await.unwrap()), 3); // the base's
/// # }
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routes {
    pub(crate) routes: Vec<Route>,
}

impl Routes {
    /// No routes: every request takes the base stack.
    pub const fn new() -> Self {
        Self { routes: Vec::new() }
    }

    /// Requests of `method` whose path starts with `prefix` (whole
    /// segments; a `/` is put in front if it has none) take `policy`.
    #[must_use]
    pub fn route(self, method: Method, prefix: &str, policy: RoutePolicy) -> Self {
        self.push(Some(method), prefix, policy)
    }

    /// Requests of any method whose path starts with `prefix` take
    /// `policy`; see [`route`](Self::route).
    #[must_use]
    pub fn any_method(self, prefix: &str, policy: RoutePolicy) -> Self {
        self.push(None, prefix, policy)
    }

    fn push(mut self, method: Option<Method>, prefix: &str, policy: RoutePolicy) -> Self {
        let prefix = if prefix.starts_with('/') {
            prefix.into()
        } else {
            format!("/{prefix}").into()
        };
        self.routes.push(Route {
            method,
            prefix,
            policy,
        });
        self
    }

    /// The number of routes.
    pub fn len(&self) -> usize {
        self.routes.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// A [`PerRoute`] over `transport`: one stack per route, `base` with the
    /// route's policy, and `base` itself for the requests no route takes.
    ///
    /// Its stacks all have a hedge layer (a route may hedge); it hedges
    /// only where the route's policy, or the base, says so.
    pub fn service<S, C, B, F, H, P>(
        &self,
        base: StackBuilder<C, B, F, H, P>,
        transport: S,
    ) -> PerRoute<Stack<S, C, B, F, Hedging, P>>
    where
        S: Clone,
        C: Clone,
        B: BreakerSlot + Clone,
        F: FleetSlot + Clone,
        P: PaceSlot + Clone,
        F::Service<AttemptTimeout<ReadAhead<S>>, C>: Clone,
        P::Service<DeadlineHeader<F::Service<AttemptTimeout<ReadAhead<S>>, C>>>: Clone,
    {
        let base = base.hedgeable();
        let stacks = self
            .routes
            .iter()
            .map(|r| r.policy.apply(base.clone()).service(transport.clone()))
            .collect();
        let table = HttpTable::of(
            self.routes
                .iter()
                .map(|r| (r.method.clone(), r.prefix.clone())),
        );
        PerRoute::new(Picker::Http(table), stacks, base.service(transport))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_prefix_then_the_method_then_the_first_wins() {
        let p = RoutePolicy::new();
        let routes = Routes::new()
            .any_method("/orders", p)
            .route(Method::POST, "/orders", p)
            .route(Method::GET, "orders/archive", p)
            .any_method("/orders", p);
        let table = HttpTable::of(
            routes
                .routes
                .iter()
                .map(|r| (r.method.clone(), r.prefix.clone())),
        );
        assert_eq!(table.pick(&Method::GET, "/orders"), Some(0));
        assert_eq!(table.pick(&Method::POST, "/orders/7"), Some(1));
        assert_eq!(table.pick(&Method::GET, "/orders/archive/2"), Some(2));
        assert_eq!(table.pick(&Method::POST, "/orders/archive/2"), Some(1));
        assert_eq!(table.pick(&Method::GET, "/ordersX"), None);
        assert_eq!(table.pick(&Method::GET, "/"), None);
        let slash = Routes::new().any_method("/api/", p);
        let table = HttpTable::of(
            slash
                .routes
                .iter()
                .map(|r| (r.method.clone(), r.prefix.clone())),
        );
        assert_eq!(table.pick(&Method::GET, "/api/x"), Some(0));
        assert_eq!(table.pick(&Method::GET, "/api"), None);
    }
}
