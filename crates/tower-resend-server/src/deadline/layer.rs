use std::time::Duration;

use http::HeaderName;
use tower_layer::Layer;

use super::service::{Config, InboundDeadline};

/// Reads the caller's deadline and runs the handler inside it; see the
/// [module docs](crate::deadline).
#[derive(Clone, Debug)]
pub struct InboundDeadlineLayer {
    pub(crate) config: Config,
}

impl InboundDeadlineLayer {
    /// Bounds every request by `max`, the server's own limit, which also
    /// applies when the caller sends no budget. Reads `grpc-timeout` only.
    pub const fn new(max: Duration) -> Self {
        Self {
            config: Config {
                max,
                default: max,
                http_header: None,
            },
        }
    }

    /// The budget of a request whose caller sends none (or a malformed one),
    /// bounded by the maximum. Default: the maximum.
    #[must_use]
    pub const fn default_budget(mut self, budget: Duration) -> Self {
        self.config.default = budget;
        self
    }

    /// Also reads the budget, in milliseconds, from `name` on requests
    /// without `grpc-timeout` (as tower-resend's
    /// [`DeadlineHeaderLayer::http_header`](tower_resend::DeadlineHeaderLayer::http_header)
    /// writes it). Default: none.
    #[must_use]
    pub fn http_header(mut self, name: HeaderName) -> Self {
        self.config.http_header = Some(name);
        self
    }
}

impl<S> Layer<S> for InboundDeadlineLayer {
    type Service = InboundDeadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        InboundDeadline {
            inner,
            config: self.config.clone(),
        }
    }
}

impl<S> InboundDeadline<S> {
    /// An [`InboundDeadlineLayer`] with the server's maximum `max`.
    pub const fn layer(max: Duration) -> InboundDeadlineLayer {
        InboundDeadlineLayer::new(max)
    }
}
