//! The pacing layer's instruments (feature `otel`), made once from the
//! meter given to [`PaceLayer::meter`](super::PaceLayer::meter).

use std::fmt;
use std::time::Duration;

use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter};
use opentelemetry::KeyValue;

/// Buckets of waits, in seconds: up to the default reset cap.
const WAIT_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 600.0,
];

/// What a pacing layer records.
#[derive(Clone)]
pub(crate) struct PaceMetrics {
    wait: Histogram<f64>,
    refused: Counter<u64>,
    remaining: Gauge<u64>,
    set_aside: Counter<u64>,
    #[cfg_attr(not(feature = "quota-redis"), allow(dead_code))]
    fallbacks: Counter<u64>,
}

impl fmt::Debug for PaceMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PaceMetrics")
    }
}

impl PaceMetrics {
    pub(crate) fn new(meter: &Meter) -> Self {
        Self {
            wait: meter
                .f64_histogram("resend.client.quota.wait")
                .with_unit("s")
                .with_description("Waits of calls for their place in the upstream's stated quota.")
                .with_boundaries(WAIT_BUCKETS.to_vec())
                .build(),
            refused: meter
                .u64_counter("resend.client.quota.refused")
                .with_unit("{call}")
                .with_description(
                    "Calls refused, not sent: the upstream's stated quota had no room before their deadline.",
                )
                .build(),
            remaining: meter
                .u64_gauge("resend.client.quota.remaining")
                .with_unit("{call}")
                .with_description("What is left of each quota the upstream states, less the calls out.")
                .build(),
            set_aside: meter
                .u64_counter("resend.client.quota.set_aside")
                .with_unit("{value}")
                .with_description(
                    "Values of the upstream's quota fields not taken as they were: malformed, \
                     negative, past the cap, of the window before, or of a quota not followed.",
                )
                .build(),
            fallbacks: meter
                .u64_counter("resend.client.quota.fallbacks")
                .with_unit("{call}")
                .with_description(
                    "Calls placed by this process's own view of the quotas: their shared store failed.",
                )
                .build(),
        }
    }

    pub(crate) fn waited(&self, wait: Duration, reason: &'static str) {
        self.wait.record(
            wait.as_secs_f64(),
            &[KeyValue::new("resend.quota.reason", reason)],
        );
    }

    pub(crate) fn refused(&self) {
        self.refused.add(1, &[]);
    }

    /// `n` values set aside, for `why` (`malformed`, `negative`,
    /// `past_cap`, `stale`, `not_followed`).
    pub(crate) fn set_aside(&self, why: &'static str, n: u64) {
        if n > 0 {
            self.set_aside
                .add(n, &[KeyValue::new("resend.quota.set_aside", why)]);
        }
    }

    /// A call placed by this process's own view: the shared store failed.
    #[cfg(feature = "quota-redis")]
    pub(crate) fn fell_back(&self) {
        self.fallbacks.add(1, &[]);
    }

    /// What is left of the quota `policy` (at most 16 are followed: the
    /// attribute is bounded).
    pub(crate) fn remaining(&self, policy: &str, left: u64) {
        self.remaining.record(
            left,
            &[KeyValue::new("resend.quota.policy", policy.to_owned())],
        );
    }
}
