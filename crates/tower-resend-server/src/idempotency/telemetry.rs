//! What the idempotency layer tells a tracing backend (a span per keyed
//! request, with its outcome) and, with the `otel` feature, a metrics
//! pipeline (replays, conflicts, lease take-overs, store latency and
//! errors). The names are listed on `IdempotencyLayer::meter`; no key, no
//! scope and no path goes into a span or a metric.

use http::{Method, StatusCode};
use tracing::field::Empty;
use tracing::Span;

use crate::problems::{Answer, ProblemType};

/// What became of a keyed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Its key was claimed and the handler ran.
    Ran,
    /// The stored response of the key's first run was replayed.
    Replayed,
    /// 409: the same key is still running.
    InProgress,
    /// 422: the key was used with another request.
    Mismatch,
    /// 400: a malformed key, a required key missing, an anonymous key
    /// refused, or a body that could not be read.
    BadRequest,
    /// 413: the request's body was over the cap.
    TooLarge,
    /// 503: the store could not be reached; nothing ran.
    StoreUnavailable,
}

impl Outcome {
    /// What became of a request the layer answered with `answer`.
    pub(crate) const fn of(answer: &Answer) -> Self {
        match answer.kind() {
            ProblemType::IdempotencyKeyInProgress => Self::InProgress,
            ProblemType::IdempotencyKeyReused => Self::Mismatch,
            ProblemType::RequestTooLarge => Self::TooLarge,
            ProblemType::IdempotencyStoreUnavailable | ProblemType::IdempotencyStoreNotSetUp => {
                Self::StoreUnavailable
            }
            _ => Self::BadRequest,
        }
    }

    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Ran => "ran",
            Self::Replayed => "replayed",
            Self::InProgress => "in_progress",
            Self::Mismatch => "mismatch",
            Self::BadRequest => "bad_request",
            Self::TooLarge => "too_large",
            Self::StoreUnavailable => "store_unavailable",
        }
    }
}

/// A store call, as the store metrics name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Begin,
    Renew,
    Complete,
    Release,
}

impl Op {
    #[cfg_attr(not(feature = "otel"), allow(dead_code))]
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Begin => "begin",
            Self::Renew => "renew",
            Self::Complete => "complete",
            Self::Release => "release",
        }
    }
}

/// The span of a keyed request, at `INFO` (the handler's own spans are its
/// children): `resend.idempotency`, with the method, and the outcome and
/// status once known. Disabled (and free) without a subscriber that wants
/// it.
pub(crate) fn request_span(method: &Method) -> Span {
    // With no subscriber that takes INFO, not made at all: made disabled,
    // it would still be handed to the `log` crate (tracing's `log`
    // feature, which sqlx turns on), made and dropped at ~230
    // instructions a request. Its events still reach `log`.
    if tracing::level_filters::LevelFilter::current() < tracing::Level::INFO {
        return Span::none();
    }
    tracing::info_span!(
        target: "tower_resend_server",
        "resend.idempotency",
        http.request.method = method.as_str(),
        resend.idempotency.outcome = Empty,
        http.response.status_code = Empty,
        otel.status_code = Empty,
    )
}

/// Records what became of the keyed request of `span`, and counts it.
pub(crate) fn outcome(span: &Span, metrics: &ServerMetrics, outcome: Outcome) {
    metrics.outcome(outcome);
    if span.is_disabled() {
        return;
    }
    span.record("resend.idempotency.outcome", outcome.as_str());
    if outcome == Outcome::StoreUnavailable {
        span.record("otel.status_code", "ERROR");
    }
}

/// Records the status of the keyed request's answer on its span.
pub(crate) fn answered(span: &Span, status: StatusCode) {
    if !span.is_disabled() {
        span.record("http.response.status_code", i64::from(status.as_u16()));
    }
}

#[cfg(feature = "otel")]
pub(crate) use otel::ServerMetrics;

#[cfg(feature = "otel")]
mod otel {
    use std::fmt;
    use std::sync::Arc;
    use std::time::Duration;

    use opentelemetry::metrics::{Counter, Histogram, Meter};
    use opentelemetry::KeyValue;

    use super::{Op, Outcome};

    /// Buckets of store calls, in seconds: the conventions' for durations,
    /// from a memory store's microseconds to a remote store's timeout.
    const STORE_BUCKETS: [f64; 16] = [
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
        1.0, 2.5, 5.0,
    ];

    struct Instruments {
        replays: Counter<u64>,
        conflicts: Counter<u64>,
        lease_takeovers: Counter<u64>,
        stored_late: Counter<u64>,
        unstored: Counter<u64>,
        store_duration: Histogram<f64>,
        store_errors: Counter<u64>,
    }

    /// The layer's instruments, if it was given a meter.
    #[derive(Clone, Default)]
    pub(crate) struct ServerMetrics(Option<Arc<Instruments>>);

    impl fmt::Debug for ServerMetrics {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_tuple("ServerMetrics")
                .field(&if self.0.is_some() { "on" } else { "off" })
                .finish()
        }
    }

    impl ServerMetrics {
        /// The instruments, made from `meter`; `held` reads how many
        /// responses are held for the store right now (`None` once the
        /// layer is gone).
        pub(crate) fn new(
            meter: &Meter,
            held: impl Fn() -> Option<u64> + Send + Sync + 'static,
        ) -> Self {
            let counter = |name: &'static str, unit: &'static str, what: &'static str| {
                meter
                    .u64_counter(name)
                    .with_unit(unit)
                    .with_description(what)
                    .build()
            };
            // Observed at each collection, while the layer lives.
            meter
                .u64_observable_gauge("resend.server.idempotency.held")
                .with_unit("{response}")
                .with_description(
                    "Final responses held in memory because the store did not take them yet",
                )
                .with_callback(move |gauge| {
                    if let Some(n) = held() {
                        gauge.observe(n, &[]);
                    }
                })
                .build();
            Self(Some(Arc::new(Instruments {
                replays: counter(
                    "resend.server.idempotency.replays",
                    "{request}",
                    "Keyed requests answered with the stored response of the key's first run",
                ),
                conflicts: counter(
                    "resend.server.idempotency.conflicts",
                    "{request}",
                    "Keyed requests refused: the key still running (409) or used with another request (422)",
                ),
                lease_takeovers: counter(
                    "resend.server.idempotency.lease_takeovers",
                    "{lease}",
                    "Leases found taken over while their holder still worked: another run of the key may have happened",
                ),
                stored_late: counter(
                    "resend.server.idempotency.stored_late",
                    "{response}",
                    "Final responses the store did not take when the work ended, stored later",
                ),
                unstored: counter(
                    "resend.server.idempotency.unstored",
                    "{response}",
                    "Final responses given up: never stored",
                ),
                store_duration: meter
                    .f64_histogram("resend.server.idempotency.store.duration")
                    .with_unit("s")
                    .with_description("Duration of idempotency store calls, timeouts included")
                    .with_boundaries(STORE_BUCKETS.to_vec())
                    .build(),
                store_errors: counter(
                    "resend.server.idempotency.store.errors",
                    "{error}",
                    "Idempotency store calls that failed or timed out",
                ),
            })))
        }

        #[inline]
        pub(crate) fn is_on(&self) -> bool {
            self.0.is_some()
        }

        pub(crate) fn outcome(&self, outcome: Outcome) {
            let Some(i) = &self.0 else { return };
            match outcome {
                Outcome::Replayed => i.replays.add(1, &[]),
                Outcome::InProgress | Outcome::Mismatch => i.conflicts.add(
                    1,
                    &[KeyValue::new(
                        "resend.idempotency.conflict",
                        outcome.as_str(),
                    )],
                ),
                _ => {}
            }
        }

        pub(crate) fn lease_taken_over(&self) {
            if let Some(i) = &self.0 {
                i.lease_takeovers.add(1, &[]);
            }
        }

        pub(crate) fn stored_late(&self) {
            if let Some(i) = &self.0 {
                i.stored_late.add(1, &[]);
            }
        }

        pub(crate) fn unstored(&self) {
            if let Some(i) = &self.0 {
                i.unstored.add(1, &[]);
            }
        }

        pub(crate) fn store_call(&self, op: Op, took: Duration, ok: bool) {
            let Some(i) = &self.0 else { return };
            let op = [KeyValue::new("resend.store.operation", op.as_str())];
            i.store_duration.record(took.as_secs_f64(), &op);
            if !ok {
                i.store_errors.add(1, &op);
            }
        }
    }
}

#[cfg(not(feature = "otel"))]
pub(crate) use noop::ServerMetrics;

#[cfg(not(feature = "otel"))]
mod noop {
    use std::time::Duration;

    use super::{Op, Outcome};

    /// No instruments without the `otel` feature.
    #[derive(Clone, Copy, Debug, Default)]
    pub(crate) struct ServerMetrics;

    impl ServerMetrics {
        #[inline]
        pub(crate) fn is_on(&self) -> bool {
            false
        }

        #[inline]
        pub(crate) fn outcome(&self, _outcome: Outcome) {}

        #[inline]
        pub(crate) fn lease_taken_over(&self) {}

        #[inline]
        pub(crate) fn stored_late(&self) {}

        #[inline]
        pub(crate) fn unstored(&self) {}

        #[inline]
        pub(crate) fn store_call(&self, _op: Op, _took: Duration, _ok: bool) {}
    }
}
