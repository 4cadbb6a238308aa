//! What every clone of one breaker shares: the published state, the rules
//! behind a lock, the window, and the classifier.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use http::{HeaderMap, Method, Response, Uri};
use tokio::time::Instant;

use super::rules::Verdict;
use super::state::{
    observes_upstream, outcome_of, Change, Classes, Machine, Outcome, Rules, State, CLOSED, KIND,
};
use super::window::Window;
use super::CircuitState;
use crate::classify::{Classify, RequestFacts};
use crate::error::{BoxError, Error};
use crate::name::Name;
use crate::telemetry::{BreakerMetrics, ClientMetrics};
use crate::vocab::{percent, Refusal, Why};

/// The layer's settings, checked.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) rules: Rules,
    pub(crate) window: Duration,
    pub(crate) failing: Classes,
    pub(crate) upstream: Option<Name>,
    /// The instruments its changes of state are counted on, if any.
    pub(crate) metrics: ClientMetrics,
}

/// One breaker, shared by every clone of the service. On cache lines of
/// its own (`align(128)`): its state's tag, which every call reads, would
/// otherwise share a line with its `Arc`'s counts, which every clone
/// writes.
#[repr(align(128))]
pub(crate) struct Breaker<K> {
    /// The machine's [`tag`](Machine::tag): its generation and whether it is
    /// closed, published so that a closed circuit lets calls through and
    /// counts successes without the lock.
    tag: AtomicU64,
    machine: Mutex<Machine>,
    window: Window,
    classifier: K,
    failing: Classes,
    upstream: Option<Name>,
    /// The state-change counter, if the layer was given a meter.
    metrics: BreakerMetrics,
    /// What the classifier is shown of the request besides its method: the
    /// breaker keeps no copy of a request's URI or headers, only whether
    /// it was gRPC (shown as `content-type: application/grpc`, so that the
    /// default classifier reads a gRPC answer's status as gRPC).
    uri: Uri,
    headers: HeaderMap,
    grpc_headers: HeaderMap,
}

impl<K> std::fmt::Debug for Breaker<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let machine = self.machine.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Breaker")
            .field("upstream", &self.upstream)
            .field("state", &machine.state())
            .finish_non_exhaustive()
    }
}

/// A call let through: what its outcome must be counted against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    /// The tag the breaker had when the call was let through.
    tag: u64,
    /// The window's epoch of the call's start.
    epoch: u64,
    probe: bool,
}

impl<K> Breaker<K> {
    /// A breaker with `config`'s rules; `upstream`: an upstream's (its
    /// window with a lane per thread shard), not a fleet instance's.
    pub(crate) fn new(config: Config, classifier: K, upstream: bool) -> Self {
        let machine = Machine::new(config.rules);
        Self {
            tag: AtomicU64::new(machine.tag()),
            machine: Mutex::new(machine),
            window: Window::new(config.window, Instant::now(), upstream),
            classifier,
            failing: config.failing,
            metrics: config.metrics.breaker(config.upstream.as_ref()),
            upstream: config.upstream,
            uri: Uri::default(),
            headers: HeaderMap::new(),
            grpc_headers: HeaderMap::from_iter([(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            )]),
        }
    }

    /// Lets a call through, or refuses it with the error to fail it with.
    /// `now` is the current instant when the caller has it at hand.
    #[inline]
    pub(crate) fn admit(&self, now: Option<Instant>) -> Result<Ticket, Error> {
        self.try_admit(now)
            .map_err(|refusal| Error::circuit_open(refusal, self.upstream.as_ref()))
    }

    /// Lets a call through, or says why it is refused.
    #[inline]
    pub(crate) fn try_admit(&self, now: Option<Instant>) -> Result<Ticket, Refusal> {
        let tag = self.tag.load(Ordering::Acquire);
        if tag & KIND == CLOSED {
            let now = now.unwrap_or_else(Instant::now);
            return Ok(Ticket {
                tag,
                epoch: self.window.epoch(now),
                probe: false,
            });
        }
        self.admit_slow()
    }

    #[cold]
    fn admit_slow(&self) -> Result<Ticket, Refusal> {
        let now = Instant::now();
        let (verdict, change, tag) = {
            let mut m = self.lock();
            let (verdict, change) = m.call(now);
            (verdict, change, self.publish(&m))
        };
        self.announce(change);
        let ticket = |probe| Ticket {
            tag,
            epoch: self.window.epoch(now),
            probe,
        };
        match verdict {
            Verdict::Call => Ok(ticket(false)),
            Verdict::Probe => Ok(ticket(true)),
            Verdict::Refuse(refusal) => Err(refusal),
        }
    }

    /// What an attempt's result says about the upstream.
    pub(crate) fn judge<R>(
        &self,
        method: &Method,
        grpc: bool,
        result: &Result<Response<R>, BoxError>,
    ) -> Outcome
    where
        K: Classify<R>,
    {
        let headers = if grpc {
            &self.grpc_headers
        } else {
            &self.headers
        };
        let facts = RequestFacts::new(method, &self.uri, headers);
        let class = match result {
            Ok(resp) => self.classifier.classify_response(&facts, resp).class(),
            Err(e) if !observes_upstream(&**e) => return Outcome::Ignored,
            Err(e) => self.classifier.classify_error(&facts, &**e).class(),
        };
        outcome_of(class, self.failing)
    }

    /// The classes it counts as failures.
    pub(crate) fn failing(&self) -> Classes {
        self.failing
    }

    /// Counts the outcome of the call let through with `ticket`.
    #[inline]
    pub(crate) fn settle(&self, ticket: Ticket, outcome: Outcome) {
        if ticket.probe {
            return self.settle_probe(ticket, outcome);
        }
        match outcome {
            // The rules' row "closed + success: closed", without the lock;
            // a success of a state that has passed is not counted.
            Outcome::Success => {
                if self.tag.load(Ordering::Relaxed) == ticket.tag {
                    self.window.record(ticket.epoch, false);
                }
            }
            Outcome::Failure => self.settle_failure(ticket),
            Outcome::Ignored => {}
        }
    }

    #[cold]
    fn settle_failure(&self, ticket: Ticket) {
        if self.tag.load(Ordering::Relaxed) != ticket.tag {
            return;
        }
        self.window.record(ticket.epoch, true);
        let now = Instant::now();
        let counts = self.window.counts(self.window.epoch(now));
        let change = {
            let mut m = self.lock();
            let change = m.failed(now, ticket.tag >> 2, counts);
            self.publish(&m);
            change
        };
        self.announce(change);
    }

    #[cold]
    fn settle_probe(&self, ticket: Ticket, outcome: Outcome) {
        let now = Instant::now();
        let change = {
            let mut m = self.lock();
            let change = m.probed(now, ticket.tag >> 2, outcome);
            if change == Some(Change::Closed) {
                // Closed afresh: what the window held is of the outage.
                self.window.clear();
            }
            self.publish(&m);
            change
        };
        self.announce(change);
    }

    /// The state, as [`CircuitBreaker::state`](super::CircuitBreaker::state) reports it.
    pub(crate) fn state(&self) -> CircuitState {
        match self.lock().state() {
            State::Closed => CircuitState::Closed,
            State::Open { .. } => CircuitState::Open,
            State::HalfOpen { .. } => CircuitState::HalfOpen,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Machine> {
        self.machine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Publishes the machine's tag (under its lock) and returns it.
    fn publish(&self, m: &Machine) -> u64 {
        let tag = m.tag();
        self.tag.store(tag, Ordering::Release);
        tag
    }

    /// One tracing event per change of state, outside the lock.
    fn announce(&self, change: Option<Change>) {
        let Some(change) = change else { return };
        self.metrics.changed(change.state());
        let upstream = self.upstream.as_deref().unwrap_or("");
        match change {
            Change::Opened {
                why: Why::Ratio { failures, calls },
                break_duration,
            } => tracing::warn!(
                upstream,
                failures,
                calls,
                failure_percent = percent(failures, calls),
                break_ms = u64::try_from(break_duration.as_millis()).unwrap_or(u64::MAX),
                "circuit breaker opened: {}% of {calls} calls failed",
                percent(failures, calls),
            ),
            Change::Opened {
                why: Why::Probe,
                break_duration,
            } => tracing::warn!(
                upstream,
                break_ms = u64::try_from(break_duration.as_millis()).unwrap_or(u64::MAX),
                "circuit breaker opened again: a probe failed"
            ),
            Change::HalfOpened { probes } => {
                tracing::info!(upstream, probes, "circuit breaker half-open: probing");
            }
            Change::Closed => {
                tracing::info!(upstream, "circuit breaker closed: the probes succeeded");
            }
        }
    }
}
