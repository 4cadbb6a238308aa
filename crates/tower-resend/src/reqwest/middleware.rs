//! tower-resend's stack around reqwest's own calls: [`ResendMiddleware`].

use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use http::{Request, Response};
use tokio::sync::mpsc;
use tower_service::Service;

use super::handoff::{take_buffered, Buffered, Dispatch, Handoff, Job, Reply};
use crate::breaker::BreakerSlot;
use crate::deadline::DeadlineHeader;
use crate::error::{BoxError, Error};
use crate::fleet::NoFleet;
use crate::hedge::HedgeSlot;
use crate::quota::PaceSlot;
use crate::read_ahead::ReadAhead;
use crate::stack::Stack;
use crate::stack::StackBuilder;
use crate::timeout::AttemptTimeout;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// One call of the stack, its types erased.
type Call = dyn Fn(Request<::reqwest::Body>) -> BoxFuture<Result<Response<::reqwest::Body>, Error>>
    + Send
    + Sync;

/// tower-resend's whole stack around reqwest's own calls: a
/// `reqwest_middleware::Middleware` (feature `reqwest-middleware`) for a
/// `ClientWithMiddleware`, or, with reqwest alone,
/// [`send_with`](RequestBuilderExt::send_with) and [`execute`](Self::execute).
///
/// Built from a [`tower_resend::stack()`](crate::stack()) builder, it runs the
/// same layers as [`Stack`] — the deadline, the Idempotency-Key (if the
/// builder has [`idempotency_keys`](StackBuilder::idempotency_keys)), the
/// retries with their classification, decision table, budget, backoff and
/// `Retry-After`, the circuit breaker if any, the attempt timeout — and each
/// attempt goes through the rest of the middleware chain (`next`) or the
/// client. Clones share one stack: one retry budget, one breaker.
///
/// See the [module docs](super) for bodies, errors, extensions and how to
/// set up the client.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::reqwest::ResendMiddleware;
///
/// let shipping = ResendMiddleware::new(
///     tower_resend::stack()
///         .name("shipping")
///         .total(Duration::from_secs(10))
///         .attempt_timeout(Duration::from_secs(5))
///         .idempotency_keys(),
/// );
/// // The same, from the builder.
/// let billing = tower_resend::stack().name("billing").reqwest_middleware();
/// # let _ = (shipping, billing);
/// ```
#[derive(Clone)]
pub struct ResendMiddleware {
    call: Arc<Call>,
}

impl fmt::Debug for ResendMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResendMiddleware").finish_non_exhaustive()
    }
}

impl ResendMiddleware {
    /// Builds the stack `stack` describes, once, around the [`Handoff`]
    /// that passes each attempt on to reqwest.
    pub fn new<C, B, H, P, RB>(stack: StackBuilder<C, B, NoFleet, H, P>) -> Self
    where
        B: BreakerSlot,
        H: HedgeSlot,
        P: PaceSlot,
        H::Service<P::Service<DeadlineHeader<AttemptTimeout<ReadAhead<Handoff>>>>, C>: Clone,
        C: Clone,
        Stack<Handoff, C, B, NoFleet, H, P>: Service<Request<::reqwest::Body>, Response = Response<RB>, Error = Error>
            + Clone
            + Send
            + Sync
            + 'static,
        <Stack<Handoff, C, B, NoFleet, H, P> as Service<Request<::reqwest::Body>>>::Future:
            Send + 'static,
        RB: http_body::Body + Send + Sync + 'static,
        RB::Data: Into<Bytes>,
        RB::Error: Into<BoxError>,
    {
        let stack = stack.service(Handoff::new());
        let call = move |req: Request<::reqwest::Body>| -> BoxFuture<_> {
            let mut stack = stack.clone();
            Box::pin(async move {
                poll_fn(|cx| stack.poll_ready(cx)).await?;
                let resp = stack.call(req).await?;
                Ok(resp.map(::reqwest::Body::wrap))
            })
        };
        Self {
            call: Arc::new(call),
        }
    }

    /// Sends `req` through the stack with `client`: every attempt is
    /// `client.execute(..)`. The direct way, without reqwest-middleware; see
    /// also [`RequestBuilderExt::send_with`].
    ///
    /// # Errors
    ///
    /// The [`tower_resend::Error`](Error) of the call: what went wrong, where,
    /// after how many attempts, with the last cause (a `reqwest::Error`, say)
    /// as its [`source`](std::error::Error::source).
    ///
    /// ```no_run
    /// use tower_resend::reqwest::{client_builder, ResendMiddleware};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = client_builder(std::time::Duration::from_secs(2)).build()?;
    /// let shipping = ResendMiddleware::new(tower_resend::stack().name("shipping"));
    ///
    /// let req = client.get("http://shipping.internal/parcels/7").build()?;
    /// let resp = shipping.execute(&client, req).await?;
    /// println!("{}", resp.text().await?);
    /// # Ok(()) }
    /// ```
    pub async fn execute(
        &self,
        client: &::reqwest::Client,
        req: ::reqwest::Request,
    ) -> Result<::reqwest::Response, Error> {
        let req = Request::try_from(req).map_err(|e| Error::connect(Box::new(e)))?;
        let (result, _) = self
            .run(req, http::Extensions::new(), |req| {
                let pending = client.execute(req);
                async move { (pending.await.map_err(super::map_error), ()) }
            })
            .await;
        result.map(::reqwest::Response::from)
    }

    /// Runs the stack on `req`, with `extensions` added to it, and sends each
    /// attempt with `send`; the result and what the last attempt to finish
    /// gave back besides its answer.
    async fn run<F, Fut, T>(
        &self,
        mut req: Request<::reqwest::Body>,
        extensions: http::Extensions,
        send: F,
    ) -> (Result<Response<::reqwest::Body>, Error>, Option<T>)
    where
        F: FnMut(::reqwest::Request) -> Fut,
        Fut: Future<Output = (Result<::reqwest::Response, BoxError>, T)>,
    {
        let (jobs_tx, jobs) = mpsc::unbounded_channel();
        let ext = req.extensions_mut();
        ext.extend(extensions);
        ext.insert(Dispatch(jobs_tx));
        if let Some(bytes) = take_buffered(req.body_mut()).filter(|b| !b.is_empty()) {
            req.extensions_mut().insert(Buffered(bytes));
        }
        drive((self.call)(req), jobs, send).await
    }
}

/// Polls the stack's call and the attempt in flight together, in this task:
/// the attempt first, so that an answer that is ready wins a tie with the
/// stack's timers; an attempt the stack gave up on (its timeout fired) is
/// dropped at once, which closes its connection.
async fn drive<F, Fut, T>(
    mut call: BoxFuture<Result<Response<::reqwest::Body>, Error>>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    mut send: F,
) -> (Result<Response<::reqwest::Body>, Error>, Option<T>)
where
    F: FnMut(::reqwest::Request) -> Fut,
    Fut: Future<Output = (Result<::reqwest::Response, BoxError>, T)>,
{
    let mut attempt = pin!(None::<Fut>);
    let mut reply: Option<tokio::sync::oneshot::Sender<Reply>> = None;
    let mut last = None;
    poll_fn(move |cx| loop {
        if let Some(fut) = attempt.as_mut().as_pin_mut() {
            if let Poll::Ready((result, t)) = fut.poll(cx) {
                attempt.set(None);
                last = Some(t);
                if let Some(tx) = reply.take() {
                    // The stack may have stopped waiting; then nobody minds.
                    let _ = tx.send(result.map(into_http));
                }
            }
        }
        if let Poll::Ready(result) = call.as_mut().poll(cx) {
            return Poll::Ready((result, last.take()));
        }
        if reply.as_ref().is_some_and(|tx| tx.is_closed()) {
            // The stack dropped the attempt (its timeout fired): stop it.
            attempt.set(None);
            reply = None;
        }
        match jobs.poll_recv(cx) {
            Poll::Ready(Some((req, tx))) => {
                // One attempt at a time: a newer one replaces any left.
                attempt.set(Some(send(req)));
                reply = Some(tx);
            }
            Poll::Ready(None) | Poll::Pending => return Poll::Pending,
        }
    })
    .await
}

/// A reqwest response as the stack sees it, its URL kept for the way back.
fn into_http(resp: ::reqwest::Response) -> Response<::reqwest::Body> {
    use ::reqwest::ResponseBuilderExt;

    let url = resp.url().clone();
    let mut resp = Response::from(resp);
    if let Ok(marker) = Response::builder().url(url).body(()) {
        resp.extensions_mut()
            .extend(marker.into_parts().0.extensions);
    }
    resp
}

impl<C, B, H, P> StackBuilder<C, B, NoFleet, H, P> {
    /// This stack as a [`ResendMiddleware`]: around reqwest's own calls,
    /// for a `reqwest_middleware::ClientWithMiddleware` or
    /// [`send_with`](RequestBuilderExt::send_with). The same as
    /// [`ResendMiddleware::new`]`(self)`.
    ///
    /// ```
    /// let shipping = tower_resend::stack().name("shipping").reqwest_middleware();
    /// # let _ = shipping;
    /// ```
    pub fn reqwest_middleware<RB>(self) -> ResendMiddleware
    where
        B: BreakerSlot,
        H: HedgeSlot,
        P: PaceSlot,
        H::Service<P::Service<DeadlineHeader<AttemptTimeout<ReadAhead<Handoff>>>>, C>: Clone,
        C: Clone,
        Stack<Handoff, C, B, NoFleet, H, P>: Service<Request<::reqwest::Body>, Response = Response<RB>, Error = Error>
            + Clone
            + Send
            + Sync
            + 'static,
        <Stack<Handoff, C, B, NoFleet, H, P> as Service<Request<::reqwest::Body>>>::Future:
            Send + 'static,
        RB: http_body::Body + Send + Sync + 'static,
        RB::Data: Into<Bytes>,
        RB::Error: Into<BoxError>,
    {
        ResendMiddleware::new(self)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for ::reqwest::RequestBuilder {}
}

/// Sends a [`reqwest::RequestBuilder`] through a [`ResendMiddleware`], with
/// the builder's own client: the direct way, without reqwest-middleware.
///
/// Sealed: implemented for `reqwest::RequestBuilder` only.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_resend::reqwest::{client_builder, RequestBuilderExt};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = client_builder(Duration::from_secs(2)).build()?;
/// let shipping = tower_resend::stack().name("shipping").idempotency_keys().reqwest_middleware();
///
/// let resp = client
///     .post("http://shipping.internal/shipments")
///     .body(r#"{"order":42}"#)
///     .send_with(&shipping)
///     .await?;
/// println!("{}", resp.text().await?);
/// # Ok(()) }
/// ```
pub trait RequestBuilderExt: sealed::Sealed {
    /// Builds the request and sends it through `tower-resend`'s stack with the
    /// builder's client, like [`send`](reqwest::RequestBuilder::send) but
    /// with every attempt bounded and retried as the stack says.
    ///
    /// # Errors
    ///
    /// The [`tower_resend::Error`](Error) of the call. A request the builder
    /// could not build is not sent: a [`Transport`](crate::ErrorKind::Transport)
    /// error, [not sent](Error::is_not_sent), with reqwest's error as its
    /// source.
    fn send_with(
        self,
        resend: &ResendMiddleware,
    ) -> impl Future<Output = Result<::reqwest::Response, Error>> + Send;
}

impl RequestBuilderExt for ::reqwest::RequestBuilder {
    fn send_with(
        self,
        resend: &ResendMiddleware,
    ) -> impl Future<Output = Result<::reqwest::Response, Error>> + Send {
        let (client, req) = self.build_split();
        async move {
            let req = req.map_err(|e| Error::connect(Box::new(e)))?;
            resend.execute(&client, req).await
        }
    }
}

#[cfg(feature = "reqwest-middleware")]
mod with_middleware {
    use super::*;
    use reqwest_middleware::{Middleware, Next};

    impl ResendMiddleware {
        async fn handle_next(
            &self,
            req: ::reqwest::Request,
            extensions: &mut http::Extensions,
            next: Next<'_>,
        ) -> reqwest_middleware::Result<::reqwest::Response> {
            let req = Request::try_from(req)
                .map_err(|e| reqwest_middleware::Error::middleware(Error::connect(Box::new(e))))?;
            let base = &*extensions;
            let (result, last) = self
                .run(req, base.clone(), |req| {
                    let next = next.clone();
                    let mut ext = base.clone();
                    async move {
                        let result = next.run(req, &mut ext).await.map_err(from_next);
                        (result, ext)
                    }
                })
                .await;
            // What the chain below wrote into the extensions, as if this
            // middleware were not there (from the last attempt).
            if let Some(ext) = last {
                *extensions = ext;
            }
            result
                .map(::reqwest::Response::from)
                .map_err(reqwest_middleware::Error::middleware)
        }
    }

    /// Runs the tower-resend stack around the rest of the chain: see
    /// [`ResendMiddleware`]. Its errors are
    /// `reqwest_middleware::Error::Middleware` holding a
    /// [`tower_resend::Error`](Error); [`resend_error`](super::super::resend_error)
    /// finds it.
    impl Middleware for ResendMiddleware {
        fn handle<'life0, 'life1, 'life2, 'async_trait>(
            &'life0 self,
            req: ::reqwest::Request,
            extensions: &'life1 mut http::Extensions,
            next: Next<'life2>,
        ) -> Pin<
            Box<
                dyn Future<Output = reqwest_middleware::Result<::reqwest::Response>>
                    + Send
                    + 'async_trait,
            >,
        >
        where
            'life0: 'async_trait,
            'life1: 'async_trait,
            'life2: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(self.handle_next(req, extensions, next))
        }
    }

    /// What the chain below said, as the stack classifies errors.
    fn from_next(e: reqwest_middleware::Error) -> BoxError {
        match e {
            reqwest_middleware::Error::Reqwest(e) => super::super::map_error(e),
            reqwest_middleware::Error::Middleware(e) => match e.downcast::<Error>() {
                Ok(ours) => Box::new(ours),
                Err(e) => match e.downcast::<::reqwest::Error>() {
                    Ok(e) => super::super::map_error(e),
                    Err(e) => e.into(),
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::error::ErrorKind;

    /// Counts the attempts alive.
    struct Live(Arc<AtomicUsize>);

    impl Drop for Live {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_attempt_the_stack_gave_up_on_is_dropped_before_the_next() {
        let resend = crate::stack()
            .attempt_timeout(Duration::from_secs(1))
            .max_attempts(2)
            .no_budget()
            .seed(1)
            .reqwest_middleware();
        let live = Arc::new(AtomicUsize::new(0));
        let (mut calls, mut most) = (0, 0);
        let req = Request::get("http://up.invalid/x")
            .body(::reqwest::Body::default())
            .unwrap();

        let (result, _) = resend
            .run(req, http::Extensions::new(), |_req| {
                calls += 1;
                most = most.max(live.fetch_add(1, Ordering::SeqCst) + 1);
                let guard = Live(Arc::clone(&live));
                async move {
                    let _guard = guard;
                    std::future::pending::<(Result<::reqwest::Response, BoxError>, ())>().await
                }
            })
            .await;

        let err = result.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::RetriesExhausted, "{err}");
        assert_eq!((calls, most), (2, 1));
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn each_attempt_has_the_stacks_head_and_the_body_in_memory() {
        let resend = crate::stack().idempotency_keys().reqwest_middleware();
        let req = Request::post("http://up.invalid/charges")
            .body(::reqwest::Body::from("amount=100"))
            .unwrap();

        let (result, seen) = resend
            .run(req, http::Extensions::new(), |req| {
                let key = req.headers().get("idempotency-key").cloned();
                let body = req.body().and_then(|b| b.as_bytes()).map(<[u8]>::to_vec);
                let resp = http::Response::builder().status(200).body("ok").unwrap();
                std::future::ready((Ok(::reqwest::Response::from(resp)), (key, body)))
            })
            .await;

        assert_eq!(result.unwrap().status(), 200);
        let (key, body) = seen.unwrap();
        assert!(key.is_some(), "the stack's key on the attempt");
        // A body in memory reaches reqwest as it was: still in memory.
        assert_eq!(body.as_deref(), Some(&b"amount=100"[..]));
    }
}
