//! Policies per route: a [`PerRoute`] that sends each request through the
//! stack of its route, built from a table of HTTP routes ([`Routes`]:
//! method and path prefix) or from a gRPC service config
//! ([`ServiceConfig`](crate::service_config::ServiceConfig), feature
//! `service-config`).
//!
//! # Design: one stack per route, picked per request
//!
//! Each route gets a whole [`Stack`](crate::stack::Stack), built by the
//! ordinary [`StackBuilder`](crate::stack::StackBuilder) from the base
//! builder with the route's settings, over a clone of one transport; the
//! routes share what the base shares (the retry budget, the breaker, the
//! adaptive throttle: one per upstream, as the channel's). The router
//! picks one per request (as axum's `Router` and tower's `Steer` do) and
//! calls a clone of it.
//!
//! The other way, overrides in request extensions that every layer would
//! read on every call, was turned down: it would put a look-up (and the
//! code to merge two sets of settings) on the success path of every stack,
//! routes or not, where the overhead line has no room for it (DESIGN §8),
//! and each layer would have to learn each override. Here a stack without
//! routes is the stack it was, byte for byte and instruction for
//! instruction; a routed call pays one pick (a hash look-up for gRPC, a
//! scan of the prefixes for HTTP) and a clone of its route's stack, and
//! each route's stack is as fast as any other.
//!
//! ```
//! use std::time::Duration;
//! use http::Method;
//! use tower_resend::routes::{RoutePolicy, Routes};
//! use tower::{service_fn, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! let slow = service_fn(|_req: http::Request<String>| async {
//!     tokio::time::sleep(Duration::from_secs(3)).await;
//!     Ok::<_, tower_resend::BoxError>(http::Response::new(String::new()))
//! });
//! // Search must answer within a second; the rest has the base's 10 s.
//! let routes = Routes::new()
//!     .route(Method::GET, "/search", RoutePolicy::new().total(Duration::from_secs(1)));
//! let api = routes.service(tower_resend::stack().name("api"), slow);
//!
//! let search = http::Request::get("/search?q=tea").body(String::new()).unwrap();
//! assert!(api.clone().oneshot(search).await.unwrap_err().is_deadline_exceeded());
//! let list = http::Request::get("/orders").body(String::new()).unwrap();
//! assert!(api.clone().oneshot(list).await.is_ok());
//! # }
//! ```
//!
//! With the `service-config` feature, a table also reads from JSON (or
//! any serde format): [`Routes::from_json`], durations written as gRPC's
//! service config writes them (`"1.5s"`).

mod http;
mod per_route;
mod pick;

pub use self::http::{RoutePolicy, Routes};
pub use self::per_route::{PerRoute, ResponseFuture};
#[cfg(feature = "service-config")]
pub(crate) use self::pick::{GrpcTable, Picker};

/// The name of earlier versions.
#[doc(hidden)]
#[deprecated(
    note = "renamed: tower_resend::routes::PerRoute (no clash with axum::Router), or tower_resend::stack::BoxStack to name it in one line"
)]
pub type Router<S> = PerRoute<S>;
