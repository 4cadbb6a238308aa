//! One simulated instance: a bounded FIFO queue in front of workers that
//! keep working on requests whose callers have gone.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;
use tower::{BoxError, Service};
use tower_resend::Deadline;

use super::recorder::Recorder;
use super::script::{Script, State};
use super::Model;
use crate::Body;

/// An instance's answer, as its future gives it.
pub(crate) type Answer = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

/// The instance's service; clones share its queue and workers.
#[derive(Clone)]
pub(crate) struct Instance {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instance")
            .field("index", &self.shared.index)
            .finish_non_exhaustive()
    }
}

struct Shared {
    index: usize,
    queue: Mutex<VecDeque<Job>>,
    /// Woken once for each job queued (a permit is kept when no worker
    /// waits).
    queued: Notify,
    bound: usize,
    /// Drops a queued job whose deadline has passed, before starting it.
    honour_deadline: bool,
    work: Mutex<WorkTime>,
    script: Arc<Script>,
    recorder: Arc<Recorder>,
}

/// A request waiting for a worker.
struct Job {
    deadline: Option<Deadline>,
    answer: oneshot::Sender<Response<Body>>,
}

/// Work times: a seeded lognormal around a mean.
struct WorkTime {
    rng: fastrand::Rng,
    mu: f64,
    sigma: f64,
}

impl WorkTime {
    fn new(model: &Model, seed: u64) -> Self {
        let sigma = model.work_sigma.max(0.0);
        // E[lognormal] = exp(mu + sigma^2 / 2) = the mean.
        let mu = model.work_mean.as_secs_f64().ln() - sigma * sigma / 2.0;
        Self {
            rng: fastrand::Rng::with_seed(seed),
            mu,
            sigma,
        }
    }

    fn draw(&mut self) -> Duration {
        // Box-Muller: one standard normal from two uniforms in (0, 1].
        let u1 = 1.0 - self.rng.f64();
        let u2 = self.rng.f64();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        Duration::from_secs_f64((self.mu + self.sigma * z).exp())
    }
}

impl Instance {
    /// Instance `index` of `script`, with its workers spawned.
    pub(crate) fn start(
        index: usize,
        model: &Model,
        honour_deadline: bool,
        script: Arc<Script>,
        recorder: Arc<Recorder>,
        seed: u64,
    ) -> Self {
        let shared = Arc::new(Shared {
            index,
            queue: Mutex::new(VecDeque::new()),
            queued: Notify::new(),
            bound: model.queue,
            honour_deadline,
            work: Mutex::new(WorkTime::new(model, seed)),
            script,
            recorder,
        });
        for _ in 0..model.workers {
            tokio::spawn(worker(Arc::clone(&shared)));
        }
        Self { shared }
    }
}

fn status(code: StatusCode) -> Response<Body> {
    let mut resp = Response::new(Body::new());
    *resp.status_mut() = code;
    resp
}

impl<B> Service<Request<B>> for Instance {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Answer;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Answer {
        let s = &self.shared;
        match s.script.state(s.index, Instant::now()) {
            State::Refusing => {
                let refused = h2::Error::from(h2::Reason::REFUSED_STREAM);
                Box::pin(std::future::ready(Err(refused.into())))
            }
            State::BlackHole => {
                s.recorder.reached();
                Box::pin(std::future::pending())
            }
            State::Up { .. } => {
                s.recorder.reached();
                let mut queue = s.queue.lock().unwrap_or_else(PoisonError::into_inner);
                if queue.len() >= s.bound {
                    drop(queue);
                    s.recorder.full();
                    return Box::pin(std::future::ready(Ok(status(
                        StatusCode::SERVICE_UNAVAILABLE,
                    ))));
                }
                let (answer, answered) = oneshot::channel();
                queue.push_back(Job {
                    // (Put there by the server's InboundDeadlineLayer, from
                    // the header the caller wrote.)
                    deadline: Deadline::of(req.extensions()),
                    answer,
                });
                drop(queue);
                s.queued.notify_one();
                Box::pin(async move {
                    // The workers outlive every request of the run.
                    answered
                        .await
                        .map_err(|_| BoxError::from("the instance stopped"))
                })
            }
        }
    }
}

/// One worker: the next job in line, its work, its answer (to nobody if
/// its caller has gone), for as long as the run lasts.
async fn worker(s: Arc<Shared>) -> Infallible {
    loop {
        let job = loop {
            let next = s
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop_front();
            match next {
                Some(job) => break job,
                None => s.queued.notified().await,
            }
        };
        if s.honour_deadline && job.deadline.is_some_and(Deadline::is_expired) {
            s.recorder.dropped();
            continue;
        }
        // The state when the work starts says how slow it is.
        let slow = match s.script.state(s.index, Instant::now()) {
            State::Up { slow } => slow,
            State::Refusing | State::BlackHole => 1.0,
        };
        let work = s
            .work
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .draw()
            .mul_f64(slow);
        tokio::time::sleep(work).await;
        let delivered = job.answer.send(status(StatusCode::OK)).is_ok();
        s.recorder.worked(work, delivered);
    }
}
