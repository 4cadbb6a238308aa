//! The client's instruments, made once from the user's meter, and what
//! each call records on them (see the [table](super#metrics-feature-otel)).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::{Counter, Histogram, Meter};
use opentelemetry::{KeyValue, StringValue};

use super::spans::{address, error_type, port};
use super::{answer_error, method_str, Outcome, WaitReason};
use crate::classify::{Class, Classification, RequestFacts};
use crate::error::BoxError;
use crate::name::Name;
use crate::vocab::{Attempts, Stop};

/// Buckets of counts per call (attempts, retries): gRFC A96's.
const COUNT_BUCKETS: [f64; 5] = [1.0, 2.0, 3.0, 4.0, 5.0];
/// Buckets of waits, in seconds: the conventions' for durations, up to the
/// longest server wait honoured by default.
const DELAY_BUCKETS: [f64; 15] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0,
];

/// Buckets of `http.client.request.duration`, in seconds: the HTTP
/// semantic conventions' own.
const DURATION_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

const UPSTREAM: &str = "resend.upstream";
const METHOD: &str = "http.request.method";

/// Every instrument of the client, made once per meter given.
struct Instruments {
    request_duration: Histogram<f64>,
    attempts: Histogram<u64>,
    retries: Histogram<u64>,
    transparent: Histogram<u64>,
    grpc_retries: Histogram<u64>,
    grpc_transparent: Histogram<u64>,
    grpc_retry_delay: Histogram<f64>,
    retry_delay: Histogram<f64>,
    hedge_copies: Histogram<u64>,
    budget_exhausted: Counter<u64>,
    outcome_unknown: Counter<u64>,
    breaker_changes: Counter<u64>,
}

impl Instruments {
    fn new(meter: &Meter) -> Self {
        let count = |name: &'static str, unit: &'static str, what: &'static str| {
            meter
                .u64_histogram(name)
                .with_unit(unit)
                .with_description(what)
                .with_boundaries(COUNT_BUCKETS.to_vec())
                .build()
        };
        let delay = |name: &'static str, what: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(what)
                .with_boundaries(DELAY_BUCKETS.to_vec())
                .build()
        };
        let counter = |name: &'static str, unit: &'static str, what: &'static str| {
            meter
                .u64_counter(name)
                .with_unit(unit)
                .with_description(what)
                .build()
        };
        Self {
            request_duration: meter
                .f64_histogram("http.client.request.duration")
                .with_unit("s")
                .with_description("Duration of HTTP client requests.")
                .with_boundaries(DURATION_BUCKETS.to_vec())
                .build(),
            attempts: count(
                "resend.client.call.attempts",
                "{attempt}",
                "Attempts made by a call, the first included",
            ),
            retries: count(
                "resend.client.call.retries",
                "{retry}",
                "Retries of an HTTP call that retried, transparent retries aside",
            ),
            transparent: count(
                "resend.client.call.transparent_retries",
                "{retry}",
                "Retries of attempts of an HTTP call that were not sent",
            ),
            grpc_retries: count(
                "grpc.client.call.retries",
                "{retry}",
                "Number of retries during the client call. If there were no retries, 0 is not reported.",
            ),
            grpc_transparent: count(
                "grpc.client.call.transparent_retries",
                "{transparent_retry}",
                "Number of transparent retries during the client call. If there were no transparent retries, 0 is not reported.",
            ),
            grpc_retry_delay: delay(
                "grpc.client.call.retry_delay",
                "Total time of delay while there is no active attempt during the client call",
            ),
            retry_delay: delay(
                "resend.client.retry.delay",
                "A wait before a retry, by its reason",
            ),
            hedge_copies: count(
                "resend.client.hedge.copies",
                "{copy}",
                "Copies sent by a hedged attempt, the first included",
            ),
            budget_exhausted: counter(
                "resend.client.retry_budget.exhausted",
                "{call}",
                "Calls that ended because no retry budget token came in time",
            ),
            outcome_unknown: counter(
                "resend.client.outcome_unknown",
                "{call}",
                "Calls that ended outcome-unknown: they may have been processed, and are not safe to resend",
            ),
            breaker_changes: counter(
                "resend.client.breaker.state_changes",
                "{change}",
                "Changes of a circuit breaker's state, by the new state",
            ),
        }
    }
}

/// The instruments of a layer, if it was given a meter.
#[derive(Clone, Default)]
pub(crate) struct ClientMetrics(Option<Arc<Instruments>>);

impl fmt::Debug for ClientMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ClientMetrics")
            .field(&if self.0.is_some() { "on" } else { "off" })
            .finish()
    }
}

/// `resend.upstream`, if there is a name.
fn upstream(name: Option<&Name>) -> Option<KeyValue> {
    name.map(|n| KeyValue::new(UPSTREAM, StringValue::from(Arc::<str>::from(n.as_str()))))
}

impl ClientMetrics {
    /// No instruments.
    pub(crate) const OFF: Self = Self(None);

    /// The instruments, made from `meter`.
    pub(crate) fn new(meter: &Meter) -> Self {
        Self(Some(Arc::new(Instruments::new(meter))))
    }

    /// True when a meter was given.
    pub(crate) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// What the calls to the upstream `name` record.
    pub(crate) fn bind(&self, name: Option<&Name>) -> CallMetrics {
        CallMetrics(self.0.as_ref().map(|i| Bound {
            i: Arc::clone(i),
            upstream: upstream(name).unwrap_or_else(|| KeyValue::new(UPSTREAM, "")),
            named: name.is_some(),
            target: name.map(|n| StringValue::from(Arc::<str>::from(n.as_str()))),
        }))
    }

    /// What the breaker of the upstream `name` records.
    pub(crate) fn breaker(&self, name: Option<&Name>) -> BreakerMetrics {
        BreakerMetrics(
            self.0
                .as_ref()
                .map(|i| (i.breaker_changes.clone(), upstream(name))),
        )
    }
}

/// The instruments of one retry service, with its upstream's name.
#[derive(Default)]
pub(crate) struct CallMetrics(Option<Bound>);

struct Bound {
    i: Arc<Instruments>,
    /// `resend.upstream`; unused when the upstream has no name.
    upstream: KeyValue,
    named: bool,
    /// `grpc.target`: the upstream's name.
    target: Option<StringValue>,
}

impl fmt::Debug for CallMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CallMetrics")
            .field(&if self.0.is_some() { "on" } else { "off" })
            .finish()
    }
}

impl Bound {
    /// `f` with the upstream's name (if it has one), `a` and `b` as its
    /// attributes, on the stack.
    fn with(&self, a: Option<KeyValue>, b: Option<KeyValue>, f: impl FnOnce(&[KeyValue])) {
        let skip = usize::from(!self.named);
        match (a, b) {
            (Some(a), Some(b)) => f(&[self.upstream.clone(), a, b][skip..]),
            (Some(a), None) | (None, Some(a)) => f(&[self.upstream.clone(), a][skip..]),
            (None, None) => f(&[self.upstream.clone()][skip..]),
        }
    }
}

impl CallMetrics {
    /// True when a meter was given.
    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// A wait before a retry ended, after `wait`.
    pub(crate) fn waited(&self, reason: WaitReason, wait: Duration) {
        let Some(b) = &self.0 else { return };
        let reason = KeyValue::new("resend.wait.reason", reason.as_str());
        b.with(Some(reason), None, |a| {
            b.i.retry_delay.record(wait.as_secs_f64(), a);
        });
    }

    /// A hedged attempt ended after sending `sent` copies, with the answer
    /// (or error) of copy `won`, counted from 1.
    pub(crate) fn hedged(&self, sent: u32, won: u32) {
        let Some(b) = &self.0 else { return };
        let winner = if won > 1 { "backup" } else { "first" };
        let winner = KeyValue::new("resend.hedge.winner", winner);
        b.with(Some(winner), None, |a| {
            b.i.hedge_copies.record(u64::from(sent), a);
        });
    }

    /// An HTTP attempt ended after `took`, with `result` classified `c`:
    /// `http.client.request.duration`, one record per request sent (each
    /// attempt is a request of its own, as each has its span), with the
    /// attributes the HTTP client conventions name. gRPC attempts are not
    /// HTTP requests in the conventions' sense, and are not recorded.
    pub(crate) fn attempt_ended<R>(
        &self,
        facts: &RequestFacts<'_>,
        server: Option<&http::uri::Authority>,
        result: &Result<http::Response<R>, BoxError>,
        c: &Classification,
        took: Duration,
    ) {
        let Some(b) = &self.0 else { return };
        if facts.is_grpc() {
            return;
        }
        let uri = facts.uri();
        let mut attrs = Vec::with_capacity(8);
        attrs.push(KeyValue::new(METHOD, method_str(facts.method())));
        // The instance of a fleet that answered, else the request's host.
        let host = server.map_or(uri.host(), |s| Some(s.host()));
        if let Some(host) = host {
            attrs.push(KeyValue::new("server.address", address(host).to_owned()));
        }
        let port = server.map_or(port(uri), http::uri::Authority::port_u16);
        if let Some(port) = port {
            attrs.push(KeyValue::new("server.port", i64::from(port)));
        }
        match uri.scheme_str() {
            Some("http") => attrs.push(KeyValue::new("url.scheme", "http")),
            Some("https") => attrs.push(KeyValue::new("url.scheme", "https")),
            Some(other) => attrs.push(KeyValue::new("url.scheme", other.to_owned())),
            None => {}
        }
        let error = match result {
            Ok(resp) => {
                let status = resp.status();
                attrs.push(KeyValue::new(
                    "http.response.status_code",
                    i64::from(status.as_u16()),
                ));
                answer_error(status, None)
            }
            Err(e) => Some(error_type(&**e, c.class())),
        };
        if let Some(error) = error {
            attrs.push(KeyValue::new("error.type", error));
        }
        if b.named {
            attrs.push(b.upstream.clone());
        }
        b.i.request_duration.record(took.as_secs_f64(), &attrs);
    }

    /// A call to `facts` ended with `outcome`, after the attempts of
    /// `history`, retrying stopped by `stop` (`None`: it was dropped).
    pub(crate) fn call_ended(
        &self,
        facts: &RequestFacts<'_>,
        outcome: Outcome,
        stop: Option<Stop>,
        history: &Attempts,
    ) {
        let Some(b) = &self.0 else { return };
        let method = KeyValue::new(METHOD, method_str(facts.method()));
        let end = KeyValue::new("resend.outcome", outcome.as_str());
        b.with(Some(method.clone()), Some(end), |a| {
            b.i.attempts.record(u64::from(history.len()), a);
        });
        match stop {
            Some(Stop::OutcomeUnknown | Stop::Replayed) => {
                b.with(Some(method.clone()), None, |a| {
                    b.i.outcome_unknown.add(1, a)
                });
            }
            // (The call may still return the last answer: a 503.)
            Some(Stop::Budget) => b.with(None, None, |a| b.i.budget_exhausted.add(1, a)),
            _ => {}
        }
        if history.len() < 2 {
            return;
        }
        // A retry of an attempt that was not sent is transparent.
        let (mut retries, mut transparent) = (0u64, 0u64);
        let mut classes = history.iter().map(|a| a.class());
        let mut previous = classes.next();
        for class in classes {
            match previous {
                Some(Class::NotSent) => transparent += 1,
                _ => retries += 1,
            }
            previous = Some(class);
        }
        if facts.is_grpc() {
            let path = facts.uri().path();
            let full = path.strip_prefix('/').unwrap_or(path);
            let target = b.target.clone().unwrap_or_else(|| {
                facts
                    .uri()
                    .authority()
                    .map_or(StringValue::from("unknown"), |a| {
                        StringValue::from(a.as_str().to_owned())
                    })
            });
            let attrs = [
                KeyValue::new("grpc.method", full.to_owned()),
                KeyValue::new("grpc.target", target),
            ];
            if retries > 0 {
                b.i.grpc_retries.record(retries, &attrs);
            }
            if transparent > 0 {
                b.i.grpc_transparent.record(transparent, &attrs);
            }
            b.i.grpc_retry_delay
                .record(history.waited().as_secs_f64(), &attrs);
        } else {
            if retries > 0 {
                b.with(Some(method.clone()), None, |a| {
                    b.i.retries.record(retries, a)
                });
            }
            if transparent > 0 {
                b.with(Some(method), None, |a| {
                    b.i.transparent.record(transparent, a)
                });
            }
        }
    }
}

/// The state-change counter of one circuit breaker, with its upstream's
/// name.
#[derive(Default)]
pub(crate) struct BreakerMetrics(Option<(Counter<u64>, Option<KeyValue>)>);

impl fmt::Debug for BreakerMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BreakerMetrics")
            .field(&if self.0.is_some() { "on" } else { "off" })
            .finish()
    }
}

impl BreakerMetrics {
    /// The breaker is now in `state` (`open`, `half_open`, `closed`).
    pub(crate) fn changed(&self, state: &'static str) {
        let Some((counter, upstream)) = &self.0 else {
            return;
        };
        let state = KeyValue::new("resend.breaker.state", state);
        match upstream {
            Some(u) => counter.add(1, &[u.clone(), state]),
            None => counter.add(1, &[state]),
        }
    }
}
