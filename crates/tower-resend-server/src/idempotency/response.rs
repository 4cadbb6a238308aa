//! Responses as records keep them, and records as responses: what is
//! stored of a handler's answer, the marks a handler sets on it, and the
//! replay.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use super::request::{IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED};
use crate::body::MaybeBuffered;
use crate::store::StoredResponse;

pub use tower_resend::classify::IDEMPOTENT_NOTHING_DONE;

/// `Idempotent-Keep: true` on a response (a header, or a gRPC trailer)
/// marks it as [`KeepResponse`](super::KeepResponse). The layer reads it and
/// takes it off.
pub const IDEMPOTENT_KEEP: HeaderName = HeaderName::from_static("idempotent-keep");

/// Whether `name` is set to `true` in `map`, and takes it off.
pub(crate) fn take_mark(map: &mut HeaderMap, name: &HeaderName) -> bool {
    map.remove(name)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// The response of a record, as the first caller gets it.
pub(crate) fn answer<B>(stored: StoredResponse) -> Response<MaybeBuffered<B>> {
    let mut resp = Response::new(MaybeBuffered::with_trailers(stored.body, stored.trailers));
    *resp.status_mut() = stored.status;
    *resp.headers_mut() = stored.headers;
    resp
}

/// The response of a record, replayed.
pub(crate) fn replay<B>(stored: StoredResponse) -> Response<MaybeBuffered<B>> {
    let omitted = stored.body_omitted;
    let mut resp = answer(stored);
    resp.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if omitted {
        resp.headers_mut()
            .insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("true"));
    }
    resp
}

/// Left out of stored responses: hop-by-hop headers, `content-length`,
/// `Set-Cookie` and the configured per-caller headers (by default the
/// [`EXCHANGE_HEADERS`](super::EXCHANGE_HEADERS)).
pub(crate) fn is_unstored(name: &HeaderName, per_caller: &[HeaderName]) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
            | "set-cookie"
    ) || per_caller.contains(name)
}

/// The headers a response is stored with: a copy without the ones left
/// out.
pub(crate) fn stored_headers(headers: &HeaderMap, per_caller: &[HeaderName]) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if !is_unstored(name, per_caller) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// The record of a response: its status and stored headers, its body if it
/// ended within the cap (`whole`), and its trailers.
pub(crate) fn record(
    status: StatusCode,
    headers: &HeaderMap,
    per_caller: &[HeaderName],
    body: &Bytes,
    whole: bool,
    trailers: Option<&HeaderMap>,
) -> StoredResponse {
    StoredResponse {
        status,
        headers: stored_headers(headers, per_caller),
        body: if whole { body.clone() } else { Bytes::new() },
        body_omitted: !whole,
        trailers: trailers.cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_headers_leave_out_hop_by_hop_and_per_caller_ones() {
        let mut h = HeaderMap::new();
        for (n, v) in [
            ("connection", "keep-alive"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "close"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("trailer", "x-sum"),
            ("upgrade", "h2c"),
            ("content-length", "3"),
            ("content-type", "text/plain"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("x-session", "s"),
            ("x-custom", "yes"),
        ] {
            h.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let mut want = HeaderMap::new();
        for (n, v) in [("content-type", "text/plain"), ("x-custom", "yes")] {
            want.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let per_caller = [HeaderName::from_static("x-session")];
        assert_eq!(stored_headers(&h, &per_caller), want);
        assert!(is_unstored(&HeaderName::from_static("set-cookie"), &[]));
        assert!(!is_unstored(&HeaderName::from_static("x-session"), &[]));
    }

    #[test]
    fn marks_are_read_and_taken_off() {
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENT_NOTHING_DONE, HeaderValue::from_static("TRUE"));
        h.insert(IDEMPOTENT_KEEP, HeaderValue::from_static("no"));
        assert!(take_mark(&mut h, &IDEMPOTENT_NOTHING_DONE));
        assert!(!take_mark(&mut h, &IDEMPOTENT_KEEP));
        assert!(h.is_empty());
        assert!(!take_mark(&mut h, &IDEMPOTENT_NOTHING_DONE));
    }
}
