//! The response future of [`Hedge`](super::Hedge): the first copy polled
//! in place, and, for a hedged call, the copies in flight polled together
//! while backups go out as the rules of [`HedgeLayer`](super::HedgeLayer)
//! say.
//!
//! Written by hand, like the retry layer's, rather than as a boxed `async`
//! block: boxing one needs `S::Future: Send` in the layer's `Service`
//! impl, and that bound made stacks nested in stacks take rustc minutes
//! to type-check.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderName, Request, Response};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::rules::{in_time, on_answer, room_for_backup, OnAnswer};
use super::{Delay, Hedged, Shared};
use crate::body::Replay;
use crate::classify::{Class, Classify, RequestFacts};
use crate::deadline::Deadline;
use crate::error::{refused_below, BoxError};
use crate::retry::{announce, announced};

pin_project_lite::pin_project! {
    /// Response future of [`Hedge`](super::Hedge).
    pub struct ResponseFuture<F, S, B, C, R> {
        #[pin]
        state: State<F, S, B, C, R>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F, S, B, C, R> {
        // Not hedged: the one copy.
        Direct { #[pin] inner: F },
        // Hedged: the copies, polled together.
        Hedged { inner: Box<HedgedCall<F, S, B, C, R>> },
    }
}

impl<F, S, B, C, R> ResponseFuture<F, S, B, C, R> {
    pub(super) fn direct(inner: F) -> Self {
        Self {
            state: State::Direct { inner },
        }
    }

    /// The call whose `first` copy is sent, and whose backups `svc` sends.
    pub(super) fn hedged(first: F, svc: S, template: Template<B>, shared: Arc<Shared<C>>) -> Self {
        let due = Box::pin(tokio::time::sleep(shared.after()));
        // The request's deadline and the ambient one: no backup goes out
        // after it (a timeout layer below, seeing a retry layer in charge,
        // does not check it again).
        let deadline = Deadline::of(&template.extensions);
        let inner = Box::new(HedgedCall {
            deadline,
            copies: vec![(1, Box::pin(first))],
            svc,
            template,
            shared,
            start: Instant::now(),
            sent: 1,
            more: true,
            due,
            waiting: None,
            last: None,
        });
        Self {
            state: State::Hedged { inner },
        }
    }
}

impl<F, S, B, C, R> std::fmt::Debug for ResponseFuture<F, S, B, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hedged = matches!(self.state, State::Hedged { .. });
        f.debug_struct("ResponseFuture")
            .field("hedged", &hedged)
            .finish()
    }
}

impl<F, S, B, C, R, E> Future for ResponseFuture<F, S, B, C, R>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
    S: Service<Request<B>, Response = Response<R>, Future = F, Error = E>,
    C: Classify<R>,
    B: Replay,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Direct { inner } => inner.poll(cx).map_err(Into::into),
            StateProj::Hedged { inner } => inner.poll(cx),
        }
    }
}

/// A request's head and a body to copy.
pub(super) struct Template<B> {
    method: http::Method,
    uri: http::Uri,
    version: http::Version,
    headers: http::HeaderMap,
    extensions: http::Extensions,
    body: B,
    /// How many attempts came before this one (the retry layer's count).
    previous: u32,
    attempt_header: Option<HeaderName>,
}

impl<B: Replay> Template<B> {
    pub(super) fn of(req: &Request<B>, attempt_header: Option<&HeaderName>) -> Option<Self> {
        Some(Self {
            previous: announced(req.headers(), attempt_header),
            attempt_header: attempt_header.cloned(),
            method: req.method().clone(),
            uri: req.uri().clone(),
            version: req.version(),
            headers: req.headers().clone(),
            extensions: req.extensions().clone(),
            body: req.body().try_copy()?,
        })
    }

    /// Copy `n` (2 for the first backup), which says how many attempts
    /// and copies came before it.
    fn copy(&self, n: u32) -> Option<Request<B>> {
        let mut req = Request::new(self.body.try_copy()?);
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers.clone();
        *req.extensions_mut() = self.extensions.clone();
        let before = self.previous.saturating_add(n - 1);
        announce(&mut req, before, self.attempt_header.as_ref());
        Some(req)
    }

    fn facts(&self) -> RequestFacts<'_> {
        RequestFacts::new(&self.method, &self.uri, &self.headers)
    }
}

/// A hedged call: the copies in flight, and what decides the next.
struct HedgedCall<F, S, B, C, R> {
    /// (copy number, its future), the copies in flight.
    copies: Vec<(u32, Pin<Box<F>>)>,
    svc: S,
    template: Template<B>,
    shared: Arc<Shared<C>>,
    start: Instant,
    deadline: Option<Deadline>,
    /// Copies sent so far.
    sent: u32,
    /// More copies may go out when `due` fires.
    more: bool,
    due: Pin<Box<Sleep>>,
    /// The next copy, made and waiting for the service to be ready.
    waiting: Option<Request<B>>,
    /// The last copy's answer while the copy after it waits for the
    /// service: the call's, if that one cannot be sent.
    last: Option<(u32, Result<Response<R>, BoxError>, Class)>,
}

impl<F, S, B, C, R, E> HedgedCall<F, S, B, C, R>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
    S: Service<Request<B>, Response = Response<R>, Future = F, Error = E>,
    C: Classify<R>,
    B: Replay,
{
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Response<R>, BoxError>> {
        loop {
            if let Some(req) = self.waiting.take() {
                self.poll_send(cx, req);
            }
            if self.waiting.is_none() && self.copies.is_empty() {
                // The copy after the last answer could not be sent.
                if let Some((n, result, class)) = self.last.take() {
                    return Poll::Ready(self.end(n, result, class));
                }
            }
            let (n, result) = match self.poll_copies(cx) {
                Poll::Pending => return Poll::Pending,
                // Time for a backup.
                Poll::Ready(None) => {
                    self.next_copy();
                    continue;
                }
                Poll::Ready(Some(ended)) => ended,
            };
            let c = {
                let facts = self.template.facts();
                match &result {
                    Ok(resp) => self.shared.classifier.classify_response(&facts, resp),
                    Err(e) => self.shared.classifier.classify_error(&facts, &**e),
                }
            };
            // A copy refused below (every circuit open, the fleet at
            // capacity) sent nothing, and a backup now would be refused too.
            let refused = c.class() == Class::NotSent
                && result
                    .as_ref()
                    .err()
                    .is_some_and(|e| refused_below(&**e).is_some());
            match on_answer(c.class(), c.pushback().is_some() || refused) {
                OnAnswer::End => {
                    if let Delay::Percentile { p, .. } = self.shared.delay {
                        self.shared.latency.record(self.start.elapsed(), p);
                    }
                    return Poll::Ready(self.end(n, result, c.class()));
                }
                OnAnswer::GoOn { backup } => self.more &= backup,
            }
            if self.more && self.waiting.is_none() {
                self.next_copy();
            }
            if self.waiting.is_some() {
                self.last = Some((n, result, c.class()));
            } else if self.copies.is_empty() {
                return Poll::Ready(self.end(n, result, c.class()));
            }
        }
    }

    /// The copy in flight that ended, and its answer; `None` when a backup
    /// is due.
    #[allow(clippy::type_complexity)]
    fn poll_copies(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<(u32, Result<Response<R>, BoxError>)>> {
        for i in 0..self.copies.len() {
            if let Poll::Ready(result) = self.copies[i].1.as_mut().poll(cx) {
                let (n, _) = self.copies.swap_remove(i);
                return Poll::Ready(Some((n, result.map_err(Into::into))));
            }
        }
        if self.more && self.waiting.is_none() && self.due.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Poll::Pending
    }

    /// Makes the next copy, if the copies, the budgets (the backups' share
    /// of the calls, then the retry budget) and the body allow one; it goes
    /// out once the service is ready.
    fn next_copy(&mut self) {
        let shared = &self.shared;
        let allowed = room_for_backup(self.sent, shared.max_copies)
            && shared.share.withdraw().is_some()
            && shared
                .budget
                .as_ref()
                .is_none_or(|b| b.withdraw().is_some());
        self.waiting = allowed.then(|| self.template.copy(self.sent + 1)).flatten();
        if self.waiting.is_none() {
            self.more = false;
        }
    }

    /// Sends `req` if the service is ready; keeps it waiting if not yet,
    /// and sends no more copies if the service failed.
    fn poll_send(&mut self, cx: &mut Context<'_>, req: Request<B>) {
        let now = match self.svc.poll_ready(cx) {
            Poll::Ready(Ok(())) => {
                let now = Instant::now();
                if !in_time(self.deadline, now) {
                    self.more = false;
                    return;
                }
                self.sent += 1;
                self.copies.push((self.sent, Box::pin(self.svc.call(req))));
                self.more = room_for_backup(self.sent, self.shared.max_copies);
                self.last = None;
                now
            }
            Poll::Ready(Err(_)) => {
                self.more = false;
                return;
            }
            // (The timer for the next backup starts once this one is sent.)
            Poll::Pending => {
                self.waiting = Some(req);
                return;
            }
        };
        self.due.as_mut().reset(now + self.shared.after());
    }

    /// The call's answer: copy `n`'s, with what hedging did.
    fn end(
        &self,
        n: u32,
        result: Result<Response<R>, BoxError>,
        class: Class,
    ) -> Result<Response<R>, BoxError> {
        let sent = self.sent;
        self.shared.metrics.hedged(sent, n);
        if sent > 1 {
            // On the attempt's span (entered while the copies are polled):
            // how many copies went, and which one answered.
            let span = tracing::Span::current();
            span.record("resend.hedge.sent", i64::from(sent));
            span.record("resend.hedge.won", i64::from(n));
            tracing::debug!(sent, won = n, class = class.as_str(), "hedged call ended");
        }
        result.map(|mut resp| {
            resp.extensions_mut().insert(Hedged { sent, won: n });
            resp
        })
    }
}
