//! reqwest under resend (feature `reqwest`), three ways:
//!
//! - [`ReqwestService`]: a `tower::Service` over a [`reqwest::Client`] that
//!   takes an [`http::Request`] and gives an [`http::Response`], so that
//!   [`tower_resend::stack()`](crate::stack()) wraps it like any other transport.
//! - [`ResendMiddleware`] as a `reqwest_middleware::Middleware` (feature
//!   `reqwest-middleware`): users of `ClientWithMiddleware` add resend in
//!   one line and keep `.send()`, `.json()`, `.text()`.
//! - [`RequestBuilderExt::send_with`] (and [`ResendMiddleware::execute`]):
//!   a plain `reqwest::RequestBuilder` (or `reqwest::Request`) sent through
//!   the stack with its own client, no middleware crate needed.
//!
//! # As reqwest middleware
//!
//! [`ResendMiddleware`] is built once per upstream from a
//! [`tower_resend::stack()`](crate::stack()) builder and runs the whole stack around
//! the rest of the chain: the deadline, the Idempotency-Key (with
//! [`idempotency_keys`](crate::stack::StackBuilder::idempotency_keys)), the retries
//! with the same classification, decision table, retry budget, backoff and
//! `Retry-After`, the circuit breaker if one was added, and the attempt
//! timeout. Each attempt is one `next.run(..)`: the middlewares after it and
//! the client see every attempt.
//!
//! `resend_error` (feature `reqwest-middleware`) shows a
//! `ClientWithMiddleware` with it.
//!
//! ## Errors
//!
//! Every error of the middleware is
//! `reqwest_middleware::Error::Middleware(e)`, where `e` (an
//! `anyhow::Error`) holds a [`tower_resend::Error`](crate::Error): find it with
//! `tower_resend::reqwest::resend_error(&err)`, or with
//! `e.downcast_ref::<tower_resend::Error>()`. Its kind says what fired ([`OutcomeUnknown`](crate::error::ErrorKind::OutcomeUnknown): a POST
//! without a key that may have been processed, verify before sending it
//! again), and the last cause, a `reqwest::Error` or an error of a later
//! middleware, is down its [`source`](std::error::Error::source) chain.
//! reqwest_middleware's own `is_timeout()`, `is_connect()`, `status()` look
//! only at `Error::Reqwest`, so they say nothing of these; ask the tower-resend
//! error. An error while reading the body of a response (`.text()`,
//! `.json()`, including the deadline running out) is reqwest's body error
//! with the tower-resend error as its source.
//!
//! ## Bodies
//!
//! A body reqwest holds in memory (`.body(bytes)`, `.json(..)`, `.form(..)`)
//! is sent again as it is, whatever its size: every attempt shares its bytes.
//! A streamed body (`Body::wrap_stream`, `Body::wrap`) follows tower-resend's
//! [`ReplayBody`](crate::body::ReplayBody) rule: the first attempt streams
//! it and keeps a copy up to the replay cap (64 KiB by default,
//! [`replay_cap`](crate::retry::RetryLayer::replay_cap)); a larger one is sent once,
//! and a call that needed a retry ends
//! [`BodyNotReplayable`](crate::error::ErrorKind::BodyNotReplayable), never a
//! resend of half a body.
//!
//! ## Extensions
//!
//! The extensions of the call (`reqwest_middleware::RequestBuilder::with_extension`)
//! reach the stack, so tower-resend's per-request settings work there:
//! [`Deadline`](crate::Deadline), [`IdempotencyKey`](crate::IdempotencyKey),
//! [`NoRetry`](crate::retry::NoRetry), [`CallOptions`](crate::retry::CallOptions).
//! Each attempt hands the rest of the chain a copy of them, and what the
//! last attempt left there comes back to the middlewares before this one.
//! The final `reqwest::Response` carries [`Attempts`](crate::retry::Attempts) in
//! its `extensions()` and keeps its `url()`.
//!
//! Put `ResendMiddleware` first in the chain, or at least before the
//! middlewares that should see each attempt (auth, signing, tracing of
//! attempts); a retrying middleware of its own (`reqwest-retry`) does not
//! belong in the same chain, as retries would multiply.
//!
//! # reqwest's errors
//!
//! reqwest's errors, from [`ReqwestService`] or from an attempt of
//! [`ResendMiddleware`], are mapped faithfully:
//!
//! | reqwest says | resend says |
//! |---|---|
//! | [`is_connect()`](reqwest::Error::is_connect): the connection could not be made (refused, DNS, connect timeout) | nothing was sent: a [`tower_resend::Error`](crate::Error) with [`is_not_sent`](crate::Error::is_not_sent), class [`NotSent`](crate::classify::Class::NotSent), always safe to retry |
//! | [`is_timeout()`](reqwest::Error::is_timeout) after the connection was made | the reqwest error as it is: class [`Unknown`](crate::classify::Class::Unknown), the server may have acted |
//! | anything else (reset, broken body, protocol error) | the reqwest error as it is: class [`Unknown`](crate::classify::Class::Unknown) |
//! | the request cannot be turned into a reqwest one (a relative URI) | nothing was sent |
//!
//! # One retry layer, one set of timeouts
//!
//! Build the client (the transport's, or the one under a
//! `ClientWithMiddleware`) with [`client_builder`] (or start from your own
//! `ClientBuilder` and do what it does):
//!
//! - **reqwest's retries off** (`.retry(reqwest::retry::never())`): reqwest
//!   0.13 retries some protocol refusals by itself; under tower-resend's
//!   [`RetryLayer`](crate::retry::RetryLayer) that would be a second layer retrying,
//!   with its own count and budget. Exactly one layer retries: tower-resend's.
//!   ([`ReqwestService`] hands reqwest a streaming body, which reqwest 0.13
//!   cannot clone, so even its default policy could not resend a request
//!   that came through that stack; [`ResendMiddleware`] hands it bodies in
//!   memory as they are, which it could: there, turning it off matters.)
//! - **`connect_timeout` set**: reqwest's connect timeout is the stack's
//!   connect timeout (2 s is a sound choice), and a connection that times out is
//!   reported as not sent.
//! - **`timeout` and `read_timeout` left unset**: tower-resend's
//!   [attempt timeout](crate::timeout::AttemptTimeoutLayer) and
//!   [deadline](crate::deadline::CallDeadlineLayer) bound each attempt and the call, and
//!   they say which one fired. If you must set reqwest's `timeout` (the client
//!   is also used without resend), make it longer than the stack's attempt
//!   timeout, so that tower-resend's fires first; a reqwest timeout that fires first
//!   is only "a transport error, outcome unknown".
//! - `tcp_nodelay(true)`, which reqwest sets by default: small writes are not
//!   held back (and tests on tokio's paused clock need it).
//!
//! ```
//! use std::time::Duration;
//! use http::Request;
//! use tower_resend::reqwest::{client_builder, ReqwestService};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let client = client_builder(Duration::from_secs(2)).build().unwrap();
//! let shipping = tower_resend::stack()
//!     .name("shipping")
//!     .total(Duration::from_secs(10))
//!     .attempt_timeout(Duration::from_secs(5))
//!     .service(ReqwestService::new(client));
//!
//! // Nothing listens on port 9: refused, so not sent, retried, then given up.
//! let req = Request::get("http://127.0.0.1:9/parcels/7").body(String::new()).unwrap();
//! let err = shipping.oneshot(req).await.unwrap_err();
//! assert!(err.is_not_sent());
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::error::{BoxError, Error};

mod handoff;
mod middleware;

pub use handoff::{Handoff, HandoffFuture};
pub use middleware::{RequestBuilderExt, ResendMiddleware};

/// The [`tower_resend::Error`](Error) inside an error of a `ClientWithMiddleware`
/// call that went through [`ResendMiddleware`]; `None` for an error that did
/// not come from it (one of reqwest's own, from a middleware before it).
///
/// The same as matching `reqwest_middleware::Error::Middleware(e)` and
/// `e.downcast_ref::<tower_resend::Error>()`.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::reqwest::{client_builder, resend_error, ResendMiddleware};
/// use reqwest_middleware::ClientBuilder;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let client = ClientBuilder::new(client_builder(Duration::from_secs(2)).build().unwrap())
///     .with(ResendMiddleware::new(tower_resend::stack().name("shipping")))
///     .build();
///
/// // Nothing listens on port 9: refused, so not sent, retried, then given up.
/// let err = client.get("http://127.0.0.1:9/parcels/7").send().await.unwrap_err();
/// let err = resend_error(&err).expect("tower-resend's own error");
/// assert!(err.is_not_sent());
/// assert_eq!(err.upstream(), Some("shipping"));
/// assert_eq!(err.attempts(), 3);
/// # }
/// ```
#[cfg(feature = "reqwest-middleware")]
pub fn resend_error(error: &reqwest_middleware::Error) -> Option<&Error> {
    match error {
        reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<Error>(),
        reqwest_middleware::Error::Reqwest(_) => None,
    }
}

/// A [`reqwest::ClientBuilder`] set up to be the transport of a tower-resend stack:
/// reqwest's own retries off, `connect_timeout` as given, `TCP_NODELAY`, and
/// no overall or read timeout (tower-resend's attempt timeout and deadline bound
/// the attempts). See the [module docs](self) for why.
///
/// Add what your upstream needs (TLS through reqwest's features, HTTP/2,
/// pool settings) before `build()`.
///
/// ```
/// use std::time::Duration;
///
/// let client = tower_resend::reqwest::client_builder(Duration::from_secs(2))
///     .pool_idle_timeout(Duration::from_secs(30))
///     .build()
///     .unwrap();
/// let transport = tower_resend::reqwest::ReqwestService::new(client);
/// # let _ = transport;
/// ```
pub fn client_builder(connect_timeout: Duration) -> ::reqwest::ClientBuilder {
    ::reqwest::Client::builder()
        .retry(::reqwest::retry::never())
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
}

/// A [`reqwest::Client`] as a `tower::Service` of `http` types; see the
/// [module docs](self).
///
/// It takes any [`http_body::Body`] whose data is `Bytes`-like (tower-resend's
/// [`ReplayBody`](crate::body::ReplayBody) included) and gives a
/// `Response<reqwest::Body>`. Clones share the client's connection pool.
///
/// ```
/// use std::time::Duration;
/// use http::Request;
/// use tower_resend::reqwest::ReqwestService;
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let transport = ReqwestService::from_connect_timeout(Duration::from_secs(2)).unwrap();
/// let req = Request::get("http://127.0.0.1:9/").body(String::new()).unwrap();
/// let err = tower_resend::Error::from_box(transport.oneshot(req).await.unwrap_err());
/// assert!(err.is_not_sent()); // refused: nothing was written
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ReqwestService {
    client: ::reqwest::Client,
}

impl ReqwestService {
    /// Wraps `client`. Build it with [`client_builder`], or at least with
    /// `.retry(reqwest::retry::never())` and no `timeout` shorter than the
    /// stack's attempt timeout.
    pub const fn new(client: ::reqwest::Client) -> Self {
        Self { client }
    }

    /// A service over a client from [`client_builder`]`(connect_timeout)`.
    ///
    /// # Errors
    ///
    /// When reqwest cannot build the client (its TLS backend or resolver
    /// fails to initialise).
    pub fn from_connect_timeout(connect_timeout: Duration) -> Result<Self, ::reqwest::Error> {
        client_builder(connect_timeout).build().map(Self::new)
    }

    /// The client.
    pub fn get_ref(&self) -> &::reqwest::Client {
        &self.client
    }

    /// Unwraps the client.
    pub fn into_inner(self) -> ::reqwest::Client {
        self.client
    }
}

impl From<::reqwest::Client> for ReqwestService {
    fn from(client: ::reqwest::Client) -> Self {
        Self::new(client)
    }
}

type Pending = <::reqwest::Client as Service<::reqwest::Request>>::Future;

impl<B> Service<Request<B>> for ReqwestService
where
    B: http_body::Body + Send + Sync + 'static,
    B::Data: Into<Bytes>,
    B::Error: Into<BoxError>,
{
    type Response = Response<::reqwest::Body>;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // reqwest's client is always ready; its pool makes connections per call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let state = match ::reqwest::Request::try_from(req.map(::reqwest::Body::wrap)) {
            Ok(req) => State::Sending {
                pending: self.client.call(req),
            },
            // No reqwest request, so nothing was sent.
            Err(e) => State::Failed {
                error: Some(Error::connect(Box::new(e)).into()),
            },
        };
        ResponseFuture { state }
    }
}

/// Maps a reqwest error to what it says about the request; see the
/// [module docs](self).
fn map_error(e: ::reqwest::Error) -> BoxError {
    if e.is_connect() || e.is_builder() {
        // The connection could not be made (refused, DNS, connect timeout),
        // or no request could be built: nothing was written.
        Error::connect(Box::new(e)).into()
    } else {
        // A timeout after connecting, a reset, a broken body: the server may
        // have acted. The classifier calls it Unknown.
        Box::new(e)
    }
}

pin_project! {
    /// Response future of [`ReqwestService`].
    pub struct ResponseFuture {
        #[pin]
        state: State,
    }
}

pin_project! {
    #[project = StateProj]
    enum State {
        Sending { #[pin] pending: Pending },
        Failed { error: Option<BoxError> },
    }
}

impl Future for ResponseFuture {
    type Output = Result<Response<::reqwest::Body>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Sending { pending } => {
                pending.poll(cx).map_ok(Response::from).map_err(map_error)
            }
            StateProj::Failed { error } => Poll::Ready(Err(error
                .take()
                .unwrap_or_else(|| "reqwest future polled after completion".into()))),
        }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::{Class, Classify, HttpClassifier, RequestFacts};
    use tower::ServiceExt;

    fn classify(e: &BoxError) -> Class {
        let req = Request::get("http://up/x").body(()).unwrap();
        Classify::<()>::classify_error(&HttpClassifier::new(), &RequestFacts::of(&req), &**e)
            .class()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_refused_connection_is_not_sent() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let svc = ReqwestService::from_connect_timeout(Duration::from_secs(2)).unwrap();
        let req = Request::post(format!("http://127.0.0.1:{port}/charges"))
            .body(String::from("amount=100"))
            .unwrap();
        let err = svc.oneshot(req).await.unwrap_err();
        assert_eq!(classify(&err), Class::NotSent);
        let err = Error::from_box(err);
        assert!(err.is_not_sent(), "{err}");
        assert_eq!(err.kind(), crate::error::ErrorKind::Transport);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_relative_uri_is_not_sent() {
        let svc = ReqwestService::from_connect_timeout(Duration::from_secs(2)).unwrap();
        let req = Request::get("/no-host").body(String::new()).unwrap();
        let err = Error::from_box(svc.oneshot(req).await.unwrap_err());
        assert!(err.is_not_sent(), "{err}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_reqwest_timeout_after_connecting_is_unknown() {
        // Accepts, reads, never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hold = tokio::spawn(async move {
            let (sock, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(sock);
        });
        let client = client_builder(Duration::from_secs(2))
            .timeout(Duration::from_millis(50))
            .build()
            .unwrap();
        let req = Request::get(format!("http://{addr}/x"))
            .body(String::new())
            .unwrap();
        let err = ReqwestService::new(client).oneshot(req).await.unwrap_err();
        let reqwest_err = err
            .downcast_ref::<::reqwest::Error>()
            .expect("reqwest's own error");
        assert!(reqwest_err.is_timeout());
        assert_eq!(classify(&err), Class::Unknown);
        assert!(!Error::from_box(err).is_not_sent());
        hold.abort();
    }
}
