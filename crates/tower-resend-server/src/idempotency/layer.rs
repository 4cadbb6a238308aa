//! [`IdempotencyLayer`]: the configuration by value, and the layer.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::HeaderName;
use tower_layer::Layer;

use super::backend::Backend;
use super::config::{
    clamped, Anonymous, Config, Scope, LEASE_RANGE, RECORD_TTL_RANGE, RETRY_AFTER_RANGE,
    STORE_TIMEOUT_RANGE,
};
#[cfg(doc)]
use super::config::{
    DEFAULT_LEASE, DEFAULT_RECORD_TTL, DEFAULT_REQUEST_CAP, DEFAULT_RESPONSE_CAP,
    DEFAULT_RETRY_AFTER, DEFAULT_STORE_RETRY_FOR, DEFAULT_STORE_TIMEOUT, X_API_KEY,
};
use super::service::Idempotency;
use super::stats::IdempotencyStats;

/// Answers a repeated `Idempotency-Key` with the first result instead of
/// doing the work twice; see the [module docs](crate::idempotency).
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_resend_server::{IdempotencyLayer, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let runs = Arc::new(AtomicUsize::new(0));
/// let counted = runs.clone();
/// let svc = IdempotencyLayer::new(MemoryStore::new()).layer(service_fn(move |_req| {
///     counted.fetch_add(1, Ordering::SeqCst);
///     async { Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Empty::<bytes::Bytes>::new())) }
/// }));
/// for _ in 0..2 {
///     let req = http::Request::post("/orders").header("idempotency-key", "order-7").body(http_body_util::Empty::<bytes::Bytes>::new()).unwrap();
///     svc.clone().oneshot(req).await.unwrap();
/// }
/// assert_eq!(runs.load(Ordering::SeqCst), 1);
/// # }
/// ```
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
            config: Config::new(),
        }
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
    /// first caller alone (a per-session token, say), besides the
    /// [`EXCHANGE_HEADERS`](crate::EXCHANGE_HEADERS) left out by default.
    /// `Set-Cookie` is never stored whatever this says, nor are hop-by-hop
    /// headers.
    #[must_use]
    pub fn per_caller_header(mut self, header: HeaderName) -> Self {
        let mut all = self.config.per_caller.to_vec();
        if !all.contains(&header) {
            all.push(header);
        }
        self.config.per_caller = all.into();
        self
    }

    /// Stores and replays `header` although it is one of the
    /// [`EXCHANGE_HEADERS`](crate::EXCHANGE_HEADERS) left out by default
    /// (a `Date` a client compares, say).
    ///
    /// ```
    /// use tower_resend_server::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .replayed_header(http::header::DATE)
    ///     .per_caller_header(http::HeaderName::from_static("x-session"));
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn replayed_header(mut self, header: HeaderName) -> Self {
        let kept: Vec<HeaderName> = self
            .config
            .per_caller
            .iter()
            .filter(|h| **h != header)
            .cloned()
            .collect();
        self.config.per_caller = kept.into();
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

impl<S, St: Backend> Idempotency<S, St> {
    /// Wraps `inner` with the defaults of [`IdempotencyLayer::new`].
    pub fn new(inner: S, store: St) -> Self {
        IdempotencyLayer::new(store).layer(inner)
    }

    /// An [`IdempotencyLayer`] over `store`.
    pub fn layer(store: St) -> IdempotencyLayer<St> {
        IdempotencyLayer::new(store)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::DEFAULT_LEASE;
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
