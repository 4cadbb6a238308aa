//! What the layer reads from a request: the key, the fingerprint, the scope.

use std::borrow::Cow;

use http::request::Parts;
use http::{HeaderName, HeaderValue, Method};
use sha2::{Digest, Sha256};

use crate::store::Fingerprint;

/// `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `X-Idempotency-Key`, also accepted.
pub const X_IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("x-idempotency-key");
/// `Idempotent-Replayed: true` marks a response replayed from the store.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// `Idempotent-Body-Omitted: true` marks a replay whose body was larger than
/// the cap and was not stored.
pub const IDEMPOTENT_BODY_OMITTED: HeaderName = HeaderName::from_static("idempotent-body-omitted");

/// True for GET, HEAD, OPTIONS, TRACE, PUT and DELETE.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// A request's idempotency key, checked: 1 to 255 visible ASCII
/// characters. It holds the request's own header value, which shares the
/// bytes hyper read rather than copying them.
#[derive(Clone, Debug)]
pub(crate) struct Key(HeaderValue);

impl Key {
    /// The key as text.
    pub(crate) fn as_str(&self) -> &str {
        // Visible ASCII, checked when the key was made, is UTF-8: the
        // default is never taken. (`from_utf8` checks ASCII a word at a
        // time; `HeaderValue::to_str` a byte at a time, on every call.)
        std::str::from_utf8(self.0.as_bytes()).unwrap_or_default()
    }
}

/// The key a request carries: `Ok(None)` without one, `Err` with a reason
/// when it is malformed (or two different keys are given).
pub(crate) fn key(parts: &Parts) -> Result<Option<Key>, &'static str> {
    // One pass over the headers, comparing names, rather than a hashed
    // lookup for each of the two names: a request's few headers compare in
    // fewer instructions than two names hash (a standard header's name is
    // told apart at its first word).
    let (mut plain, mut x): (Option<&HeaderValue>, Option<&HeaderValue>) = (None, None);
    for (name, value) in &parts.headers {
        let slot = if *name == IDEMPOTENCY_KEY {
            &mut plain
        } else if *name == X_IDEMPOTENCY_KEY {
            &mut x
        } else {
            continue;
        };
        if slot.replace(value).is_some() {
            return Err("the request carries more than one idempotency key");
        }
    }
    let k = match (plain, x) {
        (Some(a), Some(b)) if a != b => return Err("Idempotency-Key and X-Idempotency-Key differ"),
        (Some(k), _) | (None, Some(k)) => k,
        (None, None) => return Ok(None),
    };
    resend::idempotency::validate_key(k.as_bytes())
        .map_err(|_| "an idempotency key must be 1 to 255 visible ASCII characters")?;
    Ok(Some(Key(k.clone())))
}

/// A hash of method, path and query, and body: one SHA-256 pass over
/// `method NUL path-and-query NUL body` (neither the method nor the path
/// and query can hold a NUL, so the encoding is unambiguous).
pub(crate) fn fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(parts.method.as_str().as_bytes());
    h.update([0]);
    h.update(
        parts
            .uri
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .as_bytes(),
    );
    h.update([0]);
    h.update(body);
    Fingerprint(h.finalize().into())
}

/// Lower-case hex of `bytes`, appended to `out`.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    for &b in bytes {
        out.extend(crate::store::hex_pair(b).map(char::from));
    }
}

/// The default scope: a hash of the `Authorization` header, so that callers
/// with different credentials never share keys (and credentials are not
/// stored); `anonymous` without one.
pub fn authorization_scope(parts: &Parts) -> String {
    default_scope(parts).into_owned()
}

/// [`authorization_scope`], as the layer uses it: `anonymous` without
/// allocating.
pub(crate) fn default_scope(parts: &Parts) -> Cow<'static, str> {
    match parts.headers.get(http::header::AUTHORIZATION) {
        Some(v) => {
            let h = Sha256::digest(v.as_bytes());
            let mut s = String::with_capacity(37);
            s.push_str("auth:");
            push_hex(&mut s, &h[..16]);
            Cow::Owned(s)
        }
        None => Cow::Borrowed("anonymous"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(req: Request<()>) -> Parts {
        req.into_parts().0
    }

    /// `key`, with the key as text.
    fn key_text(parts: &Parts) -> Result<Option<String>, &'static str> {
        key(parts).map(|k| k.map(|k| k.as_str().to_owned()))
    }

    #[test]
    fn keys_are_checked() {
        let p = |k: &str| {
            parts(
                Request::post("/")
                    .header("idempotency-key", k)
                    .body(())
                    .unwrap(),
            )
        };
        assert_eq!(key_text(&p("abc")), Ok(Some("abc".into())));
        assert!(key(&p("has space")).is_err());
        assert!(key(&p(&"x".repeat(256))).is_err());
        assert_eq!(
            key_text(&p(&"x".repeat(255))).map(|k| k.map(|k| k.len())),
            Ok(Some(255))
        );
        assert!(key(&p("")).is_err());
        let x = parts(
            Request::post("/")
                .header("x-idempotency-key", "k1")
                .body(())
                .unwrap(),
        );
        assert_eq!(key_text(&x), Ok(Some("k1".into())));
        let both = parts(
            Request::post("/")
                .header("x-idempotency-key", "k1")
                .header("idempotency-key", "k2")
                .body(())
                .unwrap(),
        );
        assert!(key(&both).is_err());
        let agree = parts(
            Request::post("/")
                .header("x-idempotency-key", "k1")
                .header("content-type", "text/plain")
                .header("idempotency-key", "k1")
                .body(())
                .unwrap(),
        );
        assert_eq!(key_text(&agree), Ok(Some("k1".into())));
        for name in ["idempotency-key", "x-idempotency-key"] {
            let twice = parts(
                Request::post("/")
                    .header(name, "k1")
                    .header("accept", "*/*")
                    .header(name, "k1")
                    .body(())
                    .unwrap(),
            );
            assert!(key(&twice).is_err(), "{name} twice");
        }
        let none = parts(Request::post("/").body(()).unwrap());
        assert_eq!(key_text(&none), Ok(None));
        let utf8 = parts(
            Request::post("/")
                .header(
                    "idempotency-key",
                    http::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
                )
                .body(())
                .unwrap(),
        );
        assert!(key(&utf8).is_err());
    }

    #[test]
    fn fingerprint_covers_method_path_query_and_body() {
        let p = |m: Method, u: &str| parts(Request::builder().method(m).uri(u).body(()).unwrap());
        let base = fingerprint(&p(Method::POST, "/a?x=1"), b"body");
        assert_eq!(base, fingerprint(&p(Method::POST, "/a?x=1"), b"body"));
        assert_ne!(base, fingerprint(&p(Method::PATCH, "/a?x=1"), b"body"));
        assert_ne!(base, fingerprint(&p(Method::POST, "/a?x=2"), b"body"));
        assert_ne!(base, fingerprint(&p(Method::POST, "/b?x=1"), b"body"));
        assert_ne!(base, fingerprint(&p(Method::POST, "/a?x=1"), b"bodY"));
        // Where the path ends and the body begins is not ambiguous.
        assert_ne!(
            fingerprint(&p(Method::POST, "/a"), b"b"),
            fingerprint(&p(Method::POST, "/ab"), b"")
        );
    }

    #[test]
    fn default_scope_hashes_the_credentials() {
        let a = parts(
            Request::post("/")
                .header("authorization", "Bearer a")
                .body(())
                .unwrap(),
        );
        let b = parts(
            Request::post("/")
                .header("authorization", "Bearer b")
                .body(())
                .unwrap(),
        );
        assert_ne!(authorization_scope(&a), authorization_scope(&b));
        assert!(!authorization_scope(&a).contains("Bearer"));
        let digest = Sha256::digest(b"Bearer a");
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(authorization_scope(&a), format!("auth:{hex}"));
        let anonymous = parts(Request::post("/").body(()).unwrap());
        assert_eq!(authorization_scope(&anonymous), "anonymous");
        assert!(matches!(
            default_scope(&anonymous),
            Cow::Borrowed("anonymous")
        ));
        assert_eq!(default_scope(&a), authorization_scope(&a));
    }
}
