//! The circuit breaker's place in the composed stack: empty unless asked
//! for, so that a stack without a breaker pays nothing for it.
// The slots are sealed: their methods pass the crate's own types (the
// fleet's roster), and no one outside the crate can name or call them.
#![allow(private_interfaces)]

use std::sync::Arc;

use super::{CircuitBreaker, CircuitBreakerLayer};
use crate::fleet::Roster;
use crate::name::Name;
use crate::retry::{Retry, RetryLayer};

/// What the circuit breaker's place in a [`Stack`](crate::stack::Stack) holds:
/// [`NoBreaker`] (the default) or a [`CircuitBreakerLayer`], put there by
/// [`StackBuilder::circuit_breaker`](crate::stack::StackBuilder::circuit_breaker).
///
/// Sealed: nothing else can be put there.
pub trait BreakerSlot: sealed::WrapsBreaker {}

/// No circuit breaker: the default of a [`stack`](crate::stack()), which
/// then has no layer in its place at all.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoBreaker;

pub(crate) mod sealed {
    use crate::retry::{Retry, RetryLayer};

    /// How the place wraps the services under it.
    pub trait WrapsBreaker {
        /// What it makes of the service `S` under it.
        type Service<S>;

        /// Wraps `inner`, naming the breaker `name` unless it has a name,
        /// and puts `retry` around it; over a `fleet`, the breaker's
        /// circuits are the fleet's instances' own.
        fn wrap<S: Clone, C>(
            self,
            inner: S,
            name: Option<&crate::name::Name>,
            retry: RetryLayer<C>,
            fleet: Option<&crate::fleet::Roster>,
        ) -> Retry<Self::Service<S>, C>;
    }
}

impl sealed::WrapsBreaker for NoBreaker {
    type Service<S> = S;

    fn wrap<S: Clone, C>(
        self,
        inner: S,
        _name: Option<&Name>,
        retry: RetryLayer<C>,
        _fleet: Option<&Roster>,
    ) -> Retry<S, C> {
        retry.into_service(inner)
    }
}

impl BreakerSlot for NoBreaker {}

impl<K> sealed::WrapsBreaker for CircuitBreakerLayer<K> {
    type Service<S> = CircuitBreaker<S, K>;

    fn wrap<S: Clone, C>(
        self,
        inner: S,
        name: Option<&Name>,
        retry: RetryLayer<C>,
        fleet: Option<&Roster>,
    ) -> Retry<CircuitBreaker<S, K>, C> {
        let breaker = match name {
            Some(name) if self.is_unnamed() => self.upstream(name.clone()),
            _ => self,
        };
        let Some(fleet) = fleet else {
            return retry.into_service(breaker.into_service(inner));
        };
        let (breaker, circuits) = breaker.into_instances(inner);
        fleet.set_circuits(Arc::new(circuits));
        retry.into_service(breaker)
    }
}

impl<K> BreakerSlot for CircuitBreakerLayer<K> {}
