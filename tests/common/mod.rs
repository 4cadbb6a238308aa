//! Helpers shared by the loopback test suites: clients, requests, a streamed
//! request body, and a guard that keeps every test bounded in time.

#[macro_use]
mod suite;
#[cfg(feature = "tonic")]
pub(crate) mod grpc;
#[allow(unused_imports, clippy::single_component_path_imports)]
// a path to the macro; see suite.rs
pub(crate) use http_behaviour_suite;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::task::JoinSet;
use tower::ServiceExt;

use bytes::Bytes;
use http::{Method, Request, Response, Uri};
use http_body::{Body, Frame};
use http_body_util::Full;
use tower_resend::retry::Attempts;

/// The connect timeout of every test client.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The hyper-util client of the composed stack for in-memory bodies.
pub(crate) type Transport = tower_resend::connect::HyperClient;

/// `tower_resend::hyper_client` for requests with an in-memory body.
pub(crate) fn transport() -> Transport {
    tower_resend::hyper_client(CONNECT_TIMEOUT)
}

/// The stack under test with the DESIGN defaults spelled out, named and
/// seeded so that every run draws the same jitter.
pub(crate) fn stack() -> tower_resend::stack::StackBuilder {
    tower_resend::stack()
        .name("upstream")
        .total(Duration::from_secs(10))
        .attempt_timeout(Duration::from_secs(5))
        .max_attempts(3)
        .seed(7)
}

/// A request with an in-memory body.
pub(crate) fn request(method: Method, uri: Uri, body: &'static [u8]) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(uri)
        .body(Full::new(Bytes::from_static(body)))
        .expect("a valid request")
}

/// A GET without a body.
pub(crate) fn get(uri: Uri) -> Request<Full<Bytes>> {
    request(Method::GET, uri, b"")
}

/// A POST with a small body and no Idempotency-Key.
pub(crate) fn post(uri: Uri) -> Request<Full<Bytes>> {
    request(Method::POST, uri, b"amount=100")
}

/// The attempt history a response carries.
pub(crate) fn attempts<B>(resp: &Response<B>) -> &Attempts {
    resp.extensions()
        .get::<Attempts>()
        .expect("every response through a retry layer carries Attempts")
}

/// Fails the test instead of hanging if `fut` does not complete within 10
/// minutes of the paused clock (an instant of real time).
pub(crate) async fn within<F: Future>(fut: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(600), fut)
        .await
        .expect("the test did not finish within 600 s of paused time")
}

/// Lets the paused clock run for `d`, so that anything still scheduled (a
/// retry in the background) would show up at the server.
pub(crate) async fn idle(d: Duration) {
    tokio::time::sleep(d).await;
}

/// A port on 127.0.0.1 that nothing listens on: bound, then closed.
pub(crate) fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local address").port()
}

/// `n` distinct addresses on 127.0.0.1 that nothing listens on: bound
/// together (so that no two are the same), then closed.
pub(crate) fn closed_addrs(n: usize) -> Vec<std::net::SocketAddr> {
    let listeners: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local address"))
        .collect()
}

/// A request body streamed in chunks, with a `Pending` between chunks so that
/// it really streams (no size hint: sent chunked over HTTP/1.1).
#[derive(Debug)]
pub(crate) struct Chunks {
    chunks: VecDeque<Bytes>,
    pause: bool,
}

impl Chunks {
    /// `count` chunks of `size` bytes; every byte depends on its position,
    /// so a reordered or truncated replay cannot compare equal.
    pub(crate) fn new(count: usize, size: usize) -> Self {
        let chunks = (0..count)
            .map(|c| {
                (0..size)
                    .map(|i| ((c * size + i) % 251) as u8)
                    .collect::<Vec<u8>>()
                    .into()
            })
            .collect();
        Self {
            chunks,
            pause: true,
        }
    }

    /// Everything the body will yield, in one piece.
    pub(crate) fn concat(&self) -> Bytes {
        self.chunks.iter().flatten().copied().collect()
    }
}

/// A stream body of the caller's own: kept for replays by the stack as a
/// `ReplayBody`, up to its cap.
impl tower_resend::body::Replay for Chunks {
    type Sent = tower_resend::body::ReplayBody<Self>;

    fn keep(self, cap: usize) -> Self::Sent {
        tower_resend::body::ReplayBody::new(self, cap)
    }

    fn send_once(self) -> Self::Sent {
        tower_resend::body::ReplayBody::once(self)
    }

    fn try_copy(&self) -> Option<Self> {
        None
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if this.pause && !this.chunks.is_empty() {
            this.pause = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        this.pause = true;
        Poll::Ready(this.chunks.pop_front().map(|c| Ok(Frame::data(c))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }
}

/// `calls` calls, 20 at a time, each of `request(n)` through `stack`, each
/// response looked at by `look(n, &response)` (every call must succeed):
/// what each took, and what `look` said of it, sorted by the time taken.
#[allow(dead_code)] // the load-shaped suites' (fleet, hedge)
pub(crate) async fn in_parallel<S, RB, T>(
    stack: S,
    calls: usize,
    request: impl Fn(usize) -> Request<Full<Bytes>> + Clone + Send + 'static,
    look: impl Fn(usize, &Response<RB>) -> T + Clone + Send + 'static,
) -> Vec<(Duration, T)>
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Error: std::fmt::Debug + Send,
    S::Future: Send,
    RB: Send + 'static,
    T: Send + 'static,
{
    const TASKS: usize = 20;
    let mut set = JoinSet::new();
    for t in 0..TASKS {
        let (stack, request, look) = (stack.clone(), request.clone(), look.clone());
        set.spawn(async move {
            let mut out = Vec::new();
            for n in (t..calls).step_by(TASKS) {
                let started = tokio::time::Instant::now();
                let resp = stack
                    .clone()
                    .oneshot(request(n))
                    .await
                    .unwrap_or_else(|e| panic!("call {n}: {e:?}"));
                out.push((started.elapsed(), look(n, &resp)));
            }
            out
        });
    }
    let mut all = Vec::with_capacity(calls);
    while let Some(done) = set.join_next().await {
        all.extend(done.expect("the task"));
    }
    all.sort_by_key(|(took, _)| *took);
    all
}
