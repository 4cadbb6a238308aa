//! One Idempotency-Key per logical operation, reused on every attempt.
//!
//! [`IdempotencyKeyLayer`] gives each request whose method is not idempotent
//! (POST, PATCH, …) and that has no key yet an `Idempotency-Key` header: the
//! [`IdempotencyKey`] the caller put in the request's extensions (derived from
//! the operation, e.g. `shipment-request:42`, so that a job that runs again
//! sends the same key), or else a fresh UUID v4. Placed outside the
//! [`RetryLayer`](crate::RetryLayer), it runs once per call, so every attempt
//! of the call carries the same key, and the retry layer treats the request
//! as replay-safe.
//!
//! Using the layer declares that the upstream honours keys: it answers a
//! repeated key with the first result instead of doing the work twice. A
//! request can opt out with [`NoIdempotencyKey`].
//!
//! ```
//! use http::Request;
//! use resend::idempotency::{IdempotencyKey, IdempotencyKeyLayer};
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let svc = IdempotencyKeyLayer::new().layer(service_fn(|req: Request<()>| async move {
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

use std::fmt;
use std::task::{Context, Poll};

use http::header::HeaderName;
use http::{HeaderValue, Request};
use tower_layer::Layer;
use tower_service::Service;

use crate::classify::{is_idempotent, KEY_HEADERS};

/// The default header: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The most characters a key may have.
pub const MAX_KEY_LEN: usize = 255;

/// A key for one logical operation, set by the caller in the request's
/// extensions: 1 to 255 visible ASCII characters.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(HeaderValue);

/// Why a string is not a valid idempotency key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidIdempotencyKey {
    reason: &'static str,
}

impl fmt::Display for InvalidIdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid idempotency key: {}", self.reason)
    }
}

impl std::error::Error for InvalidIdempotencyKey {}

/// Checks the key syntax: 1 to 255 visible ASCII characters (`!` to `~`).
pub fn validate_key(key: &[u8]) -> Result<(), InvalidIdempotencyKey> {
    let bad = |reason| Err(InvalidIdempotencyKey { reason });
    if key.is_empty() {
        return bad("it is empty");
    }
    if key.len() > MAX_KEY_LEN {
        return bad("it is longer than 255 characters");
    }
    if !key.iter().all(|b| b.is_ascii_graphic()) {
        return bad("it must be visible ASCII characters only (no spaces or control characters)");
    }
    Ok(())
}

impl IdempotencyKey {
    /// A key from `key`, checked: 1 to 255 visible ASCII characters.
    ///
    /// ```
    /// use resend::idempotency::IdempotencyKey;
    ///
    /// assert!(IdempotencyKey::new("shipment-request:42").is_ok());
    /// assert!(IdempotencyKey::new("").is_err());
    /// assert!(IdempotencyKey::new("has space").is_err());
    /// ```
    pub fn new(key: impl AsRef<str>) -> Result<Self, InvalidIdempotencyKey> {
        let key = key.as_ref().as_bytes();
        validate_key(key)?;
        HeaderValue::from_bytes(key)
            .map(Self)
            .map_err(|_| InvalidIdempotencyKey {
                reason: "it is not a valid header value",
            })
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        // Validated as visible ASCII at construction.
        self.0.to_str().unwrap_or_default()
    }
}

/// A request extension: send this request without an Idempotency-Key even
/// though its method is not idempotent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoIdempotencyKey;

/// Gives each unsafe request one Idempotency-Key; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct IdempotencyKeyLayer {
    header: HeaderName,
    enabled: bool,
}

impl IdempotencyKeyLayer {
    /// Writes `Idempotency-Key`.
    pub const fn new() -> Self {
        Self {
            header: IDEMPOTENCY_KEY,
            enabled: true,
        }
    }

    /// A layer that writes nothing: for a stack whose upstream does not
    /// honour keys.
    pub(crate) const fn disabled() -> Self {
        Self {
            header: IDEMPOTENCY_KEY,
            enabled: false,
        }
    }

    /// Writes the key under `header` instead. Default `Idempotency-Key`.
    #[must_use]
    pub fn header(mut self, header: HeaderName) -> Self {
        self.header = header;
        self
    }
}

impl Default for IdempotencyKeyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for IdempotencyKeyLayer {
    type Service = SetIdempotencyKey<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SetIdempotencyKey {
            inner,
            header: self.header.clone(),
            enabled: self.enabled,
        }
    }
}

/// Middleware that gives unsafe requests an Idempotency-Key; see
/// [`IdempotencyKeyLayer`].
#[derive(Clone, Debug)]
pub struct SetIdempotencyKey<S> {
    inner: S,
    header: HeaderName,
    enabled: bool,
}

impl<S> SetIdempotencyKey<S> {
    /// An [`IdempotencyKeyLayer`] with the defaults.
    pub const fn layer() -> IdempotencyKeyLayer {
        IdempotencyKeyLayer::new()
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
}

fn generated() -> HeaderValue {
    let mut buf = uuid::Uuid::encode_buffer();
    let s = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut buf);
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
        if !self.enabled {
            return self.inner.call(req);
        }
        let given = req.extensions().get::<IdempotencyKey>();
        let wanted = given.is_some() || !is_idempotent(req.method());
        // Looked for only when a key is wanted: an idempotent request
        // without one (most GETs) does no header lookups here.
        let has_key = || {
            req.headers().contains_key(&self.header)
                || KEY_HEADERS.iter().any(|h| req.headers().contains_key(h))
        };
        if wanted && !has_key() && req.extensions().get::<NoIdempotencyKey>().is_none() {
            let value = given.map_or_else(generated, |k| k.0.clone());
            req.headers_mut().insert(self.header.clone(), value);
        }
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{service_fn, ServiceExt};

    async fn sent(layer: &IdempotencyKeyLayer, req: Request<()>) -> http::HeaderMap {
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
        let l = IdempotencyKeyLayer::new();
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
        let l = IdempotencyKeyLayer::new();
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

        let l = IdempotencyKeyLayer::new().header(HeaderName::from_static("x-request-key"));
        let h = sent(&l, Request::post("/").body(()).unwrap()).await;
        assert_eq!(h["x-request-key"].len(), 36);
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
