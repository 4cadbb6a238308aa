//! Sending a request again: what a retry needs to resend a call safely.
//! [`ReplayBody`] keeps a bounded copy of the request body as the first
//! attempt streams it, so that later attempts send the very same bytes, or
//! are refused when the body was too large to keep.

mod body;

pub use body::{ReplayBody, ReplayError, DEFAULT_REPLAY_CAP};
