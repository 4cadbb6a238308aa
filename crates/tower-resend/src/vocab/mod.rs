//! The crate's shared vocabulary, at the bottom of its house: the class of
//! a failure, why retrying stopped, the attempt history, a gRPC status, why
//! a circuit breaker refused, and the errors whose type alone says what the
//! server did. It imports nothing of the crate; every room above takes its
//! words from here (and re-exports them where users have always found
//! them: `classify::Class`, `retry::Attempts`, `hedge::Hedged`, `connect::HttpsNotEnabled`).

mod attempt_marker;
mod attempts;
mod breaker;
mod class;
mod digits;
mod grpc;
mod hedged;
mod marker;
mod tried;

pub(crate) use attempt_marker::RetryInCharge;
pub(crate) use attempts::{write_ms, Readable};
pub use attempts::{Attempt, Attempts, Stop};
pub(crate) use breaker::{percent, Circuits, Pass, Refusal, Why};
pub use class::Class;
pub(crate) use digits::parse_digits;
pub use grpc::{GrpcCode, GRPC_STATUS};
pub use hedged::Hedged;
pub use marker::HttpsNotEnabled;
pub(crate) use tried::{Elsewhere, NextAttempt, Tried};
