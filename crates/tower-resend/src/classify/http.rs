use std::sync::Arc;
use std::time::SystemTime;

use http::{header::RETRY_AFTER, Response, StatusCode};

use super::pushback::{parse_retry_after, Pushback};
use super::{Class, Classification, Classify, RequestFacts};

/// The HTTP classifier of the [module table](super), with per-status
/// overrides; on gRPC requests, the [gRPC table](super#grpc).
///
/// A request whose `content-type` is `application/grpc` (or a subtype) is
/// classified as [`GrpcClassifier`](super::GrpcClassifier) classifies it:
/// by the `grpc-status` of a trailers-only answer, with its
/// `grpc-retry-pushback-ms`. Its replay-safety stays the HTTP rule, which
/// for gRPC (every call a POST) means an idempotency key: no method is
/// idempotent until a [`GrpcClassifier`](super::GrpcClassifier) declares it
/// so. The overrides apply to HTTP statuses, not to gRPC ones.
///
/// ```
/// use http::{Request, Response, StatusCode};
/// use tower_resend::classify::{Class, Classify, HttpClassifier, RequestFacts};
///
/// let c = HttpClassifier::new();
/// let get = Request::get("http://api/items/1").body(()).unwrap();
/// let resp = Response::builder().status(502).body(()).unwrap();
/// assert_eq!(c.classify_response(&RequestFacts::of(&get), &resp).class(), Class::Unknown);
/// ```
#[derive(Clone, Debug, Default)]
pub struct HttpClassifier {
    // Few entries, looked up only when present; shared, so clones are cheap.
    overrides: Option<Arc<[(StatusCode, Class)]>>,
}

impl HttpClassifier {
    /// The classifier of the module table, with no overrides.
    pub const fn new() -> Self {
        Self { overrides: None }
    }

    /// Classifies `status` as `class`, whatever the table says; the last
    /// override of a status wins. For [`Class::Overloaded`] and
    /// [`Class::InProgress`] the response's `Retry-After` is read as usual.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_resend::classify::{Class, HttpClassifier};
    ///
    /// // This API answers 409 when the resource already exists.
    /// let c = HttpClassifier::new().on_status(StatusCode::CONFLICT, Class::Rejected);
    /// # let _ = c;
    /// ```
    #[must_use]
    pub fn on_status(self, status: StatusCode, class: Class) -> Self {
        let mut list: Vec<_> = self
            .overrides
            .as_deref()
            .unwrap_or_default()
            .iter()
            .filter(|(s, _)| *s != status)
            .copied()
            .collect();
        list.push((status, class));
        Self {
            overrides: Some(list.into()),
        }
    }

    fn class_of(&self, req: &RequestFacts<'_>, status: StatusCode) -> Classification {
        if let Some(list) = &self.overrides {
            if let Some((_, class)) = list.iter().find(|(s, _)| *s == status) {
                return Classification::new(*class)
                    .with_maybe_processed(status == StatusCode::SERVICE_UNAVAILABLE);
            }
        }
        let class = match status.as_u16() {
            100..=399 => Class::Success,
            408 | 425 => Class::NotProcessed,
            429 => Class::Overloaded,
            409 if req.has_idempotency_key() => Class::InProgress,
            503 => return Classification::new(Class::Overloaded).with_maybe_processed(true),
            501 | 505 | 511 => Class::Rejected,
            500..=599 => Class::Unknown,
            _ => Class::Rejected,
        };
        Classification::new(class)
    }
}

/// Reads `Retry-After`; a malformed value is ignored with a debug event.
pub(crate) fn retry_after<B>(resp: &Response<B>) -> Option<Pushback> {
    let value = resp.headers().get(RETRY_AFTER)?;
    match parse_retry_after(value.as_bytes(), SystemTime::now()) {
        Ok(wait) => Some(Pushback::After(wait)),
        Err(e) => {
            tracing::debug!(value = ?value, error = %e, "ignoring malformed Retry-After");
            None
        }
    }
}

impl HttpClassifier {
    /// The HTTP table (with the overrides), whatever the protocol.
    pub(super) fn classify_http<B>(
        &self,
        req: &RequestFacts<'_>,
        resp: &Response<B>,
    ) -> Classification {
        let c = self.class_of(req, resp.status());
        let c = if matches!(c.class(), Class::Overloaded | Class::InProgress) {
            c.with_pushback(retry_after(resp))
        } else {
            c
        };
        // Only a 5xx pays for the header lookup.
        if resp.status().is_server_error() && super::says_nothing_done(resp.headers()) {
            return c.nothing_done();
        }
        c
    }

    /// The HTTP table for an error, whatever the protocol.
    pub(super) fn classify_error_http(
        &self,
        _req: &RequestFacts<'_>,
        err: &(dyn std::error::Error + 'static),
    ) -> Classification {
        Classification::new(classify_error(err))
    }
}

impl<B> Classify<B> for HttpClassifier {
    fn classify_response(&self, req: &RequestFacts<'_>, resp: &Response<B>) -> Classification {
        // A gRPC answer is a 200 whatever its status: only then can the
        // gRPC table differ from the HTTP one, so only then is the request
        // looked at.
        if resp.status() == StatusCode::OK && req.is_grpc() {
            return super::grpc::classify_response(self, req, resp);
        }
        self.classify_http(req, resp)
    }

    fn classify_error(
        &self,
        req: &RequestFacts<'_>,
        err: &(dyn std::error::Error + 'static),
    ) -> Classification {
        if req.is_grpc() {
            return super::grpc::classify_error(self, req, err);
        }
        self.classify_error_http(req, err)
    }
}

/// What a transport or resend error says about the request: [`Class::NotSent`]
/// when something in its source chain proves nothing was written, else
/// [`Class::Unknown`].
pub(crate) fn classify_error(err: &(dyn std::error::Error + 'static)) -> Class {
    let mut next = Some(err);
    while let Some(e) = next {
        if e.is::<crate::vocab::HttpsNotEnabled>() {
            // Sending again cannot help: the client lacks TLS.
            return Class::Rejected;
        }
        if let Some(ours) = e.downcast_ref::<crate::error::Error>() {
            if ours.is_not_sent() {
                return Class::NotSent;
            }
        } else if proves_not_sent(e) {
            return Class::NotSent;
        }
        next = e.source();
    }
    Class::Unknown
}

#[cfg(feature = "hyper-client")]
fn proves_not_sent(e: &(dyn std::error::Error + 'static)) -> bool {
    if let Some(e) = e.downcast_ref::<hyper_util::client::legacy::Error>() {
        // hyper-util marks failures to connect (and to complete the HTTP
        // handshake, before any request is written) as connect errors.
        return e.is_connect();
    }
    if let Some(e) = e.downcast_ref::<h2::Error>() {
        // REFUSED_STREAM: the server did no work on the stream (RFC 9113
        // §8.7). A graceful GOAWAY from the server fails only the streams
        // beyond its last stream id, which it has not processed.
        return e.reason() == Some(h2::Reason::REFUSED_STREAM)
            || (e.is_go_away() && e.is_remote() && e.reason() == Some(h2::Reason::NO_ERROR));
    }
    false
}

#[cfg(not(feature = "hyper-client"))]
fn proves_not_sent(_: &(dyn std::error::Error + 'static)) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use http::Request;
    use std::time::Duration;

    fn classify(method: &str, key: bool, status: u16, c: &HttpClassifier) -> Classification {
        let mut b = Request::builder().method(method).uri("http://up/x");
        if key {
            b = b.header("idempotency-key", "k1");
        }
        let req = b.body(()).unwrap();
        let resp = Response::builder().status(status).body(()).unwrap();
        c.classify_response(&RequestFacts::of(&req), &resp)
    }

    #[test]
    fn the_design_table_row_by_row() {
        let c = HttpClassifier::new();
        let cases: &[(u16, bool, Class, bool)] = &[
            (100, false, Class::Success, false),
            (200, false, Class::Success, false),
            (204, false, Class::Success, false),
            (302, false, Class::Success, false),
            (408, false, Class::NotProcessed, false),
            (425, false, Class::NotProcessed, false),
            (429, false, Class::Overloaded, false),
            (409, true, Class::InProgress, false),
            (409, false, Class::Rejected, false),
            (503, false, Class::Overloaded, true),
            (500, false, Class::Unknown, true),
            (502, false, Class::Unknown, true),
            (504, false, Class::Unknown, true),
            (507, false, Class::Unknown, true),
            (599, false, Class::Unknown, true),
            (501, false, Class::Rejected, false),
            (505, false, Class::Rejected, false),
            (511, false, Class::Rejected, false),
            (400, false, Class::Rejected, false),
            (401, false, Class::Rejected, false),
            (404, false, Class::Rejected, false),
            (422, false, Class::Rejected, false),
        ];
        for &(status, key, class, maybe) in cases {
            let got = classify("POST", key, status, &c);
            assert_eq!(got.class(), class, "status {status} key {key}");
            assert_eq!(got.maybe_processed(), maybe, "status {status}");
        }
    }

    #[test]
    fn retry_after_is_read_for_throttling_answers_only() {
        let c = HttpClassifier::new();
        let req = Request::get("http://up/x").body(()).unwrap();
        let facts = RequestFacts::of(&req);
        for status in [429, 503] {
            let resp = Response::builder()
                .status(status)
                .header("retry-after", "7")
                .body(())
                .unwrap();
            assert_eq!(
                c.classify_response(&facts, &resp).retry_after(),
                Some(Duration::from_secs(7))
            );
        }
        let resp = Response::builder()
            .status(500)
            .header("retry-after", "7")
            .body(())
            .unwrap();
        assert_eq!(c.classify_response(&facts, &resp).retry_after(), None);
        // Malformed: ignored, never a panic.
        for bad in ["soon", "-1", "1.5"] {
            let resp = Response::builder()
                .status(429)
                .header("retry-after", bad)
                .body(())
                .unwrap();
            let got = c.classify_response(&facts, &resp);
            assert_eq!(got.class(), Class::Overloaded);
            assert_eq!(got.retry_after(), None, "{bad}");
        }
        // A wait of more than 10 digits is the longest wait, which no retry
        // honours: it stops, as a 10-digit one does.
        let resp = Response::builder()
            .status(429)
            .header("retry-after", "99999999999999")
            .body(())
            .unwrap();
        assert_eq!(
            c.classify_response(&facts, &resp).retry_after(),
            Some(Duration::MAX)
        );
        // HTTP-date form.
        let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        let resp = Response::builder()
            .status(503)
            .header("retry-after", date)
            .body(())
            .unwrap();
        let wait = c.classify_response(&facts, &resp).retry_after().unwrap();
        assert!(
            wait > Duration::from_secs(100) && wait <= Duration::from_secs(120),
            "{wait:?}"
        );
    }

    #[test]
    fn overrides_replace_a_row() {
        let c = HttpClassifier::new()
            .on_status(StatusCode::CONFLICT, Class::Rejected)
            .on_status(StatusCode::NOT_FOUND, Class::NotProcessed)
            .on_status(StatusCode::NOT_FOUND, Class::Unknown);
        assert_eq!(classify("POST", true, 409, &c).class(), Class::Rejected);
        assert_eq!(classify("GET", false, 404, &c).class(), Class::Unknown);
        assert_eq!(classify("GET", false, 500, &c).class(), Class::Unknown);
    }

    #[test]
    fn grpc_requests_are_classified_by_the_grpc_table_without_being_named() {
        use crate::classify::GrpcCode;

        let c = HttpClassifier::new().on_status(StatusCode::OK, Class::Rejected);
        let request = |grpc: bool, key: bool| {
            let mut b = Request::post("http://up/ledger.Ledger/Charge");
            if grpc {
                b = b.header("content-type", "application/grpc+proto");
            }
            if key {
                b = b.header("idempotency-key", "k-1");
            }
            b.body(()).unwrap()
        };
        let answer = |status: u16, grpc_status: Option<&str>| {
            let mut b = Response::builder()
                .status(status)
                .header("content-type", "application/grpc");
            if let Some(s) = grpc_status {
                b = b
                    .header("grpc-status", s)
                    .header("grpc-retry-pushback-ms", "40");
            }
            b.body(()).unwrap()
        };
        let grpc = request(true, false);
        let facts = RequestFacts::of(&grpc);

        // A trailers-only UNAVAILABLE: overloaded, may have been processed,
        // with its pushback and its code.
        let got = c.classify_response(&facts, &answer(200, Some("14")));
        assert_eq!(got.class(), Class::Overloaded);
        assert!(got.maybe_processed());
        assert_eq!(got.retry_after(), Some(Duration::from_millis(40)));
        assert_eq!(got.grpc_code(), Some(GrpcCode::Unavailable));
        // RESOURCE_EXHAUSTED was not processed.
        let got = c.classify_response(&facts, &answer(200, Some("8")));
        assert_eq!(got.class(), Class::Overloaded);
        assert!(!got.maybe_processed());
        // The status comes in the trailers: under way, a success so far
        // (the HTTP override of 200 is not applied to gRPC answers).
        let got = c.classify_response(&facts, &answer(200, None));
        assert_eq!(got.class(), Class::Success);
        assert_eq!(got.grpc_code(), None);
        // A proxy's 503: the HTTP table.
        let got = c.classify_response(&facts, &answer(503, None));
        assert_eq!((got.class(), got.grpc_code()), (Class::Overloaded, None));

        // The same answer to a request that is not gRPC: the HTTP table.
        let http = request(false, false);
        let got = c.classify_response(&RequestFacts::of(&http), &answer(200, Some("14")));
        assert_eq!((got.class(), got.grpc_code()), (Class::Rejected, None));

        // Replay-safety: a gRPC call is a POST; safe with a key only.
        assert!(!Classify::<()>::is_replay_safe(&c, &facts));
        let keyed = request(true, true);
        assert!(Classify::<()>::is_replay_safe(
            &c,
            &RequestFacts::of(&keyed)
        ));

        // A refused connection proves nothing was sent.
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            Classify::<()>::classify_error(&c, &facts, &refused).class(),
            Class::NotSent
        );
    }

    #[test]
    fn errors_are_unknown_unless_proven_not_sent() {
        let timeout = Error::attempt_timeout(Duration::from_secs(1));
        assert_eq!(classify_error(&timeout), Class::Unknown);
        let refused = Error::connect(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert_eq!(classify_error(&refused), Class::NotSent);
        assert_eq!(
            classify_error(&Error::connect_timeout(Duration::from_secs(2))),
            Class::NotSent
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(classify_error(&reset), Class::Unknown);
        let refused_stream = h2::Error::from(h2::Reason::REFUSED_STREAM);
        assert_eq!(classify_error(&refused_stream), Class::NotSent);
        let internal = h2::Error::from(h2::Reason::INTERNAL_ERROR);
        assert_eq!(classify_error(&internal), Class::Unknown);
    }
}
