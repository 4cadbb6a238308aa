use std::time::Duration;

use tower_layer::Layer;

use super::{ReadAhead, DEFAULT_READ_AHEAD};

/// Reads the response body of an attempt before returning the response,
/// when a [`RetryLayer`](crate::retry::RetryLayer) above says the attempt may be
/// retried (a replay-safe request with retries allowed; it says so in the
/// attempt's extensions, so the layers between may be any, a buffer's worker
/// included):
/// up to the cap, whatever the body says of its length (a chunked HTTP/1.1
/// body and an HTTP/2 body without `content-length` too). A break inside a
/// body that ends within the cap (a reset connection, a truncated body)
/// then fails the attempt, and the retry layer retries it.
///
/// A body longer than the cap is handed on once the cap is reached: the
/// bytes read so far, then the rest as it comes; a break past the cap
/// reaches the caller while it reads. A body that declares a length over
/// the cap is not read at all, and neither are streams that are not meant
/// to end soon (gRPC, `text/event-stream`), nor requests the retry layer
/// did not mark. Place it below the retry layer and the attempt timeout
/// (so that the timeout covers the body too);
/// [`tower_resend::stack()`](crate::stack()) does.
///
/// It also bounds how long a body may send nothing, when given an
/// [`idle_timeout`](Self::idle_timeout) (reqwest's `read_timeout`): while the
/// body is read ahead that fails the attempt, which the retry layer retries;
/// later, the caller's read fails.
///
/// ```
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::{BodyExt, Full};
/// use tower_resend::read_ahead::ReadAheadLayer;
/// use tower_resend::retry::RetryLayer;
/// use tower::{service_fn, ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let svc = ServiceBuilder::new()
///     .layer(RetryLayer::new())
///     .layer(ReadAheadLayer::new(64 * 1024))
///     .service(service_fn(|_req: Request<Full<Bytes>>| async {
///         Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("read ahead"))))
///     }));
/// let resp = svc.oneshot(Request::get("http://up/").body(Full::new(Bytes::new())).unwrap()).await.unwrap();
/// assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "read ahead");
/// # }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ReadAheadLayer {
    cap: usize,
    idle: Option<Duration>,
}

impl ReadAheadLayer {
    /// Reads marked bodies of at most `cap` bytes; 0 reads none. No idle
    /// timeout.
    pub const fn new(cap: usize) -> Self {
        Self { cap, idle: None }
    }

    /// Fails a response body that sends nothing for `idle`: its next read
    /// is an [`AttemptTimeout`](crate::ErrorKind::AttemptTimeout) error in
    /// the [`Body`](crate::Phase::Body) phase, whose
    /// [`limit`](crate::Error::limit) is `idle`. Default: none (an attempt
    /// timeout above still bounds what is read ahead).
    ///
    /// ```
    /// use std::pin::Pin;
    /// use std::task::{Context, Poll};
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body::Frame;
    /// use http_body_util::BodyExt;
    /// use tower::{service_fn, Layer, ServiceExt};
    /// use tower_resend::read_ahead::ReadAheadLayer;
    /// use tower_resend::{Error, ErrorKind};
    ///
    /// /// A body that sends nothing, ever.
    /// struct Silent;
    /// impl http_body::Body for Silent {
    ///     type Data = Bytes;
    ///     type Error = std::io::Error;
    ///     fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
    ///         Poll::Pending
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let stalls = service_fn(|_: Request<()>| async { Ok::<_, std::convert::Infallible>(Response::new(Silent)) });
    /// let svc = ReadAheadLayer::new(0).idle_timeout(Duration::from_millis(200)).layer(stalls);
    /// let body = svc.oneshot(Request::new(())).await.unwrap().into_body();
    /// let err = body.collect().await.unwrap_err();
    /// let err = err.downcast_ref::<Error>().unwrap();
    /// assert_eq!(err.kind(), ErrorKind::AttemptTimeout);
    /// assert_eq!(err.limit(), Some(Duration::from_millis(200)));
    /// # }
    /// ```
    #[must_use]
    pub const fn idle_timeout(mut self, idle: Duration) -> Self {
        self.idle = Some(idle);
        self
    }
}

impl Default for ReadAheadLayer {
    /// [`DEFAULT_READ_AHEAD`] (64 KiB), no idle timeout.
    fn default() -> Self {
        Self::new(DEFAULT_READ_AHEAD)
    }
}

impl<S> Layer<S> for ReadAheadLayer {
    type Service = ReadAhead<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReadAhead::new(inner, self.cap).with_idle(self.idle)
    }
}
