//! gRPC's `retryThrottling` as a kind of [`RetryBudget`]: a count of tokens
//! that attempts' failures take and successes give back, read on the slow
//! path only (see the service config).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::RetryBudget;

/// gRPC's retry throttling (gRFC A6): a count of tokens, in thousandths,
/// that starts full; an attempt that fails with a code its method's policy
/// retries (or does not find fatal) takes one, a success gives back
/// `ratio`; retries and hedges go out only while more than half is left.
pub(crate) struct TokenBucket {
    /// Thousandths of a token.
    tokens: AtomicU64,
    max: u64,
    ratio: u64,
}

impl TokenBucket {
    /// Half the tokens or fewer left: no retry, no hedge.
    pub(super) fn open(&self) -> bool {
        self.tokens.load(Ordering::Relaxed) * 2 > self.max
    }

    #[cfg_attr(not(feature = "service-config"), allow(dead_code))]
    fn update(&self, f: impl Fn(u64) -> u64) {
        let _ = self
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some(f(t)));
    }
}

impl std::fmt::Debug for TokenBucket {
    /// As the budget of this kind says itself.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryBudget")
            .field("grpc_max_tokens", &self.max)
            .field("grpc_token_ratio", &self.ratio)
            .field("grpc_tokens", &self.tokens.load(Ordering::Relaxed))
            .finish()
    }
}

impl RetryBudget {
    /// gRPC's `retryThrottling`: `max_tokens` (thousandths of a token, as
    /// gRPC counts them) to start with, `ratio` thousandths given back by
    /// each success. Nothing but [`failed_attempt`](Self::failed_attempt)
    /// and [`succeeded`](Self::succeeded) moves the count (the service
    /// config's transport wrapper calls them for every attempt); a
    /// withdrawal takes nothing, and finds a token while more than half of
    /// `max_tokens` is left.
    #[cfg_attr(not(feature = "service-config"), allow(dead_code))]
    pub(crate) fn grpc_throttling(max_tokens: u64, ratio: u64) -> Self {
        let mut budget = Self::build(0.0, 0.0, Duration::from_secs(10), super::DEFAULT_BURST);
        if let Some(inner) = Arc::get_mut(&mut budget.inner) {
            inner.bucket = Some(TokenBucket {
                tokens: AtomicU64::new(max_tokens),
                max: max_tokens,
                ratio,
            });
        }
        budget
    }

    /// gRPC throttling: an attempt failed with a code its policy retries.
    /// (Nothing for a budget of the other kind.)
    #[cfg_attr(not(feature = "service-config"), allow(dead_code))]
    pub(crate) fn failed_attempt(&self) {
        if let Some(b) = &self.inner.bucket {
            b.update(|t| t.saturating_sub(1000));
        }
    }

    /// gRPC throttling: a call succeeded. (Nothing for a budget of the
    /// other kind.)
    #[cfg_attr(not(feature = "service-config"), allow(dead_code))]
    pub(crate) fn succeeded(&self) {
        if let Some(b) = &self.inner.bucket {
            b.update(|t| t.saturating_add(b.ratio).min(b.max));
        }
    }

    /// gRPC throttling: the tokens left, in thousandths; `None` for a
    /// budget of the other kind.
    #[cfg(test)]
    pub(crate) fn tokens(&self) -> Option<u64> {
        self.inner
            .bucket
            .as_ref()
            .map(|b| b.tokens.load(Ordering::Relaxed))
    }
}
