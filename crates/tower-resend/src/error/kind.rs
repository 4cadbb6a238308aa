//! What went wrong, where, and what to do next.

use std::fmt;
use std::time::Duration;

/// What went wrong, in terms of what the caller may do next.
///
/// The enum is `#[non_exhaustive]`: later layers (retries, budgets) add kinds.
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
/// let stack = tower_resend::stack().total(Duration::from_secs(3)).service(slow);
/// let err = stack.oneshot(http::Request::new(String::new())).await.unwrap_err();
/// match err.kind() {
///     ErrorKind::DeadlineExceeded => {} // the whole budget went
///     ErrorKind::AttemptTimeout => unreachable!("the last attempt is cut by the deadline"),
///     other => panic!("{other:?}"),
/// }
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The call's deadline ran out: the whole budget of the call is spent.
    /// [`Error::phase`](crate::Error::phase) tells whether an attempt was in flight or a wait was running.
    DeadlineExceeded,
    /// One attempt took longer than the per-attempt timeout, while the
    /// call's deadline still had time left.
    AttemptTimeout,
    /// The connection could not be made within the connect timeout. Nothing
    /// was sent.
    ConnectTimeout,
    /// The transport failed: connection refused, DNS, reset, a broken body.
    /// [`Error::is_not_sent`](crate::Error::is_not_sent) tells whether the request can have reached the server.
    Transport,
    /// The server may have acted on a request that is not safe to send again
    /// (a POST without an Idempotency-Key that timed out, or got a 5xx).
    /// Verify before sending it again: look the resource up.
    OutcomeUnknown,
    /// Every attempt allowed failed; the last failure is the
    /// [`source`](std::error::Error::source).
    RetriesExhausted,
    /// A retry was allowed but the shared retry budget was empty: the
    /// upstream is failing for many calls at once.
    BudgetExhausted,
    /// A retry was needed but the request body was too large to keep a copy
    /// of, so it cannot be sent again.
    BodyNotReplayable,
    /// The upstream's [circuit breaker](crate::breaker) is open: it looked
    /// unwell, so the call failed at once. Nothing was sent (safe to fall
    /// back, or to send elsewhere); [`Error::retry_advice`](crate::Error::retry_advice) says to come back
    /// after the time it stays open ([`Error::limit`](crate::Error::limit)).
    CircuitOpen,
    /// The [adaptive throttle](crate::retry::AdaptiveThrottle) turned the
    /// attempt away: the upstream has been rejecting most calls, so this
    /// one was not sent (a job runner can requeue it; it costs the
    /// upstream nothing).
    Throttled,
    /// Every instance of the [fleet](crate::fleet) that the call could use
    /// has as many attempts in flight as its
    /// [limit](crate::fleet::InstanceLimit) allows, or the fleet as many as
    /// its [total limit](crate::fleet::FleetLayer::limit_total): the fleet has shown it
    /// is getting more than it serves, so this attempt failed at once, not
    /// sent, rather than queue where its caller would have gone before its
    /// answer came. Safe to send again, later:
    /// [`Error::retry_advice`](crate::Error::retry_advice) says after a
    /// second.
    AtCapacity,
    /// The quota the upstream states on its answers (read by a pacing
    /// layer, `quota::PaceLayer`, feature `quota`) has no room
    /// for this call before its deadline: it is spent until a reset past
    /// the deadline, or the calls paced ahead of it fill the time left. Not
    /// sent; [`Error::retry_advice`](crate::Error::retry_advice) says to
    /// come back after the reset ([`Error::limit`](crate::Error::limit)),
    /// so a job runner can requeue it.
    QuotaSpent,
}

impl ErrorKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::DeadlineExceeded => "deadline exceeded",
            Self::AttemptTimeout => "attempt timed out",
            Self::ConnectTimeout => "connect timed out",
            Self::Transport => "transport error",
            Self::OutcomeUnknown => "outcome unknown",
            Self::RetriesExhausted => "retries exhausted",
            Self::BudgetExhausted => "retry budget exhausted",
            Self::BodyNotReplayable => "body not replayable",
            Self::CircuitOpen => "circuit open",
            Self::Throttled => "throttled",
            Self::AtCapacity => "at capacity",
            Self::QuotaSpent => "quota spent",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the call was doing when its deadline ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Phase {
    /// No attempt could start: the deadline had passed before the request was
    /// sent. Nothing was sent.
    Start,
    /// An attempt was in flight: the request was sent or being sent, and no
    /// answer had come.
    Attempt,
    /// The call was waiting between attempts (a backoff or a Retry-After).
    Waiting,
    /// The response had arrived and its body was being read.
    Body,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Start => "before the request was sent",
            Self::Attempt => "while an attempt was in flight",
            Self::Waiting => "while waiting to retry",
            Self::Body => "while reading the response body",
        })
    }
}

/// What a caller that owns the retries (a job runner) should do after an
/// [`Error`](crate::Error), from [`Error::retry_advice`](crate::Error::retry_advice).
///
/// ```
/// use std::time::Duration;
/// use tower_resend::RetryAdvice;
///
/// fn release_for(advice: RetryAdvice) -> Option<Duration> {
///     match advice {
///         RetryAdvice::After(wait) | RetryAdvice::SameKey(wait) => Some(wait),
///         RetryAdvice::VerifyFirst | RetryAdvice::Never => None,
///         _ => None,
///     }
/// }
/// assert_eq!(release_for(RetryAdvice::After(Duration::from_secs(2))), Some(Duration::from_secs(2)));
/// assert_eq!(release_for(RetryAdvice::Never), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryAdvice {
    /// Safe to run again, after this wait (zero: at once).
    After(Duration),
    /// The server may have acted: verify (look the resource up) before
    /// sending again.
    VerifyFirst,
    /// Sending the same request again will not help.
    Never,
    /// The server may have acted, under an Idempotency-Key that resend
    /// chose ([`Error::idempotency_key`](crate::Error::idempotency_key)): send it again, after this wait,
    /// **with that same key** (the upstream answers the repeat from what it
    /// stored); a new key could do the work twice.
    SameKey(Duration),
}
