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

mod clock;
mod future;
mod layer;
mod pace;
mod read;
mod service;
mod shared;
mod slot;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_pace;

pub use future::ResponseFuture;
pub use layer::{PaceLayer, DEFAULT_BURST};
pub use read::{Doubt, Doubted, Form, Quota, QuotaReader, Reading, DEFAULT_RESET_CAP};
pub use service::Pace;
pub use shared::{PaceStats, QuotaLeft};
pub(crate) use slot::sealed::WrapsPace;
pub use slot::{NoPace, PaceSlot};
