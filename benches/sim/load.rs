//! The callers and what is counted of them: one run from its start to its
//! report.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Uri};
use tokio::time::Instant;
use tower::ServiceExt;

use super::clients::{self, ClientService};
use super::figures::{self, Report};
use super::recorder::Recorder;
use super::script::Script;
use super::transport::Transport;
use super::Plan;
use crate::Body;

/// Runs `plan` on the current (paused) runtime.
pub(crate) async fn run(plan: Plan) -> Report {
    // The stack's fleet picks and throttle draw from fastrand's thread-local
    // generator: seeded here, on the runtime's one thread.
    fastrand::seed(plan.seed);
    let Plan {
        scenario,
        column,
        scale,
        model,
        seed,
    } = plan;
    let stop = plan.end();
    // The client processes start one after the other over a refresh
    // interval (so that they read the DNS name at different times, as
    // processes started at different times do); the callers, and the
    // run's clock, once they all have.
    let boot = Instant::now();
    let start = boot + model.refresh;
    let recorder = Arc::new(Recorder::new(start, stop.as_secs() as usize));
    let script = Arc::new(Script::new(start, scenario, model.warm_up, scale.instances));
    let transport = Transport::start(column.server, &model, &script, &recorder, seed);
    let mut services = Vec::with_capacity(scale.clients);
    for k in 0..scale.clients {
        let at = model.refresh.mul_f64(k as f64 / scale.clients as f64);
        tokio::time::sleep_until(boot + at).await;
        let seed = seed ^ (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        services
            .push(clients::build(column.client, &model, &script, transport.clone(), seed).await);
    }
    tokio::time::sleep_until(start).await;
    let rate = model.load * model.capacity(scale) / scale.callers as f64;
    let uri = Uri::from_static("http://upstream/work");
    for i in 0..scale.callers {
        let rng = fastrand::Rng::with_seed(seed.rotate_left(17) ^ i as u64);
        tokio::spawn(caller(
            services[i % services.len()].clone(),
            uri.clone(),
            rate,
            rng,
            start + stop,
            Arc::clone(&recorder),
            model.total,
        ));
    }
    // Every call made before the stop has ended by its deadline.
    tokio::time::sleep_until(start + stop + model.total + Duration::from_secs(1)).await;
    let mut tally = recorder.take();
    tally.shed = transport.shed();
    figures::report(&plan, tally)
}

/// One caller: calls at the times of a Poisson process of `rate`, each in a
/// task of its own, until `stop`.
async fn caller(
    client: ClientService,
    uri: Uri,
    rate: f64,
    mut rng: fastrand::Rng,
    stop: Instant,
    recorder: Arc<Recorder>,
    total: Duration,
) {
    let mut next = Instant::now();
    loop {
        let gap = -(1.0 - rng.f64()).ln() / rate;
        next += Duration::from_secs_f64(gap);
        if next >= stop {
            return;
        }
        tokio::time::sleep_until(next).await;
        recorder.offered();
        tokio::spawn(call(
            client.clone(),
            uri.clone(),
            Arc::clone(&recorder),
            total,
        ));
    }
}

/// One call, through the client as a handler makes it.
async fn call(client: ClientService, uri: Uri, recorder: Arc<Recorder>, total: Duration) {
    let start = Instant::now();
    let mut req = Request::new(Body::new());
    *req.uri_mut() = uri;
    let answer = client.oneshot(req).await;
    let took = start.elapsed();
    let good = matches!(answer, Ok(status) if status.is_success()) && took <= total;
    recorder.ended(took, good);
}
