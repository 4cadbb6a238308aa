//! A stack with its type erased: one line to name in a struct field.

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use tower::util::BoxCloneSyncService;
use tower::ServiceExt;
use tower_service::Service;

use crate::error::{BoxError, Error};

/// The response body of a [`BoxStack`]: the stack's own (its deadline and
/// its read-ahead still apply), boxed.
pub type BoxBody = UnsyncBoxBody<Bytes, BoxError>;

/// A stack with its type erased, to keep in a struct field or an axum
/// state: requests of body `ReqB`, responses of [`BoxBody`], errors
/// [`tower_resend::Error`](crate::Error); cloneable, `Send` and `Sync`.
/// What [`Stack::boxed`](super::Stack::boxed) and [`boxed`] make of a
/// stack, whatever its layers (a fleet, a breaker, hedging), and of a route
/// table's or a service config's [`PerRoute`](crate::routes::PerRoute).
///
/// Boxing costs an allocation a call (the future), and one a response (the
/// body): the price of a type that does not name the layers.
///
/// ```
/// use std::time::Duration;
///
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower_resend::stack::BoxStack;
///
/// #[derive(Clone)]
/// struct Clients {
///     shipping: BoxStack<Full<Bytes>>,
/// }
///
/// let shipping = tower_resend::stack()
///     .name("shipping")
///     .hedge(Duration::from_millis(50))
///     .service(tower_resend::hyper_client(Duration::from_secs(2)))
///     .boxed();
/// let clients = Clients { shipping };
/// # let _ = clients;
/// ```
pub type BoxStack<ReqB> = BoxCloneSyncService<Request<ReqB>, Response<BoxBody>, Error>;

/// `service` (a stack, or a [`PerRoute`](crate::routes::PerRoute) of
/// stacks) as a [`BoxStack`].
///
/// ```
/// use std::time::Duration;
///
/// use http::Method;
/// use tower_resend::routes::{RoutePolicy, Routes};
/// use tower_resend::stack::{boxed, BoxStack};
///
/// let routes = Routes::new()
///     .route(Method::GET, "/search", RoutePolicy::new().total(Duration::from_secs(1)));
/// let shop: BoxStack<String> = boxed(routes.service(
///     tower_resend::stack().name("shop"),
///     tower_resend::hyper_client(Duration::from_secs(2)),
/// ));
/// # let _ = shop;
/// ```
pub fn boxed<S, ReqB, ResB>(service: S) -> BoxStack<ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>, Error = Error>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    BoxCloneSyncService::new(service.map_response(box_body))
}

/// `resp` with its body boxed.
pub(crate) fn box_body<B>(resp: Response<B>) -> Response<BoxBody>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    resp.map(|body| body.map_err(Into::into).boxed_unsync())
}
