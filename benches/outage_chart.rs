//! The README's picture: 100 calls through a 2 s outage, upstream arrivals
//! per 50 ms, tower-resend beside what a user would otherwise stack for the
//! same behaviour (tower's retry with tower's backoff and budget, and
//! reqwest-middleware with reqwest-retry), every client with the same cap:
//! 7 attempts in all, backoff from 100 ms to 5 s.
//!
//! `cargo bench -p tower-resend-benches --bench outage_chart` prints the
//! counts and writes `docs/outage.svg` at the workspace root. Real clock,
//! loopback, a few seconds a client.

#![allow(clippy::print_stdout)] // a bench reports on standard output

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use plotters::prelude::*;
use reqwest_middleware::ClientBuilder;
use reqwest_retry::policies::ExponentialBackoff as ReqwestBackoff;
use reqwest_retry::RetryTransientMiddleware;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::retry::backoff::{Backoff, ExponentialBackoff, ExponentialBackoffMaker, MakeBackoff};
use tower::retry::budget::{Budget, TpsBudget};
use tower::util::rng::HasherRng;
use tower::{BoxError, ServiceExt};
use tower_resend_testkit::{Reply, Script, TestServer};

const CALLS: usize = 100;
const OUTAGE: Duration = Duration::from_secs(2);
const WINDOW: Duration = Duration::from_millis(50);
/// Attempts in all, for every client.
const ATTEMPTS: usize = 7;
const BASE: Duration = Duration::from_millis(100);
const CAP: Duration = Duration::from_secs(5);
/// How much of the run the picture shows.
const SHOWN: Duration = Duration::from_secs(6);

/// What one client did to the upstream.
struct Run {
    name: &'static str,
    /// Arrivals per window, from the first call's start.
    per_window: Vec<usize>,
    sends: usize,
    during_outage: usize,
    ok: usize,
}

type Call = Pin<Box<dyn Future<Output = bool> + Send>>;

/// Starts an upstream that answers 503 for the outage, then 200; sends
/// `CALLS` calls at once through `call` (each says whether it ended 200).
async fn run(name: &'static str, call: impl Fn(String) -> Call) -> Run {
    let start = Instant::now();
    let server = TestServer::start(Script::from_fn(move |a| {
        if a.at.duration_since(start) < OUTAGE {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    }))
    .await
    .expect("a loopback server");
    let mut calls = JoinSet::new();
    for i in 0..CALLS {
        calls.spawn(call(server.uri(&format!("/outage/{i}")).to_string()));
    }
    let mut ok = 0;
    while let Some(done) = calls.join_next().await {
        ok += usize::from(done.expect("the call ran"));
    }
    let arrivals = server.arrivals();
    let windows = (SHOWN.as_millis() / WINDOW.as_millis()) as usize;
    let mut per_window = vec![0; windows];
    let mut during_outage = 0;
    for a in &arrivals {
        let since = a.at.duration_since(start);
        during_outage += usize::from(since < OUTAGE);
        let w = (since.as_millis() / WINDOW.as_millis()) as usize;
        if let Some(slot) = per_window.get_mut(w) {
            *slot += 1;
        }
    }
    Run {
        name,
        per_window,
        sends: arrivals.len(),
        during_outage,
        ok,
    }
}

type Req = Request<Empty<Bytes>>;

/// tower's retry as a tower user writes it for the same behaviour: retry
/// 5xx and errors, up to the cap, waiting with tower's exponential backoff,
/// drawing on tower's `TpsBudget` (its defaults: 10 s, 10 a second, 20 %).
#[derive(Clone)]
struct TowerPolicy {
    left: usize,
    backoff: ExponentialBackoff,
    budget: Arc<TpsBudget>,
}

impl<E> tower::retry::Policy<Req, Response<Incoming>, E> for TowerPolicy {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _: &mut Req,
        result: &mut Result<Response<Incoming>, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(r) if !r.status().is_server_error() => {
                self.budget.deposit();
                None
            }
            _ if self.left > 0 && self.budget.withdraw() => {
                self.left -= 1;
                Some(self.backoff.next_backoff())
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

fn ok(status: StatusCode) -> bool {
    status == StatusCode::OK
}

async fn tower_resend_run() -> Run {
    let stack = tower_resend::stack()
        .name("upstream")
        .max_attempts(ATTEMPTS as u32)
        .total(Duration::from_secs(60))
        .service(tower_resend::hyper_client(Duration::from_secs(2)));
    run("tower-resend", move |uri| {
        let stack = stack.clone();
        Box::pin(async move {
            let req = Request::get(uri).body(Empty::<Bytes>::new()).unwrap();
            match stack.oneshot(req).await {
                Ok(resp) => ok(resp.status()),
                Err(_) => false,
            }
        })
    })
    .await
}

type ErrFn = fn(hyper_util::client::legacy::Error) -> BoxError;
type TowerRetry = tower::retry::Retry<
    TowerPolicy,
    tower::util::MapErr<Client<HttpConnector, Empty<Bytes>>, ErrFn>,
>;

fn to_box(e: hyper_util::client::legacy::Error) -> BoxError {
    e.into()
}

/// One call through tower's retry (a function of its own, with every type
/// named, so the compiler sees its future is `Send`).
async fn tower_call(svc: TowerRetry, uri: String) -> bool {
    let req = Request::get(uri).body(Empty::<Bytes>::new()).unwrap();
    match svc.oneshot(req).await {
        Ok(resp) => {
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            ok(status)
        }
        Err(_) => false,
    }
}

async fn tower_retry_run() -> Run {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2));
    let maker =
        ExponentialBackoffMaker::new(BASE, CAP, 1.0, HasherRng::default()).expect("valid backoff");
    run("tower retry", move |uri| {
        let policy = TowerPolicy {
            left: ATTEMPTS - 1,
            backoff: maker.clone().make_backoff(),
            budget: Arc::clone(&budget),
        };
        let inner = tower::util::MapErr::new(client.clone(), to_box as ErrFn);
        Box::pin(tower_call(tower::retry::Retry::new(policy, inner), uri))
    })
    .await
}

async fn reqwest_retry_run() -> Run {
    let http = tower_resend::reqwest::client_builder(Duration::from_secs(2))
        .build()
        .expect("a reqwest client");
    let policy = ReqwestBackoff::builder()
        .retry_bounds(BASE, CAP)
        .build_with_max_retries(ATTEMPTS as u32 - 1);
    let client = ClientBuilder::new(http)
        .with(RetryTransientMiddleware::new_with_policy(policy))
        .build();
    run("reqwest-retry", move |uri| {
        let client = client.clone();
        Box::pin(async move {
            match client.get(uri).send().await {
                Ok(resp) => ok(resp.status()),
                Err(_) => false,
            }
        })
    })
    .await
}

fn draw(runs: &[Run], path: &PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = runs
        .iter()
        .flat_map(|r| r.per_window.iter().copied())
        .max()
        .unwrap_or(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{CALLS} calls through a 2 s outage: upstream arrivals per 50 ms (7 attempts each)"
            ),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(0f64..SHOWN.as_secs_f64(), 0usize..top + top / 10 + 1)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the calls started (the outage: 0 to 2 s)")
        .y_desc("arrivals per 50 ms")
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    chart.draw_series(std::iter::once(Rectangle::new(
        [(0.0, 0), (OUTAGE.as_secs_f64(), top + top / 10 + 1)],
        RGBColor(240, 200, 200).mix(0.35).filled(),
    )))?;
    let colours = [
        RGBColor(0, 110, 190),
        RGBColor(220, 120, 0),
        RGBColor(120, 120, 120),
    ];
    for (run, colour) in runs.iter().zip(colours) {
        let points = run
            .per_window
            .iter()
            .enumerate()
            .map(|(w, n)| ((w as f64 + 0.5) * WINDOW.as_secs_f64(), *n));
        let label = format!(
            "{}: {} sends ({} in the outage), {}/{} calls ok",
            run.name, run.sends, run.during_outage, run.ok, CALLS
        );
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    root.present()?;
    Ok(())
}

#[tokio::main]
async fn main() {
    let runs = [
        tower_resend_run().await,
        tower_retry_run().await,
        reqwest_retry_run().await,
    ];
    println!("| client | sends | in the outage | calls ok | busiest 50 ms |");
    println!("|---|---|---|---|---|");
    for r in &runs {
        println!(
            "| {} | {} | {} | {}/{CALLS} | {} |",
            r.name,
            r.sends,
            r.during_outage,
            r.ok,
            r.per_window.iter().max().unwrap_or(&0)
        );
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/outage.svg");
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("docs/ can be made");
    }
    draw(&runs, &path).expect("the SVG is written");
    println!("wrote {}", path.display());
}
