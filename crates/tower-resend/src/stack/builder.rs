use std::time::Duration;

use http::header::HeaderName;

use super::{DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_TOTAL};
use crate::breaker::NoBreaker;
use crate::classify::HttpClassifier;
use crate::deadline::DeadlineHeaderLayer;
use crate::fleet::NoFleet;
use crate::hedge::{HedgeLayer, NoHedge};
use crate::idempotency::SetIdempotencyKeyLayer;
use crate::name::Name;
use crate::quota::NoPace;
use crate::read_ahead::DEFAULT_READ_AHEAD;
use crate::retry::{Backoff, RetryBudget, RetryLayer};

/// Builds a [`Stack`](crate::stack::Stack); see [`stack()`](crate::stack()). Every setting's default is stated on
/// its method.
///
/// `C` classifies attempts for the retry layer; `B` is the circuit
/// breaker's place: [`NoBreaker`], or a [`CircuitBreakerLayer`](crate::breaker::CircuitBreakerLayer) once
/// [`circuit_breaker`](Self::circuit_breaker) put one there; `F` is the
/// fleet's place: [`NoFleet`], or a [`FleetLayer`](crate::fleet::FleetLayer) once
/// [`fleet`](Self::fleet) put one there; `H` is the hedge's place:
/// [`NoHedge`], or [`Hedging`](crate::hedge::Hedging) once [`hedge`](Self::hedge) turned it on;
/// `P` is the pacing layer's place: [`NoPace`], or a `PaceLayer` once
/// `pace` (feature `quota`) put one there.
/// The optional places' methods are in `slots.rs`; how the settings
/// become a stack is in `compose.rs`.
#[derive(Clone, Debug)]
pub struct StackBuilder<C = HttpClassifier, B = NoBreaker, F = NoFleet, H = NoHedge, P = NoPace> {
    pub(super) settings: Settings,
    pub(super) retry: RetryLayer<C>,
    pub(super) breaker: B,
    pub(super) fleet: F,
    pub(super) hedging: H,
    pub(super) pacing: P,
}

/// The settings whose types do not change with the classifier, the
/// breaker or the fleet.
#[derive(Clone, Debug)]
pub(super) struct Settings {
    pub(super) name: Option<Name>,
    pub(super) total: Duration,
    pub(super) attempt_timeout: Duration,
    pub(super) keys: SetIdempotencyKeyLayer,
    pub(super) header: DeadlineHeaderLayer,
    pub(super) read_ahead_cap: usize,
    pub(super) idle: Option<Duration>,
    /// The hedge's settings once [`hedge`](StackBuilder::hedge) (or
    /// `hedge_at_percentile`, or `maybe_hedge` with a time) turned it on.
    pub(super) hedge: Option<HedgeLayer<()>>,
}

impl StackBuilder {
    /// The defaults; see [`stack()`](crate::stack()).
    pub fn new() -> Self {
        Self {
            settings: Settings {
                name: None,
                total: DEFAULT_TOTAL,
                attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
                keys: SetIdempotencyKeyLayer::disabled(),
                header: DeadlineHeaderLayer::new(),
                read_ahead_cap: DEFAULT_READ_AHEAD,
                idle: None,
                hedge: None,
            },
            retry: RetryLayer::new(),
            breaker: NoBreaker,
            fleet: NoFleet,
            hedging: NoHedge,
            pacing: NoPace,
        }
    }
}

impl Default for StackBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl<C, B, F, H, P> StackBuilder<C, B, F, H, P> {
    /// Names the upstream: it shows up in errors, tracing and 504 bodies,
    /// names the circuit breaker (unless its layer was named), and counts
    /// this upstream's [derived](crate::idempotency::derive_keys)
    /// Idempotency-Keys. Default: unnamed.
    ///
    /// ```
    /// use tower::{service_fn, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let never = service_fn(|_: http::Request<_>| std::future::pending::<Result<http::Response<String>, tower_resend::BoxError>>());
    /// let shipping = tower_resend::stack().name("shipping").total(std::time::Duration::from_secs(1)).service(never);
    /// let err = shipping.oneshot(http::Request::new(String::new())).await.unwrap_err();
    /// assert_eq!(err.upstream(), Some("shipping"));
    /// # }
    /// ```
    #[must_use]
    pub fn name(mut self, name: impl Into<Name>) -> Self {
        let name = name.into();
        self.retry = self.retry.upstream(name.clone());
        self.settings.keys = self.settings.keys.upstream(name.clone());
        self.settings.name = Some(name);
        self
    }

    /// The deadline budget of a call, shrunk to an inherited one. Default 10 s.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let slow = service_fn(|_: http::Request<_>| async {
    ///     tokio::time::sleep(Duration::from_secs(60)).await;
    ///     Ok::<_, tower_resend::BoxError>(http::Response::new(String::new()))
    /// });
    /// let stack = tower_resend::stack().total(Duration::from_secs(2)).service(slow);
    /// let start = tokio::time::Instant::now();
    /// let err = stack.oneshot(http::Request::new(String::new())).await.unwrap_err();
    /// assert_eq!(start.elapsed(), Duration::from_secs(2));
    /// assert!(err.is_deadline_exceeded());
    /// # }
    /// ```
    #[must_use]
    pub fn total(mut self, total: Duration) -> Self {
        self.settings.total = total;
        self
    }

    /// The limit of one attempt (never more than the time left). Default 5 s.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// use tower_resend::ErrorKind;
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let slow = service_fn(|_: http::Request<_>| async {
    ///     tokio::time::sleep(Duration::from_secs(60)).await;
    ///     Ok::<_, tower_resend::BoxError>(http::Response::new(String::new()))
    /// });
    /// // A POST without a key is not retried: its one attempt is cut at 1 s.
    /// let stack = tower_resend::stack().attempt_timeout(Duration::from_secs(1)).service(slow);
    /// let req = http::Request::post("/charges").body(String::new()).unwrap();
    /// let err = stack.oneshot(req).await.unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::OutcomeUnknown); // it may have run
    /// assert_eq!(err.attempts(), 1);
    /// # }
    /// ```
    #[must_use]
    pub fn attempt_timeout(mut self, per_attempt: Duration) -> Self {
        self.settings.attempt_timeout = per_attempt;
        self
    }

    /// Attempts in all, the first included. Default 3. Attempts refused
    /// before they were sent, which a [fleet](crate::fleet) sends on at once
    /// to another instance, are not counted (gRPC's transparent retries).
    ///
    /// ```
    /// use tower::{service_fn, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let unavailable = service_fn(|_: http::Request<_>| async {
    ///     Ok::<_, tower_resend::BoxError>(http::Response::builder().status(503).body(String::new()).unwrap())
    /// });
    /// let stack = tower_resend::stack().max_attempts(2).no_budget().service(unavailable);
    /// let resp = stack.oneshot(http::Request::new(String::new())).await.unwrap();
    /// assert_eq!(resp.extensions().get::<tower_resend::retry::Attempts>().unwrap().len(), 2);
    /// # }
    /// ```
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.retry = self.retry.max_attempts(attempts);
        self
    }

    /// The backoff between attempts. Default [`Backoff::DEFAULT`].
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.retry = self.retry.backoff(backoff);
        self
    }

    /// The retry budget, shared by every clone of the stack. Default
    /// [`RetryBudget::default`].
    #[must_use]
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.retry = self.retry.budget(budget);
        self
    }

    /// No retry budget: only attempts and time limit retries.
    #[must_use]
    pub fn no_budget(mut self) -> Self {
        self.retry = self.retry.no_budget();
        self
    }

    /// Throttles on the client side, by the SRE rule with its defaults (an
    /// upstream that rejects most calls receives about twice what it
    /// accepts; see [`AdaptiveThrottle`](crate::retry::AdaptiveThrottle)):
    /// attempts turned away fail at once, not sent, with
    /// [`ErrorKind::Throttled`](crate::ErrorKind::Throttled). Shared by
    /// every clone of the stack. Default: off.
    #[must_use]
    pub fn adaptive_throttling(self) -> Self {
        self.adaptive_throttle(crate::retry::AdaptiveThrottle::new())
    }

    /// Throttles on the client side with `throttle` (its ratio and window
    /// set; keep a clone to read its probability). Default: off.
    #[must_use]
    pub fn adaptive_throttle(mut self, throttle: crate::retry::AdaptiveThrottle) -> Self {
        self.retry = self.retry.adaptive_throttle(throttle);
        self
    }

    /// Seeds the jitter, for tests. Default: seeded from the system.
    ///
    /// ```
    /// let stack = tower_resend::stack().seed(7); // the same waits on every run
    /// # let _ = stack;
    /// ```
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.retry = self.retry.seed(seed);
        self
    }

    /// Configures the retry layer further (overload floor, server waits,
    /// replay cap…).
    #[must_use]
    pub fn retry<C2>(
        self,
        f: impl FnOnce(RetryLayer<C>) -> RetryLayer<C2>,
    ) -> StackBuilder<C2, B, F, H, P> {
        StackBuilder {
            settings: self.settings,
            retry: f(self.retry),
            breaker: self.breaker,
            fleet: self.fleet,
            hedging: self.hedging,
            pacing: self.pacing,
        }
    }

    /// Declares that this upstream honours `Idempotency-Key`: unsafe requests
    /// get one key per call (the caller's [`IdempotencyKey`](crate::IdempotencyKey),
    /// a key [derived](crate::idempotency::derive_keys) from a keyed inbound
    /// operation, or a UUID v4), reused on every attempt, which makes them
    /// replay-safe. Default: off.
    ///
    /// ```
    /// use tower::{service_fn, ServiceExt};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let upstream = service_fn(|req: http::Request<_>| async move {
    ///     let status = if req.headers().contains_key("idempotency-key") { 201 } else { 400 };
    ///     Ok::<_, tower_resend::BoxError>(http::Response::builder().status(status).body(String::new()).unwrap())
    /// });
    /// let stack = tower_resend::stack().idempotency_keys().service(upstream);
    /// let post = http::Request::post("/orders").body(String::new()).unwrap();
    /// let resp = stack.oneshot(post).await.unwrap();
    /// assert_eq!(resp.status(), 201); // a generated key went out
    /// # }
    /// ```
    #[must_use]
    pub fn idempotency_keys(mut self) -> Self {
        self.settings.keys = match &self.settings.name {
            Some(name) => SetIdempotencyKeyLayer::new().upstream(name.clone()),
            None => SetIdempotencyKeyLayer::new(),
        };
        self
    }

    /// Reads the response bodies of replay-safe attempts up to `bytes`
    /// (whatever length they declare) before returning them, so that a
    /// connection that breaks inside one is a failed attempt, retried; the
    /// rest of a longer body, gRPC and event streams reach the caller as
    /// they come, and a break in them is the caller's error (see
    /// [`ReadAheadLayer`](crate::read_ahead::ReadAheadLayer)). Default [`DEFAULT_READ_AHEAD`] (64 KiB); 0 turns
    /// it off.
    ///
    /// ```
    /// // Small bodies only (4 KiB), or none at all.
    /// let small = tower_resend::stack().read_ahead(4 * 1024);
    /// let off = tower_resend::stack().read_ahead(0);
    /// # let _ = (small, off);
    /// ```
    #[must_use]
    pub fn read_ahead(mut self, bytes: usize) -> Self {
        self.settings.read_ahead_cap = bytes;
        self
    }

    /// Fails a response body that sends nothing for `idle` (reqwest's
    /// `read_timeout`; see [`ReadAheadLayer::idle_timeout`](crate::read_ahead::ReadAheadLayer::idle_timeout)): while it is read ahead,
    /// that fails the attempt, which a replay-safe request retries; later,
    /// the caller's read fails. Default: none (the attempt timeout and the
    /// deadline still bound what is read ahead).
    ///
    /// ```
    /// use std::time::Duration;
    /// let stack = tower_resend::stack().idle_timeout(Duration::from_secs(5));
    /// # let _ = stack;
    /// ```
    #[must_use]
    pub fn idle_timeout(mut self, idle: Duration) -> Self {
        self.settings.idle = Some(idle);
        self
    }

    /// Also writes the time left, in milliseconds, as `name` on HTTP requests
    /// (gRPC requests always carry `grpc-timeout`). Default: none.
    #[must_use]
    pub fn deadline_header(mut self, name: HeaderName) -> Self {
        self.settings.header = self.settings.header.http_header(name);
        self
    }
}
