use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use tower_layer::Layer;

use super::service::Idempotency;
use crate::store::{Store, Ttl};

/// The default lease: 60 s. A holder that dies is replaced after it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// The default life of a finished record: 24 h.
pub const DEFAULT_RECORD_TTL: Duration = Duration::from_secs(24 * 3600);
/// The default cap on a request body read to fingerprint it: 1 MiB.
pub const DEFAULT_REQUEST_CAP: usize = 1024 * 1024;
/// The default cap on a response body stored for replay: 1 MiB.
pub const DEFAULT_RESPONSE_CAP: usize = 1024 * 1024;
/// The default time a store may take to answer before the layer gives up
/// (503): 2 s.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(2);
/// The default `Retry-After` on a 409 (same key in progress): 1 s.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The scope of a request's key: borrowed when it is a constant (the
/// default scope's `anonymous`), so that it costs no allocation.
pub(crate) type ScopeFn = dyn Fn(&Parts) -> Cow<'static, str> + Send + Sync;
pub(crate) type RequireFn = dyn Fn(&Parts) -> bool + Send + Sync;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) ttl: Ttl,
    pub(crate) request_cap: usize,
    pub(crate) response_cap: usize,
    pub(crate) store_timeout: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) require: Option<Arc<RequireFn>>,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("ttl", &self.ttl)
            .field("request_cap", &self.request_cap)
            .field("response_cap", &self.response_cap)
            .field("store_timeout", &self.store_timeout)
            .field("retry_after", &self.retry_after)
            .field("require", &self.require.is_some())
            .finish_non_exhaustive()
    }
}

/// Answers a repeated `Idempotency-Key` with the first result instead of
/// doing the work twice; see the [module docs](crate::idempotency).
#[derive(Clone, Debug)]
pub struct IdempotencyLayer<St> {
    store: St,
    config: Config,
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer keeping its records in `store`, with the defaults: a
    /// [`DEFAULT_LEASE`] (60 s) lease, records kept [`DEFAULT_RECORD_TTL`]
    /// (24 h), request and response bodies capped at 1 MiB, keys optional,
    /// scoped by [`authorization_scope`](super::authorization_scope).
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
                scope: Arc::new(super::request::default_scope),
                require: None,
            },
        }
    }

    /// How long a lease holds: a request whose holder died (the process
    /// crashed) runs again after it. Make it longer than the slowest
    /// handler. Default [`DEFAULT_LEASE`] (60 s).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.ttl.lease = lease;
        self
    }

    /// How long a finished operation's response is kept for replay. Default
    /// [`DEFAULT_RECORD_TTL`] (24 h).
    #[must_use]
    pub fn record_ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl.record = ttl;
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

    /// How long the store may take to answer before the request fails
    /// closed with 503. Default [`DEFAULT_STORE_TIMEOUT`] (2 s).
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.config.store_timeout = timeout;
        self
    }

    /// The `Retry-After` sent with 409 while the same key is in progress.
    /// Default [`DEFAULT_RETRY_AFTER`] (1 s).
    #[must_use]
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.config.retry_after = after;
        self
    }

    /// Scopes keys by the caller's identity, as `scope` reads it from the
    /// request (a tenant or account id set by authentication, say), so no
    /// caller can replay another's response. Default
    /// [`authorization_scope`](super::authorization_scope): a hash of the
    /// `Authorization` header.
    #[must_use]
    pub fn scope_with(mut self, scope: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.config.scope = Arc::new(move |parts| Cow::Owned(scope(parts)));
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
}

impl<S, St: Store> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_parts(inner, self.store.clone(), self.config.clone())
    }
}
