//! Reading what an answer says of the caller's quota, in every common form
//! (the table is in the [module docs](super)).

use std::time::Duration;

use http::HeaderName;

/// What one answer said of one quota: a policy (and partition, when the
/// server partitions it), what is left of it, and when it is whole again.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Quota {
    /// The form it was read from.
    pub form: Form,
    /// The policy's name: the IETF fields' identifier, the model APIs'
    /// resource (`requests`, `tokens`, `input-tokens`…), `default` for the
    /// forms that name none, or the name given to a form of your own.
    pub policy: Box<str>,
    /// The IETF fields' partition key (`pk`), when the server gave one.
    pub partition: Option<Box<[u8]>>,
    /// The quota's size, when the answer said it.
    pub limit: Option<u64>,
    /// What is left of it.
    pub remaining: u64,
    /// How long until it is whole again (at most the reader's cap).
    pub reset: Duration,
    /// The policy's window, when the answer said it (`w`).
    pub window: Option<Duration>,
}

/// The forms a [`QuotaReader`] reads; see the [module docs](super).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Form {
    /// `RateLimit-Policy` and `RateLimit`: the IETF fields (draft 09 on),
    /// structured fields.
    Ietf,
    /// `RateLimit-Limit`, `-Remaining`, `-Reset` (delta seconds), or one
    /// `RateLimit: limit=…, remaining=…, reset=…`: the earlier drafts'.
    Draft,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset` (delta seconds, or an
    /// epoch time in seconds: told apart by size).
    XRateLimit,
    /// `X-Rate-Limit-Limit`, `-Remaining`, `-Reset`, the same way.
    XRateDashLimit,
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, the reset a
    /// duration (`6m0s`): OpenAI's and the APIs that follow it.
    ModelDuration,
    /// `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
    /// {limit,remaining,reset}`, the reset an RFC 3339 time.
    ModelTime,
    /// A form of your own ([`QuotaReader::form`]).
    Custom,
}

/// Why a value read off the wire was not taken as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Doubt {
    /// It does not parse (garbage, a wrong type, a missing member).
    Malformed,
    /// It is negative.
    Negative,
    /// Its reset (or `Retry-After`) lies past the reader's cap: read as
    /// the cap.
    PastCap,
}

/// A value not taken as it was, and its field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Doubted {
    /// The field.
    pub field: HeaderName,
    /// Why.
    pub doubt: Doubt,
}

/// Everything one answer's headers said of the caller's quotas.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reading {
    /// The quotas, in the order of the forms of the module docs' table.
    pub quotas: Vec<Quota>,
    /// The `Retry-After` of a 429 or a 403 (at most the cap): the quota is
    /// spent until then, whatever the other fields say.
    pub retry_after: Option<Duration>,
    /// The values not taken as they were.
    pub doubted: Vec<Doubted>,
}

/// A form of your own: the names of its three fields.
#[derive(Clone, Debug)]
pub(super) struct Custom {
    pub(super) policy: Box<str>,
    /// Limit, remaining, reset.
    pub(super) names: [HeaderName; 3],
}

/// Reads the quota an upstream states on its answers (its
/// [`read`](Self::read) is in `fields.rs`, beside the reading of each
/// form).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use http::{HeaderMap, StatusCode};
/// use tower_resend::quota::QuotaReader;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("ratelimit-policy", r#""default";q=100;w=60"#.parse().unwrap());
/// headers.insert("ratelimit", r#""default";r=15;t=40"#.parse().unwrap());
/// let reading = QuotaReader::new().read(StatusCode::OK, &headers, SystemTime::now());
/// let q = &reading.quotas[0];
/// assert_eq!((q.limit, q.remaining, q.reset), (Some(100), 15, Duration::from_secs(40)));
/// assert_eq!(q.window, Some(Duration::from_secs(60)));
/// ```
#[derive(Clone, Debug)]
pub struct QuotaReader {
    pub(super) cap: Duration,
    pub(super) custom: Vec<Custom>,
}

/// The longest reset a reader takes as it is, by default: 10 minutes.
pub const DEFAULT_RESET_CAP: Duration = Duration::from_secs(600);

/// Values at or over this are epoch times, under it delta seconds
/// (2001-09-09 as an epoch time; 31 years as a delta).
pub(super) const EPOCH_FROM: u64 = 1_000_000_000;

impl Default for QuotaReader {
    fn default() -> Self {
        Self::new()
    }
}

impl QuotaReader {
    /// Reads every form of the module docs' table; a reset past
    /// [`DEFAULT_RESET_CAP`] is read as the cap.
    pub const fn new() -> Self {
        Self {
            cap: DEFAULT_RESET_CAP,
            custom: Vec::new(),
        }
    }

    /// The longest reset (and `Retry-After`) taken as it is; a longer one
    /// is read as this, and doubted ([`Doubt::PastCap`]): nothing read off
    /// the wire makes the caller wait longer. Default: 10 minutes.
    #[must_use]
    pub const fn cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self
    }

    /// The longest reset taken as it is.
    pub(crate) const fn reset_cap(&self) -> Duration {
        self.cap
    }

    /// Also reads a form of your own, named `policy`: three fields, the
    /// limit, what remains, and the reset in delta seconds (or an epoch
    /// time, told apart as `X-RateLimit-Reset`'s).
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_resend::quota::QuotaReader;
    ///
    /// let reader = QuotaReader::new().form(
    ///     "search",
    ///     HeaderName::from_static("x-search-quota"),
    ///     HeaderName::from_static("x-search-left"),
    ///     HeaderName::from_static("x-search-reset"),
    /// );
    /// # let _ = reader;
    /// ```
    #[must_use]
    pub fn form(
        mut self,
        policy: &str,
        limit: HeaderName,
        remaining: HeaderName,
        reset: HeaderName,
    ) -> Self {
        self.custom.push(Custom {
            policy: policy.into(),
            names: [limit, remaining, reset],
        });
        self
    }
}
