//! gRPC status codes.

use std::fmt;

use http::header::HeaderName;
use http::HeaderMap;

/// The `grpc-status` header (or trailer).
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// A gRPC status code, as `grpc-status` carries it.
///
/// resend reads it without tonic; with the `tonic` feature it converts to
/// and from `tonic::Code`.
///
/// ```
/// use tower_resend::classify::GrpcCode;
///
/// assert_eq!(GrpcCode::parse(b"14"), GrpcCode::Unavailable);
/// assert_eq!(GrpcCode::Unavailable.as_i32(), 14);
/// assert_eq!(GrpcCode::Unavailable.to_string(), "UNAVAILABLE");
/// // What is not a code reads as UNKNOWN, as gRPC says.
/// assert_eq!(GrpcCode::parse(b"99"), GrpcCode::Unknown);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GrpcCode {
    /// 0: OK.
    Ok,
    /// 1: CANCELLED.
    Cancelled,
    /// 2: UNKNOWN.
    Unknown,
    /// 3: INVALID_ARGUMENT.
    InvalidArgument,
    /// 4: DEADLINE_EXCEEDED.
    DeadlineExceeded,
    /// 5: NOT_FOUND.
    NotFound,
    /// 6: ALREADY_EXISTS.
    AlreadyExists,
    /// 7: PERMISSION_DENIED.
    PermissionDenied,
    /// 8: RESOURCE_EXHAUSTED.
    ResourceExhausted,
    /// 9: FAILED_PRECONDITION.
    FailedPrecondition,
    /// 10: ABORTED.
    Aborted,
    /// 11: OUT_OF_RANGE.
    OutOfRange,
    /// 12: UNIMPLEMENTED.
    Unimplemented,
    /// 13: INTERNAL.
    Internal,
    /// 14: UNAVAILABLE.
    Unavailable,
    /// 15: DATA_LOSS.
    DataLoss,
    /// 16: UNAUTHENTICATED.
    Unauthenticated,
}

impl GrpcCode {
    /// The code numbered `n`; a number that is no code is
    /// [`Unknown`](Self::Unknown).
    pub const fn from_i32(n: i32) -> Self {
        match n {
            0 => Self::Ok,
            1 => Self::Cancelled,
            3 => Self::InvalidArgument,
            4 => Self::DeadlineExceeded,
            5 => Self::NotFound,
            6 => Self::AlreadyExists,
            7 => Self::PermissionDenied,
            8 => Self::ResourceExhausted,
            9 => Self::FailedPrecondition,
            10 => Self::Aborted,
            11 => Self::OutOfRange,
            12 => Self::Unimplemented,
            13 => Self::Internal,
            14 => Self::Unavailable,
            15 => Self::DataLoss,
            16 => Self::Unauthenticated,
            _ => Self::Unknown,
        }
    }

    /// The code's number.
    pub const fn as_i32(self) -> i32 {
        match self {
            Self::Ok => 0,
            Self::Cancelled => 1,
            Self::Unknown => 2,
            Self::InvalidArgument => 3,
            Self::DeadlineExceeded => 4,
            Self::NotFound => 5,
            Self::AlreadyExists => 6,
            Self::PermissionDenied => 7,
            Self::ResourceExhausted => 8,
            Self::FailedPrecondition => 9,
            Self::Aborted => 10,
            Self::OutOfRange => 11,
            Self::Unimplemented => 12,
            Self::Internal => 13,
            Self::Unavailable => 14,
            Self::DataLoss => 15,
            Self::Unauthenticated => 16,
        }
    }

    /// The code's name as gRPC writes it: `UNAVAILABLE`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "OK",
            Self::Cancelled => "CANCELLED",
            Self::Unknown => "UNKNOWN",
            Self::InvalidArgument => "INVALID_ARGUMENT",
            Self::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Self::NotFound => "NOT_FOUND",
            Self::AlreadyExists => "ALREADY_EXISTS",
            Self::PermissionDenied => "PERMISSION_DENIED",
            Self::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Self::FailedPrecondition => "FAILED_PRECONDITION",
            Self::Aborted => "ABORTED",
            Self::OutOfRange => "OUT_OF_RANGE",
            Self::Unimplemented => "UNIMPLEMENTED",
            Self::Internal => "INTERNAL",
            Self::Unavailable => "UNAVAILABLE",
            Self::DataLoss => "DATA_LOSS",
            Self::Unauthenticated => "UNAUTHENTICATED",
        }
    }

    /// Reads a `grpc-status` value (`0` to `16` in ASCII digits); anything
    /// else is [`Unknown`](Self::Unknown), as tonic reads it.
    pub const fn parse(value: &[u8]) -> Self {
        match *value {
            [d @ b'0'..=b'9'] => Self::from_i32((d - b'0') as i32),
            [b'1', d @ b'0'..=b'6'] => Self::from_i32(10 + (d - b'0') as i32),
            _ => Self::Unknown,
        }
    }

    /// The `grpc-status` in `headers` (the response headers of a
    /// trailers-only response, or trailers), if there is one.
    ///
    /// ```
    /// use tower_resend::classify::GrpcCode;
    ///
    /// let mut trailers = http::HeaderMap::new();
    /// trailers.insert("grpc-status", http::HeaderValue::from_static("8"));
    /// assert_eq!(GrpcCode::in_headers(&trailers), Some(GrpcCode::ResourceExhausted));
    /// assert_eq!(GrpcCode::in_headers(&http::HeaderMap::new()), None);
    /// ```
    pub fn in_headers(headers: &HeaderMap) -> Option<Self> {
        if headers.is_empty() {
            return None;
        }
        headers.get(GRPC_STATUS).map(|v| Self::parse(v.as_bytes()))
    }
}

impl fmt::Display for GrpcCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
