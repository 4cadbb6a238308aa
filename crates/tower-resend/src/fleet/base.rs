//! Where an instance is: its base URI (a scheme, an authority, and the
//! path its API sits under), and each attempt's URI made from it. The one
//! place that turns addresses into bases, whatever gave them (a list's
//! strings, a discovery's URIs, a resolver's socket addresses).

use std::net::SocketAddr;
use std::sync::Arc;

use http::uri::{Authority, Parts, PathAndQuery, Scheme};
use http::Uri;

use super::InvalidFleet;

/// An instance's base URI: every attempt sent to it takes its scheme and
/// authority, and goes under its path prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Base {
    pub(crate) scheme: Scheme,
    pub(crate) authority: Arc<Authority>,
    /// The path every request's path goes under, without a trailing `/`
    /// (`/api/v2`); `None` for a base without one (no path, or `/`).
    prefix: Option<Box<str>>,
}

impl Base {
    /// The base URI `address` (`http://10.0.0.1:8080`, or with a path
    /// prefix `http://10.0.0.1:8080/api/v2`).
    pub(crate) fn parse(address: &str) -> Result<Self, InvalidFleet> {
        // (`http::Uri` drops a fragment without a word: look for it first.)
        if address.contains('#') {
            return Err(InvalidFleet::fragment(address));
        }
        let uri: Uri = address
            .parse()
            .map_err(|_| InvalidFleet::not_a_base(address))?;
        Self::from_uri(uri).map_err(|why| why.at(address))
    }

    /// The base URI `uri`; an error (without the address, which the
    /// caller gives it) if it is not one.
    pub(crate) fn from_uri(uri: Uri) -> Result<Self, InvalidFleet> {
        let parts = uri.into_parts();
        let (Some(scheme), Some(authority)) = (parts.scheme, parts.authority) else {
            return Err(InvalidFleet::not_a_base(""));
        };
        let prefix = match parts.path_and_query {
            Some(pq) if pq.query().is_some() => return Err(InvalidFleet::query("")),
            Some(pq) => Some(pq.path().trim_end_matches('/'))
                .filter(|p| !p.is_empty())
                .map(Box::from),
            None => None,
        };
        Ok(Self {
            scheme,
            authority: Arc::new(authority),
            prefix,
        })
    }

    /// The base of a resolver's answer `addr`, over `scheme` (no path).
    pub(crate) fn of_socket(scheme: &Scheme, addr: SocketAddr) -> Option<Self> {
        // A socket address always makes an authority ("[::1]:80" for IPv6).
        let authority = Authority::try_from(addr.to_string().as_str()).ok()?;
        Some(Self {
            scheme: scheme.clone(),
            authority: Arc::new(authority),
            prefix: None,
        })
    }

    /// The path prefix (`/api/v2`), if the base has one.
    pub(crate) fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }

    /// The URI of an attempt at this instance of a request for `uri`: the
    /// base's scheme and authority, and the request's path under the
    /// base's prefix, joined by one `/`, with the request's query. Without
    /// a prefix the request's path and query are taken as they are (a
    /// clone of a shared buffer: nothing is allocated for them). `None`
    /// if they do not make a URI.
    pub(crate) fn attempt_uri(&self, uri: &Uri) -> Option<Uri> {
        let pq = match (&self.prefix, uri.path_and_query()) {
            (None, Some(pq)) => pq.clone(),
            (None, None) => PathAndQuery::from_static("/"),
            (Some(prefix), pq) => join(prefix, pq)?,
        };
        let mut parts = Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some((*self.authority).clone());
        parts.path_and_query = Some(pq);
        Uri::from_parts(parts).ok()
    }
}

/// `prefix` (no trailing `/`), one `/`, the request's path without its
/// leading one, and its query. A request for the server itself (`*`,
/// as `OPTIONS *` asks) is left as it is.
fn join(prefix: &str, pq: Option<&PathAndQuery>) -> Option<PathAndQuery> {
    let path = pq.map_or("/", PathAndQuery::path);
    if path == "*" {
        return pq.cloned();
    }
    let rest = path.strip_prefix('/').unwrap_or(path);
    let query = pq.and_then(PathAndQuery::query);
    let mut out =
        String::with_capacity(prefix.len() + 1 + rest.len() + query.map_or(0, |q| q.len() + 1));
    out.push_str(prefix);
    out.push('/');
    out.push_str(rest);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    PathAndQuery::try_from(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: &str, request: &str) -> String {
        let base = Base::parse(base).unwrap();
        let uri: Uri = request.parse().unwrap();
        base.attempt_uri(&uri).unwrap().to_string()
    }

    #[test]
    fn a_base_path_is_kept_under_one_slash() {
        for (base, request, sent) in [
            (
                "http://h:1/api/v2",
                "/orders?x=1",
                "http://h:1/api/v2/orders?x=1",
            ),
            (
                "http://h:1/api/v2/",
                "/orders?x=1",
                "http://h:1/api/v2/orders?x=1",
            ),
            ("http://h:1/api/v2//", "/orders", "http://h:1/api/v2/orders"),
            (
                "http://h:1/api",
                "http://inventory/orders/7?x=1&y=2",
                "http://h:1/api/orders/7?x=1&y=2",
            ),
            ("http://h:1/api", "http://inventory", "http://h:1/api/"),
            ("http://h:1/api", "/", "http://h:1/api/"),
            ("http://h:1/api", "/?x=1", "http://h:1/api/?x=1"),
            // A path that is its own (two slashes) keeps its own.
            ("http://h:1/api", "//twice", "http://h:1/api//twice"),
            // gRPC: the method's path under the prefix, once.
            (
                "https://h:1/grpc",
                "/pkg.Service/Method",
                "https://h:1/grpc/pkg.Service/Method",
            ),
            // No path, or `/`: as it always was.
            ("http://h:1", "/orders?x=1", "http://h:1/orders?x=1"),
            ("http://h:1/", "/orders?x=1", "http://h:1/orders?x=1"),
            ("http://h:1///", "/orders", "http://h:1/orders"),
            ("http://h:1", "http://inventory", "http://h:1/"),
        ] {
            assert_eq!(at(base, request), sent, "{base} + {request}");
        }
        assert_eq!(
            Base::parse("http://h:1/api/v2/").unwrap().prefix(),
            Some("/api/v2")
        );
        assert_eq!(Base::parse("http://h:1/").unwrap().prefix(), None);
        assert_eq!(Base::parse("http://h:1").unwrap().prefix(), None);
    }

    #[test]
    fn a_base_with_a_query_or_a_fragment_or_no_authority_is_refused() {
        for (address, says) in [
            ("http://h:1/api?v=2", "cannot have a query"),
            ("http://h:1?v=2", "cannot have a query"),
            ("http://h:1/api?", "cannot have a query"),
            ("http://h:1/api#top", "cannot have a fragment"),
            ("http://h:1#", "cannot have a fragment"),
            ("/api/v2", "expected a base URI"),
            ("h:1", "expected a base URI"),
            ("not a uri", "expected a base URI"),
        ] {
            let e = Base::parse(address).unwrap_err().to_string();
            assert!(e.contains(says), "{address}: {e}");
            assert!(e.contains(&format!("{address:?}")), "{address}: {e}");
        }
    }

    #[test]
    fn a_socket_address_is_a_base_without_a_path() {
        let b = Base::of_socket(&Scheme::HTTP, "[::1]:80".parse().unwrap()).unwrap();
        assert_eq!(b.authority.as_str(), "[::1]:80");
        assert_eq!(b.prefix(), None);
        let uri: Uri = "/a?b".parse().unwrap();
        assert_eq!(b.attempt_uri(&uri).unwrap(), "http://[::1]:80/a?b");
    }
}
