//! The hedge's place in a [`Stack`](crate::stack::Stack): a stack that
//! does not hedge has no layer there at all, as it has none in the
//! breaker's or the fleet's place when it has neither.

use super::{Hedge, HedgeLayer};
use tower_layer::Layer;

/// What can sit in the hedge's place of a [`Stack`](crate::stack::Stack):
/// [`NoHedge`] (the default) or [`Hedging`], which
/// [`StackBuilder::hedge`](crate::stack::StackBuilder::hedge) puts there.
/// Sealed.
pub trait HedgeSlot: sealed::WrapsHedge {}

/// No hedging: the default of a [`stack`](crate::stack()), which then has
/// no layer in the hedge's place at all.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHedge;

/// Hedging on: a [`Hedge`] layer in the stack, set up by
/// [`StackBuilder::hedge`](crate::stack::StackBuilder::hedge) and the
/// builder's other `hedge_` settings.
#[derive(Clone, Copy, Debug, Default)]
pub struct Hedging;

pub(crate) mod sealed {
    use super::HedgeLayer;

    /// How the place wraps the service under it.
    pub trait WrapsHedge {
        /// What it makes of the service `S` under it, classifying with `C`.
        type Service<S, C>;

        /// Wraps `inner` in `hedge`, or leaves it as it is.
        fn wrap<S, C: Clone>(hedge: HedgeLayer<C>, inner: S) -> Self::Service<S, C>;
    }
}

impl sealed::WrapsHedge for NoHedge {
    type Service<S, C> = S;

    fn wrap<S, C: Clone>(_: HedgeLayer<C>, inner: S) -> S {
        inner
    }
}

impl HedgeSlot for NoHedge {}

impl sealed::WrapsHedge for Hedging {
    type Service<S, C> = Hedge<S, C>;

    fn wrap<S, C: Clone>(hedge: HedgeLayer<C>, inner: S) -> Hedge<S, C> {
        hedge.layer(inner)
    }
}

impl HedgeSlot for Hedging {}
