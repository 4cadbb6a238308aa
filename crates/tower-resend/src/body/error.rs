//! Why a kept body could not be sent again.

use std::fmt;

/// Why a [`ReplayBody`](super::ReplayBody) clone could not send the whole body.
///
/// A clone that cannot finish fails with this error (boxed, so look for it
/// with `downcast_ref`) rather than end early: a receiver must never take a
/// part of the body for the whole. Errors of the original body itself are
/// passed on as they are, boxed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayError {
    pub(super) reason: Reason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reason {
    /// The copy this clone needed was dropped at the cap.
    Capped,
    /// The original body failed while another clone was reading it.
    Failed,
    /// A newer clone has taken the rest of the original over.
    Superseded,
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.reason {
            Reason::Capped => "request body cannot be sent again: it grew past the replay cap",
            Reason::Failed => "request body cannot be sent again: the original body failed",
            Reason::Superseded => {
                "request body cannot be sent again: a newer attempt is sending it"
            }
        })
    }
}

impl std::error::Error for ReplayError {}
