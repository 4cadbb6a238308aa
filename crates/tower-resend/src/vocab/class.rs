//! What an attempt's result says the server did.

use std::fmt;

/// What an attempt's result says the server did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Class {
    /// The server answered and the answer is final (1xx, 2xx, 3xx).
    Success,
    /// The server refused the request as it is; sending it again will not help.
    Rejected,
    /// Nothing reached the server: it is always safe to send again.
    NotSent,
    /// The server received the request and says it did not act on it (408, 425).
    NotProcessed,
    /// The server is shedding load (429, 503); it may say when to come back.
    Overloaded,
    /// A request with the same Idempotency-Key is still running (409 with a key).
    InProgress,
    /// The server may or may not have acted on the request: a 5xx, a timeout
    /// after the request was written, a connection lost mid-response.
    Unknown,
}

impl Class {
    /// A short lower-case name, as used in tracing events.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Rejected => "rejected",
            Self::NotSent => "not_sent",
            Self::NotProcessed => "not_processed",
            Self::Overloaded => "overloaded",
            Self::InProgress => "in_progress",
            Self::Unknown => "unknown",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
