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
//! layer (feature `hyper-client`, on by default), and `https://` too with
//! the `https` feature (hyper-rustls on `ring`, the webpki roots); its TLS
//! handshake happens under the same connect timeout, and a failed handshake
//! is not sent, like any other connect failure.
//!
//! ```
//! use std::time::Duration;
//! use tower_resend::connect::ConnectTimeoutLayer;
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
pub use crate::vocab::HttpsNotEnabled;

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
pub use hyper_impl::{hyper_client, hyper_client_with, HyperClient, HyperFuture};
#[cfg(feature = "https")]
pub use hyper_impl::{hyper_client_with_tls, tls_config, webpki_roots_config};
/// The rustls crate tower-resend's `https` is built on, for [`tls_config`]'s
/// roots and your own `ClientConfig`s (feature `https`).
#[cfg(feature = "https")]
pub use rustls;

#[cfg(feature = "hyper-client")]
mod hyper_impl {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use bytes::{Buf, Bytes};
    use http::{Request, Response};
    use http_body::Body;
    use http_body_util::combinators::UnsyncBoxBody;
    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::client::legacy::{Builder, Client};
    use hyper_util::rt::TokioExecutor;
    use pin_project_lite::pin_project;
    use tower_service::Service;

    use super::ConnectTimeout;
    use crate::error::BoxError;

    /// The request body the client sends: whatever body the caller gave,
    /// boxed, so that neither the client's type nor the stack's names it.
    type AnyBody = UnsyncBoxBody<Bytes, BoxError>;

    #[cfg(feature = "https")]
    type Connector = ConnectTimeout<hyper_rustls::HttpsConnector<HttpConnector>>;
    #[cfg(not(feature = "https"))]
    type Connector = ConnectTimeout<HttpConnector>;

    /// tower-resend's hyper-util client: HTTP/1.1 (and HTTP/2 over TLS, by ALPN),
    /// `http://` and, with the `https` feature, `https://` (rustls with the
    /// webpki roots), connections made under a connect timeout, and any
    /// request body (`Full<Bytes>`, `String`, `Empty`, a stream, a body
    /// another tower-resend stack wraps): the body's type appears nowhere, so
    /// nested stacks do not nest it.
    ///
    /// A failure to connect (refused, DNS, the TLS handshake, the connect
    /// timeout) comes back as hyper-util's error with the facts inside:
    /// [`Error::from_box`](crate::Error::from_box) of it says
    /// [not sent](crate::Error::is_not_sent). Without the `https` feature an
    /// `https://` URL fails at once with [`HttpsNotEnabled`](super::HttpsNotEnabled),
    /// and is not retried.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let client: tower_resend::connect::HyperClient = tower_resend::hyper_client(Duration::from_secs(2));
    /// // Any request body; nothing listens on port 9 here.
    /// let req = http::Request::get("http://127.0.0.1:9/").body(String::new()).unwrap();
    /// let err = client.request(req).await.unwrap_err();
    /// assert!(tower_resend::Error::from_box(err.into()).is_not_sent());
    /// # }
    /// ```
    #[derive(Clone, Debug)]
    pub struct HyperClient {
        inner: Client<Connector, AnyBody>,
    }

    /// tower-resend's hyper-util client (see [`HyperClient`]) with the default
    /// settings, `TCP_NODELAY` on, connections made under
    /// `connect_timeout`.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let client = tower_resend::hyper_client(Duration::from_secs(2));
    /// let stack: tower_resend::stack::Stack<tower_resend::connect::HyperClient> = tower_resend::stack().service(client);
    /// # let _ = stack;
    /// # }
    /// ```
    pub fn hyper_client(connect_timeout: Duration) -> HyperClient {
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
    /// let client = tower_resend::connect::hyper_client_with(&builder, Duration::from_secs(2));
    /// # let _ = client;
    /// # }
    /// ```
    pub fn hyper_client_with(builder: &Builder, connect_timeout: Duration) -> HyperClient {
        #[cfg(feature = "https")]
        return hyper_client_with_tls(builder, webpki_roots_config(), connect_timeout);
        #[cfg(not(feature = "https"))]
        HyperClient {
            inner: builder.build(ConnectTimeout::new(http(), connect_timeout)),
        }
    }

    fn http() -> HttpConnector {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http
    }

    /// The TLS settings of [`hyper_client`]: [`tls_config`] with the webpki
    /// roots (Mozilla's, compiled in: the same on every machine, as reqwest's
    /// `rustls-tls` does it) (feature `https`).
    #[cfg(feature = "https")]
    pub fn webpki_roots_config() -> rustls::ClientConfig {
        tls_config(rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        })
    }

    /// A rustls client config trusting `roots` (a private CA, a test
    /// certificate): rustls on `ring` whatever provider the process has
    /// installed, TLS 1.2 and 1.3, no client certificate. Give it to
    /// [`hyper_client_with_tls`]; it sets ALPN itself (feature `https`).
    ///
    /// ```
    /// use tower_resend::connect::rustls;
    ///
    /// let mut roots = rustls::RootCertStore::empty();
    /// // roots.add(my_ca_der)?;
    /// let tls = tower_resend::connect::tls_config(roots);
    /// # let _ = tls;
    /// ```
    #[cfg(feature = "https")]
    pub fn tls_config(roots: rustls::RootCertStore) -> rustls::ClientConfig {
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        match rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
        {
            Ok(b) => b.with_root_certificates(roots).with_no_client_auth(),
            // (`ring` supports the default versions; were it ever not so,
            // the process's default provider is used, with the same roots.)
            Err(_) => rustls::ClientConfig::builder()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        }
    }

    /// Like [`hyper_client_with`], with your own TLS settings (a private
    /// CA's roots, client certificates): `tls` is a rustls client config
    /// (feature `https`); ALPN (HTTP/2, HTTP/1.1) is set here, over any
    /// ALPN list `tls` had. `http://` URLs work too.
    ///
    /// ```
    /// use std::time::Duration;
    /// use hyper_util::{client::legacy::Client, rt::TokioExecutor};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_resend::connect::rustls;
    ///
    /// let mut roots = rustls::RootCertStore::empty();
    /// // roots.add(my_private_ca)?;
    /// let tls = tower_resend::connect::tls_config(roots);
    /// let client = tower_resend::connect::hyper_client_with_tls(
    ///     &Client::builder(TokioExecutor::new()),
    ///     tls,
    ///     Duration::from_secs(2),
    /// );
    /// # let _ = client;
    /// # }
    /// ```
    #[cfg(feature = "https")]
    pub fn hyper_client_with_tls(
        builder: &Builder,
        tls: rustls::ClientConfig,
        connect_timeout: Duration,
    ) -> HyperClient {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector({
                let mut http = http();
                // hyper-rustls takes `https://` from here on.
                http.enforce_http(false);
                http
            });
        HyperClient {
            inner: builder.build(ConnectTimeout::new(https, connect_timeout)),
        }
    }

    impl HyperClient {
        /// Sends `req` once, as hyper-util's `Client::request` does: no
        /// retries, no deadline (those are the stack's), the connect
        /// timeout still applies. The same as calling the service.
        pub fn request<B>(&self, req: Request<B>) -> HyperFuture
        where
            B: Body + Send + 'static,
            B::Error: Into<BoxError>,
        {
            if !cfg!(feature = "https") && req.uri().scheme() == Some(&http::uri::Scheme::HTTPS) {
                return HyperFuture {
                    inner: Inner::NoTls {
                        error: Some(super::HttpsNotEnabled { _private: () }),
                    },
                };
            }
            let req = req.map(|body| {
                // A body with nothing to send (most GETs) goes as the empty
                // body, which boxes nothing; others are boxed.
                if body.is_end_stream() {
                    return AnyBody::default();
                }
                body.map_frame(|frame| frame.map_data(|mut d| d.copy_to_bytes(d.remaining())))
                    .map_err(Into::into)
                    .boxed_unsync()
            });
            HyperFuture {
                inner: Inner::Calling {
                    future: self.inner.request(req),
                },
            }
        }
    }

    impl<B> Service<Request<B>> for HyperClient
    where
        B: Body + Send + 'static,
        B::Error: Into<BoxError>,
    {
        type Response = Response<Incoming>;
        type Error = BoxError;
        type Future = HyperFuture;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Service::<Request<AnyBody>>::poll_ready(&mut self.inner, cx).map_err(Into::into)
        }

        fn call(&mut self, req: Request<B>) -> Self::Future {
            self.request(req)
        }
    }

    pin_project! {
        /// Response future of [`HyperClient`].
        pub struct HyperFuture {
            #[pin]
            inner: Inner,
        }
    }

    pin_project! {
        #[project = InnerProj]
        enum Inner {
            Calling { #[pin] future: hyper_util::client::legacy::ResponseFuture },
            NoTls { error: Option<super::HttpsNotEnabled> },
        }
    }

    impl std::fmt::Debug for HyperFuture {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("HyperFuture").finish_non_exhaustive()
        }
    }

    impl Future for HyperFuture {
        type Output = Result<Response<Incoming>, BoxError>;

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
            match self.project().inner.project() {
                InnerProj::Calling { future } => future.poll(cx).map_err(Into::into),
                InnerProj::NoTls { error } => Poll::Ready(Err(match error.take() {
                    Some(e) => e.into(),
                    None => "hyper client future polled after completion".into(),
                })),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
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

    /// Without the `https` feature an `https://` URL fails once, at once,
    /// and the error says what to turn on. (`.ci/run` runs this with the
    /// default features, as the workspace's tests turn `https` on.)
    #[cfg(all(feature = "hyper-client", not(feature = "https")))]
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn https_without_the_feature_fails_once_and_says_so() {
        let stack = crate::stack()
            .max_attempts(3)
            .service(hyper_client(Duration::from_secs(2)));
        let start = tokio::time::Instant::now();
        let err = stack
            .oneshot(
                http::Request::get("https://example.com/")
                    .body(http_body_util::Empty::<bytes::Bytes>::new())
                    .unwrap(),
            )
            .await
            .unwrap_err();
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(err.attempts(), 1, "{err:?}");
        let text = format!("{err}");
        assert!(text.contains("`https` feature"), "{text}");
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
