use std::sync::Arc;

use http::header::HeaderName;

pub use crate::vocab::GRPC_STATUS;
use http::{HeaderMap, Response, StatusCode};

use super::pushback::{parse_grpc_pushback, Pushback};
use super::{Class, Classification, Classify, GrpcCode, HttpClassifier, RequestFacts};

/// The `grpc-retry-pushback-ms` header (or trailer).
pub const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The gRPC classifier of the [module table](super#grpc), with an allowlist
/// of idempotent methods.
///
/// The default [`HttpClassifier`] applies the same table to gRPC requests
/// (`content-type: application/grpc…`) without being asked; name this one
/// to declare methods idempotent ([`idempotent`](Self::idempotent)), so
/// that an answer that may have been processed (UNAVAILABLE, a timeout) is
/// retried for them. It applies the gRPC table to every request, whatever
/// its content type.
///
/// ```
/// use http::{Request, Response};
/// use tower_resend::classify::{Class, Classify, GrpcClassifier, RequestFacts};
///
/// let c = GrpcClassifier::new().idempotent("/shop.Catalog/GetItem");
/// let get = Request::post("http://shop/shop.Catalog/GetItem").body(()).unwrap();
/// let buy = Request::post("http://shop/shop.Orders/Buy").body(()).unwrap();
/// assert!(Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&get)));
/// assert!(!Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&buy)));
///
/// let unavailable = Response::builder().header("grpc-status", "14").body(()).unwrap();
/// let got = c.classify_response(&RequestFacts::of(&buy), &unavailable);
/// assert_eq!(got.class(), Class::Overloaded);
/// assert!(got.maybe_processed()); // so Buy is not retried
/// ```
#[derive(Clone, Debug, Default)]
pub struct GrpcClassifier {
    http: HttpClassifier,
    // Few entries, shared, so clones are cheap.
    idempotent: Option<Arc<[Box<str>]>>,
}

impl GrpcClassifier {
    /// The classifier of the module table; no method is on the allowlist.
    pub const fn new() -> Self {
        Self {
            http: HttpClassifier::new(),
            idempotent: None,
        }
    }

    /// Declares the method `full_name` (`/pkg.Service/Method`, the request
    /// path) idempotent: it may be sent again after an answer that leaves
    /// its outcome unknown.
    ///
    /// ```
    /// let c = tower_resend::classify::GrpcClassifier::new().idempotent("/bank.Ledger/GetBalance");
    /// assert!(c.is_idempotent("/bank.Ledger/GetBalance"));
    /// assert!(!c.is_idempotent("/bank.Ledger/Transfer"));
    /// ```
    #[must_use]
    pub fn idempotent(self, full_name: &str) -> Self {
        self.idempotent_methods([full_name])
    }

    /// Declares each of `full_names` idempotent; see [`idempotent`](Self::idempotent).
    ///
    /// ```
    /// let c = tower_resend::classify::GrpcClassifier::new()
    ///     .idempotent_methods(["/shop.Catalog/GetItem", "/shop.Catalog/ListItems"]);
    /// assert!(c.is_idempotent("/shop.Catalog/ListItems"));
    /// ```
    #[must_use]
    pub fn idempotent_methods<I, S>(self, full_names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut list: Vec<Box<str>> = self.idempotent.as_deref().unwrap_or_default().to_vec();
        for name in full_names {
            let name = name.as_ref();
            if !list.iter().any(|m| &**m == name) {
                list.push(name.into());
            }
        }
        Self {
            http: self.http,
            idempotent: Some(list.into()),
        }
    }

    /// True when `path` (`/pkg.Service/Method`) is on the allowlist.
    pub fn is_idempotent(&self, path: &str) -> bool {
        self.idempotent
            .as_deref()
            .is_some_and(|list| list.iter().any(|m| &**m == path))
    }

    /// Classifies a call by its trailers, for reporting: the status of a
    /// call whose response began with messages comes in the trailers, after
    /// the retry layer has returned the response, so no retry acts on it.
    /// Trailers without `grpc-status` are [`Unknown`](Class::Unknown): the
    /// call ended without saying how.
    ///
    /// ```
    /// use tower_resend::classify::{Class, GrpcClassifier, GrpcCode};
    ///
    /// let mut trailers = http::HeaderMap::new();
    /// trailers.insert("grpc-status", http::HeaderValue::from_static("4"));
    /// let c = GrpcClassifier::new().classify_trailers(&trailers);
    /// assert_eq!(c.class(), Class::Unknown); // DEADLINE_EXCEEDED: may have been processed
    /// assert_eq!(c.grpc_code(), Some(GrpcCode::DeadlineExceeded));
    /// ```
    pub fn classify_trailers(&self, trailers: &HeaderMap) -> Classification {
        match GrpcCode::in_headers(trailers) {
            Some(code) => classify_code(code, trailers),
            None => Classification::new(Class::Unknown),
        }
    }
}

/// Classifies a gRPC status and what came with it (`headers`: the response
/// headers of a trailers-only response, or the trailers). The table of the
/// [module docs](super#grpc).
fn classify_code(code: GrpcCode, headers: &HeaderMap) -> Classification {
    let c = match code {
        GrpcCode::Ok => Classification::new(Class::Success),
        GrpcCode::Unavailable => Classification::new(Class::Overloaded)
            .with_maybe_processed(true)
            .with_pushback(pushback(headers)),
        GrpcCode::ResourceExhausted => {
            Classification::new(Class::Overloaded).with_pushback(pushback(headers))
        }
        // The deadline is the call's: another attempt would have less of
        // it. Never retried, whatever the method.
        GrpcCode::DeadlineExceeded => {
            Classification::new(Class::Unknown).with_pushback(Some(Pushback::DoNotRetry))
        }
        GrpcCode::Cancelled
        | GrpcCode::InvalidArgument
        | GrpcCode::NotFound
        | GrpcCode::AlreadyExists
        | GrpcCode::PermissionDenied
        | GrpcCode::FailedPrecondition
        | GrpcCode::Aborted
        | GrpcCode::OutOfRange
        | GrpcCode::Unimplemented
        | GrpcCode::Unauthenticated => Classification::new(Class::Rejected),
        GrpcCode::Unknown | GrpcCode::Internal | GrpcCode::DataLoss => {
            Classification::new(Class::Unknown).with_pushback(pushback(headers))
        }
    };
    let c = c.with_grpc_code(Some(code));
    if c.class() != Class::Success && super::says_nothing_done(headers) {
        return c.nothing_done();
    }
    c
}

/// Reads `grpc-retry-pushback-ms`: absent is `None`; negative or malformed
/// is [`Pushback::DoNotRetry`].
fn pushback(headers: &HeaderMap) -> Option<Pushback> {
    headers
        .get(GRPC_RETRY_PUSHBACK_MS)
        .map(|v| parse_grpc_pushback(v.as_bytes()))
}

/// The gRPC table for a response: a 200 with `grpc-status` in its headers
/// (trailers-only) by the status; a 200 without (the status comes in the
/// trailers) a success; any other HTTP status (a proxy answered) by `http`'s
/// HTTP table.
pub(super) fn classify_response<B>(
    http: &HttpClassifier,
    req: &RequestFacts<'_>,
    resp: &Response<B>,
) -> Classification {
    if resp.status() != StatusCode::OK {
        // Not a gRPC answer: a proxy or load balancer spoke HTTP.
        return http.classify_http(req, resp);
    }
    match GrpcCode::in_headers(resp.headers()) {
        Some(code) => classify_code(code, resp.headers()),
        // The status will come in the trailers: the call is under way.
        None => Classification::new(Class::Success),
    }
}

/// The gRPC table for an error: [`NotSent`](Class::NotSent) when the error
/// proves nothing was written, else as `http` says.
pub(super) fn classify_error(
    http: &HttpClassifier,
    req: &RequestFacts<'_>,
    err: &(dyn std::error::Error + 'static),
) -> Classification {
    if proves_not_sent(err) {
        return Classification::new(Class::NotSent);
    }
    http.classify_error_http(req, err)
}

impl<B> Classify<B> for GrpcClassifier {
    fn classify_response(&self, req: &RequestFacts<'_>, resp: &Response<B>) -> Classification {
        classify_response(&self.http, req, resp)
    }

    fn classify_error(
        &self,
        req: &RequestFacts<'_>,
        err: &(dyn std::error::Error + 'static),
    ) -> Classification {
        classify_error(&self.http, req, err)
    }

    fn is_replay_safe(&self, req: &RequestFacts<'_>) -> bool {
        self.is_idempotent(req.uri().path()) || req.has_idempotency_key()
    }
}

/// True when `err`'s source chain holds a refused connection, or (feature
/// `tonic`) tonic's `ConnectError` (the channel could not connect): nothing
/// was written.
pub(crate) fn proves_not_sent(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        #[cfg(feature = "tonic")]
        if e.is::<::tonic::ConnectError>() {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            // Only connect(2) is refused.
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;
    use std::time::Duration;

    fn classify(method: &str, headers: &[(&str, &str)]) -> (Classification, bool) {
        let c = GrpcClassifier::new().idempotent("/svc.S/Get");
        let req = Request::post(format!("http://up{method}"))
            .body(())
            .unwrap();
        let mut resp = Response::builder();
        for (k, v) in headers {
            resp = resp.header(*k, *v);
        }
        let resp = resp.body(()).unwrap();
        let facts = RequestFacts::of(&req);
        (
            c.classify_response(&facts, &resp),
            Classify::<()>::is_replay_safe(&c, &facts),
        )
    }

    #[test]
    fn the_status_table_row_by_row() {
        let rows: &[(&str, Class, bool)] = &[
            ("0", Class::Success, false),
            ("14", Class::Overloaded, true),
            ("8", Class::Overloaded, false),
            ("4", Class::Unknown, true),
            ("1", Class::Rejected, false),
            ("3", Class::Rejected, false),
            ("5", Class::Rejected, false),
            ("6", Class::Rejected, false),
            ("7", Class::Rejected, false),
            ("9", Class::Rejected, false),
            ("10", Class::Rejected, false),
            ("11", Class::Rejected, false),
            ("12", Class::Rejected, false),
            ("16", Class::Rejected, false),
            ("2", Class::Unknown, true),
            ("13", Class::Unknown, true),
            ("15", Class::Unknown, true),
            ("99", Class::Unknown, true),
            ("fourteen", Class::Unknown, true),
        ];
        for &(status, class, maybe) in rows {
            let (c, _) = classify("/svc.S/Get", &[("grpc-status", status)]);
            assert_eq!(c.class(), class, "grpc-status {status}");
            assert_eq!(c.maybe_processed(), maybe, "grpc-status {status}");
            // The code goes with the classification, for the attempt record.
            assert_eq!(
                c.grpc_code(),
                Some(GrpcCode::parse(status.as_bytes())),
                "grpc-status {status}"
            );
        }
        // DEADLINE_EXCEEDED is never retried, even for an idempotent method.
        let (c, safe) = classify("/svc.S/Get", &[("grpc-status", "4")]);
        assert!(safe);
        assert_eq!(c.pushback(), Some(Pushback::DoNotRetry));
        // No status in the headers: it comes in the trailers.
        let (c, _) = classify("/svc.S/Get", &[]);
        assert_eq!(c.class(), Class::Success);
        assert_eq!(c.grpc_code(), None);
    }

    #[test]
    fn codes_parse_as_tonic_reads_them() {
        for n in 0..=16 {
            let code = GrpcCode::from_i32(n);
            assert_eq!(code.as_i32(), n);
            assert_eq!(GrpcCode::parse(n.to_string().as_bytes()), code);
        }
        for bad in [&b""[..], b"17", b"-1", b"014", b"1 ", b"\xff", b"20"] {
            assert_eq!(GrpcCode::parse(bad), GrpcCode::Unknown, "{bad:?}");
        }
        assert_eq!(GrpcCode::from_i32(-1), GrpcCode::Unknown);
        assert_eq!(
            GrpcCode::ResourceExhausted.to_string(),
            "RESOURCE_EXHAUSTED"
        );
    }

    #[test]
    fn pushback_is_read_like_retry_after() {
        let (c, _) = classify(
            "/svc.S/Put",
            &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")],
        );
        assert_eq!(c.retry_after(), Some(Duration::from_millis(1500)));
        for bad in ["-1", "soon", "1.5", ""] {
            let (c, _) = classify(
                "/svc.S/Get",
                &[("grpc-status", "14"), ("grpc-retry-pushback-ms", bad)],
            );
            assert_eq!(c.pushback(), Some(Pushback::DoNotRetry), "{bad:?}");
        }
        // On a final status, pushback is not read.
        let (c, _) = classify(
            "/svc.S/Get",
            &[("grpc-status", "5"), ("grpc-retry-pushback-ms", "10")],
        );
        assert_eq!(c.pushback(), None);
    }

    #[test]
    fn replay_safety_is_the_allowlist_or_a_key() {
        let c = GrpcClassifier::new()
            .idempotent("/svc.S/Get")
            .idempotent_methods(["/svc.S/List", "/svc.S/Get"]);
        let facts = |path: &str, key: bool| {
            let mut b = Request::post(format!("http://up{path}"));
            if key {
                b = b.header("idempotency-key", "k-1");
            }
            let req = b.body(()).unwrap();
            Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&req))
        };
        assert!(facts("/svc.S/Get", false));
        assert!(facts("/svc.S/List", false));
        assert!(!facts("/svc.S/Charge", false));
        assert!(facts("/svc.S/Charge", true));
        // The HTTP rule does not apply: a GET is not safe by its method.
        let get = Request::get("http://up/svc.S/Charge").body(()).unwrap();
        assert!(!Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&get)));
    }

    #[test]
    fn non_200_answers_are_classified_as_http() {
        let c = GrpcClassifier::new();
        let req = Request::post("http://up/svc.S/Get").body(()).unwrap();
        let resp = Response::builder()
            .status(502)
            .header("grpc-status", "0")
            .body(())
            .unwrap();
        let got = c.classify_response(&RequestFacts::of(&req), &resp);
        assert_eq!(got.class(), Class::Unknown);
        assert_eq!(got.grpc_code(), None);
    }

    #[test]
    fn trailers_are_classified_for_reporting() {
        let c = GrpcClassifier::new();
        let mut t = HeaderMap::new();
        assert_eq!(c.classify_trailers(&t).class(), Class::Unknown);
        t.insert(GRPC_STATUS, "0".parse().unwrap());
        assert_eq!(c.classify_trailers(&t).class(), Class::Success);
        t.insert(GRPC_STATUS, "7".parse().unwrap());
        assert_eq!(c.classify_trailers(&t).class(), Class::Rejected);
    }

    #[test]
    fn a_refused_connection_is_not_sent() {
        let c = GrpcClassifier::new();
        let req = Request::post("http://up/svc.S/Get").body(()).unwrap();
        let facts = RequestFacts::of(&req);
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            Classify::<()>::classify_error(&c, &facts, &refused).class(),
            Class::NotSent
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(
            Classify::<()>::classify_error(&c, &facts, &reset).class(),
            Class::Unknown
        );
    }
}
