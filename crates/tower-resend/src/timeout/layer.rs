use std::time::Duration;

use tower_layer::Layer;

use super::AttemptTimeout;

/// Bounds each attempt by `min(per_attempt, time left before the deadline)`.
///
/// See the [module docs](super) for what each limit reports.
#[derive(Clone, Copy, Debug)]
pub struct AttemptTimeoutLayer {
    per_attempt: Duration,
}

impl AttemptTimeoutLayer {
    /// A layer giving each attempt at most `per_attempt`.
    pub const fn new(per_attempt: Duration) -> Self {
        Self { per_attempt }
    }
}

impl<S> Layer<S> for AttemptTimeoutLayer {
    type Service = AttemptTimeout<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AttemptTimeout::new(inner, self.per_attempt)
    }
}
