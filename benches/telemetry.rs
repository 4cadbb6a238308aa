//! Instruction counts of one successful call through the full stack with
//! telemetry off and on, for `valgrind --tool=callgrind` (as `callgrind.rs`):
//!
//! ```sh
//! cargo bench -p tower-resend-benches --features otel --bench telemetry --no-run
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.off <bench binary> off 1000
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.off <bench binary> off 6000
//! ```
//! (The difference of the two runs, over 5000, is the cost of one call
//! without the setup's.) Variants, each the full `tower_resend::stack()` over a
//! service that answers at once, on a current-thread runtime:
//! - `off`: no subscriber, no meter (resend built with `otel`);
//! - `spans`: a global subscriber with tracing-opentelemetry under an
//!   `info` filter, to an SDK tracer provider (always sampled) with a
//!   simple processor and an exporter that drops what it gets: the call and
//!   attempt spans made, ended and exported;
//! - `metrics`: a meter from an SDK meter provider with a manual reader
//!   (never collected): the instruments recorded on;
//! - `both`;
//! - `one_span`, for scale: `off` inside one `info_span!` of the bench's own
//!   per call, entered for the call, exported as in `spans` (tower-resend's spans
//!   filtered out): what one span costs through tracing-opentelemetry.
#![allow(missing_docs, clippy::unwrap_used)]

use http::Request;
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::{ManualReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tower::{Service, ServiceExt};
use tower_resend_benches::{Body, Instant200};
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer as _;

/// Takes the spans and drops them: what is measured is tower-resend's spans and
/// the SDK's work on them, not an exporter's I/O.
#[derive(Debug)]
struct Drop;

impl SpanExporter for Drop {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        std::hint::black_box(batch);
        std::future::ready(Ok(()))
    }
}

async fn run<S>(svc: S, n: usize, one_span: bool)
where
    S: Service<Request<Body>> + Clone,
    S::Error: std::fmt::Debug,
{
    for _ in 0..n {
        let req = Request::get("http://upstream/quote")
            .body(Body::new())
            .unwrap();
        let call = svc.clone().oneshot(req);
        let resp = if one_span {
            call.instrument(tracing::info_span!("bench.call")).await
        } else {
            call.await
        };
        std::hint::black_box(resp.unwrap());
    }
}

fn main() {
    let variant = std::env::args().nth(1).unwrap_or_default();
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let (spans, metrics) = match variant.as_str() {
        "off" => (false, false),
        "spans" | "one_span" => (true, false),
        "metrics" => (false, true),
        "both" => (true, true),
        other => panic!("unknown variant {other:?}"),
    };
    let one_span = variant == "one_span";
    let tracer = SdkTracerProvider::builder()
        .with_simple_exporter(Drop)
        .build();
    if spans {
        // As an application has it: the usual `info` filter.
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer.tracer("bench"))
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
        let registry = tracing_subscriber::registry();
        if one_span {
            // tower-resend's own spans filtered out.
            let layer = layer.with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                meta.target() != "tower_resend"
            }));
            tracing::subscriber::set_global_default(registry.with(layer)).unwrap();
        } else {
            tracing::subscriber::set_global_default(registry.with(layer)).unwrap();
        }
    }
    let meters = SdkMeterProvider::builder()
        .with_reader(ManualReader::builder().build())
        .build();
    let mut stack = tower_resend::stack().name("bench");
    if metrics {
        stack = stack.meter(&meters.meter("tower-resend"));
    }
    let svc = stack.service(Instant200);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(svc, n, one_span));
}
