//! What the layer reads from a request: the key, the fingerprint, the scope.

use std::borrow::Cow;

use http::request::Parts;
use http::{HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

use super::config::Scope;
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

    /// The key as the request's header value.
    pub(crate) fn header_value(&self) -> &HeaderValue {
        &self.0
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
    let bad =
        "an idempotency key must be 1 to 255 visible ASCII characters, bare or as a quoted string";
    // The IETF draft's key is a structured-field string: `"k"` is the key
    // `k`, as a bare `k` is.
    let k = match unquote(k.as_bytes()) {
        Some(inner) => HeaderValue::from_bytes(&inner).map_err(|_| bad)?,
        None if k.as_bytes().first() == Some(&b'"') => return Err(bad),
        None => k.clone(),
    };
    tower_resend::idempotency::validate_key(k.as_bytes()).map_err(|_| bad)?;
    Ok(Some(Key(k)))
}

/// The inner text of a structured-field string (RFC 9651, 3.3.3): `"`,
/// printable ASCII with `\"` and `\\` escaped, `"`; `None` if `value` is
/// not one.
fn unquote(value: &[u8]) -> Option<Vec<u8>> {
    let inner = value.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return None,
            },
            b'"' => return None,
            0x20..=0x7e => out.push(b),
            _ => return None,
        }
    }
    Some(out)
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

/// The headers the default scope always reads: `Authorization`,
/// `Proxy-Authorization` and `Cookie`.
pub const CREDENTIAL_HEADERS: [HeaderName; 3] = [
    http::header::AUTHORIZATION,
    http::header::PROXY_AUTHORIZATION,
    http::header::COOKIE,
];

/// The default scope of a request's key: a hash of every credential the
/// request presents — `Authorization`, `Proxy-Authorization`, `Cookie` and
/// `X-Api-Key` — so that callers with different credentials never share
/// keys, and no credential is stored; `None` when the request presents none
/// (see [`Anonymous`](super::Anonymous) for what such a request gets).
///
/// ```
/// use http::Request;
/// use tower_resend_server::idempotency::credential_scope;
///
/// let scope = |req: Request<()>| credential_scope(&req.into_parts().0);
/// let alice = scope(Request::post("/").header("cookie", "session=alice").body(()).unwrap());
/// let bob = scope(Request::post("/").header("cookie", "session=bob").body(()).unwrap());
/// assert_ne!(alice, bob);
/// assert!(!alice.unwrap().contains("alice"));
/// assert_eq!(scope(Request::post("/").body(()).unwrap()), None);
/// ```
pub fn credential_scope(parts: &Parts) -> Option<String> {
    credentials(parts, &[super::config::X_API_KEY]).map(Cow::into_owned)
}

/// The scope of a request under the layer's configuration, and whether the
/// caller is anonymous (the default scope found no credential).
pub(crate) fn scope(parts: &Parts, scope: &Scope) -> (Cow<'static, str>, bool) {
    match scope {
        Scope::Credentials { api_keys } => match credentials(parts, api_keys) {
            Some(s) => (s, false),
            None => (Cow::Borrowed("anonymous"), true),
        },
        Scope::Custom(f) => (Cow::Owned(f(parts)), false),
    }
}

/// A hash of the credential headers present (name and every value, in
/// order); `None` when there is none.
fn credentials(parts: &Parts, api_keys: &[HeaderName]) -> Option<Cow<'static, str>> {
    // Most requests' few headers hold no credential: one pass over them,
    // comparing names (a standard name compares as a number), tells, where
    // a lookup of each credential name would hash it.
    let is_credential =
        |name: &HeaderName| CREDENTIAL_HEADERS.contains(name) || api_keys.contains(name);
    if !parts.headers.keys().any(is_credential) {
        return None;
    }
    let mut h: Option<Sha256> = None;
    for name in CREDENTIAL_HEADERS.iter().chain(api_keys) {
        for value in parts.headers.get_all(name) {
            let h = h.get_or_insert_with(Sha256::new);
            // Neither a header name nor a value holds a NUL: the encoding is
            // unambiguous.
            h.update(name.as_str().as_bytes());
            h.update([0]);
            h.update(value.as_bytes());
            h.update([0]);
        }
    }
    let digest = h?.finalize();
    let mut s = String::with_capacity(37);
    s.push_str("cred:");
    push_hex(&mut s, &digest[..16]);
    Some(Cow::Owned(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Method, Request};

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
        // A structured-field string is the key it quotes.
        assert_eq!(key_text(&p("\"abc\"")), Ok(Some("abc".into())));
        assert_eq!(key_text(&p(r#""a\"b""#)), Ok(Some("a\"b".into())));
        for bad in ["\"", "\"\"", "\"abc", "\"a b\"", r#""a\x""#, r#""a"b""#] {
            assert!(key(&p(bad)).is_err(), "{bad}");
        }
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

    fn scoped(req: Request<()>) -> Option<String> {
        credential_scope(&parts(req))
    }

    #[test]
    fn the_default_scope_hashes_every_credential() {
        let with = |name: &str, value: &str| {
            scoped(Request::post("/").header(name, value).body(()).unwrap())
        };
        let a = with("authorization", "Bearer a");
        assert_ne!(a, with("authorization", "Bearer b"));
        assert!(!a.as_deref().unwrap().contains("Bearer"));
        let digest = {
            let mut h = Sha256::new();
            h.update(b"authorization\0Bearer a\0");
            h.finalize()
        };
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(a, Some(format!("cred:{hex}")));
        // Each kind of credential scopes, and the same value under two
        // headers is two scopes.
        let all = [
            with("authorization", "Basic YTpi"),
            with("proxy-authorization", "Basic YTpi"),
            with("cookie", "Basic YTpi"),
            with("x-api-key", "Basic YTpi"),
            with("cookie", "session=1"),
            with("cookie", "session=2"),
            with("x-api-key", "k1"),
            with("x-api-key", "k2"),
            scoped(Request::post("/").body(()).unwrap()),
        ];
        for (i, x) in all.iter().enumerate() {
            for (j, y) in all.iter().enumerate() {
                assert_eq!(i == j, x == y, "{i} {j}");
            }
        }
        // No credential: anonymous; a header that is not a credential does
        // not make one.
        assert_eq!(all[8], None);
        assert_eq!(with("x-tenant", "a"), None);
        // Several credentials together are one scope of their own.
        let both = scoped(
            Request::post("/")
                .header("authorization", "Bearer a")
                .header("cookie", "s=1")
                .body(())
                .unwrap(),
        );
        assert_ne!(both, a);
        assert_ne!(both, with("cookie", "s=1"));
    }

    #[test]
    fn the_layer_scope_reads_its_api_key_headers_and_says_anonymous() {
        let custom = Scope::Credentials {
            api_keys: std::sync::Arc::new([HeaderName::from_static("x-key")]),
        };
        let p = parts(Request::post("/").header("x-key", "k").body(()).unwrap());
        let (s, anonymous) = scope(&p, &custom);
        assert!(s.starts_with("cred:") && !anonymous);
        // X-Api-Key is no longer read when the list is replaced.
        let p = parts(
            Request::post("/")
                .header("x-api-key", "k")
                .body(())
                .unwrap(),
        );
        assert_eq!(scope(&p, &custom), (Cow::Borrowed("anonymous"), true));
        assert!(matches!(scope(&p, &custom).0, Cow::Borrowed(_)));
        let f = Scope::Custom(std::sync::Arc::new(|_: &Parts| "tenant-1".to_owned()));
        assert_eq!(scope(&p, &f), (Cow::Owned("tenant-1".to_owned()), false));
    }
}
