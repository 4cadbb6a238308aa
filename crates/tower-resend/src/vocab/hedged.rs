//! What hedging did for a call.

/// What hedging did for a call: the copies sent, and which one answered
/// (1 for the first). In the extensions of the response it returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hedged {
    /// Copies sent, the first included.
    pub sent: u32,
    /// The copy whose answer was returned, counted from 1.
    pub won: u32,
}
