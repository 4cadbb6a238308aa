//! Telemetry: the spans and metrics resend emits, by OpenTelemetry's names.
//!
//! Two calls on loopback, no outside services:
//! - a flaky GET (503, 503, 200) through a tower-resend stack: one `resend.call`
//!   span, three `GET` client spans under it with `http.request.resend_count`,
//!   `http.response.status_code` and `error.type`, and a `waiting to retry`
//!   event per wait;
//! - a keyed POST to an axum app behind tower-resend-server's `IdempotencyLayer`
//!   whose handler takes 500 ms: the first attempt times out (150 ms), the
//!   retry finds the key still running (409), the third gets the stored
//!   response, replayed; the handler ran once.
//!
//! Spans go through `tracing` and tracing-opentelemetry to an OpenTelemetry
//! SDK tracer provider; metrics to an SDK meter provider, from the meters
//! passed to `tower_resend::stack().meter(..)` and `IdempotencyLayer::meter(..)`.
//! Both are printed at the end, one line per span and per data point:
//! `cargo run --example telemetry`. With `-- --stdout`, the SDK's stdout
//! exporters print them instead, in full (several screens).
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry::trace::{SpanId, Status, TracerProvider as _};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tokio::net::TcpListener;
use tower::ServiceExt;
use tower_resend::{retry::Attempts, IdempotencyKey};
use tower_resend_server::{IdempotencyLayer, MemoryStore};
use tower_resend_testkit::{Reply, Script, TestServer};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer as _;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let stdout = std::env::args().any(|a| a == "--stdout");

    // The application's telemetry: an SDK tracer provider fed by
    // tracing-opentelemetry (at the usual `info` level), and an SDK meter
    // provider.
    let spans = InMemorySpanExporter::default();
    let tracer = match stdout {
        true => SdkTracerProvider::builder()
            .with_simple_exporter(opentelemetry_stdout::SpanExporter::default()),
        false => SdkTracerProvider::builder().with_simple_exporter(spans.clone()),
    }
    .build();
    let points = InMemoryMetricExporter::default();
    let meters = match stdout {
        true => SdkMeterProvider::builder().with_reader(
            PeriodicReader::builder(opentelemetry_stdout::MetricExporter::default()).build(),
        ),
        false => {
            SdkMeterProvider::builder().with_reader(PeriodicReader::builder(points.clone()).build())
        }
    }
    .build();
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer.tracer("example"))
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(otel))?;
    let meter = meters.meter("tower-resend");

    // 1. A flaky GET: 503, 503, 200.
    let quotes = TestServer::start(
        Script::new()
            .then_n(2, Reply::status(503))
            .otherwise(Reply::ok().body("rates")),
    )
    .await?;
    let client = tower_resend::stack()
        .name("quotes")
        .no_budget()
        .retry(|r| r.overload_floor(Duration::from_millis(50)))
        .meter(&meter)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let req = Request::get(quotes.uri("/rates?customer=42")).body(Full::<Bytes>::default())?;
    let resp = client.oneshot(req).await?;
    let made = resp.extensions().get::<Attempts>().map_or(0, Attempts::len);
    println!("GET /rates: {} after {made} attempts", resp.status());
    drop(resp);

    // 2. A keyed POST, replayed by resend-server.
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let counted = Arc::clone(&counted);
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    (http::StatusCode::CREATED, "order 1")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new()).meter(&meters.meter("tower-resend-server")),
        );
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    let orders = tower_resend::stack()
        .name("orders")
        .attempt_timeout(Duration::from_millis(150))
        .idempotency_keys()
        .meter(&meter)
        .service(tower_resend::hyper_client(Duration::from_secs(1)));
    let mut req = Request::post(format!("http://{addr}/orders"))
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"tea\"}")))?;
    req.extensions_mut().insert(IdempotencyKey::new("order-1")?);
    let resp = orders.oneshot(req).await?;
    let made = resp.extensions().get::<Attempts>().map_or(0, Attempts::len);
    let replayed = resp.headers().contains_key("idempotent-replayed");
    println!(
        "POST /orders: {} after {made} attempts (replayed: {replayed}); the handler ran {} time(s)",
        resp.status(),
        runs.load(Ordering::SeqCst)
    );
    drop(resp);

    tracer.force_flush()?;
    meters.force_flush()?;
    if !stdout {
        println!("\nspans (tracing -> tracing-opentelemetry -> OpenTelemetry SDK):");
        print_spans(spans.get_finished_spans()?);
        println!("\nmetrics (OpenTelemetry SDK, cumulative):");
        if let Some(last) = points.get_finished_metrics()?.last() {
            print_metrics(last);
        }
    }
    Ok(())
}

/// Each span on a line, its children under it; its events under it too.
fn print_spans(spans: Vec<SpanData>) {
    let ids: Vec<SpanId> = spans.iter().map(|s| s.span_context.span_id()).collect();
    let mut children: HashMap<SpanId, Vec<&SpanData>> = HashMap::new();
    let mut roots = Vec::new();
    for span in &spans {
        if ids.contains(&span.parent_span_id) {
            children.entry(span.parent_span_id).or_default().push(span);
        } else {
            roots.push(span);
        }
    }
    roots.sort_by_key(|s| s.start_time);
    for root in roots {
        print_span(root, &children, 0);
    }
}

fn print_span(span: &SpanData, children: &HashMap<SpanId, Vec<&SpanData>>, depth: usize) {
    let pad = "  ".repeat(depth + 1);
    let took = span
        .end_time
        .duration_since(span.start_time)
        .unwrap_or_default();
    let status = match span.status {
        Status::Error { .. } => " ERROR",
        _ => "",
    };
    println!(
        "{pad}{} [{:?}{status}, {} ms] {}",
        span.name,
        span.span_kind,
        took.as_millis(),
        attributes(span.attributes.iter())
    );
    for event in span.events.iter() {
        println!(
            "{pad}  * {}: {}",
            event.name,
            attributes(event.attributes.iter())
        );
    }
    let mut mine = children
        .get(&span.span_context.span_id())
        .cloned()
        .unwrap_or_default();
    mine.sort_by_key(|s| s.start_time);
    for child in mine {
        print_span(child, children, depth + 1);
    }
}

/// `key=value ...`, without what tracing-opentelemetry adds to events
/// (their level and target).
fn attributes<'a>(kvs: impl Iterator<Item = &'a opentelemetry::KeyValue>) -> String {
    kvs.filter(|kv| !matches!(kv.key.as_str(), "level" | "target"))
        .map(|kv| format!("{}={}", kv.key, kv.value))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Each data point on a line: histograms as count and sum, counters and
/// gauges as their value.
fn print_metrics(metrics: &ResourceMetrics) {
    for scope in metrics.scope_metrics() {
        for metric in scope.metrics() {
            let unit = match metric.unit() {
                "s" => " s",
                _ => "",
            };
            let lines = match metric.data() {
                AggregatedMetrics::F64(d) => points(d, unit),
                AggregatedMetrics::U64(d) => points(d, unit),
                AggregatedMetrics::I64(d) => points(d, unit),
            };
            for line in lines {
                println!("  {} {line}", metric.name());
            }
        }
    }
}

fn points<T: Copy + std::fmt::Display>(data: &MetricData<T>, unit: &str) -> Vec<String> {
    let labels = |mut kvs: Vec<&opentelemetry::KeyValue>| {
        kvs.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
        match kvs.is_empty() {
            true => String::new(),
            false => format!("{{{}}} ", attributes(kvs.into_iter())),
        }
    };
    match data {
        MetricData::Histogram(h) => h
            .data_points()
            .map(|p| {
                format!(
                    "{}count {}, sum {:.3}{unit}",
                    labels(p.attributes().collect()),
                    p.count(),
                    p.sum()
                )
            })
            .collect(),
        MetricData::Sum(s) => s
            .data_points()
            .map(|p| format!("{}{}", labels(p.attributes().collect()), p.value()))
            .collect(),
        MetricData::Gauge(g) => g
            .data_points()
            .map(|p| format!("{}{}", labels(p.attributes().collect()), p.value()))
            .collect(),
        MetricData::ExponentialHistogram(_) => Vec::new(),
    }
}
