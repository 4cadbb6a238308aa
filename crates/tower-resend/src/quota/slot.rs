//! The pacing layer's place in a [`Stack`](crate::stack::Stack): empty
//! unless [`StackBuilder::pace`](crate::stack::StackBuilder::pace) puts a
//! [`PaceLayer`](super::PaceLayer) there, so that a stack that does not
//! pace pays nothing for it (as it pays nothing for a fleet or a hedge it
//! does not have).

/// What the pacing layer's place in a [`Stack`](crate::stack::Stack)
/// holds: [`NoPace`] (the default) or a
/// [`PaceLayer`](super::PaceLayer) (feature `quota`). Sealed.
pub trait PaceSlot: sealed::WrapsPace {}

/// No pacing: the default of a [`stack`](crate::stack()), with no layer in
/// the pacing layer's place at all.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoPace;

pub(crate) mod sealed {
    /// How the place wraps the service under it.
    pub trait WrapsPace {
        /// What it makes of the service `S` under it.
        type Service<S>;

        /// Wraps `inner`, or leaves it as it is.
        fn wrap<S>(&self, inner: S) -> Self::Service<S>;
    }
}

impl sealed::WrapsPace for NoPace {
    type Service<S> = S;

    fn wrap<S>(&self, inner: S) -> S {
        inner
    }
}

impl PaceSlot for NoPace {}

#[cfg(feature = "quota")]
impl sealed::WrapsPace for super::PaceLayer {
    type Service<S> = super::Pace<S>;

    fn wrap<S>(&self, inner: S) -> super::Pace<S> {
        super::Pace::new(inner, self.clone())
    }
}

#[cfg(feature = "quota")]
impl PaceSlot for super::PaceLayer {}
