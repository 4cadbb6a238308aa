//! What a retry layer tells the layers below it about the attempt it sends.

use std::time::Duration;

use http::Extensions;

/// In the extensions of every attempt a retry layer sends. A retry layer
/// further in finds it and passes the request through, so retries never
/// multiply (3 layers of 3 attempts send 3 times, not 27); the layers below
/// read what it says of this attempt. An extension rather than a
/// thread-local, so that it survives whatever lies between the layers (an
/// `async` adapter, a buffer's worker task).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RetryInCharge {
    /// This attempt's own limit (the request's `CallOptions`): an attempt
    /// timeout below applies it instead of its own.
    pub(crate) attempt_timeout: Option<Duration>,
    /// A break in its response body is retried (a replay-safe request with
    /// retries allowed): a read-ahead layer below reads small bodies ahead.
    pub(crate) read_ahead: bool,
}

/// The usual mark, [`RetryInCharge::USUAL`], as the extension: of no size,
/// so that inserting it allocates nothing (every call's first attempt
/// carries one).
#[derive(Clone, Copy, Debug)]
struct Usual;

impl RetryInCharge {
    /// What most attempts carry: no limit of their own, bodies read ahead.
    pub(crate) const USUAL: Self = Self {
        attempt_timeout: None,
        read_ahead: true,
    };

    /// Marks an attempt's extensions with this.
    pub(crate) fn mark(self, ext: &mut Extensions) {
        if self == Self::USUAL {
            ext.insert(Usual);
        } else {
            ext.insert(self);
        }
    }

    /// The mark on an attempt's extensions, if a retry layer sent it.
    pub(crate) fn of(ext: &Extensions) -> Option<Self> {
        if ext.get::<Usual>().is_some() {
            return Some(Self::USUAL);
        }
        ext.get::<Self>().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_reads_back_as_it_was_written() {
        let unusual = [
            RetryInCharge {
                attempt_timeout: Some(Duration::from_secs(1)),
                read_ahead: true,
            },
            RetryInCharge {
                attempt_timeout: None,
                read_ahead: false,
            },
        ];
        for mark in [RetryInCharge::USUAL].into_iter().chain(unusual) {
            let mut ext = Extensions::new();
            assert_eq!(RetryInCharge::of(&ext), None);
            mark.mark(&mut ext);
            assert_eq!(RetryInCharge::of(&ext), Some(mark));
            assert_eq!(ext.len(), 1);
        }
    }
}
