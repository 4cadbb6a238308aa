//! A simulator of the real stack at scale (DESIGN §11): callers, client
//! processes each with its stack, and a fleet of instances, all in one
//! process on tokio's paused clock, so that a minute of a storm takes
//! seconds of CPU and the same seed gives the same figures ([`run`]; the
//! `storm` bench runs every scenario and column).
//!
//! The failure it is for: a short trigger (instances gone, slower work, a
//! black hole, a fleet replaced) fills the instances' queues; callers time
//! out and retry into those queues, which keep working on the requests
//! their callers abandoned; the work done is for nobody, the retries keep
//! the queues full, and the fleet stays down after the trigger has ended
//! (a *metastable* failure). The layers are the real ones (tower's retry,
//! balancer and budget, `tower_resend::stack()`, the server half's
//! `InboundDeadlineLayer` and `ShedLayer`); what is simulated, and how far
//! it holds:
//!
//! - **callers** ([`Scale::callers`]): each an open-loop Poisson source
//!   (a seeded draw of exponential gaps): it calls whether or not its last
//!   call has ended, as the users of a front end do. Each call is a GET
//!   (replay-safe: every column may retry it) made through its client
//!   process's service, cloned, as a handler makes it. Limits: no caller
//!   gives up on its own before the deadline its client sets, and none
//!   comes back later (no user retrying by hand: that loop is left out).
//! - **client processes** ([`Scale::clients`]): the callers are spread
//!   evenly over them; each builds its column's client once (one stack,
//!   one balancer, one retry budget, one fleet view), as the README builds
//!   one per upstream per process, so budgets, throttles and fleet health
//!   are per process, as in production. The processes start one after the
//!   other over a DNS refresh interval before the callers begin, so that
//!   they read the fleet's name at different times.
//! - **instances** ([`Model::workers`], [`Model::queue`],
//!   [`Model::work_mean`]): a FIFO queue of bounded length in front of
//!   `workers` tasks. A request finding the queue full gets 503 at once
//!   (no `Retry-After`); otherwise it waits its turn and then takes a work
//!   time drawn from a seeded lognormal around the mean. The work runs in
//!   the worker's task, not in the request's future: a caller that gives
//!   up does not stop it (the feedback loop). Only a server that honours
//!   deadlines ([`Server::Deadline`], [`Server::Shed`]) drops a queued
//!   request whose deadline has passed, and only before starting it; work
//!   once started always runs to its end. Limits: no CPU contention
//!   between workers (a slower instance is a trigger, not an effect), no
//!   cancellation seen by the server other than through the deadline, no
//!   connection limits, no memory, no cold start.
//! - **the wire**: a transport routes each attempt to the instance its
//!   URI's authority names and strips the request's extensions on the way
//!   (the server sees the method, URI and headers, as over a network: a
//!   `Deadline` reaches it only as the header the stack writes). No latency
//!   on the wire and no loss: the only failures are the instances'.
//!   Dropping an attempt (a timeout) drops the server's future at once, as
//!   an HTTP/2 reset does; the work queued for it stays.
//! - **triggers** ([`Scenario`]): scripted in simulated time from the
//!   start of the run. A down instance refuses new requests at once with
//!   `REFUSED_STREAM` (which tower-resend classifies as not sent) and
//!   finishes what it had queued, as a server draining does; a black hole
//!   takes requests and never answers; a slow period multiplies the work
//!   time of work that starts in it; the fleet's DNS name is a script that
//!   the stack reads through [`FleetLayer::resolved`] and tower's balancer
//!   through a `Discover` stream, both every [`Model::refresh`].
//! - **figures** ([`Report`]): per second of simulated time, the calls
//!   made, the attempts that reached an instance, the calls answered 2xx
//!   within their deadline, the p99 of the calls' time, the instance work
//!   done and the part of it for callers already gone; per run, when the
//!   goodput came back to 95 % of what it was before the trigger
//!   ([`Recovery`]), the peak amplification, and the share of the work done
//!   for nobody.
//!
//! [`FleetLayer::resolved`]: tower_resend::fleet::FleetLayer::resolved

mod clients;
mod figures;
mod instance;
mod load;
mod recorder;
mod script;
mod transport;

#[cfg(test)]
mod tests;

use std::time::Duration;

pub use clients::Client;
pub use figures::{Figures, Recovery, Report, Second, RECOVERED};
pub use script::Scenario;
pub use transport::Server;

/// How many callers, client processes and instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    /// Callers, each an open-loop Poisson source of calls.
    pub callers: usize,
    /// Client processes, each with one client of the column's kind, the
    /// callers spread evenly over them.
    pub clients: usize,
    /// Instances in the fleet (a fleet being replaced has up to half as
    /// many again for a while).
    pub instances: usize,
}

impl Scale {
    /// 10 000 callers in 100 client processes, 100 instances.
    pub const FULL: Self = Self {
        callers: 10_000,
        clients: 100,
        instances: 100,
    };

    /// 1 000 callers in 10 client processes, 10 instances: the tests'.
    pub const SMALL: Self = Self {
        callers: 1_000,
        clients: 10,
        instances: 10,
    };
}

/// The instances' and the clients' settings, the same for every column.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Model {
    /// Workers per instance. Default 4.
    pub workers: usize,
    /// Requests an instance holds waiting for a worker; more are answered
    /// 503. Default 256 (3.2 s of work at the mean).
    pub queue: usize,
    /// Mean work time of a request. Default 50 ms.
    pub work_mean: Duration,
    /// The spread of the work time: the sigma of its lognormal. Default 0.5
    /// (p99 about 2.7 times the median).
    pub work_sigma: f64,
    /// Offered load, a share of the fleet's capacity
    /// (instances x workers / mean work time). Default 0.7.
    pub load: f64,
    /// Attempts in all per call, in every column. Default 3.
    pub attempts: u32,
    /// The limit of one attempt, in every column. Default 1 s: shorter
    /// than a full queue's wait, as the feedback loop needs.
    pub attempt_timeout: Duration,
    /// The call's deadline, in every column; goodput counts the calls
    /// answered 2xx within it. Default 3 s.
    pub total: Duration,
    /// How often the clients read the fleet's DNS name. Default 5 s.
    pub refresh: Duration,
    /// When the trigger starts; the goodput before it (from the third
    /// second) is the one to recover to. Default 10 s.
    pub warm_up: Duration,
    /// How long after the trigger's end the run is watched: a column not
    /// back by then is metastable. Default 60 s.
    pub watch: Duration,
}

impl Default for Model {
    fn default() -> Self {
        Self {
            workers: 4,
            queue: 256,
            work_mean: Duration::from_millis(50),
            work_sigma: 0.5,
            load: 0.7,
            attempts: 3,
            attempt_timeout: Duration::from_secs(1),
            total: Duration::from_secs(3),
            refresh: Duration::from_secs(5),
            warm_up: Duration::from_secs(10),
            watch: Duration::from_secs(60),
        }
    }
}

impl Model {
    /// Calls per second the whole fleet can serve at the mean work time.
    pub fn capacity(&self, scale: Scale) -> f64 {
        (scale.instances * self.workers) as f64 / self.work_mean.as_secs_f64()
    }
}

/// One column of the tables: a client beside a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Column {
    /// What the callers call through.
    pub client: Client,
    /// What each instance has in front of its queue.
    pub server: Server,
}

impl Column {
    /// The column's name in tables and pictures.
    pub fn name(&self) -> String {
        format!("{} | {}", self.client.name(), self.server.name())
    }
}

/// One run: a scenario, a column, a scale, a seed.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// The trigger.
    pub scenario: Scenario,
    /// The client and the server.
    pub column: Column,
    /// How many of each.
    pub scale: Scale,
    /// The settings.
    pub model: Model,
    /// Seeds every draw: arrivals, work times, jitter, picks.
    pub seed: u64,
}

impl Plan {
    /// Where the run stops taking calls: the watch after the trigger, and
    /// a few seconds more so that recovery can be seen to hold.
    pub(crate) fn end(&self) -> Duration {
        self.model.warm_up
            + self.scenario.length()
            + self.model.watch
            + Duration::from_secs(figures::HOLD as u64)
    }
}

/// Runs `plan` on a current-thread runtime of its own, its clock paused
/// (time jumps to the next timer whenever every task waits), and returns
/// its figures. Deterministic: the same plan gives the same report.
pub fn run(plan: &Plan) -> Report {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    rt.block_on(load::run(*plan))
}
