//! A circuit breaker per upstream: while the upstream looks unwell, calls
//! fail at once instead of waiting on it.
//!
//! [`CircuitBreakerLayer`] counts, over a sliding window, the attempts that
//! say the upstream is unwell: by default the [classifier](crate::classify)'s
//! [`Unknown`](crate::classify::Class::Unknown) (5xx, timeouts, resets),
//! [`Overloaded`](crate::classify::Class::Overloaded) (429, 503) and
//! [`NotSent`](crate::classify::Class::NotSent) (refused or timed-out
//! connections), and never a [`Rejected`](crate::classify::Class::Rejected)
//! answer, which is about the request. The other answers count as
//! successes: the upstream answered sanely.
//!
//! - **Closed**: calls go through. When at least `min_throughput` calls
//!   (100) ended in the `sampling_window` (30 s) and `failure_ratio` (10 %)
//!   of them failed, the circuit opens.
//! - **Open**: for `break_duration` (5 s) every call fails at once, without
//!   calling the upstream, with a [`tower_resend::Error`](crate::Error) of kind
//!   [`CircuitOpen`](crate::ErrorKind::CircuitOpen): it is
//!   [not sent](crate::Error::is_not_sent) (safe to fall back or send
//!   elsewhere), and its [advice](crate::Error::retry_advice) is to come
//!   back after the time it stays open.
//! - **Half-open**: the first `probes` calls (3) after the break go through;
//!   the others fail at once. One probe failure opens the circuit again for
//!   a whole break; when all the probes succeed it closes, with an empty
//!   window.
//!
//! Every change of state is one tracing event, named with the upstream:
//! `warn` when it opens (with the counts), `info` when it half-opens and
//! closes. The defaults are Polly's and seatbelt's; Polly probes with a
//! single call, which one lucky answer can fool, so the breaker asks three
//! in a row: a dead upstream costs three attempts per break (0.6 a second),
//! and the three go out at once, so closing takes one probe's time.
//!
//! Place it inside the retry layer, so that it sees every attempt, and
//! outside the attempt timeout, so that it sees the attempts that time out
//! ([`stack`](crate::stack())'s [`circuit_breaker`](crate::stack::StackBuilder::circuit_breaker)
//! does both). It needs a timeout inside it: a probe that never ends holds
//! its place. It counts an attempt by its response head; a body that fails
//! later is not seen.
//!
//! Its state is shared by every clone of the service; each service the
//! layer makes has its own.
//!
//! ```
//! use std::time::Duration;
//! use http::{Request, Response, StatusCode};
//! use tower_resend::{timeout::AttemptTimeoutLayer, breaker::CircuitBreakerLayer, Error, ErrorKind, RetryAdvice};
//! use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // An upstream that never answers.
//! let dead = service_fn(|_req: Request<()>| std::future::pending::<Result<Response<()>, Error>>());
//! let mut client = ServiceBuilder::new()
//!     .layer(CircuitBreakerLayer::new().min_throughput(10).upstream("shipping"))
//!     .layer(AttemptTimeoutLayer::new(Duration::from_millis(200)))
//!     .service(dead);
//!
//! // Ten attempts time out: 100 % of 10 calls failed.
//! for _ in 0..10 {
//!     let err = client.ready().await.unwrap().call(Request::new(())).await.unwrap_err();
//!     assert_eq!(Error::from_box(err).kind(), ErrorKind::AttemptTimeout);
//! }
//! // Open: the next call fails at once, and says when to come back.
//! let start = tokio::time::Instant::now();
//! let err = Error::from_box(client.oneshot(Request::new(())).await.unwrap_err());
//! assert_eq!(start.elapsed(), Duration::ZERO);
//! assert_eq!(err.kind(), ErrorKind::CircuitOpen);
//! assert!(err.is_not_sent());
//! assert_eq!(err.retry_advice(), RetryAdvice::After(Duration::from_secs(5)));
//! assert_eq!(err.to_string(), "shipping: circuit open for another 5 s after 100% of 10 calls failed");
//! # }
//! ```
//!
//! In the composed stack, with the defaults or configured:
//!
//! ```
//! use std::time::Duration;
//! use tower_resend::classify::Class;
//! use tower_resend::breaker::CircuitBreakerLayer;
//!
//! let breaker = CircuitBreakerLayer::new()
//!     .failure_ratio(0.5)
//!     .unwrap()
//!     .break_duration(Duration::from_secs(10))
//!     .failure_classes([Class::Unknown, Class::NotSent]);
//! let shipping = tower_resend::stack()
//!     .name("shipping") // names the breaker too
//!     .circuit_breaker_with(breaker);
//! # let _ = shipping;
//! ```

mod future;
mod layer;
mod per_instance;
mod rules;
mod service;
mod shared;
mod slot;
pub(crate) mod state;
mod window;

pub use future::ResponseFuture;
pub use layer::{
    CircuitBreakerLayer, InvalidCircuitBreaker, DEFAULT_BREAK_DURATION, DEFAULT_FAILURE_RATIO,
    DEFAULT_MIN_THROUGHPUT, DEFAULT_PROBES, DEFAULT_SAMPLING_WINDOW,
};
pub use service::CircuitBreaker;
pub(crate) use slot::sealed::WrapsBreaker;
pub use slot::{BreakerSlot, NoBreaker};

/// The state of a circuit, from [`CircuitBreaker::state`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CircuitState {
    /// Calls go through and are counted.
    Closed,
    /// Calls fail at once.
    Open,
    /// A few probes go through; the other calls fail at once.
    HalfOpen,
}

#[cfg(test)]
mod tests;
