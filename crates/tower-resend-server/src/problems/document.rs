//! One problem document, in its HTTP form (RFC 9457) and its gRPC form
//! (a trailers-only status).

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE as CONTENT_TYPE_HEADER, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use serde_json::{Map, Value};
use tower_resend::classify::{
    GrpcCode, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS, IDEMPOTENT_NOTHING_DONE,
};

use super::{ProblemType, Protocol, CONTENT_TYPE, TYPE_BASE};
use crate::body::MaybeBuffered;
use crate::store::StoredResponse;

/// `grpc-message`.
pub(super) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

/// Milliseconds, as a JSON number.
pub(crate) fn ms(d: Duration) -> Value {
    Value::from(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `Retry-After` for a wait: whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    after.as_secs().max(1) + u64::from(after.subsec_nanos() > 0 && after.as_secs() >= 1)
}

/// One problem document, and the response that carries it (a problem
/// document over HTTP, a trailers-only status over gRPC).
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    kind: ProblemType,
    detail: String,
    /// The extension members after `error`, in order.
    members: Vec<(&'static str, Value)>,
    retry_after: Option<Duration>,
    /// `grpc-message` when it is not the `detail`.
    grpc_message: Option<String>,
    /// Says `Idempotent-Nothing-Done: true`.
    nothing_done: bool,
}

impl Problem {
    /// A problem of type `kind`, saying `detail`.
    pub(crate) fn new(kind: ProblemType, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            members: Vec::new(),
            retry_after: None,
            grpc_message: None,
            nothing_done: kind.nothing_done(),
        }
    }

    /// Says that nothing was done (`Idempotent-Nothing-Done: true`), as a
    /// type that says so always does ([`ProblemType::nothing_done`]).
    pub(crate) fn nothing_done(mut self) -> Self {
        self.nothing_done = true;
        self
    }

    /// The extension member `name` (replacing one already set).
    pub(crate) fn with(mut self, name: &'static str, value: impl Into<Value>) -> Self {
        let value = value.into();
        match self.members.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => *v = value,
            None => self.members.push((name, value)),
        }
        self
    }

    /// Answered with `Retry-After` (see [`retry_after_secs`]), and over
    /// gRPC with `grpc-retry-pushback-ms`.
    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// Over gRPC, `message` in `grpc-message` rather than the `detail`.
    pub(crate) fn grpc_message(mut self, message: impl Into<String>) -> Self {
        self.grpc_message = Some(message.into());
        self
    }

    /// Another `detail`.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn set_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = detail.into();
        self
    }

    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn status(&self) -> StatusCode {
        self.kind.status()
    }

    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn detail(&self) -> &str {
        &self.detail
    }

    /// The members in their order: RFC 9457's, then the extensions.
    fn members(&self) -> impl Iterator<Item = (&str, Value)> + '_ {
        let code = self.kind.code();
        [
            ("type", Value::from(format!("{TYPE_BASE}{code}"))),
            ("title", Value::from(self.kind.title())),
            ("status", Value::from(self.kind.status().as_u16())),
            ("detail", Value::from(self.detail.as_str())),
            ("error", Value::from(code)),
        ]
        .into_iter()
        .chain(self.members.iter().map(|(n, v)| (*n, v.clone())))
    }

    /// The document as JSON.
    #[cfg_attr(not(any(feature = "axum", test)), allow(dead_code))]
    pub(crate) fn to_json(&self) -> Value {
        let map: Map<String, Value> = self.members().map(|(n, v)| (n.to_owned(), v)).collect();
        Value::Object(map)
    }

    /// The document as the body carries it, its members in order.
    fn body(&self) -> Bytes {
        let mut out = Vec::with_capacity(256);
        out.push(b'{');
        for (i, (name, value)) in self.members().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            // (A string and a JSON value always serialize.)
            let _ = serde_json::to_writer(&mut out, name);
            out.push(b':');
            let _ = serde_json::to_writer(&mut out, &value);
        }
        out.push(b'}');
        Bytes::from(out)
    }

    /// `Content-Type`, and `Retry-After` when set.
    fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(CONTENT_TYPE));
        if let Some(after) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        if self.nothing_done {
            say_nothing_done(&mut headers);
        }
        headers
    }

    /// The answer, as a record keeps it: the problem document over HTTP, a
    /// trailers-only status over gRPC (see the [module docs](self#grpc)).
    pub(crate) fn stored(&self, protocol: Protocol) -> StoredResponse {
        match protocol {
            Protocol::Http => StoredResponse::new(self.kind.status(), self.headers(), self.body()),
            Protocol::Grpc => {
                let mut headers = HeaderMap::new();
                headers.insert(
                    CONTENT_TYPE_HEADER,
                    HeaderValue::from_static("application/grpc"),
                );
                let code = self.kind.grpc_code();
                headers.insert(GRPC_STATUS, HeaderValue::from(code.as_i32()));
                let message = self.grpc_message.as_deref().unwrap_or(&self.detail);
                headers.insert(GRPC_MESSAGE, grpc_message(message));
                let pushback = match (self.retry_after, code) {
                    (Some(after), _) => Some(i64::try_from(after.as_millis()).unwrap_or(i64::MAX)),
                    // Not to be retried as it is (tower-resend's client
                    // would retry a plain RESOURCE_EXHAUSTED).
                    (None, GrpcCode::ResourceExhausted) => Some(-1),
                    (None, _) => None,
                };
                if let Some(ms) = pushback {
                    headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(ms));
                }
                if self.nothing_done {
                    say_nothing_done(&mut headers);
                }
                StoredResponse::new(StatusCode::OK, headers, Bytes::new())
            }
        }
    }

    /// The answer.
    pub(crate) fn response<B>(&self, protocol: Protocol) -> Response<MaybeBuffered<B>> {
        let stored = self.stored(protocol);
        let mut resp = Response::new(MaybeBuffered::full(stored.body));
        *resp.status_mut() = stored.status;
        *resp.headers_mut() = stored.headers;
        resp
    }
}

/// `Idempotent-Nothing-Done: true` in `headers` (a response's headers, or
/// the metadata of a trailers-only gRPC answer).
pub(crate) fn say_nothing_done(headers: &mut HeaderMap) {
    headers.insert(IDEMPOTENT_NOTHING_DONE, HeaderValue::from_static("true"));
}

/// `message` as a `grpc-message` value: percent-encoded, every byte outside
/// printable ASCII and every `%` (gRPC's rule). Written here: it is the one
/// encoding of the crate, six lines against a dependency.
fn grpc_message(message: &str) -> HeaderValue {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    HeaderValue::from_str(&out).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_has_the_rfc_members_first_then_its_own() {
        let p = Problem::new(ProblemType::IdempotencyKeyInProgress, "busy")
            .with("upstream", "shipping")
            .with("attempts", 2)
            .with("attempts", 3)
            .retry_after(Duration::from_millis(1500));
        let body = String::from_utf8(p.body().to_vec()).unwrap();
        assert_eq!(
            body,
            "{\"type\":\"https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#idempotency_key_in_progress\",\
             \"title\":\"Request with this Idempotency-Key in progress\",\"status\":409,\"detail\":\"busy\",\
             \"error\":\"idempotency_key_in_progress\",\"upstream\":\"shipping\",\"attempts\":3}"
        );
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), p.to_json());
        let h = p.headers();
        assert_eq!(h["content-type"], "application/problem+json");
        assert_eq!(h["retry-after"], "2");
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_and_at_least_one() {
        for (ms, secs) in [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (2500, 3)] {
            assert_eq!(retry_after_secs(Duration::from_millis(ms)), secs, "{ms} ms");
        }
    }

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(grpc_message("plain text"), "plain text");
        assert_eq!(grpc_message("100% – done\n"), "100%25 %E2%80%93 done%0A");
    }
}
