//! The answers the layer gives on its own account.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

use crate::body::MaybeBuffered;

/// A JSON error response: `{"error": code, "message": message}`.
pub(crate) fn json_error<B>(
    status: StatusCode,
    code: &str,
    message: &str,
) -> Response<MaybeBuffered<B>> {
    let body = serde_json::json!({ "error": code, "message": message }).to_string();
    let mut resp = Response::new(MaybeBuffered::full(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// `json_error` with a `Retry-After` in whole seconds (at least 1).
pub(crate) fn retry_later<B>(
    status: StatusCode,
    code: &str,
    message: &str,
    after: std::time::Duration,
) -> Response<MaybeBuffered<B>> {
    let mut resp = json_error(status, code, message);
    let secs = after.as_secs().max(1) + u64::from(after.subsec_nanos() > 0 && after.as_secs() >= 1);
    resp.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    resp
}
