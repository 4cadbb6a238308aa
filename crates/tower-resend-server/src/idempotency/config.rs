//! The layer's configuration: its defaults and bounds, and what every
//! service it makes shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::HeaderName;

use super::held::HeldResponses;
use super::running::Running;
use super::stats::IdempotencyStats;
use crate::store::Ttl;

/// The default lease: 10 s, renewed every third of it while the handler
/// runs. A holder that dies (the process crashed) is replaced after it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);
/// The default life of a finished record: 24 h.
pub const DEFAULT_RECORD_TTL: Duration = Duration::from_secs(24 * 3600);
/// The default cap on a request body read to fingerprint it: 1 MiB.
pub const DEFAULT_REQUEST_CAP: usize = 1024 * 1024;
/// The default cap on a response body stored for replay: 1 MiB.
pub const DEFAULT_RESPONSE_CAP: usize = 1024 * 1024;
/// The default time a store may take to answer before the layer gives up
/// (503 before the work; a retry in the background after it): 2 s.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(2);
/// The default `Retry-After` on a 409 (same key in progress): 1 s.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The default time the layer keeps trying to store a response the store
/// did not take (it was down when the work ended): 10 min. Meanwhile this
/// process answers the key from the response it holds.
pub const DEFAULT_STORE_RETRY_FOR: Duration = Duration::from_secs(600);
/// The default header of API keys read by the default scope: `X-Api-Key`.
pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// The bounds of [`IdempotencyLayer::lease`](super::IdempotencyLayer::lease): 100 ms to 1 h.
pub const LEASE_RANGE: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(3600));
/// The bounds of [`IdempotencyLayer::record_ttl`](super::IdempotencyLayer::record_ttl): 100 ms to 366 days.
pub const RECORD_TTL_RANGE: (Duration, Duration) = (
    Duration::from_millis(100),
    Duration::from_secs(366 * 24 * 3600),
);
/// The bounds of [`IdempotencyLayer::store_timeout`](super::IdempotencyLayer::store_timeout): 1 ms to 60 s.
pub const STORE_TIMEOUT_RANGE: (Duration, Duration) =
    (Duration::from_millis(1), Duration::from_secs(60));
/// The bounds of [`IdempotencyLayer::retry_after`](super::IdempotencyLayer::retry_after): 1 s to 1 h.
pub const RETRY_AFTER_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(3600));

pub(crate) type ScopeFn = dyn Fn(&Parts) -> String + Send + Sync;
pub(crate) type RequireFn = dyn Fn(&Parts) -> bool + Send + Sync;

/// What a keyed request from a caller without credentials gets; see
/// [`IdempotencyLayer::anonymous`](super::IdempotencyLayer::anonymous).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Anonymous {
    /// Callers without credentials share one scope, `anonymous`: a repeated
    /// key gets the first result whoever sends it, so their keys must be
    /// unguessable (UUIDs). The default.
    #[default]
    Shared,
    /// A keyed request without credentials gets 400
    /// (`idempotency_key_needs_credentials`), and nothing runs.
    Refuse,
}

/// How the layer scopes keys.
#[derive(Clone)]
pub(crate) enum Scope {
    /// The default: a hash of every credential the caller presents.
    Credentials { api_keys: Arc<[HeaderName]> },
    /// The server's own function.
    Custom(Arc<ScopeFn>),
}

/// Response headers that describe one exchange, not the answer, and are
/// not replayed by default (a replay gets its own `Date` from the server,
/// and ids, rate limits and timings of its own, or none):
/// `Date`; request and trace ids (`X-Request-Id`, `X-Correlation-Id`,
/// `Request-Id`, `traceparent`, `tracestate`); rate-limit headers
/// (`RateLimit`, `RateLimit-Policy`, `RateLimit-Limit`,
/// `RateLimit-Remaining`, `RateLimit-Reset`, and their `X-RateLimit-`
/// forms); `Server-Timing` and `X-Runtime`. [`IdempotencyLayer::per_caller_header`](super::IdempotencyLayer::per_caller_header)
/// adds to the list, [`IdempotencyLayer::replayed_header`](super::IdempotencyLayer::replayed_header)
/// takes a name off it.
pub const EXCHANGE_HEADERS: [HeaderName; 16] = [
    http::header::DATE,
    HeaderName::from_static("x-request-id"),
    HeaderName::from_static("x-correlation-id"),
    HeaderName::from_static("request-id"),
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
    HeaderName::from_static("ratelimit"),
    HeaderName::from_static("ratelimit-policy"),
    HeaderName::from_static("ratelimit-limit"),
    HeaderName::from_static("ratelimit-remaining"),
    HeaderName::from_static("ratelimit-reset"),
    HeaderName::from_static("x-ratelimit-limit"),
    HeaderName::from_static("x-ratelimit-remaining"),
    HeaderName::from_static("x-ratelimit-reset"),
    HeaderName::from_static("server-timing"),
    HeaderName::from_static("x-runtime"),
];

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) ttl: Ttl,
    pub(crate) request_cap: usize,
    pub(crate) response_cap: usize,
    pub(crate) store_timeout: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) store_retry_for: Duration,
    pub(crate) scope: Scope,
    pub(crate) anonymous: Anonymous,
    /// Response headers never stored for replay, besides `Set-Cookie`: the
    /// exchange's own by default.
    pub(crate) per_caller: Arc<[HeaderName]>,
    pub(crate) require: Option<Arc<RequireFn>>,
    /// What every service made by one layer shares: the responses held for
    /// a store that was down, the keys whose work runs, and the counts.
    pub(crate) held: Arc<HeldResponses>,
    pub(crate) running: Arc<Running>,
    pub(crate) stats: IdempotencyStats,
}

impl Config {
    /// The lease of a request whose handler must end by `remaining` (the
    /// inbound deadline's time left): the configured lease, or shorter —
    /// the time left plus one store timeout (to store the end) — so a
    /// holder that dies is replaced soon after its deadline.
    pub(crate) fn lease_for(&self, remaining: Option<Duration>) -> Ttl {
        let mut ttl = self.ttl;
        if let Some(left) = remaining {
            ttl.lease = ttl
                .lease
                .min(left.saturating_add(self.store_timeout))
                .max(LEASE_RANGE.0);
        }
        ttl
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("ttl", &self.ttl)
            .field("request_cap", &self.request_cap)
            .field("response_cap", &self.response_cap)
            .field("store_timeout", &self.store_timeout)
            .field("retry_after", &self.retry_after)
            .field("store_retry_for", &self.store_retry_for)
            .field(
                "scope",
                &match &self.scope {
                    Scope::Credentials { api_keys } => {
                        format!("credentials (api keys {api_keys:?})")
                    }
                    Scope::Custom(_) => "custom".to_owned(),
                },
            )
            .field("anonymous", &self.anonymous)
            .field("per_caller", &self.per_caller)
            .field("require", &self.require.is_some())
            .finish_non_exhaustive()
    }
}

/// `value` within `range`; out of it, the nearest bound, with a warning.
pub(crate) fn clamped(
    what: &'static str,
    value: Duration,
    range: (Duration, Duration),
) -> Duration {
    let v = value.clamp(range.0, range.1);
    if v != value {
        tracing::warn!(
            setting = what,
            given = ?value,
            used = ?v,
            "idempotency setting out of range: the nearest bound is used"
        );
    }
    v
}

/// The store and the config, behind the one `Arc` that each clone of the
/// service (axum makes one per request) and each keyed request share.
#[derive(Debug)]
pub(crate) struct Shared<St> {
    pub(crate) store: St,
    pub(crate) config: Config,
}

impl Config {
    /// The defaults of [`IdempotencyLayer::new`](super::IdempotencyLayer::new)(super::IdempotencyLayer::new).
    pub(crate) fn new() -> Self {
        Self {
            ttl: Ttl {
                lease: DEFAULT_LEASE,
                record: DEFAULT_RECORD_TTL,
            },
            request_cap: DEFAULT_REQUEST_CAP,
            response_cap: DEFAULT_RESPONSE_CAP,
            store_timeout: DEFAULT_STORE_TIMEOUT,
            retry_after: DEFAULT_RETRY_AFTER,
            store_retry_for: DEFAULT_STORE_RETRY_FOR,
            scope: Scope::Credentials {
                api_keys: Arc::new([X_API_KEY]),
            },
            anonymous: Anonymous::Shared,
            per_caller: Arc::new(EXCHANGE_HEADERS),
            require: None,
            held: Arc::default(),
            running: Arc::default(),
            stats: IdempotencyStats::default(),
        }
    }
}
