//! How the cost of a call through `stack().fleet(..)` grows with the fleet
//! and with the threads sharing one stack (its budget, throttle, breaker
//! and fleet; DESIGN section 11): in process,
//! to a transport that answers at once, so that the figure is the stack's
//! and the fleet's own. And what a limit on each instance's attempts in
//! flight (`FleetLayer::limit`) costs a call when nobody is overloaded.
//! (The memory an instance takes is `fleet_memory`'s: the counting
//! allocator it needs would put a count that every thread writes on every
//! allocation here.)
//!
//! `cargo bench -p tower-resend-benches --bench fleet_cost`
//! (`RESEND_BENCH_ROUNDS=n` sets the rounds, default 15)
#![allow(missing_docs, clippy::print_stdout)]

use std::sync::{Arc, Barrier};

use http::Request;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::fleet::{FleetLayer, InstanceLimit};

use tower_resend_benches::{median, tower_backoff, Body, Instant200, TowerRetry};

/// Calls per measure.
const CALLS: u32 = 20_000;

/// `n` instances: `http://10.a.b.c:80`.
fn addresses(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("http://10.{}.{}.{}:80", i >> 16, (i >> 8) & 255, i & 255))
        .collect()
}

fn fleet(n: usize) -> FleetLayer {
    FleetLayer::fixed(addresses(n)).expect("valid bases")
}

/// Nanoseconds per call, `CALLS` calls on clones of a stack over `n`
/// instances.
async fn per_call(n: usize) -> f64 {
    per_call_over(fleet(n)).await
}

/// Nanoseconds per call, `CALLS` calls on clones of a stack over `fleet`.
async fn per_call_over(fleet: FleetLayer) -> f64 {
    let stack = tower_resend::stack().fleet(fleet).service(Instant200);
    let start = Instant::now();
    for _ in 0..CALLS {
        let req = Request::get("http://inventory/items/7")
            .body(Body::new())
            .expect("valid request");
        std::hint::black_box(stack.clone().oneshot(req).await.expect("answered"));
    }
    start.elapsed().as_nanos() as f64 / f64::from(CALLS)
}

/// A stack that threads can share: what the thread measures take.
trait Shareable:
    tower::Service<Request<Body>, Error: std::fmt::Debug, Future: Send> + Clone + Send + Sync
{
}

impl<S> Shareable for S where
    S: tower::Service<Request<Body>, Error: std::fmt::Debug, Future: Send> + Clone + Send + Sync
{
}

/// The stack the threads share: every piece of shared state on the way of
/// a call (the retry budget, the adaptive throttle, the circuit breaker's
/// circuit per instance, the fleet) over 100 instances.
fn whole_stack() -> impl Shareable {
    tower_resend::stack()
        .circuit_breaker()
        .adaptive_throttling()
        .fleet(fleet(100))
        .service(Instant200)
}

/// `stack()` alone over the transport: its retry, budget and timeouts,
/// no fleet, no breaker, no throttle: what [`tower_retry_budget`] does.
fn retry_stack() -> impl Shareable {
    tower_resend::stack().service(Instant200)
}

/// What a tower user stacks for the same behaviour as [`retry_stack`]: a
/// call timeout (10 s), tower's `Retry` (3 attempts, jittered exponential
/// backoff) with tower's `TpsBudget` as the stack's budget is set (20 %
/// over 10 s, at least one a second),
/// an attempt timeout (5 s): the like-for-like row of the thread table.
fn tower_retry_budget() -> impl Shareable {
    use std::time::Duration;
    use tower::retry::budget::TpsBudget;
    let backoff = tower_backoff(tower::util::rng::HasherRng::default());
    let policy = TowerRetry {
        left: 2,
        backoff,
        budget: Some(Arc::new(TpsBudget::new(Duration::from_secs(10), 1, 0.2))),
    };
    tower::ServiceBuilder::new()
        .timeout(Duration::from_secs(10))
        .retry(policy)
        .timeout(Duration::from_secs(5))
        .service(Instant200)
}

/// Nanoseconds per call, each of `threads` threads (each with a runtime of
/// its own, started together) making `CALLS` calls on clones of one stack
/// that `make` builds (`shared`), or each on a stack of its own: the same
/// work with nothing shared, to tell what sharing costs from what the
/// machine does with more threads. The mean of the threads' own times:
/// threads of one runtime's pool would measure its scheduling too (two
/// tasks that never wait can run on one worker while the other idles).
fn per_call_threads<S: Shareable>(threads: usize, shared: bool, make: fn() -> S) -> f64 {
    let one = Arc::new(make());
    let start = Barrier::new(threads);
    let times: Vec<f64> = std::thread::scope(|scope| {
        let running: Vec<_> = (0..threads)
            .map(|_| {
                let stack = if shared {
                    Arc::clone(&one)
                } else {
                    Arc::new(make())
                };
                let start = &start;
                scope.spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .build()
                        .expect("runtime");
                    start.wait();
                    rt.block_on(async move {
                        let began = Instant::now();
                        for _ in 0..CALLS {
                            let req = Request::get("http://inventory/items/7")
                                .body(Body::new())
                                .expect("valid request");
                            let svc = (*stack).clone();
                            std::hint::black_box(svc.oneshot(req).await.expect("answered"));
                        }
                        began.elapsed().as_nanos() as f64 / f64::from(CALLS)
                    })
                })
            })
            .collect();
        running
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect()
    });
    times.iter().sum::<f64>() / times.len() as f64
}

/// Each of `rounds` rounds, the threads in another order (so that drift
/// hits all alike), shared and each its own: per thread count, the
/// medians, shared and own, in nanoseconds a call.
fn by_threads<S: Shareable>(threads: &[usize], rounds: usize, make: fn() -> S) -> Vec<(f64, f64)> {
    let mut samples: Vec<[Vec<f64>; 2]> = vec![[Vec::new(), Vec::new()]; threads.len()];
    for r in 0..rounds {
        for k in 0..threads.len() {
            let i = (k + r) % threads.len();
            samples[i][0].push(per_call_threads(threads[i], true, make));
            samples[i][1].push(per_call_threads(threads[i], false, make));
        }
    }
    samples
        .into_iter()
        .map(|[shared, own]| (median(shared), median(own)))
        .collect()
}

fn main() {
    let rounds: usize = std::env::var("RESEND_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("rounds: {rounds}, {CALLS} calls per measure, {cores} cores");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let sizes = [3usize, 100, 1_000, 10_000];
    let mut by_size: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    for r in 0..rounds {
        // Each round in another order, so that drift hits all alike.
        for k in 0..sizes.len() {
            let i = (k + r) % sizes.len();
            by_size[i].push(rt.block_on(per_call(sizes[i])));
        }
    }
    let three = median(by_size[0].clone());
    for (n, samples) in sizes.iter().zip(by_size) {
        let m = median(samples);
        println!(
            "stack().fleet(..) over {n:>6} instances : median {m:7.1} ns per call ({:.3}x the 3-instance cost)",
            m / three
        );
    }

    // A limit on each instance's attempts in flight, nobody overloaded:
    // interleaved with the same fleet without one.
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let limited = || fleet(3).limit(InstanceLimit::adaptive());
        if r % 2 == 0 {
            off.push(rt.block_on(per_call(3)));
            on.push(rt.block_on(per_call_over(limited())));
        } else {
            on.push(rt.block_on(per_call_over(limited())));
            off.push(rt.block_on(per_call(3)));
        }
    }
    let (off, on) = (median(off), median(on));
    println!(
        "stack().fleet(..) over 3 instances, with a limit per instance: median {on:7.1} ns per call, without {off:7.1} ({:.3}x)",
        on / off
    );

    let threads = [1usize, 2, 4, 8];
    let whole = by_threads(&threads, rounds, whole_stack);
    let one = whole[0].0;
    for (t, (m, own)) in threads.iter().zip(whole) {
        let note = if *t > cores {
            " (more threads than cores)"
        } else {
            ""
        };
        println!(
            "{t} thread(s) sharing one stack (budget, throttle, breaker, fleet of 100): median {m:7.1} ns per call each ({:.3}x one thread's; each with a stack of its own: {:.3}x){note}",
            m / one,
            own / one
        );
    }

    // Like for like, on as many threads as there are cores: the retry
    // layers alone, resend's and what a tower user stacks for them.
    let few: Vec<usize> = threads.iter().copied().filter(|t| *t <= cores).collect();
    let rows: [(&str, Vec<(f64, f64)>); 2] = [
        (
            "stack() alone (retry, budget, timeouts)",
            by_threads(&few, rounds, retry_stack),
        ),
        (
            "tower's timeouts, retry and TpsBudget",
            by_threads(&few, rounds, tower_retry_budget),
        ),
    ];
    for (name, medians) in rows {
        let one = medians[0].0;
        for (t, (m, own)) in few.iter().zip(medians) {
            println!(
                "{t} thread(s) sharing {name}: median {m:7.1} ns per call each ({:.3}x one thread's; each its own: {:.3}x)",
                m / one,
                own / one
            );
        }
    }
}
