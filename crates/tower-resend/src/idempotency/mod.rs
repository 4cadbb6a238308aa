//! One Idempotency-Key per logical operation, reused on every attempt.
//!
//! [`SetIdempotencyKeyLayer`] gives each request whose method is not idempotent
//! (POST, PATCH, …) and that has no key yet an `Idempotency-Key` header: the
//! [`IdempotencyKey`] the caller put in the request's extensions (derived from
//! the operation, e.g. `shipment-request:42`, so that a job that runs again
//! sends the same key), or else a fresh UUID v4. Placed outside the
//! [`RetryLayer`](crate::retry::RetryLayer), it runs once per call, so every attempt
//! of the call carries the same key, and the retry layer treats the request
//! as replay-safe.
//!
//! Using the layer declares that the upstream honours keys: it answers a
//! repeated key with the first result instead of doing the work twice. A
//! request can opt out with [`NoIdempotencyKey`].
//!
//! # Derived keys
//!
//! A server that runs a keyed operation (an inbound request with an
//! Idempotency-Key) runs its handler inside [`derive_keys`]. There, a request
//! that would get a fresh UUID v4 gets a key derived from the inbound
//! operation instead: from the caller's scope, the inbound key, the
//! upstream's name ([`SetIdempotencyKeyLayer::upstream`], else the URI's
//! authority) and how many keys that upstream has had in the scope so far.
//! When the operation runs again (its first run crashed, or its outcome was
//! lost), the same calls in the same order send the same keys, and each
//! upstream answers with what it did the first time instead of doing it
//! twice. Keys the caller sets still win.
//!
//! ```
//! use http::Request;
//! use tower_resend::{idempotency::SetIdempotencyKeyLayer, IdempotencyKey};
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let svc = SetIdempotencyKeyLayer::new().layer(service_fn(|req: Request<()>| async move {
//!     Ok::<_, std::convert::Infallible>(req.headers()["idempotency-key"].clone())
//! }));
//!
//! let mut req = Request::post("http://shipping/shipments").body(()).unwrap();
//! req.extensions_mut().insert(IdempotencyKey::new("shipment-request:42").unwrap());
//! assert_eq!(svc.clone().oneshot(req).await.unwrap(), "shipment-request:42");
//!
//! // Without one, a UUID v4 is made.
//! let req = Request::post("http://shipping/shipments").body(()).unwrap();
//! assert_eq!(svc.oneshot(req).await.unwrap().len(), 36);
//! # }
//! ```

mod derive;

use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::HeaderName;
use http::{HeaderValue, Request, Uri};
use tower_layer::Layer;
use tower_service::Service;

use crate::classify::{is_idempotent, KEY_HEADERS};
use crate::name::Name;

pub(crate) mod key;

pub use derive::derive_keys;
pub(crate) use key::IdempotencyKey;
pub use key::{validate_key, InvalidIdempotencyKey};

/// The default header: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Where a layer that makes no keys sends the caller's.
static DEFAULT_HEADER: HeaderName = IDEMPOTENCY_KEY;

/// The most characters a key may have.
pub const MAX_KEY_LEN: usize = 255;

/// A request extension: send this request without an Idempotency-Key even
/// though its method is not idempotent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoIdempotencyKey;

/// Gives each unsafe request one Idempotency-Key; see the [module docs](self).
///
/// ```
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_resend::idempotency::SetIdempotencyKeyLayer;
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let svc = SetIdempotencyKeyLayer::new().layer(service_fn(|req: http::Request<()>| async move {
///     Ok::<_, std::convert::Infallible>(req.headers().contains_key("idempotency-key"))
/// }));
/// assert!(svc.clone().oneshot(http::Request::post("/orders").body(()).unwrap()).await.unwrap());
/// assert!(!svc.oneshot(http::Request::get("/orders").body(()).unwrap()).await.unwrap());
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct SetIdempotencyKeyLayer {
    header: HeaderName,
    enabled: bool,
    upstream: Option<Name>,
}

impl SetIdempotencyKeyLayer {
    /// Writes `Idempotency-Key`.
    pub const fn new() -> Self {
        Self {
            header: IDEMPOTENCY_KEY,
            enabled: true,
            upstream: None,
        }
    }

    /// A layer that makes no keys: for a stack whose upstream is not known
    /// to honour them. A key the caller set is still sent.
    pub(crate) const fn disabled() -> Self {
        Self {
            header: IDEMPOTENCY_KEY,
            enabled: false,
            upstream: None,
        }
    }

    /// Writes the key under `header` instead. Default `Idempotency-Key`.
    #[must_use]
    pub fn header(mut self, header: HeaderName) -> Self {
        self.header = header;
        self
    }

    /// Names the upstream, for keys [derived](derive_keys) inside a keyed
    /// operation: each upstream's calls are counted apart. Default: unnamed,
    /// which counts by the request URI's authority (`host:port` as written,
    /// without user info; empty when the URI has none).
    #[must_use]
    pub fn upstream(mut self, name: impl Into<Name>) -> Self {
        self.upstream = Some(name.into());
        self
    }
}

impl Default for SetIdempotencyKeyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for SetIdempotencyKeyLayer {
    type Service = SetIdempotencyKey<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let keys = self.enabled.then(|| {
            Arc::new(Keys {
                header: self.header.clone(),
                upstream: self.upstream.clone(),
            })
        });
        SetIdempotencyKey { inner, keys }
    }
}

/// Middleware that gives unsafe requests an Idempotency-Key; see
/// [`SetIdempotencyKeyLayer`].
#[derive(Clone, Debug)]
pub struct SetIdempotencyKey<S> {
    inner: S,
    /// None: it makes no keys, and sends only the caller's (a stack's
    /// default). Shared: the service is cloned for every call, and its
    /// size is copied each time.
    keys: Option<Arc<Keys>>,
}

/// Which header a key goes in, and the upstream derived keys are counted by.
#[derive(Debug)]
struct Keys {
    header: HeaderName,
    upstream: Option<Name>,
}

impl<S> SetIdempotencyKey<S> {
    /// An [`SetIdempotencyKeyLayer`] with the defaults.
    pub const fn layer() -> SetIdempotencyKeyLayer {
        SetIdempotencyKeyLayer::new()
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// A key for a request that has none: derived inside a keyed operation,
    /// else a UUID v4.
    fn fresh<B>(keys: &Keys, req: &Request<B>) -> HeaderValue {
        let upstream = match &keys.upstream {
            Some(name) => name.as_str(),
            None => authority(req.uri()),
        };
        encode(derive::derived(upstream).unwrap_or_else(uuid::Uuid::new_v4))
    }
}

/// `host:port` as written in `uri`; empty when it has no authority.
fn authority(uri: &Uri) -> &str {
    uri.authority().map_or("", |a| {
        let a = a.as_str();
        a.rsplit_once('@').map_or(a, |(_user, host)| host)
    })
}

/// `key`, hyphenated in lower case.
fn encode(key: uuid::Uuid) -> HeaderValue {
    let mut buf = uuid::Uuid::encode_buffer();
    let s = key.hyphenated().encode_lower(&mut buf);
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid-uuid"))
}

impl<S, B> Service<Request<B>> for SetIdempotencyKey<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        self.write_key(&mut req);
        self.inner.call(req)
    }
}

/// Marks a request whose Idempotency-Key resend chose (generated or
/// derived), not the caller, with the key: an error of such a call that
/// may have been processed says which key a retry must carry.
#[derive(Clone, Debug)]
pub(crate) struct GeneratedKey(pub(crate) HeaderValue);

impl<S> SetIdempotencyKey<S> {
    /// Writes the request's key, if it needs one and has none; returns it
    /// when resend chose it (and then marks the request [`GeneratedKey`]).
    ///
    /// A key the caller set ([`IdempotencyKey`]) is written even by a layer
    /// that makes none (a stack without `idempotency_keys()`): it states
    /// the caller's intent, and makes the request replay-safe.
    pub(crate) fn write_key<B>(&self, req: &mut Request<B>) -> Option<HeaderValue> {
        let keys = self.keys.as_deref();
        let given = req.extensions().get::<IdempotencyKey>();
        let generate = keys.is_some() && !is_idempotent(req.method());
        if given.is_none() && !generate {
            return None;
        }
        let header = keys.map_or(&DEFAULT_HEADER, |k| &k.header);
        // Looked for only when a key is wanted: an idempotent request
        // without one (most GETs) does no header lookups here.
        let has_key = req.headers().contains_key(header)
            || KEY_HEADERS.iter().any(|h| req.headers().contains_key(h));
        if has_key || req.extensions().get::<NoIdempotencyKey>().is_some() {
            return None;
        }
        let (value, chosen) = match (given, keys) {
            (Some(k), _) => (k.0.clone(), false),
            (None, Some(keys)) => (Self::fresh(keys, req), true),
            (None, None) => return None,
        };
        let header = header.clone();
        if !chosen {
            req.headers_mut().insert(header, value);
            return None;
        }
        req.headers_mut().insert(header, value.clone());
        req.extensions_mut().insert(GeneratedKey(value.clone()));
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{service_fn, ServiceExt};

    async fn sent(layer: &SetIdempotencyKeyLayer, req: Request<()>) -> http::HeaderMap {
        layer
            .layer(service_fn(|req: Request<()>| async move {
                Ok::<_, std::convert::Infallible>(req.headers().clone())
            }))
            .oneshot(req)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn unsafe_methods_get_a_key_idempotent_ones_do_not() {
        let l = SetIdempotencyKeyLayer::new();
        for m in ["POST", "PATCH", "CONNECT"] {
            let h = sent(&l, Request::builder().method(m).uri("/").body(()).unwrap()).await;
            let key = h[IDEMPOTENCY_KEY].to_str().unwrap().to_owned();
            assert_eq!(uuid::Uuid::parse_str(&key).unwrap().get_version_num(), 4);
        }
        for m in ["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"] {
            let h = sent(&l, Request::builder().method(m).uri("/").body(()).unwrap()).await;
            assert!(h.get(IDEMPOTENCY_KEY).is_none(), "{m}");
        }
    }

    #[tokio::test]
    async fn two_calls_two_keys_and_existing_keys_are_kept() {
        let l = SetIdempotencyKeyLayer::new();
        let a = sent(&l, Request::post("/").body(()).unwrap()).await;
        let b = sent(&l, Request::post("/").body(()).unwrap()).await;
        assert_ne!(a[IDEMPOTENCY_KEY], b[IDEMPOTENCY_KEY]);

        let h = sent(
            &l,
            Request::post("/")
                .header("x-idempotency-key", "mine")
                .body(())
                .unwrap(),
        )
        .await;
        assert!(h.get(IDEMPOTENCY_KEY).is_none());
        assert_eq!(h["x-idempotency-key"], "mine");

        let mut req = Request::post("/").body(()).unwrap();
        req.extensions_mut().insert(NoIdempotencyKey);
        assert!(sent(&l, req).await.is_empty());

        let l = SetIdempotencyKeyLayer::new().header(HeaderName::from_static("x-request-key"));
        let h = sent(&l, Request::post("/").body(()).unwrap()).await;
        assert_eq!(h["x-request-key"].len(), 36);
    }

    fn post(uri: &str) -> Request<()> {
        Request::post(uri).body(()).unwrap()
    }

    /// The key each request was sent with, through `layer`.
    async fn keys(
        layer: &SetIdempotencyKeyLayer,
        reqs: Vec<Request<()>>,
    ) -> Vec<Option<HeaderValue>> {
        let mut out = Vec::new();
        for req in reqs {
            out.push(sent(layer, req).await.get(IDEMPOTENCY_KEY).cloned());
        }
        out
    }

    /// `keys` inside a keyed operation.
    async fn keyed(
        scope: &'static str,
        key: &'static str,
        layer: &SetIdempotencyKeyLayer,
        reqs: Vec<Request<()>>,
    ) -> Vec<Option<HeaderValue>> {
        derive_keys(scope, HeaderValue::from_static(key), keys(layer, reqs)).await
    }

    fn version(key: &HeaderValue) -> usize {
        uuid::Uuid::parse_str(key.to_str().unwrap())
            .unwrap()
            .get_version_num()
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_keyed_operation_sends_the_same_keys_each_run() {
        let l = SetIdempotencyKeyLayer::new();
        let calls = || {
            vec![
                post("http://shipping/a"),
                post("http://billing/charge"),
                post("http://shipping/b"),
                post("http://shipping/c"),
            ]
        };
        let first = keyed("caller-1", "order-7", &l, calls()).await;
        let again = keyed("caller-1", "order-7", &l, calls()).await;
        assert_eq!(first, again);
        for key in first.iter().map(|k| k.as_ref().unwrap()) {
            assert_eq!(key.len(), 36);
            assert!(validate_key(key.as_bytes()).is_ok());
            assert_eq!(version(key), 5);
            assert_eq!(key.to_str().unwrap(), key.to_str().unwrap().to_lowercase());
        }
        // Every call of the run has a key of its own.
        let mut distinct = first.clone();
        distinct.sort_by(|a, b| {
            a.as_ref()
                .unwrap()
                .as_bytes()
                .cmp(b.as_ref().unwrap().as_bytes())
        });
        distinct.dedup();
        assert_eq!(distinct.len(), 4);

        // Another caller, or another operation: unrelated keys.
        for other in [
            keyed("caller-2", "order-7", &l, calls()).await,
            keyed("caller-1", "order-8", &l, calls()).await,
        ] {
            for k in &other {
                assert!(!first.contains(k), "{k:?}");
            }
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn ordinals_count_per_upstream() {
        let l = SetIdempotencyKeyLayer::new();
        // Shipping's calls get the same keys whether or not billing is
        // called in between.
        let interleaved = keyed(
            "s",
            "k",
            &l,
            vec![
                post("http://billing/1"),
                post("http://shipping/1"),
                post("http://billing/2"),
                post("http://shipping/2"),
            ],
        )
        .await;
        let shipping = keyed(
            "s",
            "k",
            &l,
            vec![post("http://shipping/1"), post("http://shipping/2")],
        )
        .await;
        let billing = keyed(
            "s",
            "k",
            &l,
            vec![post("http://billing/1"), post("http://billing/2")],
        )
        .await;
        assert_eq!(
            interleaved,
            [&billing[0], &shipping[0], &billing[1], &shipping[1]].map(Clone::clone)
        );
        // Paths do not matter, the upstream and the order do.
        let swapped = keyed(
            "s",
            "k",
            &l,
            vec![post("http://shipping/2"), post("http://shipping/1")],
        )
        .await;
        assert_eq!(swapped, shipping);
        assert_ne!(shipping[0], billing[0]);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn caller_keys_win_and_use_up_no_ordinal() {
        let l = SetIdempotencyKeyLayer::new();
        let plain = keyed("s", "k", &l, vec![post("http://up/"), post("http://up/")]).await;

        let mut given = post("http://up/");
        given
            .extensions_mut()
            .insert(IdempotencyKey::new("mine").unwrap());
        let mut opted_out = post("http://up/");
        opted_out.extensions_mut().insert(NoIdempotencyKey);
        let header = Request::post("http://up/")
            .header("x-idempotency-key", "theirs")
            .body(())
            .unwrap();
        let own_header = Request::post("http://up/")
            .header(IDEMPOTENCY_KEY, "ours")
            .body(())
            .unwrap();
        let get = Request::get("http://up/").body(()).unwrap();
        let mixed = keyed(
            "s",
            "k",
            &l,
            vec![
                given,
                post("http://up/"),
                opted_out,
                header,
                own_header,
                get,
                post("http://up/"),
            ],
        )
        .await;
        assert_eq!(
            mixed,
            [
                Some(HeaderValue::from_static("mine")),
                plain[0].clone(),
                None,
                None,
                Some(HeaderValue::from_static("ours")),
                None,
                plain[1].clone(),
            ]
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn outside_a_keyed_operation_keys_are_uuid_v4() {
        let l = SetIdempotencyKeyLayer::new();
        let a = keys(&l, vec![post("http://up/"), post("http://up/")]).await;
        assert_ne!(a[0], a[1]);
        for key in a.iter().map(|k| k.as_ref().unwrap()) {
            assert_eq!(version(key), 4);
            assert!(validate_key(key.as_bytes()).is_ok());
        }
        // A disabled layer derives nothing either.
        let off = keyed(
            "s",
            "k",
            &SetIdempotencyKeyLayer::disabled(),
            vec![post("http://up/")],
        )
        .await;
        assert_eq!(off, [None]);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_upstream_is_the_layers_name_or_the_uri_authority() {
        let unnamed = SetIdempotencyKeyLayer::new();
        let named = |n: &'static str| SetIdempotencyKeyLayer::new().upstream(n);
        let one = |layer: SetIdempotencyKeyLayer, uri: &'static str| async move {
            keyed("s", "k", &layer, vec![post(uri)]).await.remove(0)
        };
        // Unnamed: host:port as written, without user info.
        let by_authority = one(unnamed.clone(), "http://user:pw@shipping:8080/a").await;
        assert_eq!(by_authority, one(named("shipping:8080"), "/").await);
        assert_ne!(
            by_authority,
            one(unnamed.clone(), "http://shipping/a").await
        );
        // No authority: the empty name.
        assert_eq!(
            one(unnamed.clone(), "/a").await,
            one(named(""), "http://x/").await
        );
        // Named: the name, whatever the URI says.
        assert_eq!(
            one(named("shipping"), "http://10.0.0.7:80/a").await,
            one(unnamed, "http://shipping/b").await
        );
        // One name, one count, across hosts.
        let both = keyed(
            "s",
            "k",
            &named("shipping"),
            vec![post("http://a/"), post("http://b/")],
        )
        .await;
        assert_eq!(
            both,
            keyed("s", "k", &named("shipping"), vec![post("/"), post("/")]).await
        );
    }

    #[test]
    fn key_syntax() {
        assert!(IdempotencyKey::new("a").is_ok());
        assert!(IdempotencyKey::new("x".repeat(255)).is_ok());
        assert_eq!(
            IdempotencyKey::new("x".repeat(256))
                .unwrap_err()
                .to_string(),
            "invalid idempotency key: it is longer than 255 characters"
        );
        for bad in ["", " lead", "tab\t", "é", "new\nline"] {
            assert!(IdempotencyKey::new(bad).is_err(), "{bad:?}");
        }
        assert_eq!(IdempotencyKey::new("order:7").unwrap().as_str(), "order:7");
    }
}
