//! A claimed request's work, from its handler's start to its end kept: the
//! handler run under its hold (renewed while it runs, cut by the inbound
//! deadline, its panic caught: [`supervise`]), how it ended read for the
//! rules ([`ended`]), and what they say kept ([`completed`], [`committed`])
//! and answered. A caller who goes away hands the work, where it is, to a
//! task of its own ([`to_its_end`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body::Body;
use tokio::time::Instant;
use tower_resend::classify::{GrpcCode, GRPC_RETRY_PUSHBACK_MS};
use tower_resend::deadline::server::{Snapshot, TimeLedger};
use tower_resend::{BoxError, Deadline};

use super::backend::Backend;
use super::config::Shared;
use super::request::Key;
use super::response::{answer, record, take_mark, IDEMPOTENT_KEEP, IDEMPOTENT_NOTHING_DONE};
use super::rules::{
    committed, completed, ended, renewed, Answered, Ended, Keep, Kept, OnCommit, OnCompletion,
    OnEnd, OnRenewal, Reply, Unkept,
};
use super::supervise::{supervise, to_its_end, Renewals, Supervision};
use super::{KeepResponse, NothingDone};
use crate::body::{read_capped, MaybeBuffered, Read};
use crate::deadline::Attribution;
use crate::problems::{Answer, Protocol};
use crate::store::{LeaseState, StoreError, StoredResponse};

/// A handler's response body, which the layer reads to keep it.
pub(crate) trait ResponseBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

impl<T> ResponseBody for T
where
    T: Body<Data = Bytes> + Send + Unpin + 'static,
    T::Error: Into<BoxError>,
{
}

/// What the layer's answer to a request is.
pub(crate) type Answering<RB, E> = Result<Response<MaybeBuffered<RB>>, E>;

/// What the handler's work gave: its response's head, the rest of its
/// body, and what was read of it (or how the reading failed).
type Done<RB> = (http::response::Parts, RB, Result<Read, BoxError>);

/// A handler's response, its body read (up to the cap).
struct Handled<RB> {
    head: http::response::Parts,
    /// The rest of its body, past what was read.
    body: RB,
    read: Read,
}

/// How a handler ended, as the rules take it: its response, its error, and
/// where the time went when the deadline cut it.
type HowItEnded<RB, E> = Ended<Handled<RB>, E, Snapshot>;

/// A claimed request's work, from the handler's start to its end kept.
pub(crate) struct Work<St: Backend> {
    pub(crate) shared: Arc<Shared<St>>,
    pub(crate) protocol: Protocol,
    pub(crate) deadline: Option<Deadline>,
    pub(crate) ledger: Option<TimeLedger>,
    pub(crate) started_at: Instant,
    /// The key, for the logs (none for a request without one).
    pub(crate) key: Option<Key>,
}

impl<St: Backend> Work<St> {
    /// Runs `handler` under `hold` to its end, and answers with it. The
    /// work runs in the caller's task while the caller waits (as a handler
    /// without the layer does); a caller that goes away hands it, where it
    /// is, to a task of its own ([`to_its_end`]), which runs it to its end.
    pub(crate) fn run_to_its_end<F, RB, E>(
        self,
        hold: St::Hold,
        handler: Pin<Box<F>>,
    ) -> impl Future<Output = Answering<RB, E>>
    where
        F: Future<Output = Result<Response<RB>, E>> + Send + 'static,
        RB: ResponseBody,
        E: Send + 'static,
    {
        // Boxed: moved as one pointer, into a task too.
        to_its_end(Box::pin(self.run(hold, handler)))
    }

    fn key(&self) -> &str {
        self.key.as_ref().map_or("", Key::as_str)
    }

    /// The handler run to its end under its hold, and its end kept.
    // An async block rather than an `async fn`, which keeps each of its
    // parameters twice: this future is boxed on every keyed request.
    #[allow(clippy::manual_async_fn)]
    fn run<F, RB, E>(
        self,
        hold: St::Hold,
        handler: Pin<Box<F>>,
    ) -> impl Future<Output = Answering<RB, E>>
    where
        F: Future<Output = Result<Response<RB>, E>> + Send,
        RB: ResponseBody,
        E: Send,
    {
        async move {
            let supervised = self.supervise(&hold, handler).await;
            // Boxed when it comes: this future keeps room for the handler's
            // supervision only (the hold, moved on, would be kept twice).
            Box::pin(self.end(hold, supervised)).await
        }
    }

    /// How the handler ended, kept or let go as the rules say, and answered.
    // An async block rather than an `async fn`, which keeps each of its
    // parameters twice: this future is boxed on every keyed request.
    #[allow(clippy::manual_async_fn)]
    fn end<RB, E>(
        &self,
        mut hold: St::Hold,
        supervised: Supervision<Result<Done<RB>, E>>,
    ) -> impl Future<Output = Answering<RB, E>> + use<'_, St, RB, E>
    where
        RB: ResponseBody,
        E: Send,
    {
        async move {
            let shared = &self.shared;
            if !St::take_back(shared, &mut hold).await {
                tracing::error!("the handler's transaction is still in use after it ended: it is rolled back when let go");
                Box::pin(St::release(shared, hold)).await;
                return Ok(Answer::TransactionInUse.response(self.protocol));
            }
            match ended(St::MODE, how_it_ended(supervised)) {
                // Boxed, as the rarer ends are: with this step's room it
                // would pass the thread cache's largest block.
                OnEnd::Keep(keep) => Box::pin(self.keep(hold, keep)).await,
                OnEnd::Release(handled) => {
                    Box::pin(St::release(shared, hold)).await;
                    Ok(said_nothing_done(handler_response(handled)))
                }
                OnEnd::RollBack(unkept) => {
                    Box::pin(St::release(shared, hold)).await;
                    self.unkept(unkept)
                }
            }
        }
    }

    /// The handler (and the reading of its response) under [`supervise`]:
    /// the hold renewed while it runs, cut by the deadline.
    async fn supervise<F, RB, E>(
        &self,
        held: &St::Hold,
        handler: Pin<Box<F>>,
    ) -> Supervision<Result<Done<RB>, E>>
    where
        F: Future<Output = Result<Response<RB>, E>> + Send,
        RB: ResponseBody,
        E: Send,
    {
        let cap = self.shared.config.response_cap;
        let work = move || async move {
            let (head, mut body) = handler.await?.into_parts();
            let read = read_capped(&mut body, cap).await;
            Ok::<Done<RB>, E>((head, body, read))
        };
        // Counted from the request's start, which its claim was sent after.
        let from = self.started_at;
        let renewal = St::renew_every(held).map(|every| {
            let renew = move || async move {
                // Boxed: a renewal comes every third of the lease, not in
                // every request's room.
                let renewal = Box::pin(St::renew(&self.shared, held)).await;
                self.renewed(renewal);
            };
            (Renewals { from, every }, renew)
        });
        let deadline = self.deadline.map(|d| d.instant());
        supervise(work, deadline, self.ledger.as_ref(), renewal).await
    }

    /// What a renewal found, reported.
    fn renewed(&self, renewal: Result<LeaseState, StoreError>) {
        let error = renewal.as_ref().err().map(ToString::to_string);
        match renewed(renewal) {
            OnRenewal::Renewed | OnRenewal::AlreadyStored => {}
            OnRenewal::LeaseLost => {
                self.shared.config.stats.count_lease_lost();
                tracing::error!(
                    key = self.key(),
                    "idempotency lease taken over while its handler still works: another run of this key may have happened"
                );
            }
            OnRenewal::RenewLater => {
                tracing::warn!(
                    error = error.as_deref().unwrap_or(""),
                    key = self.key(),
                    "could not renew an idempotency lease; trying again"
                );
            }
        }
    }

    /// Keeps `keep` as the key's end, and answers with it.
    // An async block rather than an `async fn`, which keeps each of its
    // parameters twice: this future is boxed on every keyed request.
    #[allow(clippy::manual_async_fn)]
    fn keep<RB, E>(
        &self,
        mut hold: St::Hold,
        keep: Keep<Handled<RB>, E, Snapshot>,
    ) -> impl Future<Output = Answering<RB, E>> + use<'_, St, RB, E>
    where
        RB: ResponseBody,
        E: Send,
    {
        async move {
            let shared = &self.shared;
            let (stored, status) = match &keep {
                Keep::Response(Handled { head, read, .. }) => (
                    record(
                        head.status,
                        &head.headers,
                        &shared.config.per_caller,
                        &read.bytes,
                        read.whole,
                        read.trailers.as_deref(),
                    ),
                    head.status,
                ),
                Keep::Deadline(cut) => {
                    tracing::warn!(
                        key = self.key(),
                        "the inbound deadline cut a keyed handler: its 504 is kept as the operation's end"
                    );
                    (
                        self.deadline_answer(cut.clone()),
                        StatusCode::GATEWAY_TIMEOUT,
                    )
                }
                Keep::Answer(answer) | Keep::Failed(answer, _) => {
                    (answer.stored(self.protocol), answer.kind().status())
                }
            };
            match St::keep(shared, &mut hold, &stored, status).await {
                Kept::Stored(found) => match completed(found) {
                    OnCompletion::Stored => {}
                    OnCompletion::LeaseLost => {
                        shared.config.stats.count_lease_lost();
                        tracing::error!(key = self.key(), "idempotency lease taken over before the response could be stored: another run of this key may have happened");
                    }
                    OnCompletion::Hold => {
                        tracing::warn!(
                            key = self.key(),
                            "could not store an idempotent response: it is held, and stored in the background"
                        );
                        St::hold(shared, hold, stored.clone());
                    }
                },
                Kept::Committed(commit, status) => match committed(commit, status) {
                    OnCommit::Answered => {}
                    // The handler's answer stands, unkept.
                    OnCommit::RollBack(Reply::Handler) => Box::pin(St::release(shared, hold)).await,
                    OnCommit::RollBack(Reply::Answer(answer)) => {
                        Box::pin(St::release(shared, hold)).await;
                        return Ok(answer.response(self.protocol));
                    }
                    OnCommit::Answer(answer) => {
                        tracing::error!(
                            key = self.key(),
                            "the transaction of a keyed request may not have committed"
                        );
                        return Ok(answer.response(self.protocol));
                    }
                },
            }
            match keep {
                Keep::Response(handled) => Ok(handler_response(handled)),
                // A handler's error still reaches its first caller as it is.
                Keep::Failed(_, e) => Err(e),
                Keep::Answer(_) | Keep::Deadline(_) => Ok(answer(stored)),
            }
        }
    }

    /// The answer of a request whose end is not kept.
    fn unkept<RB, E>(&self, unkept: Unkept<Handled<RB>, E, Snapshot>) -> Answering<RB, E>
    where
        RB: ResponseBody,
    {
        match unkept {
            // Rolled back: nothing of it was done, and it says so.
            Unkept::Response(handled) => Ok(said_nothing_done(handler_response(handled))),
            Unkept::Error(e) => Err(e),
            Unkept::Answer(answer) => Ok(answer.response(self.protocol)),
            Unkept::Deadline(cut) => Ok(said_nothing_done(answer(self.deadline_answer(cut)))),
        }
    }

    /// The deadline's 504, saying where the time went as of the `cut`, as
    /// the inbound deadline layer's does; DEADLINE_EXCEEDED over gRPC.
    fn deadline_answer(&self, cut: Snapshot) -> StoredResponse {
        let elapsed = self.started_at.elapsed();
        let budget = self.deadline.map_or(elapsed, |d| {
            d.instant().saturating_duration_since(self.started_at)
        });
        Attribution::from_snapshot(cut, budget, elapsed).stored(self.protocol)
    }
}

/// How the handler ended, for the rules; its marks read and taken off the
/// response (they are for the layer; an answer that lets its key go says
/// "nothing done" to the caller again, whoever marked it).
fn how_it_ended<RB, E>(supervised: Supervision<Result<Done<RB>, E>>) -> HowItEnded<RB, E> {
    match supervised {
        Supervision::Done(Ok((mut head, body, Ok(mut read)))) => {
            let mut nothing_done = head.extensions.get::<NothingDone>().is_some()
                | take_mark(&mut head.headers, &IDEMPOTENT_NOTHING_DONE);
            let mut keep = head.extensions.get::<KeepResponse>().is_some()
                | take_mark(&mut head.headers, &IDEMPOTENT_KEEP);
            let mut grpc = GrpcCode::in_headers(&head.headers);
            let mut pushback = head.headers.contains_key(GRPC_RETRY_PUSHBACK_MS);
            if let Some(trailers) = &mut read.trailers {
                nothing_done |= take_mark(trailers, &IDEMPOTENT_NOTHING_DONE);
                keep |= take_mark(trailers, &IDEMPOTENT_KEEP);
                grpc = grpc.or(GrpcCode::in_headers(trailers));
                pushback |= trailers.contains_key(GRPC_RETRY_PUSHBACK_MS);
                if trailers.is_empty() {
                    read.trailers = None;
                }
            }
            let answered = Answered {
                status: head.status,
                grpc,
                pushback,
                nothing_done,
                keep,
            };
            Ended::Answered(answered, Handled { head, body, read })
        }
        Supervision::Done(Ok((_, _, Err(e)))) => {
            tracing::warn!(error = %e, "a keyed response's body failed after its head");
            Ended::BodyFailed
        }
        Supervision::Done(Err(e)) => Ended::Failed(e),
        Supervision::Panicked => Ended::Panicked,
        Supervision::DeadlineCut(cut) => Ended::DeadlineCut(cut),
    }
}

/// `resp`, saying that nothing was done (`Idempotent-Nothing-Done: true`):
/// its key was let go, or its work rolled back.
fn said_nothing_done<B>(mut resp: Response<B>) -> Response<B> {
    crate::problems::say_nothing_done(resp.headers_mut());
    resp
}

/// The handler's own response, as its caller gets it: its head, and its
/// body (with its trailers) from memory, or what was read of it followed by
/// the rest.
fn handler_response<RB>(handled: Handled<RB>) -> Response<MaybeBuffered<RB>> {
    let Handled { head, body, read } = handled;
    let body = if read.whole {
        MaybeBuffered::with_boxed_trailers(read.bytes, read.trailers)
    } else {
        MaybeBuffered::chain(read.bytes, body)
    };
    Response::from_parts(head, body)
}

#[cfg(test)]
#[path = "work_tests.rs"]
pub(super) mod tests;
