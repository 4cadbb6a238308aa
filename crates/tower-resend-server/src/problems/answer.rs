//! The answers the idempotency layer gives on its own account.

use std::borrow::Cow;
use std::time::Duration;

use http::Response;

use super::{Problem, ProblemType, Protocol};
use crate::body::MaybeBuffered;
use crate::store::StoredResponse;

/// The answers the idempotency layer gives on its own account, each in its
/// HTTP and gRPC form (through [`Problem`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// 400: the key is malformed, for this reason.
    KeyInvalid(&'static str),
    /// 400: the route requires a key.
    KeyRequired,
    /// 400: a keyed request without credentials, refused.
    KeyNeedsCredentials,
    /// 400: the request's body could not be read.
    RequestBodyFailed,
    /// 413: the request's body is over the cap.
    RequestTooLarge { cap: usize },
    /// 409: the same key is running.
    InProgress { retry_after: Duration },
    /// 422: the key was used with another request.
    KeyReused,
    /// 503: the store cannot be reached.
    StoreUnavailable,
    /// 503: the store answers, but its table is missing.
    StoreNotSetUp,
    /// 503: the commit's outcome is unknown (transactional).
    CommitOutcomeUnknown,
    /// 500: the operation failed (`failure`); `undone`: rolled back, so it
    /// may be sent again, rather than kept as the key's end.
    Failed { failure: Failure, undone: bool },
    /// 500: the handler kept its transaction (rolled back).
    TransactionInUse,
    /// 500: the handler's transaction was aborted, and its success answer
    /// not kept.
    TransactionAborted,
    /// 422: a statement of the handler's transaction violated an integrity
    /// constraint (SQLSTATE class 23), and its success answer was not kept.
    ConstraintViolation,
    /// 503: the handler's transaction failed to serialize or deadlocked
    /// (SQLSTATE 40001, 40P01), and its success answer was not kept.
    TransactionConflict,
}

/// How an operation failed, for [`Answer::Failed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The handler returned an error.
    Handler,
    /// The handler panicked.
    Panic,
    /// The response's body failed after its head.
    ResponseLost,
}

/// `Retry-After` of the layer's own 503s.
const RETRY_SOON: Duration = Duration::from_secs(1);

impl Answer {
    /// Its problem type.
    pub(crate) const fn kind(&self) -> ProblemType {
        match self {
            Self::KeyInvalid(_) => ProblemType::IdempotencyKeyInvalid,
            Self::KeyRequired => ProblemType::IdempotencyKeyRequired,
            Self::KeyNeedsCredentials => ProblemType::IdempotencyKeyNeedsCredentials,
            Self::RequestBodyFailed => ProblemType::RequestBodyFailed,
            Self::RequestTooLarge { .. } => ProblemType::RequestTooLarge,
            Self::InProgress { .. } => ProblemType::IdempotencyKeyInProgress,
            Self::KeyReused => ProblemType::IdempotencyKeyReused,
            Self::StoreUnavailable => ProblemType::IdempotencyStoreUnavailable,
            Self::StoreNotSetUp => ProblemType::IdempotencyStoreNotSetUp,
            Self::CommitOutcomeUnknown => ProblemType::CommitOutcomeUnknown,
            Self::Failed { failure, .. } => match failure {
                Failure::Handler => ProblemType::HandlerFailed,
                Failure::Panic => ProblemType::HandlerPanicked,
                Failure::ResponseLost => ProblemType::ResponseLost,
            },
            Self::TransactionInUse => ProblemType::TransactionInUse,
            Self::TransactionAborted => ProblemType::TransactionAborted,
            Self::ConstraintViolation => ProblemType::ConstraintViolation,
            Self::TransactionConflict => ProblemType::TransactionConflict,
        }
    }

    /// What happened this time: the document's `detail`, and
    /// `grpc-message`.
    fn detail(&self) -> Cow<'static, str> {
        const KEPT: &str = "it will not run again under this key";
        const UNDONE: &str = "its transaction was rolled back: nothing of it was committed, so it may be sent again (with the same key)";
        Cow::Borrowed(match self {
            Self::KeyInvalid(reason) => reason,
            Self::KeyRequired => "this request must carry an Idempotency-Key header",
            Self::KeyNeedsCredentials => {
                "a request with an Idempotency-Key must identify its caller (credentials)"
            }
            Self::RequestBodyFailed => "the request body could not be read",
            Self::RequestTooLarge { cap } => {
                return Cow::Owned(format!(
                    "a request with an idempotency key may have at most {cap} bytes of body"
                ))
            }
            Self::InProgress { .. } => {
                "a request with this idempotency key is in progress; retry later"
            }
            Self::KeyReused => "this idempotency key was used with another request (method, path or body differ)",
            Self::StoreUnavailable => "the idempotency store cannot be reached; nothing was done",
            Self::StoreNotSetUp => "the idempotency store is not set up: its table is missing (run migrate); nothing was done",
            Self::CommitOutcomeUnknown => "the operation's transaction may or may not have committed; send it again with the same key: it is replayed if it did",
            Self::Failed { failure, undone } => {
                let what = match failure {
                    Failure::Handler => "the operation failed and may have run in part",
                    Failure::Panic => "the operation failed unexpectedly and may have run in part",
                    Failure::ResponseLost => "the operation ran, but its response was lost",
                };
                let then = if *undone { UNDONE } else { KEPT };
                return Cow::Owned(format!("{what}; {then}"));
            }
            Self::TransactionInUse => "the operation kept its transaction after it ended; it was rolled back, so it may be sent again (with the same key)",
            Self::TransactionAborted => "a statement of the operation's transaction failed, so nothing of it was committed; it may be sent again (with the same key)",
            Self::ConstraintViolation => "a statement of the operation's transaction violated an integrity constraint, so nothing of it was committed; sent again as it is, it fails the same way",
            Self::TransactionConflict => "the operation's transaction conflicted with another (a serialization failure or a deadlock), so nothing of it was committed; send it again (with the same key)",
        })
    }

    /// The `Retry-After` it carries, if any.
    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InProgress { retry_after } => Some(*retry_after),
            Self::StoreUnavailable
            | Self::StoreNotSetUp
            | Self::CommitOutcomeUnknown
            | Self::TransactionConflict => Some(RETRY_SOON),
            _ => None,
        }
    }

    /// The problem it is.
    pub(crate) fn problem(&self) -> Problem {
        let mut p = Problem::new(self.kind(), self.detail());
        if let Self::Failed { undone: true, .. } = self {
            // Rolled back: nothing of it was done.
            p = p.nothing_done();
        }
        match self.retry_after() {
            Some(after) => p.retry_after(after),
            None => p,
        }
    }

    /// The answer, as a record keeps it.
    pub(crate) fn stored(&self, protocol: Protocol) -> StoredResponse {
        self.problem().stored(protocol)
    }

    /// The answer.
    pub(crate) fn response<B>(&self, protocol: Protocol) -> Response<MaybeBuffered<B>> {
        self.problem().response(protocol)
    }
}

#[cfg(test)]
mod tests {
    use http::StatusCode;
    use tower_resend::classify::{GrpcCode, GRPC_RETRY_PUSHBACK_MS};

    use super::super::document::GRPC_MESSAGE;
    use super::super::CONTENT_TYPE;
    use super::*;

    /// The layer's answers in both forms: over gRPC, trailers-only with the
    /// status a stock retry policy and tower-resend's classifier treat
    /// right, and the detail as `grpc-message`.
    #[test]
    fn answers_in_their_grpc_form() {
        let rows = [
            (
                Answer::InProgress {
                    retry_after: Duration::from_secs(2),
                },
                409,
                GrpcCode::Unavailable,
                Some("2000"),
            ),
            (Answer::KeyReused, 422, GrpcCode::InvalidArgument, None),
            (
                Answer::ConstraintViolation,
                422,
                GrpcCode::FailedPrecondition,
                None,
            ),
            (
                Answer::TransactionConflict,
                503,
                GrpcCode::Unavailable,
                Some("1000"),
            ),
            (Answer::TransactionAborted, 500, GrpcCode::Internal, None),
            (
                Answer::KeyInvalid("bad key"),
                400,
                GrpcCode::InvalidArgument,
                None,
            ),
            (
                Answer::StoreUnavailable,
                503,
                GrpcCode::Unavailable,
                Some("1000"),
            ),
            (
                Answer::RequestTooLarge { cap: 10 },
                413,
                GrpcCode::ResourceExhausted,
                Some("-1"),
            ),
            (
                Answer::Failed {
                    failure: Failure::Panic,
                    undone: false,
                },
                500,
                GrpcCode::Internal,
                None,
            ),
        ];
        for (answer, status, code, pushback) in rows {
            let http = answer.stored(Protocol::Http);
            assert_eq!(http.status.as_u16(), status, "{answer:?}");
            assert_eq!(http.headers["content-type"], CONTENT_TYPE);
            let grpc = answer.stored(Protocol::Grpc);
            assert_eq!(grpc.status, StatusCode::OK, "{answer:?}");
            assert!(grpc.body.is_empty(), "trailers-only");
            assert_eq!(grpc.headers["content-type"], "application/grpc");
            assert_eq!(
                GrpcCode::in_headers(&grpc.headers),
                Some(code),
                "{answer:?}"
            );
            assert_eq!(
                grpc.headers
                    .get(GRPC_RETRY_PUSHBACK_MS)
                    .map(|v| v.to_str().unwrap()),
                pushback,
                "{answer:?}"
            );
            assert_eq!(grpc.headers[GRPC_MESSAGE], *answer.detail(), "{answer:?}");
        }
    }
}
