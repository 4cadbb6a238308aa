//! A keyed retry the layer would shed, answered first from its key's
//! record ([`ShedLayer::replays_from`](super::ShedLayer::replays_from)).
//!
//! The hook runs the refused request through the idempotency layer with a
//! handler that sheds ([`Refuse`]): the layer's own rules then answer it.
//! A key with a stored answer gets its replay (the cheapest answer the
//! server has: no work, one store read); a key whose work still runs gets
//! its 409; a key with another request gets its 422; any other key is
//! claimed, shed by the handler (marked [`NothingDone`]) and given back at
//! once. Only retries (a request that says attempts came before it) are
//! asked about: a first attempt's key has no answer yet, and asking would
//! cost the store a claim for every request shed.

use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Empty;
use tower_layer::Layer;
use tower_resend::BoxError;
use tower_service::Service;

use super::lanes::{Refusal, State};
use crate::body::MaybeBuffered;
use crate::idempotency::{Backend, Idempotency, IdempotencyLayer, NothingDone};
use crate::problems::{Problem, ProblemType, Protocol};

/// What a [`ShedLayer`](super::ShedLayer) does with a request it
/// refuses: sheds it ([`NoReplays`]), or first asks the key's record
/// ([`Replays`]). Sealed.
pub trait ShedReplays<B>: sealed::Answer<B> {}

impl<B, T: sealed::Answer<B>> ShedReplays<B> for T {}

// The sealed trait names crate-private types: the point is that it is not
// implemented, nor called, outside the crate.
#[allow(private_interfaces)]
pub(super) mod sealed {
    use std::future::Future;

    use http::{Request, Response};

    use super::{Refusing, State};
    use crate::body::MaybeBuffered;

    // `pub` in a private module: nameable nowhere outside the crate.
    #[allow(unreachable_pub)]
    pub trait Answer<B>: Clone + Send + Sync + 'static {
        /// The answer to `req`, which the layer refuses as `refusing` says.
        fn answer<RB: Send + 'static>(
            &self,
            state: &State,
            req: Request<B>,
            refusing: Refusing,
        ) -> impl Future<Output = Response<MaybeBuffered<RB>>> + Send;
    }
}

/// A [`ShedLayer`](super::ShedLayer) that sheds every request it refuses
/// (the default).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoReplays;

#[allow(private_interfaces)]
impl<B: Send + 'static> sealed::Answer<B> for NoReplays {
    fn answer<RB: Send + 'static>(
        &self,
        state: &State,
        req: Request<B>,
        refusing: Refusing,
    ) -> impl Future<Output = Response<MaybeBuffered<RB>>> + Send {
        refusing.count(state);
        ready(refusing.response(Protocol::of(req.headers())))
    }
}

/// A [`ShedLayer`](super::ShedLayer) that answers a keyed retry it would
/// shed from the key's record, through the idempotency layer it was given
/// ([`ShedLayer::replays_from`](super::ShedLayer::replays_from)).
pub struct Replays<St> {
    probe: Idempotency<Refuse, St>,
}

impl<St: Backend> Replays<St> {
    pub(super) fn new(idempotency: &IdempotencyLayer<St>) -> Self {
        Self {
            probe: idempotency.layer(Refuse),
        }
    }
}

impl<St: Clone> Clone for Replays<St> {
    fn clone(&self) -> Self {
        Self {
            probe: self.probe.clone(),
        }
    }
}

impl<St> std::fmt::Debug for Replays<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replays").finish_non_exhaustive()
    }
}

#[allow(private_interfaces)]
impl<St, B> sealed::Answer<B> for Replays<St>
where
    St: Backend,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    async fn answer<RB: Send + 'static>(
        &self,
        state: &State,
        mut req: Request<B>,
        refusing: Refusing,
    ) -> Response<MaybeBuffered<RB>> {
        let protocol = Protocol::of(req.headers());
        if !refusing.retry || !refusing.keyed {
            refusing.count(state);
            return refusing.response(protocol);
        }
        req.extensions_mut().insert(refusing);
        let mut probe = self.probe.clone();
        // (Ready at once: the handler is.)
        let Ok(()) =
            std::future::poll_fn(|cx| Service::<Request<B>>::poll_ready(&mut probe, cx)).await;
        let Ok(resp) = probe.call(req).await;
        if resp.extensions().get::<Shed>().is_some() {
            refusing.count(state);
        } else {
            // Answered by the key's record: a replay, or why there is none
            // (still running, another request's key).
            state.counts.replayed.fetch_add(1, Relaxed);
            tracing::debug!(
                status = resp.status().as_u16(),
                "a keyed retry the server would shed answered by its key's record"
            );
        }
        resp.map(MaybeBuffered::flatten)
    }
}

/// A refusal, as the layer decided it: why, the wait it names, and what
/// the request said of itself.
#[derive(Clone, Copy, Debug)]
pub(super) struct Refusing {
    pub(super) why: Refusal,
    pub(super) wait: Duration,
    /// Attempts came before this one.
    pub(super) retry: bool,
    /// It carries an Idempotency-Key.
    pub(super) keyed: bool,
}

impl Refusing {
    pub(super) fn count(&self, state: &State) {
        let count = match self.why {
            Refusal::First => &state.counts.shed_first,
            Refusal::Retry => &state.counts.shed_retries,
            Refusal::Deadline => &state.counts.shed_deadline,
        };
        count.fetch_add(1, Relaxed);
        tracing::debug!(why = ?self.why, wait_ms = self.wait.as_millis() as u64, "request shed");
    }

    /// The `request_shed` problem. A keyed request's says that this attempt
    /// was not processed: an earlier one under its key may have been.
    pub(super) fn response<RB>(&self, protocol: Protocol) -> Response<MaybeBuffered<RB>> {
        let detail = match (self.why, self.keyed) {
            (Refusal::First | Refusal::Retry, false) => {
                "the server is at capacity and shed this request; nothing was done, send it again after Retry-After"
            }
            (Refusal::First | Refusal::Retry, true) => {
                "the server is at capacity and did not process this attempt (an earlier one with this Idempotency-Key may have run); send it again with the same key after Retry-After"
            }
            (Refusal::Deadline, false) => {
                "the server is at capacity, and the request's deadline would pass before its turn; nothing was done"
            }
            (Refusal::Deadline, true) => {
                "the server is at capacity, and the request's deadline would pass before its turn; this attempt was not processed (an earlier one with this Idempotency-Key may have run)"
            }
        };
        Problem::new(ProblemType::RequestShed, detail)
            .retry_after(self.wait.max(Duration::from_millis(1)))
            .response(protocol)
    }
}

/// Marks a response as the shed handler's.
#[derive(Clone, Copy, Debug)]
struct Shed;

/// The handler a refused keyed retry runs under its key when the key has
/// no answer: the shed's refusal, with nothing done (so the key is given
/// back at once).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Refuse;

impl<B> Service<Request<MaybeBuffered<B>>> for Refuse {
    type Response = Response<MaybeBuffered<Empty<Bytes>>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<MaybeBuffered<B>>) -> Self::Future {
        let refusing = req
            .extensions()
            .get::<Refusing>()
            .copied()
            .unwrap_or(Refusing {
                why: Refusal::Retry,
                wait: super::lanes::FIRST_GUESS,
                retry: true,
                keyed: true,
            });
        let mut resp = refusing.response(Protocol::of(req.headers()));
        resp.extensions_mut().insert(NothingDone);
        resp.extensions_mut().insert(Shed);
        ready(Ok(resp))
    }
}
