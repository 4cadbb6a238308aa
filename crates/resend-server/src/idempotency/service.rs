use std::borrow::Cow;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use super::request::{self, Key, IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED};
use super::response::{json_error, retry_later};
use crate::body::{read_capped, MaybeBuffered};
use crate::store::{Begin, LeaseToken, RecordKey, Store, StoreError, StoredResponse};
use crate::IdempotencyLayer;
use resend::BoxError;

/// Middleware that deduplicates requests by `Idempotency-Key`; see
/// [`IdempotencyLayer`].
#[derive(Clone, Debug)]
pub struct Idempotency<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

/// The store and the config, behind the one `Arc` that each clone of the
/// service (axum makes one per request) and each keyed request's future
/// count: one count changed per clone, not one per field. Aligned to 128
/// bytes, so that the store and config, read by every request, do not
/// share a cache line with the counts, which both cores write.
#[derive(Debug)]
#[repr(align(128))]
struct Shared<St> {
    store: St,
    config: Config,
}

impl<S, St: Store> Idempotency<S, St> {
    /// Wraps `inner` with the defaults of [`IdempotencyLayer::new`].
    pub fn new(inner: S, store: St) -> Self {
        tower_layer::Layer::layer(&IdempotencyLayer::new(store), inner)
    }

    /// An [`IdempotencyLayer`] over `store`.
    pub fn layer(store: St) -> IdempotencyLayer<St> {
        IdempotencyLayer::new(store)
    }

    pub(crate) fn from_parts(inner: S, store: St, config: Config) -> Self {
        Self {
            inner,
            shared: Arc::new(Shared { store, config }),
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, St, B, RB> Service<Request<B>> for Idempotency<S, St>
where
    S: Service<Request<MaybeBuffered<B>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + Unpin + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<MaybeBuffered<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        if request::is_idempotent(req.method()) {
            return ResponseFuture::passthrough(self.inner.call(req.map(MaybeBuffered::inner)));
        }
        let (parts, body) = req.into_parts();
        let key = match request::key(&parts) {
            Ok(Some(key)) => key,
            Ok(None) => {
                if self
                    .shared
                    .config
                    .require
                    .as_ref()
                    .is_some_and(|r| r(&parts))
                {
                    return ResponseFuture::ready(json_error(
                        StatusCode::BAD_REQUEST,
                        "idempotency_key_required",
                        "this request must carry an Idempotency-Key header",
                    ));
                }
                let req = Request::from_parts(parts, MaybeBuffered::inner(body));
                return ResponseFuture::passthrough(self.inner.call(req));
            }
            Err(reason) => {
                tracing::debug!(reason, "malformed idempotency key");
                return ResponseFuture::ready(json_error(
                    StatusCode::BAD_REQUEST,
                    "idempotency_key_invalid",
                    reason,
                ));
            }
        };
        // The readied service goes with the request; a clone stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let guard = LeaseGuard {
            shared: Arc::clone(&self.shared),
            scope: (self.shared.config.scope)(&parts),
            key,
            token: LeaseToken::random(),
            armed: false,
            done: None,
        };
        ResponseFuture::slow(Box::pin(run(inner, guard, parts, body)))
    }
}

/// Ends the lease if the request is dropped (cancelled) before it did:
/// drops it while the handler runs (the work is presumed not done), or
/// stores the response once the handler has answered (the work is done, and
/// must not run again).
struct LeaseGuard<St: Store> {
    shared: Arc<Shared<St>>,
    scope: Cow<'static, str>,
    key: Key,
    token: LeaseToken,
    armed: bool,
    done: Option<StoredResponse>,
}

impl<St: Store> LeaseGuard<St> {
    fn config(&self) -> &Config {
        &self.shared.config
    }

    fn record_key(&self) -> RecordKey<'_> {
        RecordKey {
            scope: &self.scope,
            key: self.key.as_str(),
        }
    }

    async fn release(&mut self) {
        self.armed = false;
        if let Err(e) = self
            .shared
            .store
            .release(&self.record_key(), &self.token)
            .await
        {
            tracing::warn!(error = %e, "could not drop an idempotency lease; it will expire");
        }
    }
}

impl<St: Store> Drop for LeaseGuard<St> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // The guard is going: its scope moves to the task; the `Arc` of the
        // store and the key (handles to shared data) are cloned.
        let scope = std::mem::take(&mut self.scope);
        let (shared, key) = (Arc::clone(&self.shared), self.key.clone());
        let (token, ttl) = (self.token, self.config().ttl);
        let done = self.done.take();
        tracing::debug!(
            key = key.as_str(),
            then = if done.is_some() {
                "storing the response of the work it did"
            } else {
                "dropping its idempotency lease"
            },
            "request cancelled"
        );
        handle.spawn(async move {
            let key = RecordKey {
                scope: &scope,
                key: key.as_str(),
            };
            match done {
                Some(done) => {
                    if let Err(e) = shared.store.complete(&key, &token, &done, ttl).await {
                        tracing::error!(error = %e, "could not store an idempotent response");
                    }
                }
                None => {
                    if let Err(e) = shared.store.release(&key, &token).await {
                        tracing::warn!(error = %e, "could not drop an idempotency lease; it will expire");
                    }
                }
            }
        });
    }
}

fn unavailable<B>(e: &StoreError) -> Response<MaybeBuffered<B>> {
    tracing::warn!(error = %e, "idempotency store unavailable: failing closed");
    retry_later(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency_store_unavailable",
        "the idempotency store cannot be reached; nothing was done",
        std::time::Duration::from_secs(1),
    )
}

/// `fut`, given up after `limit`. A store that answers on the first poll
/// (the memory store always does) costs no timer; the timer, armed on the
/// first `Pending`, lives in a box of its own, so a request's future does
/// not carry its room.
fn with_timeout<F, T>(limit: std::time::Duration, fut: F) -> WithTimeout<F>
where
    F: std::future::Future<Output = Result<T, StoreError>>,
{
    WithTimeout {
        fut,
        limit,
        timer: None,
    }
}

pin_project_lite::pin_project! {
    struct WithTimeout<F> {
        #[pin]
        fut: F,
        limit: std::time::Duration,
        timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<F, T> std::future::Future for WithTimeout<F>
where
    F: std::future::Future<Output = Result<T, StoreError>>,
{
    type Output = Result<T, StoreError>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        // The store first, the clock second: an answer that is ready wins.
        if let Poll::Ready(r) = this.fut.poll(cx) {
            return Poll::Ready(r);
        }
        let limit = *this.limit;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                Poll::Ready(Err(StoreError::new(format!("no answer within {limit:?}"))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Left out of stored responses: hop-by-hop headers and `content-length`.
/// (Matched on the name's text: a standard name's text is a table lookup,
/// and no array of names is built and dropped on every call.)
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
    )
}

/// The headers a response is stored with: a copy without the hop-by-hop
/// ones, made in one pass.
fn stored_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if !is_hop_by_hop(name) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// A keyed request, start to end: the body read and the lease taken
/// ([`lease`]), the handler run, its answer settled ([`settle`]). Its state is
/// what is boxed per request, so it is kept small (864 bytes on an axum
/// route, under the 1 KB that glibc's per-thread cache serves): a function
/// returning an async block (an `async fn` would hold each parameter twice),
/// the store, the scope and the key held once (in the guard), and the two ends in
/// futures of their own, each awaited once, so their state shares room with
/// the handler's future.
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
fn run<S, St, B, RB>(
    mut inner: S,
    mut guard: LeaseGuard<St>,
    parts: http::request::Parts,
    body: B,
) -> impl std::future::Future<Output = Result<Response<MaybeBuffered<RB>>, S::Error>> + Send
where
    S: Service<Request<MaybeBuffered<B>>, Response = Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send,
    St: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + Unpin + 'static,
    RB::Error: Into<BoxError>,
{
    // The guard comes unarmed (a drop does nothing until the lease is
    // taken); it holds the store and the key, once.
    async move {
        // (The body is read and the lease taken in a future of its own: its
        // state then does not take room in the states that follow.)
        let bytes = match lease(&mut guard, &parts, body).await {
            Leased::Acquired(bytes) => bytes,
            Leased::Answer(response) => return Ok(response),
        };
        let req = Request::from_parts(parts, MaybeBuffered::full(bytes));
        // (The handler's answer goes straight into a future of its own, and
        // is worked on there in place: it takes no room of its own here.)
        settle(&mut guard, inner.call(req).await).await
    }
}

/// What follows the handler's answer: the lease dropped on an error, a 5xx
/// or a 429; otherwise the response stored (its body read up to the cap)
/// and handed on. The answer is worked on where it lies, in this future's
/// state, and taken apart only once nothing is awaited any more.
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
fn settle<'a, St, RB, E>(
    guard: &'a mut LeaseGuard<St>,
    mut result: Result<Response<RB>, E>,
) -> impl std::future::Future<Output = Result<Response<MaybeBuffered<RB>>, E>> + Send + 'a
where
    St: Store,
    RB: Body<Data = Bytes> + Send + Unpin + 'static,
    RB::Error: Into<BoxError>,
    E: Send + 'a,
{
    async move {
        let resp = match &mut result {
            Ok(resp) => resp,
            Err(_) => {
                guard.release().await;
                return result.map(|resp| resp.map(MaybeBuffered::inner));
            }
        };
        let status = resp.status();
        if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
            guard.release().await;
            return result.map(|resp| resp.map(MaybeBuffered::inner));
        }
        // The work is done: from here on, cancellation must not drop the
        // lease (the next request would do the work again). Until the body
        // is read, a cancellation stores the status and headers.
        // Usually no header is hop-by-hop: then the response's own headers
        // are lent to the record while it is stored, and no copy is made.
        let lent = !resp.headers().keys().any(is_hop_by_hop);
        let headers = if lent {
            std::mem::take(resp.headers_mut())
        } else {
            stored_headers(resp.headers())
        };
        guard.done = Some(StoredResponse {
            status,
            headers,
            body: Bytes::new(),
            body_omitted: true,
        });
        let (bytes, ended) = match read_capped(resp.body_mut(), guard.config().response_cap).await {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(error = %e, "response body failed: dropping the idempotency lease");
                guard.done = None;
                guard.release().await;
                return Ok(json_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "response_body_failed",
                    "the response body failed",
                ));
            }
        };
        // The body is lent to the record too (a clone of `Bytes` made from
        // a `Vec` would allocate), and taken back below.
        let mut prefix = Bytes::new();
        match guard.done.as_mut() {
            Some(done) if ended => {
                done.body = bytes;
                done.body_omitted = false;
            }
            _ => prefix = bytes,
        }
        let stored = match &guard.done {
            Some(done) => {
                with_timeout(
                    guard.config().store_timeout,
                    guard.shared.store.complete(
                        &guard.record_key(),
                        &guard.token,
                        done,
                        guard.config().ttl,
                    ),
                )
                .await
            }
            None => Ok(()),
        };
        guard.armed = false;
        if let Err(e) = stored {
            // The lease stays until it expires: a retry meanwhile gets 409,
            // not a second run.
            tracing::error!(error = %e, key = guard.key.as_str(), "could not store an idempotent response");
        }
        let lent_back = guard.done.take();
        result.map(|resp| {
            let (mut parts, body) = resp.into_parts();
            if let Some(done) = lent_back {
                if lent {
                    parts.headers = done.headers;
                }
                if ended {
                    return Response::from_parts(parts, MaybeBuffered::full(done.body));
                }
            }
            // The body goes on past the cap (or, were the record gone, ended
            // with the bytes held here).
            Response::from_parts(parts, MaybeBuffered::chain(prefix, body))
        })
    }
}

/// What [`lease`] ends with: the lease taken, or an answer of the layer's
/// own.
enum Leased<RB> {
    Acquired(Bytes),
    Answer(Response<MaybeBuffered<RB>>),
}

/// Reads the request's body (up to the cap), and takes the lease on its key.
// An async block rather than an `async fn`: an `async fn` moves its
// parameters into locals of its own, which would hold their room twice.
#[allow(clippy::manual_async_fn)]
fn lease<'a, St, B, RB>(
    guard: &'a mut LeaseGuard<St>,
    parts: &'a http::request::Parts,
    body: B,
) -> impl std::future::Future<Output = Leased<RB>> + Send + 'a
where
    St: Store,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    async move {
        let mut body = std::pin::pin!(body);
        let bytes = match read_capped(&mut body, guard.config().request_cap).await {
            Ok((bytes, true)) => bytes,
            Ok((_, false)) => {
                return Leased::Answer(json_error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request_too_large",
                    &format!(
                        "a request with an idempotency key may have at most {} bytes of body",
                        guard.config().request_cap
                    ),
                ))
            }
            Err(e) => {
                tracing::debug!(error = %e, "request body failed");
                return Leased::Answer(json_error(
                    StatusCode::BAD_REQUEST,
                    "request_body_failed",
                    "the request body could not be read",
                ));
            }
        };
        let fingerprint = request::fingerprint(parts, &bytes);
        let begun = with_timeout(
            guard.config().store_timeout,
            guard.shared.store.begin(
                &guard.record_key(),
                fingerprint,
                &guard.token,
                guard.config().ttl,
            ),
        )
        .await;
        match begun {
            Err(e) => return Leased::Answer(unavailable(&e)),
            Ok(Begin::InProgress { fingerprint: fp })
            | Ok(Begin::Completed {
                fingerprint: fp, ..
            }) if fp != fingerprint => {
                return Leased::Answer(json_error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_reused",
                    "this idempotency key was used with another request (method, path or body differ)",
                ));
            }
            Ok(Begin::InProgress { .. }) => {
                return Leased::Answer(retry_later(
                    StatusCode::CONFLICT,
                    "idempotency_key_in_progress",
                    "a request with this idempotency key is in progress; retry later",
                    guard.config().retry_after,
                ));
            }
            Ok(Begin::Completed { response, .. }) => {
                tracing::debug!(key = guard.key.as_str(), "replaying a stored response");
                return Leased::Answer(replay(response));
            }
            Ok(Begin::Acquired) => {}
        }
        guard.armed = true;
        Leased::Acquired(bytes)
    }
}

fn replay<B>(stored: StoredResponse) -> Response<MaybeBuffered<B>> {
    let mut resp = Response::new(MaybeBuffered::full(stored.body));
    *resp.status_mut() = stored.status;
    *resp.headers_mut() = stored.headers;
    resp.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if stored.body_omitted {
        resp.headers_mut()
            .insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("true"));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;
    use http_body_util::{BodyExt, Full};
    use tower::{Layer, ServiceExt};

    /// A response with `content-length` and `extra` as headers, through the
    /// layer (response cap `cap`), then replayed.
    async fn first_and_replay(
        cap: usize,
        extra: Option<(&'static str, &'static str)>,
    ) -> [Response<MaybeBuffered<Full<Bytes>>>; 2] {
        let handler = tower::service_fn(move |_: Request<MaybeBuffered<Full<Bytes>>>| async move {
            let mut resp = Response::new(Full::new(Bytes::from_static(b"hello")));
            let h = resp.headers_mut();
            h.insert("content-type", HeaderValue::from_static("text/plain"));
            h.insert("content-length", HeaderValue::from_static("5"));
            h.insert("x-a", HeaderValue::from_static("1"));
            if let Some((n, v)) = extra {
                h.insert(n, HeaderValue::from_static(v));
            }
            Ok::<_, std::convert::Infallible>(resp)
        });
        let svc = IdempotencyLayer::new(MemoryStore::new())
            .response_cap(cap)
            .layer(handler);
        let req = || {
            Request::post("/x")
                .header("idempotency-key", "k")
                .body(Full::new(Bytes::new()))
                .unwrap()
        };
        let first = svc.clone().oneshot(req()).await.unwrap();
        let again = svc.oneshot(req()).await.unwrap();
        [first, again]
    }

    async fn body(resp: Response<MaybeBuffered<Full<Bytes>>>) -> Bytes {
        resp.into_body().collect().await.unwrap().to_bytes()
    }

    /// The handler's headers reach the first caller as it set them (its
    /// `content-length` as the body's exact size, which hyper writes), and
    /// the replay carries them without the hop-by-hop ones.
    #[tokio::test]
    async fn headers_reach_the_first_caller_and_the_replay() {
        let [first, again] = first_and_replay(1024, None).await;
        assert_eq!(first.headers()["content-type"], "text/plain");
        assert_eq!(first.headers()["x-a"], "1");
        assert_eq!(first.body().size_hint().exact(), Some(5));
        assert!(first
            .headers()
            .get("content-length")
            .is_none_or(|v| v == "5"));
        assert_eq!(body(first).await, "hello");
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["x-a"], "1");
        assert!(again.headers().get("content-length").is_none());
        assert_eq!(body(again).await, "hello");

        // Another hop-by-hop header: the first caller gets it, the replay
        // does not.
        let [first, again] = first_and_replay(1024, Some(("connection", "close"))).await;
        assert_eq!(first.headers()["connection"], "close");
        assert_eq!(first.headers()["content-length"], "5");
        assert_eq!(body(first).await, "hello");
        assert!(again.headers().get("connection").is_none());
        assert_eq!(again.headers()["x-a"], "1");
        assert_eq!(body(again).await, "hello");
    }

    /// A body past the cap goes on to the first caller whole, with the
    /// length the handler gave it.
    #[tokio::test]
    async fn a_body_past_the_cap_keeps_its_length() {
        let [first, again] = first_and_replay(3, None).await;
        assert_eq!(first.headers()["content-length"], "5");
        assert_eq!(first.headers()["x-a"], "1");
        assert_eq!(body(first).await, "hello");
        assert_eq!(again.headers()["idempotent-body-omitted"], "true");
        assert_eq!(body(again).await, "");
    }

    /// A store that counts its clones.
    #[derive(Debug)]
    struct Counted(MemoryStore, std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Clone for Counted {
        fn clone(&self) -> Self {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Self(self.0.clone(), self.1.clone())
        }
    }

    impl Store for Counted {
        fn begin(
            &self,
            key: &RecordKey<'_>,
            fingerprint: crate::store::Fingerprint,
            token: &LeaseToken,
            ttl: crate::store::Ttl,
        ) -> impl std::future::Future<Output = Result<Begin, StoreError>> + Send {
            self.0.begin(key, fingerprint, token, ttl)
        }

        fn complete(
            &self,
            key: &RecordKey<'_>,
            token: &LeaseToken,
            response: &StoredResponse,
            ttl: crate::store::Ttl,
        ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
            self.0.complete(key, token, response, ttl)
        }

        fn release(
            &self,
            key: &RecordKey<'_>,
            token: &LeaseToken,
        ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
            self.0.release(key, token)
        }
    }

    /// Neither a clone of the service (axum makes one per request) nor a
    /// keyed request clones the store: both share the layer's one `Arc`.
    #[tokio::test]
    async fn requests_and_service_clones_share_the_store() {
        let clones = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let store = Counted(MemoryStore::new(), clones.clone());
        let handler = tower::service_fn(|_: Request<MaybeBuffered<Full<Bytes>>>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        let svc = IdempotencyLayer::new(store).layer(handler);
        let before = clones.load(std::sync::atomic::Ordering::Relaxed);
        for i in 0..10 {
            let req = Request::post("/x")
                .header("idempotency-key", format!("k{i}"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = svc.clone().oneshot(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
        }
        assert_eq!(clones.load(std::sync::atomic::Ordering::Relaxed), before);
    }

    #[test]
    fn stored_headers_leave_out_hop_by_hop_ones_only() {
        let mut h = HeaderMap::new();
        for (n, v) in [
            ("connection", "keep-alive"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "close"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("trailer", "x-sum"),
            ("upgrade", "h2c"),
            ("content-length", "3"),
            ("content-type", "text/plain"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("x-custom", "yes"),
        ] {
            h.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let mut want = HeaderMap::new();
        for (n, v) in [
            ("content-type", "text/plain"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("x-custom", "yes"),
        ] {
            want.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        assert_eq!(stored_headers(&h), want);
    }
}
