//! The wire: a transport that takes each attempt to the instance its URI's
//! authority names, through what that instance's server has in front of
//! its queue.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::HeaderName;
use http::{Request, Response};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceExt};
use tower_resend_server::{AdaptiveLimit, InboundDeadlineLayer, ShedLayer};

use super::instance::{Answer, Instance};
use super::recorder::Recorder;
use super::script::{self, Script};
use super::Model;
use crate::Body;

/// The header in which the stack writes the time left, and the servers that
/// honour deadlines read it (milliseconds).
pub(crate) const DEADLINE_HEADER: HeaderName = HeaderName::from_static("x-request-timeout-ms");

/// The longest deadline a server grants, and what it grants a request
/// that says none (tower's retry sends none).
const SERVER_MAX: Duration = Duration::from_secs(10);

/// What each instance has in front of its queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    /// Nothing: every request queued is worked on, its caller there or not.
    Plain,
    /// tower-resend-server's `InboundDeadlineLayer` (the caller's budget
    /// from the stack's deadline header, 10 s at most and when none is
    /// said), and an instance that drops a queued request whose deadline
    /// has passed before starting it (the layer does not drop queued work
    /// by itself: it ends the request's future, and the work queued behind
    /// it stays; the instance reads the `Deadline` the layer put in the
    /// request's extensions).
    Deadline,
    /// As [`Server::Deadline`], with `ShedLayer::adaptive` between the
    /// deadline layer and the queue, its limit found between the workers
    /// and the workers plus the queue: retries refused before first
    /// attempts, 503 with `Retry-After`.
    Shed,
}

impl Server {
    /// Every server, in the tables' order.
    pub const ALL: [Server; 3] = [Server::Plain, Server::Deadline, Server::Shed];

    /// Its name in tables, pictures and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Server::Plain => "plain",
            Server::Deadline => "deadline",
            Server::Shed => "deadline+shed",
        }
    }

    /// The server of that name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// An instance behind its server's layers, as the wire sees it.
type Front = BoxCloneSyncService<Request<Body>, Response<Body>, BoxError>;

/// The answer as it comes off the wire: status and headers, no body (the
/// instances' are empty), no extensions.
fn off_the_wire<RB>(resp: Response<RB>) -> Response<Body> {
    let (mut parts, _) = resp.into_parts();
    parts.extensions = http::Extensions::new();
    Response::from_parts(parts, Body::new())
}

/// `instance` behind `server`'s layers; its `ShedLayer`, if it has one.
fn front(server: Server, model: &Model, instance: Instance) -> (Front, Option<ShedLayer>) {
    let deadline = InboundDeadlineLayer::new(SERVER_MAX).http_header(DEADLINE_HEADER);
    match server {
        Server::Plain => (Front::new(instance), None),
        Server::Deadline => (
            Front::new(ServiceExt::<Request<Body>>::map_response(
                deadline.layer(instance),
                off_the_wire,
            )),
            None,
        ),
        Server::Shed => {
            let limit = AdaptiveLimit::between(model.workers, model.workers + model.queue);
            let shed = ShedLayer::adaptive(limit);
            let front = Front::new(ServiceExt::<Request<Body>>::map_response(
                deadline.layer(shed.layer(instance)),
                off_the_wire,
            ));
            (front, Some(shed))
        }
    }
}

/// Routes each request to the instance its URI's authority names
/// (`10.x.y.z:80`, see the script's addresses), or refuses it at once
/// (`REFUSED_STREAM`) when no instance has that address. Counts every
/// request as sent.
#[derive(Clone)]
pub(crate) struct Transport {
    fronts: Arc<[Front]>,
    sheds: Arc<[ShedLayer]>,
    recorder: Arc<Recorder>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("instances", &self.fronts.len())
            .finish_non_exhaustive()
    }
}

impl Transport {
    /// Starts every instance the script has, behind `server`.
    pub(crate) fn start(
        server: Server,
        model: &Model,
        script: &Arc<Script>,
        recorder: &Arc<Recorder>,
        seed: u64,
    ) -> Self {
        let honour = server != Server::Plain;
        let (fronts, sheds): (Vec<Front>, Vec<Option<ShedLayer>>) = (0..script.slots())
            .map(|i| {
                let seed = seed ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
                let instance = Instance::start(
                    i,
                    model,
                    honour,
                    Arc::clone(script),
                    Arc::clone(recorder),
                    seed,
                );
                front(server, model, instance)
            })
            .unzip();
        Self {
            fronts: fronts.into(),
            sheds: sheds.into_iter().flatten().collect(),
            recorder: Arc::clone(recorder),
        }
    }
}

impl Transport {
    /// Requests the servers' `ShedLayer`s refused so far.
    pub(crate) fn shed(&self) -> u64 {
        self.sheds.iter().map(|s| s.stats().shed()).sum()
    }
}

impl<B> Service<Request<B>> for Transport {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Answer;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Answer {
        self.recorder.sent();
        let (parts, _body) = req.into_parts();
        let front = parts
            .uri
            .authority()
            .and_then(script::instance_of)
            .and_then(|i| self.fronts.get(i));
        let Some(front) = front else {
            let refused = h2::Error::from(h2::Reason::REFUSED_STREAM);
            return Box::pin(std::future::ready(Err(refused.into())));
        };
        // What goes over the wire: no extensions.
        let mut wire = Request::new(Body::new());
        *wire.method_mut() = parts.method;
        *wire.uri_mut() = parts.uri;
        *wire.version_mut() = parts.version;
        *wire.headers_mut() = parts.headers;
        Box::pin(front.clone().oneshot(wire))
    }
}
