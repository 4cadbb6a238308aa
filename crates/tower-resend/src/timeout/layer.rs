use std::time::Duration;

use tower_layer::Layer;

use super::AttemptTimeout;

/// Bounds each attempt by `min(per_attempt, time left before the deadline)`.
///
/// ```
/// use std::time::Duration;
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_resend::{timeout::AttemptTimeoutLayer, Error, ErrorKind};
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let slow = service_fn(|_: http::Request<()>| async {
///     tokio::time::sleep(Duration::from_secs(60)).await;
///     Ok::<_, tower_resend::BoxError>(http::Response::new(()))
/// });
/// let svc = AttemptTimeoutLayer::new(Duration::from_secs(1)).layer(slow);
/// let err = Error::from_box(svc.oneshot(http::Request::new(())).await.unwrap_err());
/// assert_eq!(err.kind(), ErrorKind::AttemptTimeout);
/// # }
/// ```
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
