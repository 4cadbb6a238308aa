//! The one error type of tower-resend, and what it says about a failed call.
//!
//! Every tower-resend layer that fails on its own account (a deadline, an attempt
//! timeout, a connect timeout) fails with [`Error`]. Standalone layers follow
//! tower and return a [`BoxError`] with an [`Error`] inside, which callers find
//! with [`Error::from_box`] (or `downcast_ref`). The facts are the same either
//! way: the [`ErrorKind`], the upstream's name, the attempts made, the time
//! spent and the cause as [`source`](std::error::Error::source).

use crate::name::Name;
use std::time::Duration;

use crate::vocab::{Attempt, Attempts, Class, Refusal};

mod display;
mod kind;
mod make;

pub use kind::{ErrorKind, Phase, RetryAdvice};

/// A type-erased error, as tower middleware passes errors around.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The error of a tower-resend call: what went wrong, where and after how long.
///
/// It cannot be built outside resend; it always says something human, and its
/// cause is available through [`source`](std::error::Error::source).
///
/// ```
/// use tower_resend::{Error, ErrorKind};
///
/// fn report(e: &Error) -> String {
///     match e.kind() {
///         ErrorKind::DeadlineExceeded => format!("gave up after {:?}", e.elapsed()),
///         _ if e.is_not_sent() => "never reached the server: safe to send again".to_owned(),
///         _ => e.to_string(),
///     }
/// }
/// # let _ = report;
/// ```
pub struct Error {
    // Boxed so that `Result<Response, Error>` stays one pointer wide on the
    // success path.
    inner: Box<Inner>,
}

struct Inner {
    kind: ErrorKind,
    not_sent: bool,
    phase: Option<Phase>,
    limit: Option<Duration>,
    upstream: Option<Name>,
    attempts: u32,
    elapsed: Option<Duration>,
    history: Option<Attempts>,
    /// For [`ErrorKind::CircuitOpen`]: why and for how long.
    circuit: Option<Refusal>,
    /// The Idempotency-Key a retry must carry: the one the stack chose (the
    /// caller set none), or the caller's when the call ended unsettled.
    key: Option<http::HeaderValue>,
    source: Option<BoxError>,
}

impl Error {
    /// Turns any error a tower service returned into a tower-resend [`Error`].
    ///
    /// A tower-resend [`Error`] in the box is taken out as it is. Anything else
    /// becomes [`ErrorKind::Transport`] with the original error as its source;
    /// when a tower-resend error or a hyper-util connect error is found anywhere in
    /// its [`source`](std::error::Error::source) chain, the result keeps what
    /// that says: a connect timeout stays [`ErrorKind::ConnectTimeout`], and a
    /// failure to connect stays [not sent](Self::is_not_sent).
    ///
    /// ```
    /// use tower_resend::{BoxError, Error, ErrorKind};
    ///
    /// let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
    /// let e = Error::from_box(BoxError::from(io));
    /// assert_eq!(e.kind(), ErrorKind::Transport);
    /// assert!(!e.is_not_sent());
    /// ```
    pub fn from_box(error: BoxError) -> Self {
        let error = match error.downcast::<Self>() {
            Ok(e) => return *e,
            Err(other) => other,
        };
        // Look down the chain for facts an inner layer established.
        let mut kind = ErrorKind::Transport;
        let mut not_sent = false;
        let mut limit = None;
        let mut upstream = None;
        let mut circuit = None;
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(&*error);
        while let Some(e) = next {
            if let Some(ours) = e.downcast_ref::<Self>() {
                kind = ours.inner.kind;
                not_sent = ours.inner.not_sent;
                limit = ours.inner.limit;
                upstream.clone_from(&ours.inner.upstream);
                circuit = ours.inner.circuit;
                break;
            }
            if is_hyper_connect_error(e) {
                not_sent = true;
            }
            next = e.source();
        }
        let mut e = Self::new(kind);
        e.inner.not_sent = not_sent || e.inner.not_sent;
        e.inner.limit = limit;
        e.inner.upstream = upstream;
        e.inner.circuit = circuit;
        e.inner.source = Some(error);
        e
    }

    /// What went wrong.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// use tower_resend::{ErrorKind, RetryAdvice};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// // A POST to an upstream that never answers, under a key the stack chose.
    /// let hangs = service_fn(|_: http::Request<_>| std::future::pending::<Result<http::Response<String>, tower_resend::BoxError>>());
    /// let stack = tower_resend::stack().idempotency_keys().attempt_timeout(Duration::from_secs(1)).max_attempts(1).service(hangs);
    /// let post = http::Request::post("/charges").body(String::new()).unwrap();
    /// let err = stack.oneshot(post).await.unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::OutcomeUnknown);
    /// # }
    /// ```
    pub fn kind(&self) -> ErrorKind {
        self.inner.kind
    }

    /// True when the request cannot have reached the server: the connection
    /// was refused, timed out, or failed before anything was written (DNS,
    /// TLS handshake). Such a request is always safe to send again.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::ServiceExt;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// // Nothing listens on port 9 of this machine: the connection is refused.
    /// let stack = tower_resend::stack().max_attempts(1).service(tower_resend::hyper_client(Duration::from_secs(2)));
    /// let post = http::Request::post("http://127.0.0.1:9/charges").body(String::new()).unwrap();
    /// let err = stack.oneshot(post).await.unwrap_err();
    /// assert!(err.is_not_sent()); // safe to send again, POST or not
    /// # }
    /// ```
    pub fn is_not_sent(&self) -> bool {
        self.inner.not_sent
    }

    /// True when the upstream did nothing with this call: the request
    /// [never reached it](Self::is_not_sent), or every attempt made was
    /// answered in a way that says it was not acted on (see
    /// [`Attempts::none_processed`]: not sent, 408, 425, 429).
    ///
    /// Running the whole operation again is then safe, even without an
    /// Idempotency-Key. When false, the upstream may have acted (an attempt
    /// timed out in flight, a 5xx, a connection lost mid-response): the
    /// outcome is unknown unless the upstream deduplicates. A server uses
    /// this to tell "nothing was done, the operation may run again" from
    /// "outcome unknown".
    ///
    /// ```
    /// use tower_resend::Error;
    ///
    /// fn may_run_again(e: &Error) -> bool {
    ///     e.nothing_processed()
    /// }
    /// # let _ = may_run_again;
    /// ```
    pub fn nothing_processed(&self) -> bool {
        self.inner.not_sent
            || self
                .inner
                .history
                .as_ref()
                .is_some_and(Attempts::none_processed)
    }

    /// True for [`ErrorKind::DeadlineExceeded`].
    pub fn is_deadline_exceeded(&self) -> bool {
        self.inner.kind == ErrorKind::DeadlineExceeded
    }

    /// True for every kind of timeout: deadline, attempt and connect.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self.inner.kind,
            ErrorKind::DeadlineExceeded | ErrorKind::AttemptTimeout | ErrorKind::ConnectTimeout
        )
    }

    /// For [`ErrorKind::DeadlineExceeded`]: what the call was doing when the
    /// deadline ran out.
    pub fn phase(&self) -> Option<Phase> {
        self.inner.phase
    }

    /// The limit that fired, for attempt and connect timeouts; for
    /// [`ErrorKind::CircuitOpen`], how long the circuit stays open (for a
    /// half-open circuit whose probes are all out, a break's length).
    pub fn limit(&self) -> Option<Duration> {
        self.inner.limit
    }

    /// The upstream's name, when the stack was named.
    pub fn upstream(&self) -> Option<&str> {
        self.inner.upstream.as_deref()
    }

    /// The attempts made before this error, when a layer counted them (0 if
    /// none did).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// use tower_resend::{ErrorKind, RetryAdvice};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// // A POST to an upstream that never answers, under a key the stack chose.
    /// let hangs = service_fn(|_: http::Request<_>| std::future::pending::<Result<http::Response<String>, tower_resend::BoxError>>());
    /// let stack = tower_resend::stack().idempotency_keys().attempt_timeout(Duration::from_secs(1)).max_attempts(1).service(hangs);
    /// let post = http::Request::post("/charges").body(String::new()).unwrap();
    /// let err = stack.oneshot(post).await.unwrap_err();
    /// assert_eq!(err.attempts(), 1);
    /// # }
    /// ```
    pub fn attempts(&self) -> u32 {
        self.inner.attempts
    }

    /// What each attempt got and how long the call waited between them, when
    /// a retry layer ran the call.
    pub fn history(&self) -> Option<&Attempts> {
        self.inner.history.as_ref()
    }

    /// True for [`ErrorKind::OutcomeUnknown`]: the server may have acted on
    /// the request; verify before sending it again.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// use tower_resend::{ErrorKind, RetryAdvice};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// // A POST to an upstream that never answers, under a key the stack chose.
    /// let hangs = service_fn(|_: http::Request<_>| std::future::pending::<Result<http::Response<String>, tower_resend::BoxError>>());
    /// let stack = tower_resend::stack().idempotency_keys().attempt_timeout(Duration::from_secs(1)).max_attempts(1).service(hangs);
    /// let post = http::Request::post("/charges").body(String::new()).unwrap();
    /// let err = stack.oneshot(post).await.unwrap_err();
    /// // The upstream may have charged: look it up before sending again.
    /// assert!(err.is_outcome_unknown());
    /// # }
    /// ```
    pub fn is_outcome_unknown(&self) -> bool {
        self.inner.kind == ErrorKind::OutcomeUnknown
    }

    /// What a caller that owns the retries (a job runner) should do now.
    ///
    /// ```
    /// use tower_resend::{Error, RetryAdvice};
    ///
    /// fn after_failure(e: &Error) -> &'static str {
    ///     match e.retry_advice() {
    ///         RetryAdvice::After(_) => "release the job for later",
    ///         RetryAdvice::VerifyFirst => "look the resource up before sending again",
    ///         RetryAdvice::Never => "fail the job for a person to review",
    ///         _ => "fail the job",
    ///     }
    /// }
    /// # let _ = after_failure;
    /// ```
    pub fn retry_advice(&self) -> RetryAdvice {
        const LATER: Duration = Duration::from_secs(1);
        let last = self.inner.history.as_ref().and_then(Attempts::last);
        let wait = last.and_then(Attempt::server_wait).unwrap_or(LATER);
        match self.inner.kind {
            // The server replayed the recorded failure of an earlier attempt
            // (a handler cut by its deadline, say): the same key gets the same
            // answer for the record's life, and the work may be half done.
            ErrorKind::OutcomeUnknown if self.replayed() => RetryAdvice::VerifyFirst,
            ErrorKind::OutcomeUnknown if self.inner.key.is_some() => RetryAdvice::SameKey(wait),
            ErrorKind::OutcomeUnknown => RetryAdvice::VerifyFirst,
            // Not sent, but sending again before the circuit closes fails
            // the same way.
            ErrorKind::CircuitOpen => RetryAdvice::After(self.inner.limit.unwrap_or(LATER)),
            // Not sent, and the upstream's stated quota has no room before
            // its reset (the limit).
            ErrorKind::QuotaSpent => RetryAdvice::After(self.inner.limit.unwrap_or(LATER)),
            // Not sent, and the upstream is rejecting most calls, or its
            // fleet has more in flight than it serves: later.
            ErrorKind::Throttled | ErrorKind::AtCapacity => RetryAdvice::After(LATER),
            _ if self.inner.not_sent => RetryAdvice::After(Duration::ZERO),
            _ if last.is_some_and(|a| a.class() == Class::Rejected) => RetryAdvice::Never,
            // A retry was needed and could not be made: unless nothing was
            // processed, the server may have acted.
            ErrorKind::BodyNotReplayable if !self.nothing_processed() => RetryAdvice::VerifyFirst,
            _ => RetryAdvice::After(wait),
        }
    }

    /// True when the call's last answer was one the server replayed from
    /// its idempotency store.
    fn replayed(&self) -> bool {
        self.inner
            .history
            .as_ref()
            .and_then(Attempts::last)
            .is_some_and(Attempt::replayed)
    }

    /// The Idempotency-Key the call was sent under (the one resend chose,
    /// or the caller's own): a retry by the caller must carry this same key.
    /// Set on errors of keyed calls that may have been processed, which are
    /// then [`OutcomeUnknown`](ErrorKind::OutcomeUnknown) with the advice
    /// [`RetryAdvice::SameKey`] — also a call whose last answer left it
    /// unsettled: another attempt under the key still running (409), or a
    /// shed 503 after an earlier attempt that may have run. The operation
    /// may be done or under way; sent again with the same key, the
    /// server's record answers. A key resend chose is also set on an error
    /// of a call that was not processed (safe to send again either way).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// use tower_resend::{ErrorKind, RetryAdvice};
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// // A POST to an upstream that never answers, under a key the stack chose.
    /// let hangs = service_fn(|_: http::Request<_>| std::future::pending::<Result<http::Response<String>, tower_resend::BoxError>>());
    /// let stack = tower_resend::stack().idempotency_keys().attempt_timeout(Duration::from_secs(1)).max_attempts(1).service(hangs);
    /// let post = http::Request::post("/charges").body(String::new()).unwrap();
    /// let err = stack.oneshot(post).await.unwrap_err();
    /// let key = err.idempotency_key().expect("the key the stack chose");
    /// assert!(matches!(err.retry_advice(), RetryAdvice::SameKey(_)));
    /// # let _ = key;
    /// # }
    /// ```
    pub fn idempotency_key(&self) -> Option<&str> {
        self.inner.key.as_ref().and_then(|k| k.to_str().ok())
    }

    /// How long the call (or, for an attempt or connect timeout, the attempt)
    /// ran before it failed, when a layer measured it.
    pub fn elapsed(&self) -> Option<Duration> {
        self.inner.elapsed
    }
}

/// The kind of a refusal by a layer that sent nothing because what it
/// knows of the upstream says that a resend now would be refused too (a
/// circuit breaker's, [`ErrorKind::CircuitOpen`]; a fleet's at capacity,
/// [`ErrorKind::AtCapacity`]; a pacing layer's whose quota is spent,
/// [`ErrorKind::QuotaSpent`]), when `e` is one, anywhere in its chain.
pub(crate) fn refused_below(e: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    std::iter::successors(Some(e), |e| e.source()).find_map(|e| {
        let kind = e.downcast_ref::<Error>()?.kind();
        matches!(
            kind,
            ErrorKind::CircuitOpen | ErrorKind::AtCapacity | ErrorKind::QuotaSpent
        )
        .then_some(kind)
    })
}

#[cfg(feature = "hyper-client")]
fn is_hyper_connect_error(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<hyper_util::client::legacy::Error>()
        .is_some_and(hyper_util::client::legacy::Error::is_connect)
}

#[cfg(not(feature = "hyper-client"))]
fn is_hyper_connect_error(_: &(dyn std::error::Error + 'static)) -> bool {
    false
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests;
