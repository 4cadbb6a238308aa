//! Without the `otel` feature: the metrics' places, empty, so that the
//! layers read the same either way and a call pays nothing for them.

use std::time::Duration;

use super::{Outcome, WaitReason};
use crate::classify::RequestFacts;
use crate::name::Name;
use crate::vocab::{Attempts, Stop};

/// No instruments. (Not `Copy`, as the one with instruments is not.)
#[derive(Clone, Debug, Default)]
pub(crate) struct ClientMetrics;

impl ClientMetrics {
    pub(crate) const OFF: Self = Self;

    pub(crate) fn is_on(&self) -> bool {
        false
    }

    pub(crate) fn bind(&self, _name: Option<&Name>) -> CallMetrics {
        CallMetrics
    }

    pub(crate) fn breaker(&self, _name: Option<&Name>) -> BreakerMetrics {
        BreakerMetrics
    }
}

/// No instruments.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CallMetrics;

impl CallMetrics {
    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        false
    }

    #[inline]
    pub(crate) fn waited(&self, _reason: WaitReason, _wait: Duration) {}

    #[inline]
    pub(crate) fn hedged(&self, _sent: u32, _won: u32) {}

    #[inline]
    pub(crate) fn attempt_ended<R>(
        &self,
        _facts: &RequestFacts<'_>,
        _server: Option<&http::uri::Authority>,
        _result: &Result<http::Response<R>, crate::error::BoxError>,
        _c: &crate::classify::Classification,
        _took: Duration,
    ) {
    }

    #[inline]
    pub(crate) fn call_ended(
        &self,
        _facts: &RequestFacts<'_>,
        _outcome: Outcome,
        _stop: Option<Stop>,
        _history: &Attempts,
    ) {
    }
}

/// No instruments.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BreakerMetrics;

impl BreakerMetrics {
    #[inline]
    pub(crate) fn changed(&self, _state: &'static str) {}
}
