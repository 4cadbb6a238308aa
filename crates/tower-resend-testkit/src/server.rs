//! The server: [`TestServer`], its [`Builder`] and the [`Arrival`] records.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, CONTENT_LENGTH};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::body::{read_body, ReadFailure, ReplyBody};
use crate::reply::Action;
use crate::script::{Decision, Plan, ReplyFn};
use crate::{Reply, Script};

/// The default cap on a request body: 16 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 16 * 1024 * 1024;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const X_IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("x-idempotency-key");

/// One request as the server received it.
#[derive(Clone, Debug)]
pub struct Arrival {
    /// When the request had been received in full (head and body), on tokio's
    /// clock.
    pub at: Instant,
    /// The request method.
    pub method: Method,
    /// The request target in origin form (path and query), as received. An
    /// absolute target (as HTTP/2 sends) is reduced to its path and query.
    pub uri: Uri,
    /// `HTTP/1.1` or `HTTP/2.0` (or `HTTP/1.0`).
    pub version: Version,
    /// The request headers, as received.
    pub headers: HeaderMap,
    /// The `Idempotency-Key` header, else the `X-Idempotency-Key` header;
    /// `None` if absent or not visible ASCII.
    pub idempotency_key: Option<String>,
    /// The request body. For a request over the body limit (answered `413`),
    /// the bytes read before the limit was hit (none if the declared
    /// `Content-Length` was already over it); for a request whose body the
    /// client did not finish sending, the bytes that came.
    pub body: Bytes,
    /// 1-based index of this arrival among all arrivals at this server.
    pub attempt: usize,
}

/// What the server has seen and done.
#[derive(Debug, Default)]
struct Record {
    arrivals: Vec<Arrival>,
    arrival_count: usize,
    keyless_effects: usize,
    keyed_effects: HashMap<String, usize>,
    total_effects: usize,
}

impl Record {
    fn effect(&mut self, key: Option<&str>) {
        match key {
            None => self.keyless_effects += 1,
            Some(key) => match self.keyed_effects.get_mut(key) {
                Some(n) => *n += 1,
                None => {
                    self.keyed_effects.insert(key.to_owned(), 1);
                }
            },
        }
        self.total_effects += 1;
    }
}

/// State shared by the handle, the accept loop and every request.
struct Shared {
    plan: Plan,
    record: Mutex<Record>,
    connections: AtomicUsize,
    body_limit: usize,
    /// Resolves `changed()` with an error once the [`TestServer`] is dropped.
    shutdown: watch::Receiver<()>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("plan", &self.plan)
            .field("connections", &self.connections)
            .field("body_limit", &self.body_limit)
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn record(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs `fut` until it ends or the server shuts down.
async fn until_shutdown<F: Future>(mut shutdown: watch::Receiver<()>, fut: F) {
    tokio::select! {
        _ = fut => {}
        _ = shutdown.changed() => {}
    }
}

/// The executor for hyper's HTTP/2 stream tasks: `tokio::spawn`, ended at
/// shutdown.
#[derive(Clone, Debug)]
struct Exec {
    shutdown: watch::Receiver<()>,
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

/// Which protocols the server speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocols {
    Both,
    Http1,
    Http2,
}

/// Configures and starts a [`TestServer`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> std::io::Result<()> {
/// use tower_resend_testkit::{Reply, Script, TestServer};
///
/// let server = TestServer::builder()
///     .script(Script::new().then(Reply::status(503)))
///     .http1_only()
///     .start()
///     .await?;
/// # drop(server);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "a Builder does nothing until start() is awaited"]
pub struct Builder {
    script: Script,
    protocols: Protocols,
    body_limit: usize,
}

impl Default for Builder {
    fn default() -> Builder {
        Builder {
            script: Script::new(),
            protocols: Protocols::Both,
            body_limit: DEFAULT_BODY_LIMIT,
        }
    }
}

impl Builder {
    /// The script requests follow (default: [`Script::new`], every request
    /// gets `200 OK`).
    pub fn script(mut self, script: Script) -> Builder {
        self.script = script;
        self
    }

    /// Speak only HTTP/1.1 (and 1.0). By default the server speaks HTTP/1.1
    /// and HTTP/2 with prior knowledge (h2c) on the same port.
    pub fn http1_only(mut self) -> Builder {
        self.protocols = Protocols::Http1;
        self
    }

    /// Speak only HTTP/2 with prior knowledge (h2c).
    pub fn http2_only(mut self) -> Builder {
        self.protocols = Protocols::Http2;
        self
    }

    /// The largest request body the server reads, in bytes (default
    /// [`DEFAULT_BODY_LIMIT`]). A larger request is recorded and answered
    /// `413 Payload Too Large` without consulting the script.
    pub fn body_limit(mut self, bytes: usize) -> Builder {
        self.body_limit = bytes;
        self
    }

    /// Binds `127.0.0.1:0` and starts serving on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub async fn start(self) -> io::Result<TestServer> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let (shutdown_tx, shutdown) = watch::channel(());

        let mut http = auto::Builder::new(Exec {
            shutdown: shutdown.clone(),
        });
        match self.protocols {
            Protocols::Both => {}
            Protocols::Http1 => http = http.http1_only(),
            Protocols::Http2 => http = http.http2_only(),
        }

        let shared = Arc::new(Shared {
            plan: self.script.compile(),
            record: Mutex::new(Record::default()),
            connections: AtomicUsize::new(0),
            body_limit: self.body_limit,
            shutdown: shutdown.clone(),
        });
        let accept = tokio::spawn(until_shutdown(
            shutdown,
            accept_loop(listener, Arc::new(http), shared.clone()),
        ))
        .abort_handle();

        Ok(TestServer {
            addr,
            shared,
            accept,
            _shutdown: shutdown_tx,
        })
    }
}

/// A scripted, fault-injecting HTTP/1.1 and HTTP/2 server on `127.0.0.1`.
///
/// Start it with [`TestServer::start`] or [`TestServer::builder`]; point a
/// client at [`uri`](TestServer::uri); then assert on what arrived
/// ([`arrivals`](TestServer::arrivals)) and what work was done
/// ([`effects`](TestServer::effects)).
///
/// Dropping it shuts it down: the listener closes and every connection and
/// request task ends (at its next poll), so hung requests do not outlive it.
pub struct TestServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
    /// Dropping it tells every task to end.
    _shutdown: watch::Sender<()>,
}

impl fmt::Debug for TestServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let record = self.shared.record();
        f.debug_struct("TestServer")
            .field("addr", &self.addr)
            .field("arrivals", &record.arrival_count)
            .field("effects", &record.total_effects)
            .field("connections", &self.connections())
            .finish_non_exhaustive()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        // Dropping `_shutdown` right after ends every other task.
        self.accept.abort();
    }
}

impl TestServer {
    /// A [`Builder`] with the default settings.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// Starts a server following `script` (same as
    /// `TestServer::builder().script(script).start()`).
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub async fn start(script: Script) -> io::Result<TestServer> {
        TestServer::builder().script(script).start().await
    }

    /// The address the server listens on (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>` followed by `path_and_query` (a leading `/`
    /// is added if missing).
    ///
    /// # Panics
    ///
    /// If `path_and_query` does not make a valid URI.
    #[track_caller]
    pub fn uri(&self, path_and_query: &str) -> Uri {
        let slash = if path_and_query.starts_with('/') {
            ""
        } else {
            "/"
        };
        let uri = format!("http://{}{slash}{path_and_query}", self.addr);
        match uri.parse() {
            Ok(uri) => uri,
            Err(error) => panic!("TestServer::uri: {uri:?} is not a valid URI: {error}"),
        }
    }

    /// A snapshot of the recorded arrivals, in arrival order.
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.shared.record().arrivals.clone()
    }

    /// Takes the recorded arrivals out, leaving none recorded.
    ///
    /// Counters ([`arrival_count`](TestServer::arrival_count),
    /// [`Arrival::attempt`], effects) are not reset. Long-running benchmarks
    /// can call this now and then to bound memory.
    pub fn take_arrivals(&self) -> Vec<Arrival> {
        std::mem::take(&mut self.shared.record().arrivals)
    }

    /// How many requests have arrived so far (including any taken out with
    /// [`take_arrivals`](TestServer::take_arrivals)).
    pub fn arrival_count(&self) -> usize {
        self.shared.record().arrival_count
    }

    /// How many effects were recorded for requests with this idempotency key
    /// (`None`: for requests without one).
    pub fn effects(&self, key: Option<&str>) -> usize {
        let record = self.shared.record();
        match key {
            None => record.keyless_effects,
            Some(key) => record.keyed_effects.get(key).copied().unwrap_or(0),
        }
    }

    /// How many effects were recorded in all.
    pub fn total_effects(&self) -> usize {
        self.shared.record().total_effects
    }

    /// How many TCP connections the server has accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::Relaxed)
    }
}

/// Accepts connections and spawns a task for each until shut down.
async fn accept_loop(listener: TcpListener, http: Arc<auto::Builder<Exec>>, shared: Arc<Shared>) {
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
