//! The fleet's place in the composed stack: empty unless a fleet is given,
//! so that a stack of one upstream address pays nothing for it.
// The slots are sealed: their methods pass the crate's own types (the
// fleet's roster), and no one outside the crate can name or call them.
#![allow(private_interfaces)]

use std::sync::Arc;

use super::{Fleet, FleetLayer};

/// What the fleet's place in a [`Stack`](crate::stack::Stack) holds:
/// [`NoFleet`] (the default) or a [`FleetLayer`], put there by
/// [`StackBuilder::fleet`](crate::stack::StackBuilder::fleet).
///
/// Sealed: nothing else can be put there.
pub trait FleetSlot: sealed::WrapsFleet {}

/// No fleet: the default of a [`stack`](crate::stack()), whose attempts
/// go to the request's URI, with no layer in the fleet's place at all.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoFleet;

pub(crate) mod sealed {
    /// How the place wraps the service under it.
    pub trait WrapsFleet {
        /// What it makes of the service `S` under it, classifying with `C`.
        type Service<S, C>;

        /// A fleet is there: the retry layer carries each call's record
        /// of the instances it used.
        const IS_FLEET: bool;

        /// Wraps `inner`, classifying its answers with `classifier`.
        fn wrap<S: Clone, C: Clone>(&self, inner: S, classifier: C) -> Self::Service<S, C>;

        /// The fleet, if there is one (a breaker above gives it circuits).
        fn roster(&self) -> Option<&crate::fleet::Roster>;
    }
}

impl sealed::WrapsFleet for NoFleet {
    type Service<S, C> = S;
    const IS_FLEET: bool = false;

    fn wrap<S: Clone, C: Clone>(&self, inner: S, _classifier: C) -> S {
        inner
    }

    fn roster(&self) -> Option<&crate::fleet::Roster> {
        None
    }
}

impl FleetSlot for NoFleet {}

impl sealed::WrapsFleet for FleetLayer {
    type Service<S, C> = Fleet<S, C>;
    const IS_FLEET: bool = true;

    fn wrap<S: Clone, C: Clone>(&self, inner: S, classifier: C) -> Fleet<S, C> {
        Fleet {
            inner,
            roster: Arc::clone(&self.roster),
            classifier,
        }
    }

    fn roster(&self) -> Option<&crate::fleet::Roster> {
        Some(&self.roster)
    }
}

impl FleetSlot for FleetLayer {}
