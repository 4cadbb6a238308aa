use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::body::MaybeBuffered;

pub(crate) type Slow<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<MaybeBuffered<B>>, E>> + Send>>;

// Set by a keyed request's future in the poll in which it starts the
// handler, and read by the `ResponseFuture` polling it: from then on, a
// dropped response future hands the work to a task of its own instead of
// cancelling it. A thread-local rather than a shared flag: it is set and
// read within one synchronous `poll` (and put back after it, for a keyed
// layer nested in another's handler), so it costs no allocation.
thread_local! {
    static STARTED: Cell<bool> = const { Cell::new(false) };
}

/// Tells the `ResponseFuture` polling this future that the handler has
/// started: its work must now run to completion whatever the caller does.
pub(crate) fn handler_started() {
    STARTED.set(true);
}

pin_project! {
    /// Response future of [`Idempotency`](super::Idempotency): requests
    /// without a key go straight through; keyed ones take the boxed path
    /// through the store.
    ///
    /// Dropping it (the client went away, an attempt timeout cut the
    /// connection, an outer deadline fired) once a keyed request's handler
    /// has started does not cancel the work: it goes on in a task of its
    /// own, still bounded by the inbound deadline, and its response is
    /// stored for the caller's retry.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }

    impl<F, B, E> PinnedDrop for ResponseFuture<F, B, E> {
        fn drop(this: Pin<&mut Self>) {
            if let StateProj::Keyed { run, started, detach } = this.project().state.project() {
                if *started {
                    if let Some(run) = run.take() {
                        detach(run);
                    }
                }
            }
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        Passthrough { #[pin] future: F },
        Keyed {
            run: Option<Slow<B, E>>,
            // The handler has started.
            started: bool,
            // Spawns the rest of the work: made where the bounds that
            // spawning needs are known.
            detach: fn(Slow<B, E>),
        },
        Ready { response: Option<Response<MaybeBuffered<B>>> },
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// Runs the rest of a keyed request's work in a task of its own.
fn detach<B: Send + 'static, E: Send + 'static>(run: Slow<B, E>) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            tracing::debug!("the caller of a keyed request went away: its work goes on");
            runtime.spawn(async move {
                let _ = run.await;
            });
        }
        Err(_) => tracing::error!(
            "a keyed request's caller went away outside a tokio runtime: its work is cut, and its lease will expire"
        ),
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            state: State::Passthrough { future },
        }
    }

    pub(crate) fn keyed(run: Slow<B, E>) -> Self
    where
        B: Send + 'static,
        E: Send + 'static,
    {
        Self {
            state: State::Keyed {
                run: Some(run),
                started: false,
                detach: detach::<B, E>,
            },
        }
    }

    pub(crate) fn ready(response: Response<MaybeBuffered<B>>) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<MaybeBuffered<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Passthrough { future } => future
                .poll(cx)
                .map(|r| r.map(|resp| resp.map(MaybeBuffered::inner))),
            StateProj::Keyed { run, started, .. } => {
                let Some(future) = run.as_mut() else {
                    return Poll::Pending;
                };
                let outer = STARTED.replace(false);
                let polled = future.as_mut().poll(cx);
                if STARTED.replace(outer) {
                    *started = true;
                }
                if polled.is_ready() {
                    *run = None;
                }
                polled
            }
            StateProj::Ready { response } => match response.take() {
                Some(r) => Poll::Ready(Ok(r)),
                None => Poll::Pending,
            },
        }
    }
}
