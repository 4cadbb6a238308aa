//! The layer's counts and limit as OpenTelemetry instruments, observed at
//! each collection (feature `otel`).

use std::sync::{Arc, Weak};

use opentelemetry::metrics::Meter;
use opentelemetry::KeyValue;

use super::lanes::State;

/// Registers the instruments of [`ShedLayer::meter`](super::ShedLayer::meter)
/// on `meter`, reading `state` while it lives.
pub(super) fn observe(meter: &Meter, state: Weak<State>) {
    let stats = move || Weak::upgrade(&state).map(|s: Arc<State>| s.stats());
    let read = stats.clone();
    meter
        .u64_observable_gauge("resend.server.shed.limit")
        .with_unit("{request}")
        .with_description("The requests the shedding layer lets run at once now")
        .with_callback(move |gauge| {
            if let Some(s) = read() {
                gauge.observe(s.limit as u64, &[]);
            }
        })
        .build();
    let read = stats.clone();
    meter
        .u64_observable_counter("resend.server.shed.admitted")
        .with_unit("{request}")
        .with_description("Requests the shedding layer let through")
        .with_callback(move |counter| {
            if let Some(s) = read() {
                counter.observe(s.admitted, &[]);
            }
        })
        .build();
    meter
        .u64_observable_counter("resend.server.shed.refused")
        .with_unit("{request}")
        .with_description("Requests the shedding layer refused, nothing done, by reason")
        .with_callback(move |counter| {
            if let Some(s) = stats() {
                for (reason, n) in [
                    ("first", s.shed_first),
                    ("retry", s.shed_retries),
                    ("deadline", s.shed_deadline),
                ] {
                    counter.observe(n, &[KeyValue::new("resend.shed.reason", reason)]);
                }
            }
        })
        .build();
}
