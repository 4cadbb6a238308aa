//! In-process overhead as interleaved ratios: every round times each
//! variant in turn (rotating which goes first) and the ratios are taken
//! within the round, so that drift on a shared machine hits both sides of a
//! ratio alike (one variant after another, it lands between them).
//!
//! `cargo bench -p tower-resend-benches --bench overhead_ratio`
//! (`RESEND_BENCH_ROUNDS=n` sets the rounds, default 41: on a shared VM, 21
//! moved the stack's ratio by ±0.05 from run to run). With
//! `RESEND_BENCH_ONLY=pace`, only the paced stack and the same stack over
//! the same answers, in turn, for 201 rounds by default: the pacing
//! layer's cost, whose 100 ns line is within the noise of a full run.
#![allow(missing_docs, clippy::print_stdout)]

use tokio::time::Instant;

use http::Request;
use tower::ServiceExt;

use tower_resend_benches::variants::{self, Variant};
use tower_resend_benches::{median, Body};

/// Calls per variant per round.
const CALLS: u32 = 20_000;

/// Nanoseconds per call over `CALLS` calls, each on a clone of `svc`.
async fn per_call<S: Variant>(svc: &S) -> f64 {
    let start = Instant::now();
    for _ in 0..CALLS {
        let req = Request::get("http://upstream/quote")
            .body(Body::new())
            .expect("valid request");
        let resp = svc.clone().oneshot(req).await;
        std::hint::black_box(resp.expect("answered"));
    }
    start.elapsed().as_nanos() as f64 / f64::from(CALLS)
}

fn main() {
    let rounds: usize = std::env::var("RESEND_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(41);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    if std::env::var("RESEND_BENCH_ONLY").is_ok_and(|v| v == "pace") {
        let rounds: usize = std::env::var("RESEND_BENCH_ROUNDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(201);
        rt.block_on(pace_only(rounds));
        return;
    }
    rt.block_on(async {
        let tower = variants::tower_timeout();
        let tower_ext = variants::tower_timeout_ext();
        let ours = variants::resend_deadline_attempt();
        let retry = variants::tower_retry();
        let retry_ext = variants::tower_retry_ext();
        let stack = variants::stack();
        let breaker = variants::stack_breaker();
        let no_read_ahead = variants::stack_no_read_ahead();
        let throttled = variants::stack_throttled();
        let paced = variants::stack_paced();
        let unpaced = variants::stack_quota_unpaced();
        const NAMES: [&str; 11] = [
            "tower Timeout",
            "tower Timeout + Deadline extension",
            "resend Deadline + AttemptTimeout",
            "tower Timeout + Retry + Timeout",
            "the same + Deadline and history extensions",
            "tower_resend::stack()",
            "tower_resend::stack().circuit_breaker()",
            "tower_resend::stack().read_ahead(0)",
            "tower_resend::stack().adaptive_throttling()",
            "tower_resend::stack().pace(..), quota stated",
            "tower_resend::stack(), the same answers",
        ];
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); NAMES.len()];
        // Warm-up round, not counted.
        for k in 0..=rounds {
            let mut got = [0.0; NAMES.len()];
            for j in 0..NAMES.len() {
                let which = (k + j) % NAMES.len();
                got[which] = match which {
                    0 => per_call(&tower).await,
                    1 => per_call(&tower_ext).await,
                    2 => per_call(&ours).await,
                    3 => per_call(&retry).await,
                    4 => per_call(&retry_ext).await,
                    5 => per_call(&stack).await,
                    6 => per_call(&breaker).await,
                    7 => per_call(&no_read_ahead).await,
                    8 => per_call(&throttled).await,
                    9 => per_call(&paced).await,
                    _ => per_call(&unpaced).await,
                };
            }
            if k > 0 {
                for (t, g) in times.iter_mut().zip(got) {
                    t.push(g);
                }
            }
        }
        println!("rounds: {rounds}, {CALLS} calls per variant per round, current-thread runtime");
        for (name, t) in NAMES.iter().zip(&times) {
            println!("{name:<44}: median {:7.1} ns per call", median(t.clone()));
        }
        let ratio = |a: usize, b: usize| {
            median(times[a].iter().zip(&times[b]).map(|(x, y)| x / y).collect())
        };
        println!(
            "Deadline + AttemptTimeout / tower Timeout            : {:.2}",
            ratio(2, 0)
        );
        println!(
            "Deadline + AttemptTimeout / Timeout + extension      : {:.2}",
            ratio(2, 1)
        );
        println!(
            "tower_resend::stack() / tower retry + timeouts             : {:.2}",
            ratio(5, 3)
        );
        println!(
            "tower_resend::stack() / tower retry + timeouts + extensions: {:.2}",
            ratio(5, 4)
        );
        println!(
            "stack().circuit_breaker() / stack()                  : {:.3}",
            ratio(6, 5)
        );
        println!(
            "stack().circuit_breaker() - stack()                  : {:+.1} ns",
            median(times[6].iter().zip(&times[5]).map(|(x, y)| x - y).collect())
        );
        println!(
            "stack() - stack().read_ahead(0)                      : {:+.1} ns",
            median(times[5].iter().zip(&times[7]).map(|(x, y)| x - y).collect())
        );
        println!(
            "stack().adaptive_throttling() - stack()              : {:+.1} ns",
            median(times[8].iter().zip(&times[5]).map(|(x, y)| x - y).collect())
        );
        println!(
            "stack().pace(..) - stack(), quota stated on each answer: {:+.1} ns",
            median(
                times[9]
                    .iter()
                    .zip(&times[10])
                    .map(|(x, y)| x - y)
                    .collect()
            )
        );
    });
}

/// The paced stack against the same stack over the same answers, in turn
/// (which goes first alternating), `rounds` rounds after one of warm-up:
/// the median of the rounds' differences.
async fn pace_only(rounds: usize) {
    let paced = variants::stack_paced();
    let unpaced = variants::stack_quota_unpaced();
    let mut diffs = Vec::with_capacity(rounds);
    let mut bases = Vec::with_capacity(rounds);
    for k in 0..=rounds {
        let (p, u) = if k % 2 == 0 {
            (per_call(&paced).await, per_call(&unpaced).await)
        } else {
            let u = per_call(&unpaced).await;
            (per_call(&paced).await, u)
        };
        if k > 0 {
            diffs.push(p - u);
            bases.push(u);
        }
    }
    let mut sorted = diffs.clone();
    sorted.sort_by(f64::total_cmp);
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q) as usize];
    println!(
        "stack().pace(..) - stack(), quota stated on each answer, {rounds} rounds: median {:+.1} ns (quartiles {:+.1}, {:+.1}), over stack() at {:.0} ns",
        median(diffs),
        at(0.25),
        at(0.75),
        median(bases)
    );
}
