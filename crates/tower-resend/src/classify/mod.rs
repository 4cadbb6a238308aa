//! What one attempt's result says the server may have done.
//!
//! A [`Classify`] looks at one attempt's response or error and answers with a
//! [`Classification`]: a [`Class`], whether the server may have acted on the
//! request, and what it said about waiting. It knows the protocol and nothing
//! of the business; per-API quirks are configuration
//! ([`HttpClassifier::on_status`]). The retry layer decides from it.
//!
//! The default, [`HttpClassifier`], implements this table, and the
//! [gRPC one](#grpc) for gRPC requests:
//!
//! | observation | class | was it processed? |
//! |---|---|---|
//! | 1xx, 2xx, 3xx | [`Success`](Class::Success) | yes |
//! | connect refused or timed out, DNS, TLS handshake: nothing was written | [`NotSent`](Class::NotSent) | no |
//! | HTTP/2 `REFUSED_STREAM`, a graceful `GOAWAY` beyond the last stream id | [`NotSent`](Class::NotSent) | no |
//! | 408, 425 | [`NotProcessed`](Class::NotProcessed) | no |
//! | 429 | [`Overloaded`](Class::Overloaded), with its `Retry-After` | no |
//! | 409 on a request that carries an Idempotency-Key | [`InProgress`](Class::InProgress): the same key is still running | not yet |
//! | 503 | [`Overloaded`](Class::Overloaded), with its `Retry-After` | unknown |
//! | 500, 502, 504, other 5xx but 501, 505, 511 | [`Unknown`](Class::Unknown) | maybe |
//! | a timeout after the request was written, a reset mid-response, a body error | [`Unknown`](Class::Unknown) | maybe |
//! | other 4xx, 501, 505, 511, 409 without a key | [`Rejected`](Class::Rejected) | no, refused |
//! | a 503 marked [`Idempotent-Nothing-Done: true`](IDEMPOTENT_NOTHING_DONE) (a server's shed or refusal) | [`Overloaded`](Class::Overloaded), with its `Retry-After` | no |
//! | another 5xx so marked | [`NotProcessed`](Class::NotProcessed) | no |
//!
//! A timeout is never "it failed": it is "we do not know". Connect failures
//! are the one place where we can know that nothing was sent.
//!
//! # gRPC
//!
//! A gRPC call is an HTTP/2 POST whose answer is a 200 with its status in
//! `grpc-status`: in the response headers of a *trailers-only* response (a
//! call that failed before any message, the usual shape of UNAVAILABLE and
//! RESOURCE_EXHAUSTED), or in the trailers. [`HttpClassifier`], the default,
//! recognises gRPC requests by their `content-type` (`application/grpc…`,
//! the same test that makes the stack write `grpc-timeout`) and classifies
//! them by this table, as [`GrpcClassifier`] does; the retry layer acts on
//! a status in the headers only, since one in the trailers arrives after the
//! layer has handed the response on
//! ([`GrpcClassifier::classify_trailers`] reads it, for reporting).
//!
//! | `grpc-status` | class | retried |
//! |---|---|---|
//! | OK | [`Success`](Class::Success) | no |
//! | UNAVAILABLE | [`Overloaded`](Class::Overloaded), may have been processed (like HTTP 503) | when replay-safe, after `grpc-retry-pushback-ms` (or the overload floor) plus backoff |
//! | RESOURCE_EXHAUSTED | [`Overloaded`](Class::Overloaded), not processed (like HTTP 429) | yes, after `grpc-retry-pushback-ms` (or the overload floor) plus backoff |
//! | DEADLINE_EXCEEDED | [`Unknown`](Class::Unknown), never retried | no: the deadline is the call's, shared by every attempt |
//! | CANCELLED, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION, ABORTED, OUT_OF_RANGE, UNIMPLEMENTED, UNAUTHENTICATED | [`Rejected`](Class::Rejected) | no |
//! | UNKNOWN, INTERNAL, DATA_LOSS, a malformed status | [`Unknown`](Class::Unknown) (like HTTP 500) | when replay-safe |
//! | UNAVAILABLE marked `idempotent-nothing-done: true` (a server's shed or refusal) | [`Overloaded`](Class::Overloaded), not processed | yes, as RESOURCE_EXHAUSTED |
//! | another failing status so marked | [`NotProcessed`](Class::NotProcessed), its pushback kept | yes, unless its pushback says not to (DEADLINE_EXCEEDED's does) |
//! | no `grpc-status` in the headers (it comes in the trailers) | [`Success`](Class::Success) for the retry layer | no |
//! | an HTTP status other than 200 (a proxy answered) | as the HTTP table says | as for HTTP |
//! | a refused connection (tonic's `ConnectError`) | [`NotSent`](Class::NotSent) | yes |
//!
//! A `grpc-retry-pushback-ms` that is negative or malformed means "do not
//! retry", as gRPC's retry design says; a valid one replaces the overload
//! floor, like `Retry-After`. The [`Classification`] carries the status
//! ([`Classification::grpc_code`]), and so does the attempt's record
//! ([`Attempt::grpc_code`](crate::retry::Attempt::grpc_code)).
//!
//! gRPC methods are all POST, so a call is **replay-safe** only with an
//! `idempotency-key` metadata entry ([`RequestFacts::has_idempotency_key`])
//! or, with a [`GrpcClassifier`], when its method is on the classifier's
//! allowlist of idempotent methods ([`GrpcClassifier::idempotent`]): opt-in,
//! so that without it an unsafe call is never sent twice. Everything else
//! that may have been processed (UNAVAILABLE, a timeout after the request
//! was written) ends the call with
//! [`OutcomeUnknown`](crate::ErrorKind::OutcomeUnknown); what was not
//! processed (RESOURCE_EXHAUSTED, a refused connection) is retried for every
//! method.
//!
//! ```
//! use http::{Request, Response};
//! use tower_resend::classify::{Class, Classify, GrpcCode, HttpClassifier, RequestFacts};
//!
//! let req = Request::post("http://ledger/ledger.Ledger/Charge")
//!     .header("content-type", "application/grpc")
//!     .body(())
//!     .unwrap();
//! let facts = RequestFacts::of(&req);
//! let exhausted = Response::builder()
//!     .header("content-type", "application/grpc")
//!     .header("grpc-status", "8")
//!     .header("grpc-retry-pushback-ms", "250")
//!     .body(())
//!     .unwrap();
//! let got = HttpClassifier::new().classify_response(&facts, &exhausted);
//! assert_eq!(got.class(), Class::Overloaded);
//! assert!(!got.maybe_processed()); // so even Charge is retried...
//! assert_eq!(got.retry_after(), Some(std::time::Duration::from_millis(250))); // ...after 250 ms
//! assert_eq!(got.grpc_code(), Some(GrpcCode::ResourceExhausted));
//! assert!(!Classify::<()>::is_replay_safe(&HttpClassifier::new(), &facts));
//! ```
//!
//! ```
//! use http::{Method, Request, Response, StatusCode};
//! use tower_resend::classify::{Class, Classify, HttpClassifier, RequestFacts};
//!
//! let req = Request::post("http://api/orders").body(()).unwrap();
//! let facts = RequestFacts::of(&req);
//!
//! let c = HttpClassifier::new();
//! let resp = Response::builder().status(503).header("retry-after", "2").body(()).unwrap();
//! let got = c.classify_response(&facts, &resp);
//! assert_eq!(got.class(), Class::Overloaded);
//! assert!(got.maybe_processed());
//! assert_eq!(got.retry_after(), Some(std::time::Duration::from_secs(2)));
//!
//! // "This API's 409 means it already exists": configuration, not a fork.
//! let c = HttpClassifier::new().on_status(StatusCode::CONFLICT, Class::Rejected);
//! let resp = Response::builder().status(409).body(()).unwrap();
//! assert_eq!(c.classify_response(&facts, &resp).class(), Class::Rejected);
//! ```

mod grpc;
mod http;
mod pushback;

use std::time::Duration;

use ::http::{HeaderMap, Method, Request, Response, Uri};

#[cfg(any(feature = "tonic", feature = "service-config"))]
pub(crate) use self::grpc::proves_not_sent as grpc_proves_not_sent;
pub use self::grpc::{GrpcClassifier, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS};
pub use self::http::HttpClassifier;
pub use self::pushback::{parse_grpc_pushback, parse_retry_after, InvalidRetryAfter, Pushback};
pub use crate::vocab::{Class, GrpcCode};

/// A [`Class`] and what goes with it: whether the server may have acted on
/// the request, what it said about waiting, and for gRPC the status it
/// answered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Classification {
    class: Class,
    maybe_processed: bool,
    pushback: Option<Pushback>,
    grpc: Option<GrpcCode>,
    replayed: bool,
}

impl Classification {
    /// A classification of `class`, with the default answer to "may it have
    /// been processed?": yes for [`Unknown`](Class::Unknown), no for the others
    /// (a [`Success`](Class::Success) was processed, and is final anyway).
    pub const fn new(class: Class) -> Self {
        Self {
            class,
            maybe_processed: matches!(class, Class::Unknown),
            pushback: None,
            grpc: None,
            replayed: false,
        }
    }

    /// Marks an answer the server replayed from its idempotency store
    /// (`Idempotent-Replayed: true`): the stored answer of an earlier
    /// attempt under the same key, which every later attempt under that key
    /// gets again. The retry layer sets it on the answers it classifies.
    #[must_use]
    pub const fn with_replayed(mut self, replayed: bool) -> Self {
        self.replayed = replayed;
        self
    }

    /// True for an answer the server replayed from its idempotency store.
    pub const fn replayed(&self) -> bool {
        self.replayed
    }

    /// Records the gRPC status the attempt was answered with (the
    /// `grpc-status` of a trailers-only response), so that the attempt's
    /// record says it ([`Attempt::grpc_code`](crate::retry::Attempt::grpc_code)).
    #[must_use]
    pub const fn with_grpc_code(mut self, code: Option<GrpcCode>) -> Self {
        self.grpc = code;
        self
    }

    /// The gRPC status the attempt was answered with, if it was a gRPC
    /// answer that carried one in its headers.
    pub const fn grpc_code(&self) -> Option<GrpcCode> {
        self.grpc
    }

    /// The classification of a failure the server says it did nothing with
    /// ([`IDEMPOTENT_NOTHING_DONE`]): an overloaded answer (503,
    /// UNAVAILABLE) that was not processed, like a 429; any other failure
    /// that may have been processed (a 500, INTERNAL, DEADLINE_EXCEEDED)
    /// [`NotProcessed`](Class::NotProcessed). What the server said about
    /// waiting, and its gRPC status, are kept. A success, a rejection or
    /// "in progress" is left as it is.
    ///
    /// ```
    /// use tower_resend::classify::{Class, Classification};
    ///
    /// let shed = Classification::new(Class::Overloaded).with_maybe_processed(true).nothing_done();
    /// assert_eq!(shed.class(), Class::Overloaded);
    /// assert!(!shed.maybe_processed());
    /// assert_eq!(Classification::new(Class::Unknown).nothing_done().class(), Class::NotProcessed);
    /// ```
    #[must_use]
    pub const fn nothing_done(mut self) -> Self {
        match self.class {
            Class::Unknown => self.class = Class::NotProcessed,
            Class::Overloaded => {}
            _ => return self,
        }
        self.maybe_processed = false;
        self
    }

    /// Marks that the server may have acted on the request (a 503).
    #[must_use]
    pub const fn with_maybe_processed(mut self, maybe: bool) -> Self {
        self.maybe_processed = maybe;
        self
    }

    /// Records what the server said about waiting (`Retry-After`,
    /// `grpc-retry-pushback-ms`).
    #[must_use]
    pub const fn with_pushback(mut self, pushback: Option<Pushback>) -> Self {
        self.pushback = pushback;
        self
    }

    /// The class.
    pub const fn class(&self) -> Class {
        self.class
    }

    /// True when the server may have acted on the request, so that an unsafe
    /// request must not be sent again without verifying.
    pub const fn maybe_processed(&self) -> bool {
        self.maybe_processed
    }

    /// What the server said about waiting, if anything.
    pub const fn pushback(&self) -> Option<Pushback> {
        self.pushback
    }

    /// The wait the server asked for, if it asked for one.
    pub const fn retry_after(&self) -> Option<Duration> {
        match self.pushback {
            Some(Pushback::After(d)) => Some(d),
            _ => None,
        }
    }
}

/// The facts about a request that classification and the retry decision use.
#[derive(Clone, Copy, Debug)]
pub struct RequestFacts<'a> {
    method: &'a Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
}

/// Marks a response replayed from a server's idempotency store (the
/// server half's `IDEMPOTENT_REPLAYED`, and the IETF draft's convention).
pub(crate) const IDEMPOTENT_REPLAYED: ::http::HeaderName =
    ::http::HeaderName::from_static("idempotent-replayed");

/// True when `headers` say the response was replayed from the server's
/// idempotency store.
pub(crate) fn is_replayed(headers: &HeaderMap) -> bool {
    headers
        .get(&IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// `Idempotent-Nothing-Done: true` on a failure (a header, or the metadata
/// of a trailers-only gRPC answer) says that the server did nothing with
/// this attempt: tower-resend-server puts it on its shedding and refusal
/// answers (and on a handler's answer marked `NothingDone`). The classifier
/// reads it: such a failure was [not processed](Classification::maybe_processed),
/// so the call may be sent again, keyed or not, and a call all of whose
/// attempts say so ends as overload, never as outcome unknown.
pub const IDEMPOTENT_NOTHING_DONE: ::http::HeaderName =
    ::http::HeaderName::from_static("idempotent-nothing-done");

/// True when `headers` say the server did nothing with the attempt.
pub(crate) fn says_nothing_done(headers: &HeaderMap) -> bool {
    headers
        .get(&IDEMPOTENT_NOTHING_DONE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// The header names recognised as an idempotency key on outgoing requests.
pub(crate) const KEY_HEADERS: [::http::HeaderName; 2] = [
    ::http::HeaderName::from_static("idempotency-key"),
    ::http::HeaderName::from_static("x-idempotency-key"),
];

impl<'a> RequestFacts<'a> {
    /// The facts of `req`.
    pub fn of<B>(req: &'a Request<B>) -> Self {
        Self::new(req.method(), req.uri(), req.headers())
    }

    /// The facts of a request made of these parts.
    pub const fn new(method: &'a Method, uri: &'a Uri, headers: &'a HeaderMap) -> Self {
        Self {
            method,
            uri,
            headers,
        }
    }

    /// The request's method.
    pub const fn method(&self) -> &'a Method {
        self.method
    }

    /// The request's URI.
    pub const fn uri(&self) -> &'a Uri {
        self.uri
    }

    /// The request's headers.
    pub const fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// True when the request carries an idempotency key (`Idempotency-Key`,
    /// or `X-Idempotency-Key` as Go's net/http also recognises).
    pub fn has_idempotency_key(&self) -> bool {
        KEY_HEADERS.iter().any(|h| self.headers.contains_key(h))
    }

    /// True for a gRPC request: its `content-type` is `application/grpc` or
    /// a subtype (`application/grpc+proto`, `application/grpc-web`…).
    ///
    /// ```
    /// use tower_resend::classify::RequestFacts;
    ///
    /// let req = http::Request::post("/pkg.Svc/Method")
    ///     .header("content-type", "application/grpc+proto")
    ///     .body(())
    ///     .unwrap();
    /// assert!(RequestFacts::of(&req).is_grpc());
    /// ```
    pub fn is_grpc(&self) -> bool {
        is_grpc(self.headers)
    }

    /// True when the method is idempotent by definition (RFC 9110 §9.2.2):
    /// GET, HEAD, OPTIONS, TRACE, PUT, DELETE.
    pub fn is_idempotent_method(&self) -> bool {
        is_idempotent(self.method)
    }
}

/// True when `headers` say `content-type: application/grpc…`.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    // An empty map is the common case: answered here, without the call into
    // the map's lookup (-29 instructions per call, callgrind).
    !headers.is_empty()
        && headers
            .get(::http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// True for GET, HEAD, OPTIONS, TRACE, PUT and DELETE.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Classifies one attempt's result.
///
/// Implement it to teach resend another protocol or an API's quirks; most
/// users configure [`HttpClassifier`] instead.
pub trait Classify<B> {
    /// Classifies a response.
    fn classify_response(&self, req: &RequestFacts<'_>, resp: &Response<B>) -> Classification;

    /// Classifies an error of the inner service (the transport, or an inner
    /// resend layer such as the attempt timeout).
    fn classify_error(
        &self,
        req: &RequestFacts<'_>,
        err: &(dyn std::error::Error + 'static),
    ) -> Classification;

    /// True when the request may be sent again even though the server may
    /// have acted on it: the retry layer asks once per call, before the first
    /// attempt.
    ///
    /// The default is the HTTP rule: an idempotent method
    /// ([`RequestFacts::is_idempotent_method`]) or an idempotency key
    /// ([`RequestFacts::has_idempotency_key`]). A protocol whose methods are
    /// all POST (gRPC) overrides it, e.g. with an allowlist of idempotent
    /// methods.
    ///
    /// ```
    /// use http::Request;
    /// use tower_resend::classify::{Classify, HttpClassifier, RequestFacts};
    ///
    /// let c = HttpClassifier::new();
    /// let get = Request::get("http://api/items/1").body(()).unwrap();
    /// let post = Request::post("http://api/charges").body(()).unwrap();
    /// assert!(Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&get)));
    /// assert!(!Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&post)));
    /// ```
    fn is_replay_safe(&self, req: &RequestFacts<'_>) -> bool {
        req.is_idempotent_method() || req.has_idempotency_key()
    }
}
