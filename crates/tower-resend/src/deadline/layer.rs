use crate::name::Name;
use std::time::Duration;

use tower_layer::Layer;

use super::CallDeadline;

/// Gives every call one deadline budget and enforces it over the whole call.
///
/// The effective deadline is the earliest of the ambient one
/// ([`Deadline::current`](super::Deadline::current)), the
/// [`Deadline`](super::Deadline) already on the request, now + `total`,
/// and, on a gRPC request (`content-type: application/grpc…`), now + the
/// `grpc-timeout` it already carries: the caller's own timeout, where
/// tonic's `Request::set_timeout` puts it (a malformed value is ignored,
/// with a debug event). A [`DeadlineHeaderLayer`](super::DeadlineHeaderLayer)
/// inside then writes what is left of the deadline over it on each attempt.
/// It is written into the request's extensions for the layers inside, and it
/// bounds everything the inner service does: every attempt, every wait
/// between attempts, and the reading of the response body. When it runs out,
/// the call fails with [`ErrorKind::DeadlineExceeded`](crate::ErrorKind),
/// whose [`phase`](crate::Error::phase) says what was running and whose
/// [`elapsed`](crate::Error::elapsed) says how long the call took.
///
/// ```
/// use std::time::Duration;
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_resend::{Deadline, deadline::CallDeadlineLayer};
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let svc = CallDeadlineLayer::new(Duration::from_secs(10)).layer(service_fn(|req: http::Request<()>| async move {
///     // The budget travels in the request's extensions.
///     let left = req.extensions().get::<Deadline>().unwrap().remaining();
///     assert_eq!(left, Duration::from_secs(10));
///     Ok::<_, tower_resend::BoxError>(http::Response::new(String::new()))
/// }));
/// svc.oneshot(http::Request::new(())).await.unwrap();
/// # }
/// ```
///
/// See the [module docs](super) for more.
#[derive(Clone, Debug)]
pub struct CallDeadlineLayer {
    total: Duration,
    upstream: Option<Name>,
}

impl CallDeadlineLayer {
    /// A layer giving each call at most `total`.
    pub const fn new(total: Duration) -> Self {
        Self {
            total,
            upstream: None,
        }
    }

    /// Names the upstream in the errors this layer returns (and in errors of
    /// inner tower-resend layers that carry no name). Default: unnamed.
    #[must_use]
    pub fn upstream(mut self, name: impl Into<Name>) -> Self {
        self.upstream = Some(name.into());
        self
    }
}

impl<S> Layer<S> for CallDeadlineLayer {
    type Service = CallDeadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CallDeadline::new(inner, self.total).with_upstream(self.upstream.clone())
    }
}
