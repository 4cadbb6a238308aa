//! A service config as stacks: one per methodConfig, one for the rest,
//! and the router that picks by `/service/method`.

use std::time::Duration;

use super::classify::{CodeSet, MethodClassifier};
use super::count::CountAttempts;
use super::{MethodConfig, MethodPolicy, ServiceConfig};
use crate::breaker::BreakerSlot;
use crate::deadline::DeadlineHeader;
use crate::fleet::FleetSlot;
use crate::hedge::Hedging;
use crate::quota::PaceSlot;
use crate::read_ahead::ReadAhead;
use crate::retry::{Backoff, RetryBudget};
use crate::routes::{GrpcTable, PerRoute, Picker};
use crate::stack::{Stack, StackBuilder};
use crate::timeout::AttemptTimeout;

/// The stacks of a service config: see [`ServiceConfig::service`].
pub type ConfiguredStack<
    S,
    B = crate::breaker::NoBreaker,
    F = crate::fleet::NoFleet,
    P = crate::quota::NoPace,
> = Stack<CountAttempts<S>, MethodClassifier, B, F, Hedging, P>;

impl ServiceConfig {
    /// The channel's `retryThrottling` tokens, if the config has them.
    pub(crate) fn tokens(&self) -> Option<RetryBudget> {
        self.retry_throttling.map(|t| {
            // Thousandths, as gRPC counts them (a ratio's further decimals
            // are dropped, as gRPC drops them).
            let ratio = (t.token_ratio * 1000.0).floor() as u64;
            RetryBudget::grpc_throttling(u64::from(t.max_tokens) * 1000, ratio)
        })
    }

    /// A [`PerRoute`] over `transport` (a `tower_resend::tonic::TonicTransport`
    /// around a channel, or any transport of gRPC requests): a stack per
    /// methodConfig, `base` with the method's settings, and one more for
    /// the methods no methodConfig names, all sharing the channel's
    /// `retryThrottling` tokens. Each request goes through the stack of its
    /// method (its path, `/service/method`), matched as gRPC matches:
    /// the service and method, else the service, else the default.
    ///
    /// What a methodConfig sets, on `base`:
    ///
    /// | field | in the stack |
    /// |---|---|
    /// | `timeout` | [`total`](StackBuilder::total), the call's deadline (sooner if the caller's is), and the attempt timeout |
    /// | `retryPolicy.maxAttempts` (at most 5) | [`max_attempts`](StackBuilder::max_attempts) |
    /// | `initialBackoff`, `maxBackoff`, `backoffMultiplier` | [`backoff`](StackBuilder::backoff): the n-th retry waits a random time in `[0, min(initialBackoff * backoffMultiplier^(n-1), maxBackoff)]` (a multiplier below 1 counts as 1) |
    /// | `retryableStatusCodes` | what is retried ([`MethodClassifier`]); every other status is final |
    /// | `perAttemptRecvTimeout` | [`attempt_timeout`](StackBuilder::attempt_timeout); a cut attempt is retried |
    /// | `hedgingPolicy.maxAttempts` (at most 5) | [`hedge_copies`](StackBuilder::hedge_copies), every call hedged, no retries after |
    /// | `hedgingDelay` (default 0: all at once) | [`hedge`](StackBuilder::hedge) |
    /// | `nonFatalStatusCodes` | a copy ending with one sends the next at once and lets the others go on; any other status ends the call |
    /// | `retryThrottling` | one count for every method: each attempt ending with its method's codes takes a token, each success gives `tokenRatio` back; no retry or hedge while half the tokens or fewer are left (the call ends with its last answer) |
    ///
    /// A method without a policy (and every method without a methodConfig,
    /// unless the config has a default) is not retried nor hedged, but
    /// what was never sent (a refused connection) is sent again, as gRPC's
    /// transparent retries are. Server pushback (`grpc-retry-pushback-ms`)
    /// is honoured. The base's retry budget is not used: the config's
    /// `retryThrottling`, if any, is the channel's limit, as in gRPC.
    /// Everything else is the base's (its name, the connect and idle
    /// timeouts, the breaker, the fleet, the adaptive throttle).
    pub fn service<S, C, B, F, H, P>(
        &self,
        base: StackBuilder<C, B, F, H, P>,
        transport: S,
    ) -> PerRoute<ConfiguredStack<S, B, F, P>>
    where
        S: Clone,
        B: BreakerSlot + Clone,
        F: FleetSlot + Clone,
        P: PaceSlot + Clone,
        F::Service<AttemptTimeout<ReadAhead<CountAttempts<S>>>, MethodClassifier>: Clone,
        P::Service<
            DeadlineHeader<
                F::Service<AttemptTimeout<ReadAhead<CountAttempts<S>>>, MethodClassifier>,
            >,
        >: Clone,
        C: Clone,
    {
        // Every method's stack has a hedge layer (one type for the table),
        // which hedges only where a hedging policy says so.
        let base = base.hedgeable();
        let tokens = self.tokens();
        let mut table = GrpcTable::default();
        let mut stacks = Vec::with_capacity(self.methods.len());
        for (i, m) in self.methods.iter().enumerate() {
            for name in &m.names {
                match (&name.service, &name.method) {
                    (Some(s), Some(method)) => {
                        table.methods.insert(format!("{s}/{method}").into(), i);
                    }
                    (Some(s), None) => {
                        table.services.insert(s.as_str().into(), i);
                    }
                    (None, _) => table.default = Some(i),
                }
            }
            let (builder, codes) = configure(base.clone(), Some(m), tokens.clone());
            let count = tokens.clone().map(|t| (t, codes));
            stacks.push(builder.service(CountAttempts::new(transport.clone(), count)));
        }
        let (builder, codes) = configure(base, None, tokens.clone());
        let fallback = builder.service(CountAttempts::new(transport, tokens.map(|t| (t, codes))));
        PerRoute::new(Picker::Grpc(table), stacks, fallback)
    }
}

/// `base` with what `method` sets, and the codes whose attempts count as
/// failures.
fn configure<C, B, F, P>(
    base: StackBuilder<C, B, F, Hedging, P>,
    method: Option<&MethodConfig>,
    tokens: Option<RetryBudget>,
) -> (StackBuilder<MethodClassifier, B, F, Hedging, P>, CodeSet) {
    let policy = method.and_then(|m| m.policy.as_ref());
    let (codes, retry_timeouts) = match policy {
        Some(MethodPolicy::Retry(r)) => (CodeSet::of(&r.retryable_status_codes), true),
        Some(MethodPolicy::Hedging(h)) => (CodeSet::of(&h.non_fatal_status_codes), false),
        None => (CodeSet::default(), false),
    };
    let classifier = MethodClassifier::new(codes, policy.is_some(), retry_timeouts);
    let mut b = base.retry(|r| r.classifier(classifier));
    b = match tokens {
        // No wait for a token: gRPC ends the call with its last answer.
        Some(t) => b.budget(t).retry(|r| r.max_budget_wait(Duration::ZERO)),
        None => b.no_budget(),
    };
    if let Some(timeout) = method.and_then(|m| m.timeout) {
        b = b.total(timeout).attempt_timeout(timeout);
    }
    match policy {
        Some(MethodPolicy::Retry(r)) => {
            let cap = r.max_backoff;
            let backoff = Backoff::new(
                r.initial_backoff.min(cap),
                r.backoff_multiplier.max(1.0),
                cap,
            );
            b = b.max_attempts(r.max_attempts);
            if let Ok(backoff) = backoff {
                b = b.backoff(backoff);
            }
            if let Some(limit) = r.per_attempt_recv_timeout {
                b = b.attempt_timeout(limit);
            }
        }
        Some(MethodPolicy::Hedging(h)) => {
            b = b
                .max_attempts(1)
                .hedge(h.hedging_delay)
                .hedge_copies(h.max_attempts)
                .hedge_every_call();
        }
        None => {}
    }
    (b, codes)
}
