//! The caller's key: its syntax, checked where it is made.

use std::fmt;

use http::HeaderValue;

use super::MAX_KEY_LEN;

/// A key for one logical operation, set by the caller in the request's
/// extensions: 1 to 255 visible ASCII characters.
///
/// A tower-resend stack always sends it, as `Idempotency-Key` (or the
/// header its key layer is set to), on every attempt, whether or not it was
/// told that its upstream honours keys (`idempotency_keys()`, which makes
/// keys for requests without one): a key the caller chose states that the
/// operation may be sent again, so the request is replay-safe.
///
/// ```
/// use tower_resend::IdempotencyKey;
///
/// let mut req = http::Request::post("/shipments").body(()).unwrap();
/// let key = IdempotencyKey::new("shipment-request:42").unwrap();
/// req.extensions_mut().insert(key);
/// assert!(IdempotencyKey::new("has space").is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(pub(crate) HeaderValue);

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
    /// use tower_resend::IdempotencyKey;
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
