use std::time::Duration;

use http::HeaderName;
use tower_layer::Layer;

use super::service::{Config, InboundDeadline};

/// Reads the caller's deadline and runs the handler inside it; see the
/// [module docs](crate::deadline).
///
/// ```
/// use std::time::Duration;
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_resend_server::InboundDeadlineLayer;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let svc = InboundDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(|_: http::Request<()>| async {
///     // The caller's 3 s, inherited by every tower-resend stack called here.
///     let left = tower_resend::Deadline::current().unwrap().remaining();
///     Ok::<_, std::convert::Infallible>(http::Response::new(format!("{left:?}")))
/// }));
/// let req = http::Request::post("/orders").header("grpc-timeout", "3S").body(()).unwrap();
/// let resp = svc.oneshot(req).await.unwrap();
/// assert_eq!(resp.status(), 200);
/// # }
/// ```
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
    /// [`DeadlineHeaderLayer::http_header`](tower_resend::deadline::DeadlineHeaderLayer::http_header)
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
