//! Where a layer keeps its records, and so how a keyed request runs: under a
//! lease in a [`Store`], or inside the handler's own transaction
//! ([`PostgresTransactional`](crate::PostgresTransactional)).

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_resend::{BoxError, Deadline};
use tower_service::Service;

use super::future::Slow;
use super::request::Key;
use super::run::{run, LeaseGuard};
use super::service::Shared;
use crate::body::MaybeBuffered;
use crate::store::Store;

/// Where an [`IdempotencyLayer`](crate::IdempotencyLayer) keeps its records:
/// any [`Store`] (the memory, Redis and PostgreSQL stores, or your own), or
/// [`PostgresTransactional`](crate::PostgresTransactional) (feature
/// `postgres`). The rules are the same; what differs is what holds the key
/// while the handler runs (a lease, or the handler's transaction).
///
/// Sealed: implement [`Store`] to bring a store of your own.
pub trait Backend: sealed::Sealed + Clone + Send + Sync + 'static {}

impl<St: Store> Backend for St {}

/// The handler a backend runs a request through: the inner service, on
/// the request with its body read (or not), sent to other tasks.
pub(crate) trait Handler<B, RB>:
    Service<
        Request<MaybeBuffered<B>>,
        Response = Response<RB>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
}

impl<T, B, RB> Handler<B, RB> for T
where
    T: Service<Request<MaybeBuffered<B>>, Response = Response<RB>> + Send + 'static,
    T::Future: Send + 'static,
    T::Error: Send + 'static,
{
}

/// A request body the layer takes: bytes, with an error it can box.
pub(crate) trait RequestBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<T> RequestBody for T
where
    T: Body<Data = Bytes> + Send + 'static,
    T::Error: Into<BoxError>,
{
}

/// A handler's response body, which the layer reads to store it.
pub(crate) trait ResponseBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

impl<T> ResponseBody for T
where
    T: Body<Data = Bytes> + Send + Unpin + 'static,
    T::Error: Into<BoxError>,
{
}

/// What the layer knows of a keyed request when it hands it to the backend.
pub(crate) struct Keyed {
    pub(crate) scope: Cow<'static, str>,
    pub(crate) key: Key,
    pub(crate) deadline: Option<Deadline>,
    pub(crate) grpc: bool,
}

// The sealed trait names crate-private types: it cannot be named, nor
// implemented, outside the crate, which is its point.
#[allow(private_interfaces, private_bounds)]
pub(crate) mod sealed {
    use super::*;

    /// How a backend runs requests (not nameable outside the crate).
    pub trait Sealed: Sized {
        /// Whether unsafe requests without a key go through the backend
        /// too ([`unkeyed`](Self::unkeyed)) rather than straight to the
        /// handler.
        const TAKES_UNKEYED: bool;

        /// A keyed request, start to end.
        fn keyed<S, B, RB>(
            shared: Arc<Shared<Self>>,
            keyed: Keyed,
            inner: S,
            parts: http::request::Parts,
            body: B,
        ) -> Slow<RB, S::Error>
        where
            S: Handler<B, RB>,
            B: RequestBody,
            RB: ResponseBody;

        /// An unsafe request without a key, when [`TAKES_UNKEYED`](Self::TAKES_UNKEYED).
        fn unkeyed<S, B, RB>(
            shared: Arc<Shared<Self>>,
            deadline: Option<Deadline>,
            inner: S,
            req: Request<MaybeBuffered<B>>,
        ) -> Slow<RB, S::Error>
        where
            S: Handler<B, RB>,
            B: RequestBody,
            RB: ResponseBody;
    }

    impl<St: Store> Sealed for St {
        const TAKES_UNKEYED: bool = false;

        fn keyed<S, B, RB>(
            shared: Arc<Shared<Self>>,
            keyed: Keyed,
            inner: S,
            parts: http::request::Parts,
            body: B,
        ) -> Slow<RB, S::Error>
        where
            S: Handler<B, RB>,
            B: RequestBody,
            RB: ResponseBody,
        {
            let guard = LeaseGuard::new(shared, keyed);
            run(inner, guard, parts, body)
        }

        fn unkeyed<S, B, RB>(
            _: Arc<Shared<Self>>,
            _: Option<Deadline>,
            mut inner: S,
            req: Request<MaybeBuffered<B>>,
        ) -> Slow<RB, S::Error>
        where
            S: Handler<B, RB>,
            B: RequestBody,
            RB: ResponseBody,
        {
            // (Not called: a store leaves unkeyed requests alone.)
            let fut = inner.call(req);
            Box::pin(async move { fut.await.map(|r| r.map(MaybeBuffered::inner)) })
        }
    }
}
