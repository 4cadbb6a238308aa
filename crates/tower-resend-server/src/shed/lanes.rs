//! Admission: the slots taken, and the requests waiting for one, first
//! attempts ahead of retries.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;
use tower_resend::Deadline;

use super::limit::Limit;

/// The wait a refusal names before any work has finished to measure.
pub(super) const FIRST_GUESS: Duration = Duration::from_millis(100);

/// What a layer and its services share: the limit, the lanes, the counts.
#[derive(Debug)]
pub(super) struct State {
    lanes: Mutex<Lanes>,
    pub(super) counts: Counts,
}

#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) admitted: AtomicU64,
    pub(super) shed_first: AtomicU64,
    pub(super) shed_retries: AtomicU64,
    pub(super) shed_deadline: AtomicU64,
    pub(super) replayed: AtomicU64,
}

/// The slots taken and the requests waiting, first attempts ahead of
/// retries.
#[derive(Debug)]
struct Lanes {
    limit: Limit,
    running: usize,
    first: VecDeque<oneshot::Sender<Admission>>,
    retries: VecDeque<oneshot::Sender<Admission>>,
    /// How long work has been taking (a moving average), for the waits.
    service_time: Option<Duration>,
}

/// A waiting request's turn: a slot, or a refusal naming the wait.
pub(super) type Admission = Result<Permit, Duration>;

/// What [`State::admit`] gives a request.
pub(super) enum Admit {
    /// A slot at once.
    Run(Permit),
    /// A place in the queue: the turn comes on the receiver.
    Wait(oneshot::Receiver<Admission>),
    /// A refusal, with the wait to name.
    Refuse(Refusal, Duration),
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug)]
pub(super) enum Refusal {
    /// Every slot and queue place taken, and no retry waiting to give way.
    First,
    /// A retry finding the queue full, or sent away from it to make room
    /// for a first attempt.
    Retry,
    /// The deadline would pass in the queue.
    Deadline,
}

impl Lanes {
    fn waiting(&self) -> usize {
        self.first.len() + self.retries.len()
    }

    /// How long the work ahead of the `ahead`-th request in the queue (0
    /// for the first) takes to drain.
    fn wait_for(&self, ahead: usize) -> Duration {
        let per_round = self.service_time.unwrap_or(FIRST_GUESS);
        let rounds = u32::try_from(ahead / self.limit.current() + 1).unwrap_or(u32::MAX);
        per_round.saturating_mul(rounds)
    }

    /// The request to run next: the first attempt waiting longest, else the
    /// retry waiting longest (those that stopped waiting skipped).
    fn next_waiting(&mut self) -> Option<oneshot::Sender<Admission>> {
        loop {
            let next = match self.first.pop_front() {
                Some(next) => next,
                None => self.retries.pop_front()?,
            };
            if !next.is_closed() {
                return Some(next);
            }
        }
    }
}

impl State {
    pub(super) fn new(limit: Limit) -> Self {
        Self {
            lanes: Mutex::new(Lanes {
                limit,
                running: 0,
                first: VecDeque::new(),
                retries: VecDeque::new(),
                service_time: None,
            }),
            counts: Counts::default(),
        }
    }

    fn lanes(&self) -> MutexGuard<'_, Lanes> {
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The requests that may run at once now.
    pub(super) fn limit(&self) -> usize {
        self.lanes().limit.current()
    }

    /// A slot at once, a place in the queue (at most `max_queue` wait;
    /// `None`: as many as the limit), or a refusal with the wait to name.
    pub(super) fn admit(
        self: &Arc<Self>,
        retry: bool,
        deadline: Option<Deadline>,
        max_queue: Option<usize>,
    ) -> Admit {
        let mut lanes = self.lanes();
        let limit = lanes.limit.current();
        if lanes.running < limit && lanes.waiting() == 0 {
            lanes.running += 1;
            return Admit::Run(self.permit());
        }
        lanes.limit.limited();
        let ahead = if retry {
            lanes.waiting()
        } else {
            lanes.first.len()
        };
        let wait = lanes.wait_for(ahead);
        if deadline.is_some_and(|d| d.remaining() <= wait) {
            return Admit::Refuse(Refusal::Deadline, wait);
        }
        if lanes.waiting() >= max_queue.unwrap_or(lanes.limit.queue()) {
            if retry {
                return Admit::Refuse(Refusal::Retry, wait);
            }
            // A first attempt takes the place of the last retry waiting.
            match lanes.retries.pop_back() {
                Some(sent_away) => {
                    let drain = lanes.wait_for(lanes.waiting());
                    let _ = sent_away.send(Err(drain));
                }
                None => return Admit::Refuse(Refusal::First, wait),
            }
        }
        let (tx, rx) = oneshot::channel();
        if retry {
            lanes.retries.push_back(tx);
        } else {
            lanes.first.push_back(tx);
        }
        Admit::Wait(rx)
    }

    fn permit(self: &Arc<Self>) -> Permit {
        Permit {
            state: Arc::clone(self),
            started: Instant::now(),
            finished: false,
        }
    }

    /// A slot is free again, after work of `took` (a sample for the limit
    /// when the work `finished`): it goes to the first attempt waiting
    /// longest, else to the retry waiting longest, while the limit has
    /// room.
    fn free(self: &Arc<Self>, started: Instant, finished: bool) {
        let now = Instant::now();
        let took = now.saturating_duration_since(started);
        let mut lanes = self.lanes();
        if finished {
            lanes.limit.sample(started, took, now);
        }
        lanes.service_time = Some(match lanes.service_time {
            // A moving average over about the last eight.
            Some(avg) => (avg * 7 + took) / 8,
            None => took,
        });
        lanes.running -= 1;
        // More than one when the limit just grew.
        while lanes.running < lanes.limit.current() {
            let Some(next) = lanes.next_waiting() else {
                return;
            };
            lanes.running += 1;
            drop(lanes);
            // One gone between the look and the send drops the slot, which
            // frees it again.
            let _ = next.send(Ok(self.permit()));
            lanes = self.lanes();
        }
    }
}

/// A slot taken: freed when dropped.
#[derive(Debug)]
pub(super) struct Permit {
    state: Arc<State>,
    started: Instant,
    finished: bool,
}

impl Permit {
    /// The work ran to its end: its time is a sample for the limit (work
    /// cut short frees its slot without one).
    pub(super) fn finished(mut self) {
        self.finished = true;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.state.free(self.started, self.finished);
    }
}
