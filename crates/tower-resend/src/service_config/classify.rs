//! The classifier of a method with a service config policy: its status
//! codes are what is retried (or not fatal to a hedge), the others final.

use http::{HeaderMap, Response, StatusCode};

use crate::classify::{
    parse_grpc_pushback, Class, Classification, Classify, GrpcClassifier, GrpcCode, RequestFacts,
    GRPC_RETRY_PUSHBACK_MS,
};
use crate::error::{Error, ErrorKind};

/// A set of gRPC status codes, one bit each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CodeSet(u32);

impl CodeSet {
    pub(crate) fn of(codes: &[GrpcCode]) -> Self {
        Self(codes.iter().fold(0, |set, c| set | 1 << c.as_i32()))
    }

    pub(crate) const fn contains(self, code: GrpcCode) -> bool {
        self.0 & (1 << code.as_i32()) != 0
    }
}

/// The gRPC status of an answer: `grpc-status` in the headers of a 200 (a
/// trailers-only answer; `None` when it will come in the trailers), or the
/// status gRPC gives an HTTP status a proxy answered with (gRPC's
/// `http-grpc-status-mapping`).
pub(crate) fn answer_code<B>(resp: &Response<B>) -> Option<GrpcCode> {
    match resp.status() {
        StatusCode::OK => GrpcCode::in_headers(resp.headers()),
        StatusCode::BAD_REQUEST => Some(GrpcCode::Internal),
        StatusCode::UNAUTHORIZED => Some(GrpcCode::Unauthenticated),
        StatusCode::FORBIDDEN => Some(GrpcCode::PermissionDenied),
        StatusCode::NOT_FOUND => Some(GrpcCode::Unimplemented),
        StatusCode::TOO_MANY_REQUESTS
        | StatusCode::BAD_GATEWAY
        | StatusCode::SERVICE_UNAVAILABLE
        | StatusCode::GATEWAY_TIMEOUT => Some(GrpcCode::Unavailable),
        _ => Some(GrpcCode::Unknown),
    }
}

/// The gRPC status of a failure of the transport: DEADLINE_EXCEEDED when
/// time ran out (the channel's own `grpc-timeout`, an attempt timeout),
/// else UNAVAILABLE, as gRPC reports a broken connection.
pub(crate) fn error_code(err: &(dyn std::error::Error + 'static)) -> GrpcCode {
    let timed_out = std::iter::successors(Some(err), |e| e.source()).any(|e| {
        e.downcast_ref::<Error>().is_some_and(|e| {
            matches!(
                e.kind(),
                ErrorKind::DeadlineExceeded | ErrorKind::AttemptTimeout
            )
        })
    });
    if timed_out {
        GrpcCode::DeadlineExceeded
    } else {
        GrpcCode::Unavailable
    }
}

/// Classifies the attempts of a method by its service config policy: a
/// status in the policy's codes (`retryableStatusCodes`,
/// `nonFatalStatusCodes`) may be sent again (after
/// `grpc-retry-pushback-ms`, if the server sent one; a negative or
/// malformed one stops); OK is a success; every other status is final.
/// A method with a policy is replay-safe: the config declares it so.
///
/// Errors: a refused connection was not sent, and is sent again whatever
/// the policy (gRPC's transparent retries); an attempt cut by
/// `perAttemptRecvTimeout` is retried under a retry policy (as gRPC's C
/// core does); time running out otherwise counts as DEADLINE_EXCEEDED, and
/// any other failure of the transport as UNAVAILABLE.
///
/// The stacks that [`ServiceConfig::service`](super::ServiceConfig::service)
/// builds classify with it; it is not built by hand.
#[derive(Clone, Debug, Default)]
pub struct MethodClassifier {
    grpc: GrpcClassifier,
    codes: CodeSet,
    replay_safe: bool,
    retry_timeouts: bool,
}

impl MethodClassifier {
    /// A method whose attempts ending with `codes` may be sent again;
    /// `has_policy`: it has a retry or hedging policy (replay-safe);
    /// `retry_timeouts`: an attempt timeout is retried.
    pub(crate) fn new(codes: CodeSet, has_policy: bool, retry_timeouts: bool) -> Self {
        Self {
            grpc: GrpcClassifier::new(),
            codes,
            replay_safe: has_policy,
            retry_timeouts,
        }
    }

    fn by_code(&self, code: GrpcCode, headers: &HeaderMap) -> Classification {
        let c = if code == GrpcCode::Ok {
            Classification::new(Class::Success)
        } else if self.codes.contains(code) {
            let pushback = headers
                .get(GRPC_RETRY_PUSHBACK_MS)
                .map(|v| parse_grpc_pushback(v.as_bytes()));
            Classification::new(Class::Unknown).with_pushback(pushback)
        } else {
            Classification::new(Class::Rejected)
        };
        c.with_grpc_code(Some(code))
    }
}

impl<B> Classify<B> for MethodClassifier {
    fn classify_response(&self, _req: &RequestFacts<'_>, resp: &Response<B>) -> Classification {
        match answer_code(resp) {
            Some(code) => self.by_code(code, resp.headers()),
            // The status comes in the trailers: the call is under way.
            None => Classification::new(Class::Success),
        }
    }

    fn classify_error(
        &self,
        req: &RequestFacts<'_>,
        err: &(dyn std::error::Error + 'static),
    ) -> Classification {
        let c = Classify::<B>::classify_error(&self.grpc, req, err);
        if c.class() == Class::NotSent {
            return c;
        }
        let timeout = err
            .downcast_ref::<Error>()
            .is_some_and(|e| e.kind() == ErrorKind::AttemptTimeout);
        if (timeout && self.retry_timeouts) || self.codes.contains(error_code(err)) {
            Classification::new(Class::Unknown)
        } else {
            // Not one of the policy's codes: final, though it may have run.
            Classification::new(Class::Unknown)
                .with_pushback(Some(crate::classify::Pushback::DoNotRetry))
        }
    }

    fn is_replay_safe(&self, req: &RequestFacts<'_>) -> bool {
        self.replay_safe || req.has_idempotency_key()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Pushback;
    use http::Request;

    fn classify(c: &MethodClassifier, status: u16, headers: &[(&str, &str)]) -> Classification {
        let req = Request::post("http://up/pkg.Svc/M").body(()).unwrap();
        let mut resp = Response::builder().status(status);
        for (k, v) in headers {
            resp = resp.header(*k, *v);
        }
        c.classify_response(&RequestFacts::of(&req), &resp.body(()).unwrap())
    }

    #[test]
    fn the_policys_codes_are_retried_the_others_final() {
        let set = CodeSet::of(&[GrpcCode::Unavailable, GrpcCode::Aborted]);
        let c = MethodClassifier::new(set, true, false);
        assert_eq!(
            classify(&c, 200, &[("grpc-status", "14")]).class(),
            Class::Unknown
        );
        // ABORTED is final in resend's own table; this policy retries it.
        assert_eq!(
            classify(&c, 200, &[("grpc-status", "10")]).class(),
            Class::Unknown
        );
        // RESOURCE_EXHAUSTED is retried by resend's table; not by this policy.
        let got = classify(&c, 200, &[("grpc-status", "8")]);
        assert_eq!(got.class(), Class::Rejected);
        assert_eq!(got.grpc_code(), Some(GrpcCode::ResourceExhausted));
        assert_eq!(
            classify(&c, 200, &[("grpc-status", "0")]).class(),
            Class::Success
        );
        assert_eq!(classify(&c, 200, &[]).class(), Class::Success);
        // Pushback, on a retryable code.
        let got = classify(
            &c,
            200,
            &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "-1")],
        );
        assert_eq!(got.pushback(), Some(Pushback::DoNotRetry));
        // A proxy's 503 is UNAVAILABLE; its 500 UNKNOWN, not in the set.
        assert_eq!(classify(&c, 503, &[]).class(), Class::Unknown);
        assert_eq!(classify(&c, 500, &[]).class(), Class::Rejected);
        let req = Request::post("http://up/pkg.Svc/M").body(()).unwrap();
        assert!(Classify::<()>::is_replay_safe(&c, &RequestFacts::of(&req)));
        let none = MethodClassifier::new(CodeSet::default(), false, false);
        assert!(!Classify::<()>::is_replay_safe(
            &none,
            &RequestFacts::of(&req)
        ));
        assert_eq!(
            classify(&none, 200, &[("grpc-status", "14")]).class(),
            Class::Rejected
        );
    }
}
