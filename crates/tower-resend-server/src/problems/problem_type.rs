//! The catalogue of problem types: each one's `error` code, HTTP status,
//! title and gRPC status, once (their prose is in the `problems` module docs).

use http::StatusCode;
use tower_resend::classify::GrpcCode;

/// Every problem type of the server half: its `error` code, HTTP status,
/// title and gRPC status, once. The codes are stable: match on the enum in
/// Rust, on [`code`](Self::code) anywhere else.
///
/// ```
/// use http::StatusCode;
/// use tower_resend::classify::GrpcCode;
/// use tower_resend_server::problems::ProblemType;
///
/// let t = ProblemType::IdempotencyKeyInProgress;
/// assert_eq!(t.code(), "idempotency_key_in_progress");
/// assert_eq!(t.status(), StatusCode::CONFLICT);
/// assert_eq!(t.grpc_code(), GrpcCode::Unavailable);
/// assert_eq!(ProblemType::from_code("idempotency_key_reused"), Some(ProblemType::IdempotencyKeyReused));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemType {
    /// [`deadline_exceeded`](crate::problems#deadline_exceeded).
    DeadlineExceeded,
    /// [`outcome_unknown`](crate::problems#outcome_unknown).
    OutcomeUnknown,
    /// [`upstream_overloaded`](crate::problems#upstream_overloaded).
    UpstreamOverloaded,
    /// [`circuit_open`](crate::problems#circuit_open).
    CircuitOpen,
    /// [`upstream_timeout`](crate::problems#upstream_timeout).
    UpstreamTimeout,
    /// [`upstream_failed`](crate::problems#upstream_failed).
    UpstreamFailed,
    /// [`idempotency_key_invalid`](crate::problems#idempotency_key_invalid).
    IdempotencyKeyInvalid,
    /// [`idempotency_key_required`](crate::problems#idempotency_key_required).
    IdempotencyKeyRequired,
    /// [`idempotency_key_needs_credentials`](crate::problems#idempotency_key_needs_credentials).
    IdempotencyKeyNeedsCredentials,
    /// [`request_body_failed`](crate::problems#request_body_failed).
    RequestBodyFailed,
    /// [`request_too_large`](crate::problems#request_too_large).
    RequestTooLarge,
    /// [`idempotency_key_in_progress`](crate::problems#idempotency_key_in_progress).
    IdempotencyKeyInProgress,
    /// [`idempotency_key_reused`](crate::problems#idempotency_key_reused).
    IdempotencyKeyReused,
    /// [`idempotency_store_unavailable`](crate::problems#idempotency_store_unavailable).
    IdempotencyStoreUnavailable,
    /// [`idempotency_store_not_set_up`](crate::problems#idempotency_store_not_set_up).
    IdempotencyStoreNotSetUp,
    /// [`commit_outcome_unknown`](crate::problems#commit_outcome_unknown).
    CommitOutcomeUnknown,
    /// [`request_shed`](crate::problems#request_shed).
    RequestShed,
    /// [`handler_failed`](crate::problems#handler_failed).
    HandlerFailed,
    /// [`handler_panicked`](crate::problems#handler_panicked).
    HandlerPanicked,
    /// [`response_lost`](crate::problems#response_lost).
    ResponseLost,
    /// [`transaction_in_use`](crate::problems#transaction_in_use).
    TransactionInUse,
    /// [`transaction_aborted`](crate::problems#transaction_aborted).
    TransactionAborted,
    /// [`constraint_violation`](crate::problems#constraint_violation).
    ConstraintViolation,
    /// [`transaction_conflict`](crate::problems#transaction_conflict).
    TransactionConflict,
}

impl ProblemType {
    /// Every type, in the order of the table above.
    pub const ALL: [Self; 24] = [
        Self::DeadlineExceeded,
        Self::OutcomeUnknown,
        Self::UpstreamOverloaded,
        Self::CircuitOpen,
        Self::UpstreamTimeout,
        Self::UpstreamFailed,
        Self::IdempotencyKeyInvalid,
        Self::IdempotencyKeyRequired,
        Self::IdempotencyKeyNeedsCredentials,
        Self::RequestBodyFailed,
        Self::RequestTooLarge,
        Self::IdempotencyKeyInProgress,
        Self::IdempotencyKeyReused,
        Self::IdempotencyStoreUnavailable,
        Self::IdempotencyStoreNotSetUp,
        Self::CommitOutcomeUnknown,
        Self::RequestShed,
        Self::HandlerFailed,
        Self::HandlerPanicked,
        Self::ResponseLost,
        Self::TransactionInUse,
        Self::TransactionAborted,
        Self::ConstraintViolation,
        Self::TransactionConflict,
    ];

    /// The `error` code, and the anchor of its section above.
    pub const fn code(self) -> &'static str {
        self.row().0
    }

    /// The HTTP status it is answered with.
    pub const fn status(self) -> StatusCode {
        self.row().1
    }

    /// Its summary, the document's `title`.
    pub const fn title(self) -> &'static str {
        self.row().2
    }

    /// The gRPC status it is answered with, for a gRPC request.
    pub const fn grpc_code(self) -> GrpcCode {
        self.row().3
    }

    /// True when an answer of this type says that nothing was done: the
    /// request was refused before it ran (shed, the store down or not set
    /// up) or everything it did was rolled back. Such an answer carries
    /// [`Idempotent-Nothing-Done: true`](tower_resend::classify::IDEMPOTENT_NOTHING_DONE),
    /// which tower-resend's client reads: the call may be sent again, and
    /// one whose every attempt got such an answer ends as overload, not as
    /// outcome unknown.
    ///
    /// ```
    /// use tower_resend_server::problems::ProblemType;
    ///
    /// assert!(ProblemType::RequestShed.nothing_done());
    /// assert!(!ProblemType::CommitOutcomeUnknown.nothing_done());
    /// ```
    pub const fn nothing_done(self) -> bool {
        matches!(
            self,
            Self::RequestShed
                | Self::IdempotencyStoreUnavailable
                | Self::IdempotencyStoreNotSetUp
                | Self::TransactionInUse
                | Self::TransactionAborted
                | Self::TransactionConflict
        )
    }

    /// The type whose code is `code`.
    pub fn from_code(code: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.code() == code)
    }

    /// The table's row: code, status, title, gRPC status.
    const fn row(self) -> (&'static str, StatusCode, &'static str, GrpcCode) {
        use GrpcCode as G;
        use StatusCode as S;
        match self {
            Self::DeadlineExceeded => (
                "deadline_exceeded",
                S::GATEWAY_TIMEOUT,
                "Deadline exceeded",
                G::DeadlineExceeded,
            ),
            Self::OutcomeUnknown => (
                "outcome_unknown",
                S::BAD_GATEWAY,
                "Outcome of an upstream call unknown",
                G::Unknown,
            ),
            Self::UpstreamOverloaded => (
                "upstream_overloaded",
                S::SERVICE_UNAVAILABLE,
                "Upstream overloaded",
                G::Unavailable,
            ),
            Self::CircuitOpen => (
                "circuit_open",
                S::SERVICE_UNAVAILABLE,
                "Upstream circuit open",
                G::Unavailable,
            ),
            Self::UpstreamTimeout => (
                "upstream_timeout",
                S::GATEWAY_TIMEOUT,
                "Upstream timed out",
                G::DeadlineExceeded,
            ),
            Self::UpstreamFailed => (
                "upstream_failed",
                S::BAD_GATEWAY,
                "Upstream call failed",
                G::Unavailable,
            ),
            Self::IdempotencyKeyInvalid => (
                "idempotency_key_invalid",
                S::BAD_REQUEST,
                "Malformed Idempotency-Key",
                G::InvalidArgument,
            ),
            Self::IdempotencyKeyRequired => (
                "idempotency_key_required",
                S::BAD_REQUEST,
                "Idempotency-Key required",
                G::InvalidArgument,
            ),
            Self::IdempotencyKeyNeedsCredentials => (
                "idempotency_key_needs_credentials",
                S::BAD_REQUEST,
                "Idempotency-Key without credentials",
                G::Unauthenticated,
            ),
            Self::RequestBodyFailed => (
                "request_body_failed",
                S::BAD_REQUEST,
                "Request body unreadable",
                G::Cancelled,
            ),
            Self::RequestTooLarge => (
                "request_too_large",
                S::PAYLOAD_TOO_LARGE,
                "Keyed request too large",
                G::ResourceExhausted,
            ),
            Self::IdempotencyKeyInProgress => (
                "idempotency_key_in_progress",
                S::CONFLICT,
                "Request with this Idempotency-Key in progress",
                G::Unavailable,
            ),
            Self::IdempotencyKeyReused => (
                "idempotency_key_reused",
                S::UNPROCESSABLE_ENTITY,
                "Idempotency-Key reused for another request",
                G::InvalidArgument,
            ),
            Self::IdempotencyStoreUnavailable => (
                "idempotency_store_unavailable",
                S::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
                G::Unavailable,
            ),
            Self::IdempotencyStoreNotSetUp => (
                "idempotency_store_not_set_up",
                S::SERVICE_UNAVAILABLE,
                "Idempotency store not set up",
                G::Unavailable,
            ),
            Self::CommitOutcomeUnknown => (
                "commit_outcome_unknown",
                S::SERVICE_UNAVAILABLE,
                "Commit outcome unknown",
                G::Unavailable,
            ),
            Self::RequestShed => (
                "request_shed",
                S::SERVICE_UNAVAILABLE,
                "Request shed at capacity",
                G::Unavailable,
            ),
            Self::HandlerFailed => (
                "handler_failed",
                S::INTERNAL_SERVER_ERROR,
                "Operation failed",
                G::Internal,
            ),
            Self::HandlerPanicked => (
                "handler_panicked",
                S::INTERNAL_SERVER_ERROR,
                "Operation panicked",
                G::Internal,
            ),
            Self::ResponseLost => (
                "response_lost",
                S::INTERNAL_SERVER_ERROR,
                "Response lost",
                G::Internal,
            ),
            Self::TransactionInUse => (
                "transaction_in_use",
                S::INTERNAL_SERVER_ERROR,
                "Transaction kept by the handler",
                G::Internal,
            ),
            Self::TransactionAborted => (
                "transaction_aborted",
                S::INTERNAL_SERVER_ERROR,
                "Transaction aborted",
                G::Internal,
            ),
            Self::ConstraintViolation => (
                "constraint_violation",
                S::UNPROCESSABLE_ENTITY,
                "Integrity constraint violated",
                G::FailedPrecondition,
            ),
            Self::TransactionConflict => (
                "transaction_conflict",
                S::SERVICE_UNAVAILABLE,
                "Transaction conflict",
                G::Unavailable,
            ),
        }
    }
}
