//! Quotas the upstream states (feature `quota`): reading every common form
//! of rate-limit fields off an answer, so that a caller can pace itself and
//! never be refused.
//!
//! [`QuotaReader::read`] takes an answer's status and headers and returns a
//! [`Reading`]: a [`Quota`] per policy (and partition) it found, the
//! `Retry-After` of a 429 or a 403, and the values it did not take as they
//! were ([`Doubted`]). The forms it reads, one row each (a test per row):
//!
//! | form | fields | reset |
//! |---|---|---|
//! | [IETF](Form::Ietf) (draft 09 on) | `RateLimit-Policy: "default";q=100;w=60` and `RateLimit: "default";r=15;t=40`: structured field lists, several policies, `pk` partition keys, the identifier a String or a Token | `t`, delta seconds; without it, the policy's window `w` |
//! | [earlier drafts](Form::Draft) | `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (`RateLimit-Limit: 100, 100;w=60` names its quota first); or one `RateLimit: limit=100, remaining=15, reset=40` | delta seconds |
//! | [`X-RateLimit-*`](Form::XRateLimit) | `X-RateLimit-Limit`, `-Remaining`, `-Reset` (GitHub's, and many) | delta seconds, or an epoch time in seconds: a value of 10⁹ or more is a time (GitHub's `1372700873`), less a delta |
//! | [`X-Rate-Limit-*`](Form::XRateDashLimit) | `X-Rate-Limit-Limit`, `-Remaining`, `-Reset` | the same |
//! | [model APIs, durations](Form::ModelDuration) | `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests`, and `-tokens` (OpenAI's) | a duration: `6m0s`, `1.5s`, `20ms` |
//! | [model APIs, times](Form::ModelTime) | `anthropic-ratelimit-requests-limit`, `-remaining`, `-reset`, and `tokens`, `input-tokens`, `output-tokens` | an RFC 3339 time |
//! | [your own](Form::Custom) | three names given to [`QuotaReader::form`] | as `X-RateLimit-Reset` |
//! | `Retry-After` on a 429 or a 403 | [`Reading::retry_after`]: the quota is spent until then | delta seconds or an HTTP-date |
//!
//! A form is read when its "remaining" field is there (the IETF form: when
//! `RateLimit` is). Values from a peer are bounded: a reset (or a
//! `Retry-After`) past the reader's [cap](QuotaReader::cap), 10 minutes by
//! default, is read as the cap, so that nothing read off the wire makes a
//! caller wait longer (the IETF draft's security section warns of exactly
//! this); a negative or malformed value is not taken; each is
//! [doubted](Doubted), for the caller to count.
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use http::{HeaderMap, StatusCode};
//! use tower_resend::quota::{Doubt, Form, QuotaReader};
//!
//! // A model API's answer: requests and tokens, resets as durations.
//! let mut headers = HeaderMap::new();
//! headers.insert("x-ratelimit-limit-requests", "60".parse().unwrap());
//! headers.insert("x-ratelimit-remaining-requests", "59".parse().unwrap());
//! headers.insert("x-ratelimit-reset-requests", "1s".parse().unwrap());
//! headers.insert("x-ratelimit-limit-tokens", "150000".parse().unwrap());
//! headers.insert("x-ratelimit-remaining-tokens", "149984".parse().unwrap());
//! headers.insert("x-ratelimit-reset-tokens", "6m0s".parse().unwrap());
//! let reading = QuotaReader::new().read(StatusCode::OK, &headers, SystemTime::now());
//! let tokens = reading.quotas.iter().find(|q| &*q.policy == "tokens").unwrap();
//! assert_eq!(tokens.form, Form::ModelDuration);
//! assert_eq!((tokens.remaining, tokens.reset), (149_984, Duration::from_secs(360)));
//!
//! // A hostile reset: read as the cap, and doubted.
//! let mut headers = HeaderMap::new();
//! headers.insert("x-ratelimit-remaining", "0".parse().unwrap());
//! headers.insert("x-ratelimit-reset", "999999999".parse().unwrap());
//! let reading = QuotaReader::new().cap(Duration::from_secs(120)).read(StatusCode::OK, &headers, SystemTime::now());
//! assert_eq!(reading.quotas[0].reset, Duration::from_secs(120));
//! assert_eq!(reading.doubted[0].doubt, Doubt::PastCap);
//! ```
//!
//! # Pacing
//!
//! A [`PaceLayer`] (on a stack: [`StackBuilder::pace`](crate::stack::StackBuilder::pace))
//! reads the answers with its reader and keeps what it said of each quota
//! (per policy and partition, at most 16): what is left, and when it is
//! whole again. Then, for each call:
//!
//! - **Paced**: the calls that remain are spread over the time that
//!   remains, one every `time left / calls left` (a GCRA schedule), with a
//!   [burst](PaceLayer::burst) of a few at once. A call whose place is
//!   later waits for it; calls out (sent, or waiting for their place) have
//!   spent their share, so that concurrent callers do not all see the same
//!   count. A model API's quota of tokens (spent by an amount the call does
//!   not know beforehand) holds calls back only once spent.
//! - **Spent** (none left, or a 429's or 403's `Retry-After`): a call waits
//!   for the reset if that leaves it at least 50 ms of its deadline
//!   ([`Deadline::of`](crate::Deadline::of)), else fails at once, not sent,
//!   with [`ErrorKind::QuotaSpent`](crate::ErrorKind::QuotaSpent) and
//!   [`RetryAdvice::After`](crate::RetryAdvice::After) the reset; a retry
//!   layer above stops on it at once, and a job runner can requeue it. A
//!   call with no deadline waits at most the reader's cap.
//! - **Read now and then, while far from spent**: while every quota has a
//!   tenth of it and ten calls left (half, for a quota of tokens), an
//!   answer is read at most every 100 ms (and ten times before a reset),
//!   the calls counting themselves against the last reading in between;
//!   so another client's use is seen that late at most. Near the end every
//!   answer is read, and a 429 or a 403 always is.
//! - **At a reset**, the quota is taken as whole again (its stated size,
//!   for its stated window, or the longest reset seen) until an answer
//!   says otherwise. In a window already told of, the lowest count said
//!   holds (an answer that comes late says more is left than it is), and
//!   the earliest reset (a reset in whole seconds is rounded up).
//! - **Bounded**: every reset and `Retry-After` is held to the reader's
//!   cap, so nothing read off the wire holds calls back longer, or makes
//!   one wait past its deadline; values not taken, and quotas past 16, are
//!   counted ([`PaceStats`]).
//!
//! - **Shared by many processes** (feature `quota-redis`):
//!   `PaceLayer::shared_in` keeps the quotas in Redis (`RedisQuota`),
//!   each call's place taken there by a script, so that every process
//!   calling one upstream spends one quota; when Redis fails (within a
//!   50 ms timeout by default), each process paces by its own view, and
//!   says so ([`PaceStats::fallbacks`], a `tracing` warning per outage).
//!
//! In the stack it sits under the hedge and above the deadline header:
//! every attempt and hedged copy takes its place (retries and hedges spend
//! the quota as calls do), its wait is inside the call's deadline and
//! outside the attempt timeout, and the time left written on the request
//! is what is left after the wait. Its clones share one state. Each wait
//! and refusal is a `tracing` event in the attempt's span
//! (`resend.quota.wait_ms`, `resend.quota.reason`; `error.type =
//! "quota_spent"`, `resend.quota.reset_ms`).
//!
//! ```
//! use std::time::Duration;
//! use tower::{service_fn, ServiceExt};
//! use tower_resend::quota::PaceLayer;
//! use tower_resend::ErrorKind;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // An upstream with no call left for 5 s, then for 50 s.
//! let reset = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(5));
//! let upstream = service_fn(move |_: http::Request<String>| {
//!     let t = reset.swap(50, std::sync::atomic::Ordering::SeqCst);
//!     async move {
//!         let resp = http::Response::builder()
//!             .header("ratelimit", format!("\"default\";r=0;t={t}"))
//!             .body(String::new())
//!             .unwrap();
//!         Ok::<_, tower_resend::BoxError>(resp)
//!     }
//! });
//! let pace = PaceLayer::new();
//! let stack = tower_resend::stack().total(Duration::from_secs(10)).pace(pace.clone()).service(upstream);
//! stack.clone().oneshot(http::Request::new(String::new())).await.unwrap();
//! // Within the deadline: it waits for the reset, then goes.
//! let start = tokio::time::Instant::now();
//! stack.clone().oneshot(http::Request::new(String::new())).await.unwrap();
//! assert_eq!(start.elapsed(), Duration::from_secs(5));
//! // Past it: refused at once, not sent.
//! let err = stack.oneshot(http::Request::new(String::new())).await.unwrap_err();
//! assert_eq!(err.kind(), ErrorKind::QuotaSpent);
//! assert_eq!((pace.stats().waits, pace.stats().refused), (1, 1));
//! # }
//! ```

mod clock;
mod fields;
mod future;
mod layer;
#[cfg(feature = "otel")]
mod metrics;
mod pace;
mod read;
#[cfg(feature = "quota-redis")]
mod redis_quota;
mod service;
mod shared;
mod slot;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_pace;
#[cfg(test)]
mod tests_published;

pub use future::ResponseFuture;
pub use layer::{PaceLayer, DEFAULT_BURST};
pub use read::{Doubt, Doubted, Form, Quota, QuotaReader, Reading, DEFAULT_RESET_CAP};
#[cfg(feature = "quota-redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "quota-redis")))]
pub use redis_quota::{RedisQuota, DEFAULT_QUOTA_PREFIX, DEFAULT_RECHECK, DEFAULT_REDIS_TIMEOUT};
pub use service::Pace;
pub use shared::{PaceStats, QuotaLeft};
pub(crate) use slot::sealed::WrapsPace;
pub use slot::{NoPace, PaceSlot};
