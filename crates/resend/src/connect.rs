//! A connect timeout apart from the attempt timeout, over any connector.
//!
//! [`ConnectTimeoutLayer`] wraps a connector (a `tower::Service<Uri>` such as
//! hyper-util's `HttpConnector`) so that making a connection, DNS included,
//! takes at most the connect timeout. Every failure it reports is known to
//! have sent nothing: a timeout is [`ErrorKind::ConnectTimeout`](crate::ErrorKind),
//! any other connector error (refused, DNS, TLS handshake) is
//! [`ErrorKind::Transport`](crate::ErrorKind) with
//! [`is_not_sent`](crate::Error::is_not_sent) true. The facts survive being
//! wrapped by an HTTP client: [`Error::from_box`](crate::Error::from_box)
//! finds them in the client error's source chain.
//!
//! [`hyper_client`] builds a hyper-util client over `HttpConnector` with this
//! layer (feature `hyper-client`, on by default).
//!
//! ```
//! use std::time::Duration;
//! use resend::connect::ConnectTimeoutLayer;
//! use tower::Layer;
//!
//! # #[cfg(feature = "hyper-client")] {
//! let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
//! http.set_nodelay(true);
//! let connector = ConnectTimeoutLayer::new(Duration::from_secs(2)).layer(http);
//! let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
//!     .build::<_, http_body_util::Empty<bytes::Bytes>>(connector);
//! # let _ = client;
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_layer::Layer;
use tower_service::Service;

use crate::error::{BoxError, Error};

/// Bounds the time a connector may take; see the [module docs](self).
#[derive(Clone, Copy, Debug)]
pub struct ConnectTimeoutLayer {
    timeout: Duration,
}

impl ConnectTimeoutLayer {
    /// A layer giving each connection at most `timeout` to be made.
    pub const fn new(timeout: Duration) -> Self {
        Self { timeout }
    }
}

impl<C> Layer<C> for ConnectTimeoutLayer {
    type Service = ConnectTimeout<C>;

    fn layer(&self, inner: C) -> Self::Service {
        ConnectTimeout::new(inner, self.timeout)
    }
}

/// A connector with a connect timeout; see [`ConnectTimeoutLayer`].
#[derive(Clone, Debug)]
pub struct ConnectTimeout<C> {
    inner: C,
    timeout: Duration,
}

impl<C> ConnectTimeout<C> {
    /// Wraps the connector `inner`.
    pub const fn new(inner: C, timeout: Duration) -> Self {
        Self { inner, timeout }
    }

    /// A [`ConnectTimeoutLayer`] with `timeout`.
    pub const fn layer(timeout: Duration) -> ConnectTimeoutLayer {
        ConnectTimeoutLayer::new(timeout)
    }

    /// The inner connector.
    pub fn get_ref(&self) -> &C {
        &self.inner
    }

    /// The inner connector, mutably.
    pub fn get_mut(&mut self) -> &mut C {
        &mut self.inner
    }

    /// Unwraps the inner connector.
    pub fn into_inner(self) -> C {
        self.inner
    }
}

impl<C, R> Service<R> for ConnectTimeout<C>
where
    C: Service<R>,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = ConnectFuture<C::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| Error::connect(e.into()).into())
    }

    fn call(&mut self, target: R) -> Self::Future {
        ConnectFuture {
            inner: self.inner.call(target),
            sleep: None,
            timeout: self.timeout,
        }
    }
}

pin_project! {
    /// Future of [`ConnectTimeout`]. It is `Unpin` when the connector's future
    /// is, as hyper-util's client requires.
    #[derive(Debug)]
    pub struct ConnectFuture<F> {
        #[pin]
        inner: F,
        // Boxed so the future stays `Unpin`; made only for a connection that
        // is not ready at once, i.e. once per new connection, never per request.
        sleep: Option<Pin<Box<Sleep>>>,
        timeout: Duration,
    }
}

impl<F, T, E> Future for ConnectFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(r) = this.inner.poll(cx) {
            return Poll::Ready(r.map_err(|e| Error::connect(e.into()).into()));
        }
        let timeout = *this.timeout;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Error::connect_timeout(timeout).into())),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(feature = "hyper-client")]
pub use hyper_impl::{hyper_client, hyper_client_with, HyperClient};

#[cfg(feature = "hyper-client")]
mod hyper_impl {
    use std::time::Duration;

    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::client::legacy::{Builder, Client};
    use hyper_util::rt::TokioExecutor;

    use super::ConnectTimeout;

    /// A hyper-util client whose connections are made under a connect timeout.
    pub type HyperClient<B> = Client<ConnectTimeout<HttpConnector>, B>;

    /// A hyper-util legacy client (HTTP/1.1 by default) over `HttpConnector`
    /// with `TCP_NODELAY`, whose connections are made under `connect_timeout`.
    ///
    /// A failure to connect comes back as hyper-util's error with the facts
    /// inside: [`Error::from_box`](crate::Error::from_box) of it says
    /// [not sent](crate::Error::is_not_sent), or
    /// [`ConnectTimeout`](crate::ErrorKind::ConnectTimeout).
    ///
    /// ```
    /// use std::time::Duration;
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let client = resend::hyper_client::<Full<Bytes>>(Duration::from_secs(2));
    /// # let _ = client;
    /// # }
    /// ```
    pub fn hyper_client<B>(connect_timeout: Duration) -> HyperClient<B>
    where
        B: http_body::Body + Send,
        B::Data: Send,
    {
        hyper_client_with(&Client::builder(TokioExecutor::new()), connect_timeout)
    }

    /// Like [`hyper_client`], with the client configured by `builder` (for
    /// example HTTP/2 with prior knowledge, or pool settings).
    ///
    /// ```
    /// use std::time::Duration;
    /// use hyper_util::{client::legacy::Client, rt::TokioExecutor};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let mut builder = Client::builder(TokioExecutor::new());
    /// builder.http2_only(true);
    /// let client = resend::connect::hyper_client_with::<http_body_util::Empty<bytes::Bytes>>(
    ///     &builder,
    ///     Duration::from_secs(2),
    /// );
    /// # let _ = client;
    /// # }
    /// ```
    pub fn hyper_client_with<B>(builder: &Builder, connect_timeout: Duration) -> HyperClient<B>
    where
        B: http_body::Body + Send,
        B::Data: Send,
    {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        builder.build(ConnectTimeout::new(http, connect_timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use tower::{service_fn, ServiceExt};

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_connector_that_never_completes_is_cut_at_the_timeout() {
        let stuck = service_fn(|_: http::Uri| std::future::pending::<Result<(), BoxError>>());
        let connector = ConnectTimeoutLayer::new(Duration::from_secs(2)).layer(stuck);
        let start = tokio::time::Instant::now();
        let err = connector
            .oneshot(http::Uri::from_static("http://a/"))
            .await
            .unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        let err = Error::from_box(err);
        assert_eq!(err.kind(), ErrorKind::ConnectTimeout);
        assert!(err.is_not_sent());
        assert_eq!(err.limit(), Some(Duration::from_secs(2)));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn connector_errors_are_not_sent() {
        let refused = service_fn(|_: http::Uri| async {
            Err::<(), _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
        });
        let err = ConnectTimeout::new(refused, Duration::from_secs(2))
            .oneshot(http::Uri::from_static("http://a/"))
            .await
            .unwrap_err();
        let err = Error::from_box(err);
        assert_eq!(err.kind(), ErrorKind::Transport);
        assert!(err.is_not_sent());
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_fast_connection_wins() {
        let quick = service_fn(|_: http::Uri| async { Ok::<_, BoxError>(7) });
        let got = ConnectTimeout::new(quick, Duration::ZERO)
            .oneshot(http::Uri::from_static("http://a/"))
            .await
            .unwrap();
        assert_eq!(got, 7);
    }
}
