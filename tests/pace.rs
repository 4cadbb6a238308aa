//! Pacing by the quota the upstream states, on loopback, on tokio's paused
//! clock: an upstream with a quota of 100 calls per 10 s window, stated on
//! every answer (in the IETF fields, in `X-RateLimit-*` with epoch resets,
//! in the model APIs' fields with duration resets), 429 beyond it; 20
//! callers for 60 s through the stack with pacing, and beside them the
//! same load through the stack without it, and through tower's retry (429
//! and 5xx retried twice, 100 ms apart) as a tower user would write it.
#![allow(clippy::print_stderr)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::Full;

use tower_resend::quota::PaceLayer;

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;
#[allow(dead_code)] // each test binary uses part of the pacing helpers
mod pace_upstream;

use pace_upstream::{load, upstream, Announce, Seen, Served, EPOCH_AT_START};

const CALLERS: usize = 20;
const QUOTA: u64 = 100;
const WINDOW: Duration = Duration::from_secs(10);
const RUN: Duration = Duration::from_secs(60);

/// What the upstream saw over the run.
#[derive(Debug)]
struct Figures {
    served: usize,
    /// 200s within the run (a call that began before its end may be
    /// answered after it, in the next window).
    ok: usize,
    too_many: usize,
    /// The most 200s in the first second of a window after the first.
    at_reset: usize,
    /// The most 200s in any one second but the first (in which the
    /// callers' first calls go before any answer told the quota).
    busiest: usize,
}

fn figures(served: &Served) -> Figures {
    let seconds = RUN.as_secs() as usize + 1;
    let mut per_second = vec![0; seconds];
    for (at, status) in &served.log {
        if *status == 200 {
            if let Some(n) = per_second.get_mut(at.as_secs() as usize) {
                *n += 1;
            }
        }
    }
    let at_reset = (1..RUN.as_secs() / WINDOW.as_secs())
        .map(|k| per_second[(k * WINDOW.as_secs()) as usize])
        .max()
        .unwrap_or(0);
    Figures {
        served: served.log.len(),
        ok: served
            .log
            .iter()
            .filter(|(at, s)| *s == 200 && *at < RUN)
            .count(),
        too_many: served.log.iter().filter(|(_, s)| *s == 429).count(),
        at_reset,
        busiest: per_second.into_iter().skip(1).max().unwrap_or(0),
    }
}

/// tower's retry as a user writes it for an API that answers 429: the
/// 429 (and 5xx, and errors) retried twice, 100 ms apart.
#[derive(Clone)]
struct Retry429 {
    left: usize,
}

impl<R, E> tower::retry::Policy<http::Request<Full<Bytes>>, http::Response<R>, E> for Retry429 {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _: &mut http::Request<Full<Bytes>>,
        result: &mut Result<http::Response<R>, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(r) if r.status() != 429 && !r.status().is_server_error() => None,
            _ if self.left > 0 => {
                self.left -= 1;
                Some(tokio::time::sleep(Duration::from_millis(100)))
            }
            _ => None,
        }
    }

    fn clone_request(
        &mut self,
        req: &http::Request<Full<Bytes>>,
    ) -> Option<http::Request<Full<Bytes>>> {
        let mut copy = http::Request::new(req.body().clone());
        *copy.method_mut() = req.method().clone();
        *copy.uri_mut() = req.uri().clone();
        *copy.headers_mut() = req.headers().clone();
        Some(copy)
    }
}

/// The load through tower's retry over the same client, beside the stack.
async fn run_tower(announce: Announce) -> Figures {
    let served = Arc::new(Mutex::new(Served::default()));
    let server = upstream(announce, QUOTA, WINDOW, Arc::clone(&served)).await;
    let client = tower::ServiceBuilder::new()
        .map_err(tower_resend::Error::from_box)
        .retry(Retry429 { left: 2 })
        .timeout(Duration::from_secs(5))
        .service(common::transport());
    let seen = load(client, server.uri("/"), CALLERS, RUN).await;
    let f = figures(&served.lock().unwrap());
    eprintln!("{announce:?}, tower's retry: {f:?}, callers saw {seen:?}");
    f
}

/// One run: the load through the stack, paced or not.
async fn run(announce: Announce, paced: bool) -> (Figures, Seen) {
    let served = Arc::new(Mutex::new(Served::default()));
    let server = upstream(announce, QUOTA, WINDOW, Arc::clone(&served)).await;
    let uri = server.uri("/");
    let stack = common::stack();
    let seen = if paced {
        let pace = PaceLayer::new().wall_clock(UNIX_EPOCH + Duration::from_secs(EPOCH_AT_START));
        load(
            stack.pace(pace).service(common::transport()),
            uri,
            CALLERS,
            RUN,
        )
        .await
    } else {
        load(stack.service(common::transport()), uri, CALLERS, RUN).await
    };
    let f = figures(&served.lock().unwrap());
    eprintln!("{announce:?}, paced: {paced}: {f:?}, callers saw {seen:?}");
    (f, seen)
}

/// Paced: no 429, at least 95 % of the quota used, at most 20 % of a
/// window's quota in the first second after its reset. Beside it, the same
/// load without pacing meets 429s.
async fn paced_against_unpaced(announce: Announce) {
    let quota_in_run = (RUN.as_secs() / WINDOW.as_secs() * QUOTA) as usize;
    let (paced, seen) = run(announce, true).await;
    assert_eq!(paced.too_many, 0, "{announce:?}: {paced:?}");
    assert!(
        paced.ok * 100 >= quota_in_run * 95,
        "{announce:?}: {} of {quota_in_run}",
        paced.ok
    );
    assert!(paced.ok <= quota_in_run, "{announce:?}: {paced:?}");
    assert!(
        paced.at_reset * 100 <= QUOTA as usize * 20,
        "{announce:?}: {paced:?}"
    );
    assert!(
        paced.busiest * 100 <= QUOTA as usize * 20,
        "{announce:?}: {paced:?}"
    );
    assert_eq!(seen.failed, 0, "{announce:?}: {seen:?}");
    assert_eq!(
        seen.ok, paced.served,
        "{announce:?}: every call sent was answered 200"
    );

    let (unpaced, _) = run(announce, false).await;
    assert!(unpaced.too_many > 0, "{announce:?}: {unpaced:?}");
    let tower = run_tower(announce).await;
    assert!(tower.too_many > 0, "{announce:?}: {tower:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn paced_by_the_ietf_fields_no_call_meets_a_429() {
    paced_against_unpaced(Announce::Ietf).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn paced_by_x_ratelimit_with_epoch_resets_no_call_meets_a_429() {
    paced_against_unpaced(Announce::XEpoch).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn paced_by_the_model_apis_duration_resets_no_call_meets_a_429() {
    paced_against_unpaced(Announce::ModelDuration).await;
}
