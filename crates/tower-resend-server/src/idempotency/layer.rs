use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::HeaderName;
use tower_layer::Layer;

use super::backend::Backend;
use super::held::Held;
use super::service::Idempotency;
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

/// The bounds of [`IdempotencyLayer::lease`]: 100 ms to 1 h.
pub const LEASE_RANGE: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(3600));
/// The bounds of [`IdempotencyLayer::record_ttl`]: 100 ms to 366 days.
pub const RECORD_TTL_RANGE: (Duration, Duration) = (
    Duration::from_millis(100),
    Duration::from_secs(366 * 24 * 3600),
);
/// The bounds of [`IdempotencyLayer::store_timeout`]: 1 ms to 60 s.
pub const STORE_TIMEOUT_RANGE: (Duration, Duration) =
    (Duration::from_millis(1), Duration::from_secs(60));
/// The bounds of [`IdempotencyLayer::retry_after`]: 1 s to 1 h.
pub const RETRY_AFTER_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(3600));

/// The most responses one layer holds while the store does not take them.
pub(crate) const MAX_HELD: usize = 10_000;

pub(crate) type ScopeFn = dyn Fn(&Parts) -> String + Send + Sync;
pub(crate) type RequireFn = dyn Fn(&Parts) -> bool + Send + Sync;

/// What a keyed request from a caller without credentials gets; see
/// [`IdempotencyLayer::anonymous`].
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
    /// Response headers never stored for replay, besides `Set-Cookie`.
    pub(crate) per_caller: Arc<[HeaderName]>,
    pub(crate) require: Option<Arc<RequireFn>>,
    /// What every service made by one layer shares: the responses held for
    /// a store that was down, and the counts.
    pub(crate) held: Arc<Held>,
    /// The ticker that wakes waiting handlers to renew their leases.
    pub(crate) renewals: Arc<super::renewals::Renewals>,
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
fn clamped(what: &'static str, value: Duration, range: (Duration, Duration)) -> Duration {
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

/// Answers a repeated `Idempotency-Key` with the first result instead of
/// doing the work twice; see the [module docs](crate::idempotency).
#[derive(Clone, Debug)]
pub struct IdempotencyLayer<St> {
    store: St,
    config: Config,
}

impl<St: Backend> IdempotencyLayer<St> {
    /// A layer keeping its records in `store`, with the defaults: a
    /// [`DEFAULT_LEASE`] (10 s, renewed while the handler runs), records
    /// kept [`DEFAULT_RECORD_TTL`] (24 h), request and response bodies
    /// capped at 1 MiB, keys optional, scoped by every credential the
    /// caller presents ([`credential_scope`](super::credential_scope)),
    /// callers without credentials sharing one scope ([`Anonymous::Shared`]).
    pub fn new(store: St) -> Self {
        Self {
            store,
            config: Config {
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
                per_caller: Arc::new([]),
                require: None,
                held: Arc::default(),
                renewals: Arc::default(),
                stats: IdempotencyStats::default(),
            },
        }
    }

    /// The configuration (for the crate's tests).
    #[cfg(test)]
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// How long a lease holds without renewal. The holder renews it every
    /// third of it while the handler runs, so no second run starts however
    /// long the first takes; a holder that died (the process crashed) is
    /// replaced once it expires. Under an inbound deadline a request's lease
    /// is shorter: the time left plus one [store
    /// timeout](Self::store_timeout). Default [`DEFAULT_LEASE`] (10 s);
    /// values outside [`LEASE_RANGE`] (100 ms to 1 h) are clamped to it, with
    /// a warning.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.ttl.lease = clamped("lease", lease, LEASE_RANGE);
        self
    }

    /// How long a finished operation's response is kept for replay. Default
    /// [`DEFAULT_RECORD_TTL`] (24 h); values outside [`RECORD_TTL_RANGE`]
    /// (100 ms to 366 days) are clamped to it, with a warning.
    #[must_use]
    pub fn record_ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl.record = clamped("record_ttl", ttl, RECORD_TTL_RANGE);
        self
    }

    /// The most bytes of request body read (to fingerprint it); a larger
    /// body gets 413 and nothing runs. Default [`DEFAULT_REQUEST_CAP`] (1 MiB).
    #[must_use]
    pub fn request_cap(mut self, bytes: usize) -> Self {
        self.config.request_cap = bytes;
        self
    }

    /// The most bytes of response body stored; a larger response reaches its
    /// caller whole, and replays carry its status and headers with an empty
    /// body and `Idempotent-Body-Omitted: true`. Default
    /// [`DEFAULT_RESPONSE_CAP`] (1 MiB).
    #[must_use]
    pub fn response_cap(mut self, bytes: usize) -> Self {
        self.config.response_cap = bytes;
        self
    }

    /// How long one store call may take. Before the work, a store that does
    /// not answer in time fails the request closed (503, nothing runs);
    /// after it, the response is held and stored in the background. Default
    /// [`DEFAULT_STORE_TIMEOUT`] (2 s); values outside
    /// [`STORE_TIMEOUT_RANGE`] (1 ms to 60 s) are clamped to it, with a
    /// warning.
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.config.store_timeout = clamped("store_timeout", timeout, STORE_TIMEOUT_RANGE);
        self
    }

    /// The `Retry-After` sent with 409 while the same key is in progress.
    /// Default [`DEFAULT_RETRY_AFTER`] (1 s); values outside
    /// [`RETRY_AFTER_RANGE`] (1 s to 1 h) are clamped to it, with a warning.
    #[must_use]
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.config.retry_after = clamped("retry_after", after, RETRY_AFTER_RANGE);
        self
    }

    /// How long the layer keeps trying to store a final response that the
    /// store did not take when the work ended (it was down). Meanwhile the
    /// response is held in memory and this process answers the key from it;
    /// after it, the response is given up with one error event, and counted
    /// ([`IdempotencyStats::unstored`]). Default
    /// [`DEFAULT_STORE_RETRY_FOR`] (10 min).
    #[must_use]
    pub fn store_retry_for(mut self, period: Duration) -> Self {
        self.config.store_retry_for = period;
        self
    }

    /// Scopes keys by the caller's identity, as `scope` reads it from the
    /// request (a tenant or account id set by authentication, say), so no
    /// caller can replay another's response. It replaces the default scope
    /// (and with it the [`anonymous`](Self::anonymous) rule, which is the
    /// default scope's): the function decides for every request.
    ///
    /// Default: [`credential_scope`](super::credential_scope), a hash of
    /// every credential the request presents — `Authorization`,
    /// `Proxy-Authorization`, `Cookie` and the [API-key
    /// headers](Self::api_key_headers).
    #[must_use]
    pub fn scope_with(mut self, scope: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.config.scope = Scope::Custom(Arc::new(scope));
        self
    }

    /// The headers that carry API keys, read by the default scope besides
    /// `Authorization`, `Proxy-Authorization` and `Cookie`. Default
    /// [`X_API_KEY`] alone.
    #[must_use]
    pub fn api_key_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        if let Scope::Credentials { api_keys } = &mut self.config.scope {
            *api_keys = headers.into_iter().collect();
        }
        self
    }

    /// What a keyed request from a caller that presents no credentials gets
    /// under the default scope. Default [`Anonymous::Shared`].
    #[must_use]
    pub fn anonymous(mut self, rule: Anonymous) -> Self {
        self.config.anonymous = rule;
        self
    }

    /// Never stores `header` for replay: a response header meant for the
    /// first caller alone (a per-session token, say). `Set-Cookie` is never
    /// stored whatever this says, nor are hop-by-hop headers.
    #[must_use]
    pub fn per_caller_header(mut self, header: HeaderName) -> Self {
        let mut all = self.config.per_caller.to_vec();
        all.push(header);
        self.config.per_caller = all.into();
        self
    }

    /// Requires a key on the unsafe requests for which `required` is true
    /// (400 without one). Default: keys are optional.
    #[must_use]
    pub fn require_key_when(
        mut self,
        required: impl Fn(&Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.config.require = Some(Arc::new(required));
        self
    }

    /// Requires a key on every unsafe request (POST, PATCH, …).
    #[must_use]
    pub fn require_key(self) -> Self {
        self.require_key_when(|_| true)
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// What this layer's services have counted: responses stored late or
    /// given up, leases lost. Every service the layer makes shares them.
    pub fn stats(&self) -> IdempotencyStats {
        self.config.stats.clone()
    }

    /// Records the layer's metrics on instruments made from `meter` (your
    /// meter provider's), once, shared by every service the layer makes.
    /// Default: none, and no cost. No attribute carries a key, a scope or
    /// a path.
    ///
    /// | instrument | kind, unit | recorded | attributes |
    /// |---|---|---|---|
    /// | `resend.server.idempotency.replays` | counter, `{request}` | a keyed request answered with the stored response | |
    /// | `resend.server.idempotency.conflicts` | counter, `{request}` | a keyed request refused: 409 (the key still running) or 422 (used with another request) | `resend.idempotency.conflict` (`in_progress`, `mismatch`) |
    /// | `resend.server.idempotency.lease_takeovers` | counter, `{lease}` | a lease found taken over while its holder still worked ([`IdempotencyStats::leases_lost`]) | |
    /// | `resend.server.idempotency.stored_late` | counter, `{response}` | [`IdempotencyStats::stored_late`] | |
    /// | `resend.server.idempotency.unstored` | counter, `{response}` | [`IdempotencyStats::unstored`] | |
    /// | `resend.server.idempotency.held` | gauge, `{response}` | [`IdempotencyStats::held`], at each collection | |
    /// | `resend.server.idempotency.store.duration` | histogram, `s` | every store call of a keyed request, timeouts included | `resend.store.operation` (`begin`, `renew`, `complete`, `release`) |
    /// | `resend.server.idempotency.store.errors` | counter, `{error}` | a store call that failed or timed out | `resend.store.operation` |
    ///
    /// Without a meter, tracing still has a span per keyed request,
    /// `resend.idempotency` at `INFO` (the handler's spans are its
    /// children), with `http.request.method`, `http.response.status_code`
    /// and `resend.idempotency.outcome`: `ran`, `replayed`, `in_progress`
    /// (409), `mismatch` (422), `bad_request` (400: the body could not be
    /// read), `too_large` (413) or `store_unavailable` (503).
    ///
    /// On `PostgresTransactional` (feature `postgres`) the same
    /// span and counts; its store calls are the claim (`begin`, the
    /// transaction begun with the key's row) and the commit with the record
    /// (`complete`). It holds no lease, so it neither renews, releases nor
    /// holds responses.
    ///
    /// The counts of [`stats`](Self::stats) go on from where they were; a
    /// handle taken before this call keeps the old counts, so take it after.
    ///
    /// ```
    /// use tower_resend_server::{IdempotencyLayer, MemoryStore};
    ///
    /// // `provider.meter("tower-resend-server")` from your `SdkMeterProvider`;
    /// // the global provider here, a no-op until one is set.
    /// let meter = opentelemetry::global::meter("tower-resend-server");
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).meter(&meter);
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    #[must_use]
    pub fn meter(mut self, meter: &opentelemetry::metrics::Meter) -> Self {
        self.config.stats = self.config.stats.with_meter(meter);
        self
    }
}

impl<S, St: Backend> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_parts(inner, self.store.clone(), self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    #[test]
    fn settings_out_of_range_are_clamped() {
        let l = IdempotencyLayer::new(MemoryStore::new())
            .lease(Duration::ZERO)
            .record_ttl(Duration::MAX)
            .store_timeout(Duration::ZERO)
            .retry_after(Duration::MAX);
        assert_eq!(l.config.ttl.lease, Duration::from_millis(100));
        assert_eq!(l.config.ttl.record, Duration::from_secs(366 * 24 * 3600));
        assert_eq!(l.config.store_timeout, Duration::from_millis(1));
        assert_eq!(l.config.retry_after, Duration::from_secs(3600));
        let l = l
            .lease(Duration::MAX)
            .record_ttl(Duration::ZERO)
            .store_timeout(Duration::MAX)
            .retry_after(Duration::ZERO);
        assert_eq!(l.config.ttl.lease, Duration::from_secs(3600));
        assert_eq!(l.config.ttl.record, Duration::from_millis(100));
        assert_eq!(l.config.store_timeout, Duration::from_secs(60));
        assert_eq!(l.config.retry_after, Duration::from_secs(1));
        // In range: as given.
        let l = l
            .lease(Duration::from_secs(3))
            .record_ttl(Duration::from_secs(60));
        assert_eq!(l.config.ttl.lease, Duration::from_secs(3));
        assert_eq!(l.config.ttl.record, Duration::from_secs(60));
    }

    #[test]
    fn a_lease_is_sized_from_the_deadline_where_there_is_one() {
        let l = IdempotencyLayer::new(MemoryStore::new());
        // No deadline: the configured lease.
        assert_eq!(l.config.lease_for(None).lease, DEFAULT_LEASE);
        // A short deadline: its time left and one store timeout.
        assert_eq!(
            l.config.lease_for(Some(Duration::from_secs(1))).lease,
            Duration::from_secs(3)
        );
        // A long one: the configured lease, renewed.
        assert_eq!(
            l.config.lease_for(Some(Duration::from_secs(60))).lease,
            DEFAULT_LEASE
        );
        // Never under the least lease.
        let l = l.store_timeout(Duration::from_millis(1));
        assert_eq!(
            l.config.lease_for(Some(Duration::ZERO)).lease,
            LEASE_RANGE.0
        );
    }
}
