//! Safe retries: classify, decide, wait, replay.
//!
//! [`RetryLayer`] runs each call's attempts. After every attempt the
//! [classifier](crate::classify) says what the server may have done, and the
//! layer decides by this table. A request is
//! **replay-safe** when its method is idempotent (GET, HEAD, OPTIONS, TRACE,
//! PUT, DELETE) or it carries an `Idempotency-Key` (or `X-Idempotency-Key`);
//! the classifier has the last word
//! ([`Classify::is_replay_safe`](crate::classify::Classify::is_replay_safe)):
//! the gRPC one, whose methods are all POST, uses an allowlist of idempotent
//! methods instead.
//!
//! | class | replay-safe request | unsafe request without key |
//! |---|---|---|
//! | Success, Rejected | return it | return it |
//! | NotSent, NotProcessed | retry after backoff | retry after backoff |
//! | Overloaded | retry after Retry-After (or the 1 s floor) plus jittered backoff | 429: same; 503: stop, [`OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown) |
//! | InProgress | retry after backoff, with the same key; at the end: [`OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown), send again with the same key | (cannot happen) |
//! | Unknown | retry after backoff | stop: [`OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown), verify before resending |
//!
//! A keyed call that ends on "in progress" (409), or on a 503 after an
//! earlier attempt that may have run, ends
//! [`OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown) rather than with
//! that response, its error naming the key
//! ([`Error::idempotency_key`](crate::Error::idempotency_key)) and advising
//! [`SameKey`](crate::RetryAdvice::SameKey): the operation may be done or
//! under way, and only a resend under the same key finds out which.
//!
//! A failure the server *replayed* from its idempotency store
//! (`Idempotent-Replayed: true`: the recorded answer of an earlier attempt
//! under the same key, such as a handler cut by its deadline) is not
//! retried: every retry under the key would get it again, and the work it
//! records may be half done. The call ends
//! [`OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown), stopped by
//! [`Stop::Replayed`], and its error advises
//! [`VerifyFirst`](crate::RetryAdvice::VerifyFirst).
//!
//! An attempt that a layer below refused without sending it is not
//! retried: a [circuit breaker](crate::breaker) that is open
//! ([`CircuitOpen`](crate::ErrorKind::CircuitOpen)), or a
//! [fleet](crate::fleet) whose instances are all at their
//! [limit](crate::fleet::InstanceLimit)
//! ([`AtCapacity`](crate::ErrorKind::AtCapacity)), or a pacing layer whose
//! upstream's stated quota has no room before the call's deadline
//! ([`QuotaSpent`](crate::ErrorKind::QuotaSpent)). What each knows of the
//! upstream says that a resend now would be refused too: the call ends at
//! once, not sent, and its error's advice says when to come back.
//!
//! Every retry also needs an attempt left (3 in all by default), time left (the
//! wait plus a useful attempt must fit before the deadline; a Retry-After past
//! it ends the call at once), a token from the shared [`RetryBudget`], and a
//! body that can be replayed ([`ReplayBody`](crate::body::ReplayBody), 64 KiB kept by default).
//!
//! A request that was not sent (a refused connection) needs no token, as
//! gRPC's transparent retries, and goes to another instance of a fleet at
//! once, while the upstream otherwise answers. Nor does it count toward
//! the attempts in all while such an instance, one the call has not used,
//! can take it (gRFC A6: transparent retries do not count toward
//! `maxAttempts`): a call whose first attempts meet instances that are gone
//! goes on to one that answers. With none left to take it, its refusals
//! count with the rest, so that a fleet that refuses everywhere ends the
//! call once each instance refused it; a cap of 1 turns these retries off
//! too. When it fails as a whole
//! (the stack's last five attempts all failed, or its fleet's instances
//! fail as much as an outlier would), a refusal is an outage, not one
//! instance gone: it is retried as any failure is, after a backoff and
//! with a token, so that an outage costs the upstream little more than
//! the calls (gRPC sends nothing to a failing connection at all). The
//! refusals retried free in those last five attempts are charged to the
//! budget then: an outage's first second costs the budget's share of the
//! calls, as every later one does.
//!
//! Backoff is exponential with full jitter ([`Backoff`]): random in
//! `[0, min(cap, base * 2^n)]`. After an overloaded answer the jittered
//! backoff is added on top of the server's wait, so that clients told the same
//! `Retry-After` do not come back in step.
//!
//! Only one layer retries: a `RetryLayer` called by another one passes the
//! request through. A request can opt out with the [`NoRetry`] extension.
//! Every final response carries [`Attempts`] in its extensions; every error
//! carries them in [`Error::history`](crate::Error::history).
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Empty;
//! use bytes::Bytes;
//! use tower_resend::retry::{Attempts, RetryLayer};
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // An upstream that answers 503 twice, then 200.
//! let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
//! let upstream = service_fn(move |_req: Request<Empty<Bytes>>| {
//!     let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
//!     let status = if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
//!     async move { Ok::<_, std::convert::Infallible>(Response::builder().status(status).body(()).unwrap()) }
//! });
//! let client = RetryLayer::new().seed(7).layer(upstream);
//!
//! let resp = client.oneshot(Request::get("http://up/items").body(Empty::new()).unwrap()).await.unwrap();
//! assert_eq!(resp.status(), StatusCode::OK);
//! assert_eq!(resp.extensions().get::<Attempts>().unwrap().len(), 3);
//! # }
//! ```

mod announce;
mod backoff;
mod budget;
mod call;
mod future;
mod head;
mod layer;
pub(crate) mod policy;
mod run;
mod service;
mod streak;
mod throttle;
pub use crate::vocab::{Attempt, Attempts, Stop};
pub(crate) use announce::{announce, announced};
pub use backoff::{Backoff, InvalidBackoff};
pub(crate) use budget::{shard, Padded, PerShard, Token, DEFAULT_HEDGE_SHARE, SHARDS};
pub use budget::{InvalidBudget, RetryBudget, DEFAULT_BURST};
pub use future::ResponseFuture;
pub use layer::{RetryLayer, GRPC_PREVIOUS_RPC_ATTEMPTS, RESEND_PREVIOUS_ATTEMPTS};
pub use policy::{
    DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BUDGET_WAIT, DEFAULT_MAX_SERVER_WAIT, DEFAULT_MIN_ATTEMPT,
    DEFAULT_OVERLOAD_FLOOR, DEFAULT_WAIT_SPREAD,
};
pub use service::Retry;
pub use throttle::{AdaptiveThrottle, DEFAULT_THROTTLE_RATIO, DEFAULT_THROTTLE_WINDOW};

/// A request extension that sets, for this request alone, what the retry
/// layer's configuration says for every call: the attempts in all, and the
/// limit of each attempt (applied by the [`AttemptTimeoutLayer`](crate::timeout::AttemptTimeoutLayer)
/// below the retry layer, the stack's included; still never more than the
/// time left). Fields left `None` keep the layer's setting.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::retry::CallOptions;
///
/// let mut req = http::Request::get("http://api/report").body(()).unwrap();
/// req.extensions_mut().insert(
///     CallOptions::new().max_attempts(5).attempt_timeout(Duration::from_secs(30)),
/// );
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallOptions {
    /// Attempts in all, the first included (0 counts as 1); refused
    /// attempts a fleet sent on to another instance not counted (see the
    /// [module docs](self)).
    pub max_attempts: Option<u32>,
    /// The limit of each attempt.
    pub attempt_timeout: Option<std::time::Duration>,
}

impl CallOptions {
    /// No override: the layer's settings.
    pub const fn new() -> Self {
        Self {
            max_attempts: None,
            attempt_timeout: None,
        }
    }

    /// Attempts in all for this request, the first included (refused
    /// attempts a fleet sent on to another instance not counted).
    #[must_use]
    pub const fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// The limit of each attempt of this request.
    #[must_use]
    pub const fn attempt_timeout(mut self, limit: std::time::Duration) -> Self {
        self.attempt_timeout = Some(limit);
        self
    }
}

/// A request extension that turns retries off for that request: it is sent
/// once, whatever happens.
///
/// ```
/// let mut req = http::Request::post("http://api/charge").body(()).unwrap();
/// req.extensions_mut().insert(tower_resend::retry::NoRetry);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoRetry;
