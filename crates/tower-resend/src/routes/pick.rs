//! How a [`PerRoute`](super::PerRoute) picks a route: the HTTP table (method
//! and path prefix) and the gRPC one (service and method), which the
//! router consults and the builders of routes fill.

use std::collections::HashMap;

use http::{Method, Request};

/// How a [`PerRoute`](super::PerRoute) picks a route for a request: by method and path
/// prefix (an HTTP [route table](super::Routes)), or by gRPC service and
/// method (a [service config](crate::service_config)).
#[derive(Debug)]
pub(crate) enum Picker {
    /// Routes by method and path prefix.
    Http(HttpTable),
    /// Routes by `/service/method`.
    #[cfg_attr(not(feature = "service-config"), allow(dead_code))]
    Grpc(GrpcTable),
}

/// The routes of a gRPC service config: `/service/method` first, then
/// `/service/`, then the default, as gRPC matches them.
#[derive(Debug, Default)]
pub(crate) struct GrpcTable {
    /// `service/method` → route.
    pub(crate) methods: HashMap<Box<str>, usize>,
    /// `service` → route, for every method of it.
    pub(crate) services: HashMap<Box<str>, usize>,
    /// The route of every other method, if the config has a default.
    pub(crate) default: Option<usize>,
}

impl GrpcTable {
    fn pick(&self, path: &str) -> Option<usize> {
        let full = path.strip_prefix('/').unwrap_or(path);
        let service = full.split_once('/').map_or(full, |(s, _)| s);
        self.methods
            .get(full)
            .or_else(|| self.services.get(service))
            .copied()
            .or(self.default)
    }
}

impl Picker {
    /// The route of a request, if one matches.
    pub(crate) fn pick<B>(&self, req: &Request<B>) -> Option<usize> {
        match self {
            Self::Http(table) => table.pick(req.method(), req.uri().path()),
            Self::Grpc(table) => table.pick(req.uri().path()),
        }
    }
}

/// What the router keeps of the routes to pick one: (method, prefix).
#[derive(Debug)]
pub(crate) struct HttpTable {
    routes: Box<[(Option<Method>, Box<str>)]>,
}

impl HttpTable {
    /// The table of routes taking (method, prefix), in their order.
    pub(crate) fn of(routes: impl Iterator<Item = (Option<Method>, Box<str>)>) -> Self {
        Self {
            routes: routes.collect(),
        }
    }

    /// The route of a request: the longest prefix, then a route of its
    /// method, then the first.
    pub(crate) fn pick(&self, method: &Method, path: &str) -> Option<usize> {
        let mut best: Option<(usize, (usize, bool))> = None;
        for (i, (m, prefix)) in self.routes.iter().enumerate() {
            if m.as_ref().is_some_and(|m| m != method) {
                continue;
            }
            if !takes(prefix, path) {
                continue;
            }
            let rank = (prefix.len(), m.is_some());
            if best.is_none_or(|(_, b)| rank > b) {
                best = Some((i, rank));
            }
        }
        best.map(|(i, _)| i)
    }
}

/// True when `prefix` takes a request for `path` (whole segments:
/// `/orders` takes `/orders` and `/orders/7`, not `/ordersX`).
fn takes(prefix: &str, path: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'))
}
