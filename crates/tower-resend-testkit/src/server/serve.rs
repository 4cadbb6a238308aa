//! Serving: the accept loop, one connection, and one request on it (read it,
//! record it, follow the script, carry out the reply).

use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, CONTENT_LENGTH};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

use super::state::Shared;
use crate::arrival::Arrival;
use crate::body::{read_body, ReadFailure, ReplyBody};
use crate::reply::{Action, Reply};
use crate::script::{Decision, ReplyFn};

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const X_IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("x-idempotency-key");

/// Runs `fut` until it ends or the server shuts down.
pub(super) async fn until_shutdown<F: Future>(mut shutdown: watch::Receiver<()>, fut: F) {
    tokio::select! {
        _ = fut => {}
        _ = shutdown.changed() => {}
    }
}

/// The executor for hyper's HTTP/2 stream tasks: `tokio::spawn`, ended at
/// shutdown.
#[derive(Clone, Debug)]
pub(super) struct Exec {
    pub(super) shutdown: watch::Receiver<()>,
}

impl<F> hyper::rt::Executor<F> for Exec
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        tokio::spawn(until_shutdown(self.shutdown.clone(), fut));
    }
}

/// Accepts connections and spawns a task for each until shut down.
pub(super) async fn accept_loop(
    listener: TcpListener,
    http: Arc<auto::Builder<Exec>>,
    shared: Arc<Shared>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors and the like: back off a little.
                tracing::debug!(%error, "tower-resend-testkit: accept failed");
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        };
        shared.connections.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(until_shutdown(
            shared.shutdown.clone(),
            serve(stream, http.clone(), shared.clone()),
        ));
    }
}

/// Serves one connection.
async fn serve(stream: TcpStream, http: Arc<auto::Builder<Exec>>, shared: Arc<Shared>) {
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "tower-resend-testkit: set_nodelay failed");
    }
    let service = service_fn(move |req| handle(shared.clone(), req));
    if let Err(error) = http.serve_connection(TokioIo::new(stream), service).await {
        tracing::debug!(error = %error, "tower-resend-testkit: connection ended with an error");
    }
}

/// The error that makes hyper drop the connection (HTTP/1) or reset the
/// stream (HTTP/2) without answering.
#[derive(Debug)]
struct NoAnswer;

impl fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tower-resend-testkit: closed without answering")
    }
}

impl std::error::Error for NoAnswer {}

fn idempotency_key(headers: &HeaderMap) -> Option<String> {
    let value = headers
        .get(IDEMPOTENCY_KEY)
        .or_else(|| headers.get(X_IDEMPOTENCY_KEY))?;
    value.to_str().ok().map(str::to_owned)
}

/// Reduces an absolute request target to origin form.
fn origin_form(uri: Uri) -> Uri {
    if uri.scheme().is_none() && uri.authority().is_none() {
        return uri;
    }
    let mut parts = http::uri::Parts::default();
    parts.path_and_query = uri
        .path_and_query()
        .cloned()
        .or_else(|| Some(http::uri::PathAndQuery::from_static("/")));
    Uri::from_parts(parts).unwrap_or(uri)
}

/// Handles one request: read it, record it, follow the script.
async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<ReplyBody>, NoAnswer> {
    let (parts, body) = req.into_parts();
    let (body, failure) = match read_body(body, shared.body_limit).await {
        Ok(body) => (body, None),
        Err(ReadFailure::TooLarge(body)) => (body, Some(Unread::TooLarge)),
        Err(ReadFailure::Failed(body)) => (body, Some(Unread::Broken)),
    };
    let uri = origin_form(parts.uri);
    let version = parts.version;
    let idempotency_key = idempotency_key(&parts.headers);
    let mut arrival = Arrival {
        at: Instant::now(),
        method: parts.method,
        uri,
        version,
        headers: parts.headers,
        idempotency_key,
        body,
        attempt: 0,
    };

    // Record the arrival and consult the script under one lock, so that queue
    // order is arrival order.
    let next = {
        let mut record = shared.record();
        record.arrival_count += 1;
        arrival.attempt = record.arrival_count;
        let next = match failure {
            Some(unread) => Next::Refuse(unread),
            None => match shared.plan.decide(arrival.uri.path()) {
                Decision::Reply(reply) => {
                    let key = if reply.effect {
                        arrival.idempotency_key.clone()
                    } else {
                        None
                    };
                    Next::Act(reply, key)
                }
                Decision::Fn(f) => Next::Ask(f, Box::new(arrival.clone())),
            },
        };
        record.arrivals.push(arrival);
        next
    };

    match next {
        Next::Act(reply, key) => act(&shared, &reply, key.as_deref(), version).await,
        Next::Ask(f, arrival) => {
            let reply = f(&arrival);
            act(&shared, &reply, arrival.idempotency_key.as_deref(), version).await
        }
        Next::Refuse(Unread::TooLarge) => {
            let mut response = Response::new(ReplyBody::full(Bytes::new()));
            *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
            Ok(response)
        }
        // The client broke its own request: there is no one to answer.
        Next::Refuse(Unread::Broken) => Err(NoAnswer),
    }
}

/// What to do after recording an arrival.
enum Next {
    /// Act on this reply; the key is there if the reply records an effect.
    Act(Arc<Reply>, Option<String>),
    /// Ask the script's function about this arrival.
    Ask(ReplyFn, Box<Arrival>),
    /// Do not consult the script: the request was not read in full.
    Refuse(Unread),
}

/// Why a request body was not read in full.
#[derive(Clone, Copy, Debug)]
enum Unread {
    /// Over the body limit: answer `413`.
    TooLarge,
    /// The client's side failed: nothing to answer.
    Broken,
}

/// How much larger than the bytes sent a broken body claims to be.
const BROKEN_BODY_SHORTFALL: usize = 1024;

/// Carries out `reply`: delay, effect, then the act itself.
async fn act(
    shared: &Arc<Shared>,
    reply: &Reply,
    key: Option<&str>,
    version: Version,
) -> Result<Response<ReplyBody>, NoAnswer> {
    let delay = reply.delay.filter(|d| !d.is_zero());
    match (reply.effect, delay) {
        (false, None) => {}
        (false, Some(delay)) => tokio::time::sleep(delay).await,
        (true, None) => shared.record().effect(key),
        (true, Some(delay)) => {
            // The work completes even if the client gives up (and hyper drops
            // this future): do it on a task of its own and wait for it.
            let worker = shared.clone();
            let key = key.map(str::to_owned);
            let work = tokio::spawn(until_shutdown(shared.shutdown.clone(), async move {
                tokio::time::sleep(delay).await;
                worker.record().effect(key.as_deref());
            }));
            if work.await.is_err() {
                return Err(NoAnswer);
            }
        }
    }

    match &reply.action {
        Action::Respond => {
            let mut response = Response::new(ReplyBody::full(reply.body.clone()));
            *response.status_mut() = reply.status;
            if !reply.headers.is_empty() {
                *response.headers_mut() = reply.headers.clone();
            }
            Ok(response)
        }
        Action::Never => std::future::pending().await,
        Action::Close => Err(NoAnswer),
        Action::ResetMidBody(sent) => {
            let mut headers = reply.headers.clone();
            if !headers.contains_key(CONTENT_LENGTH) {
                let claimed = sent.len().saturating_add(BROKEN_BODY_SHORTFALL);
                headers.insert(CONTENT_LENGTH, HeaderValue::from(claimed));
            }
            let body = ReplyBody::broken(sent.clone(), version == Version::HTTP_2);
            let mut response = Response::new(body);
            *response.status_mut() = reply.status;
            *response.headers_mut() = headers;
            Ok(response)
        }
        Action::StallMidBody(sent) => {
            let mut response = Response::new(ReplyBody::stalled(sent.clone()));
            *response.status_mut() = reply.status;
            *response.headers_mut() = reply.headers.clone();
            Ok(response)
        }
        Action::ResetMidStream(sent) => {
            // No length to fall short of: the body fails, which drops the
            // HTTP/1 connection before the last chunk and resets an HTTP/2
            // stream.
            let mut response = Response::new(ReplyBody::broken(sent.clone(), false));
            *response.status_mut() = reply.status;
            *response.headers_mut() = reply.headers.clone();
            Ok(response)
        }
    }
}
