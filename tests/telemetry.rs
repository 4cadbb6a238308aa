//! What resend tells a tracing backend and a metrics pipeline, read back
//! from the OpenTelemetry SDK's in-memory span exporter (through
//! tracing-opentelemetry) and an in-memory metric reader: the call and
//! attempt spans and their attributes, the wait events, and the client's
//! metrics, over loopback against the scripted `tower-resend-testkit` server (and
//! an in-process gRPC-shaped upstream), on tokio's paused clock.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry::trace::{SpanKind, Status, TracerProvider as _};
use opentelemetry::Value;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tower::{service_fn, Layer, ServiceExt};
use tower_resend::retry::{RetryBudget, RetryLayer};
use tower_resend::{breaker::CircuitBreakerLayer, ErrorKind};
use tower_resend_testkit::{Reply, Script, TestServer};
use tracing_subscriber::layer::SubscriberExt;

/// What one test reads back: the spans exported and the metrics collected.
struct Telemetry {
    spans: InMemorySpanExporter,
    tracer: SdkTracerProvider,
    metrics: InMemoryMetricExporter,
    meters: SdkMeterProvider,
    _subscriber: tracing::subscriber::DefaultGuard,
}

impl Telemetry {
    /// A tracer provider and a meter provider to memory, and a subscriber
    /// with tracing-opentelemetry on this thread (the tests run on a
    /// current-thread runtime).
    fn start() -> Self {
        let spans = InMemorySpanExporter::default();
        let tracer = SdkTracerProvider::builder()
            .with_simple_exporter(spans.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(tracer.tracer("test"));
        let subscriber = tracing_subscriber::registry().with(layer);
        let metrics = InMemoryMetricExporter::default();
        let meters = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(metrics.clone()).build())
            .build();
        Self {
            spans,
            tracer,
            metrics,
            meters,
            _subscriber: tracing::subscriber::set_default(subscriber),
        }
    }

    fn meter(&self) -> Meter {
        self.meters.meter("tower-resend")
    }

    /// The spans ended so far, in the order they ended.
    fn spans(&self) -> Vec<SpanData> {
        self.tracer.force_flush().expect("flush the spans");
        self.spans.get_finished_spans().expect("the finished spans")
    }

    /// The spans named `name`.
    fn named(&self, name: &str) -> Vec<SpanData> {
        self.spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }

    /// Every data point collected so far (cumulative), by instrument name.
    fn points(&self) -> BTreeMap<String, Vec<Point>> {
        self.meters.force_flush().expect("flush the metrics");
        let all = self.metrics.get_finished_metrics().expect("the metrics");
        let mut points: BTreeMap<String, Vec<Point>> = BTreeMap::new();
        // Cumulative: the last collection holds everything.
        let Some(last) = all.last() else {
            return points;
        };
        for scope in last.scope_metrics() {
            for metric in scope.metrics() {
                let found = points.entry(metric.name().to_owned()).or_default();
                found.extend(collect(metric.data()));
            }
        }
        points
    }

    /// The data points of `name` (none if it recorded nothing).
    fn points_of(&self, name: &str) -> Vec<Point> {
        self.points().remove(name).unwrap_or_default()
    }
}

/// One data point: its attributes, and its count and sum (a histogram) or
/// its value (a counter: count 1, sum the value).
#[derive(Clone, Debug, PartialEq)]
struct Point {
    attrs: BTreeMap<String, String>,
    count: u64,
    sum: f64,
}

impl Point {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.get(key).map(String::as_str)
    }
}

fn collect(data: &AggregatedMetrics) -> Vec<Point> {
    fn attrs<'a>(
        kvs: impl Iterator<Item = &'a opentelemetry::KeyValue>,
    ) -> BTreeMap<String, String> {
        kvs.map(|kv| (kv.key.to_string(), kv.value.to_string()))
            .collect()
    }
    fn of<T: Copy>(data: &MetricData<T>, f: fn(T) -> f64) -> Vec<Point> {
        match data {
            MetricData::Histogram(h) => h
                .data_points()
                .map(|p| Point {
                    attrs: attrs(p.attributes()),
                    count: p.count(),
                    sum: f(p.sum()),
                })
                .collect(),
            MetricData::Sum(s) => s
                .data_points()
                .map(|p| Point {
                    attrs: attrs(p.attributes()),
                    count: 1,
                    sum: f(p.value()),
                })
                .collect(),
            MetricData::Gauge(g) => g
                .data_points()
                .map(|p| Point {
                    attrs: attrs(p.attributes()),
                    count: 1,
                    sum: f(p.value()),
                })
                .collect(),
            MetricData::ExponentialHistogram(_) => Vec::new(),
        }
    }
    match data {
        AggregatedMetrics::F64(d) => of(d, |v| v),
        AggregatedMetrics::U64(d) => of(d, |v| v as f64),
        AggregatedMetrics::I64(d) => of(d, |v| v as f64),
    }
}

/// The value of the attribute `key` of `span`, as text.
fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// The value of the attribute `key` of `span`, as an integer.
fn int(span: &SpanData, key: &str) -> Option<i64> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .and_then(|kv| match kv.value {
            Value::I64(n) => Some(n),
            _ => None,
        })
}

async fn server(script: Script) -> TestServer {
    TestServer::start(script)
        .await
        .expect("start the test server")
}

fn get(uri: http::Uri) -> Request<Full<Bytes>> {
    Request::get(uri).body(Full::new(Bytes::new())).unwrap()
}

fn transport() -> tower_resend::connect::HyperClient {
    tower_resend::hyper_client(Duration::from_secs(2))
}

/// The stack under test, named `upstream`, seeded.
fn stack() -> tower_resend::stack::StackBuilder {
    tower_resend::stack()
        .name("upstream")
        .total(Duration::from_secs(10))
        .attempt_timeout(Duration::from_secs(5))
        .max_attempts(3)
        .seed(7)
}

/// The attribute `key` of every span of `spans`.
fn attrs_of(spans: &[SpanData], key: &str) -> Vec<Option<String>> {
    spans.iter().map(|s| attr(s, key)).collect()
}

/// The events named `name` of `span`: their attributes, as text.
fn events(span: &SpanData, name: &str) -> Vec<BTreeMap<String, String>> {
    span.events
        .iter()
        .filter(|e| e.name == name)
        .map(|e| {
            e.attributes
                .iter()
                .map(|kv| (kv.key.to_string(), kv.value.to_string()))
                .collect()
        })
        .collect()
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

// 1. A flaky call: 503, 503, 200.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_flaky_get_is_one_call_span_over_three_attempt_spans() {
    let t = Telemetry::start();
    let server = server(
        Script::new()
            .then(Reply::status(503))
            .then(Reply::status(503).header("retry-after", "1"))
            .otherwise(Reply::ok()),
    )
    .await;
    // No retry budget: every wait is the policy's (see the next test).
    let client = stack().no_budget().meter(&t.meter()).service(transport());
    let resp = client
        .oneshot(get(server.uri("/quote?token=secret")))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    drop(resp);

    // One call span; three attempt spans under it, client spans named by
    // the method, in the order they were sent.
    let calls = t.named("resend.call");
    assert_eq!(calls.len(), 1, "{calls:#?}");
    let call = &calls[0];
    let attempts = t.named("GET");
    assert_eq!(attempts.len(), 3, "{attempts:#?}");
    for a in &attempts {
        assert_eq!(a.parent_span_id, call.span_context.span_id());
        assert_eq!(a.span_context.trace_id(), call.span_context.trace_id());
        assert_eq!(a.span_kind, SpanKind::Client);
    }
    let resend_count: Vec<_> = attempts
        .iter()
        .map(|a| int(a, "http.request.resend_count"))
        .collect();
    assert_eq!(resend_count, [None, Some(1), Some(2)]);
    let status: Vec<_> = attempts
        .iter()
        .map(|a| int(a, "http.response.status_code"))
        .collect();
    assert_eq!(status, [Some(503), Some(503), Some(200)]);
    assert_eq!(
        attrs_of(&attempts, "error.type"),
        [Some("503".into()), Some("503".into()), None]
    );
    assert!(matches!(attempts[0].status, Status::Error { .. }));
    assert!(matches!(attempts[1].status, Status::Error { .. }));
    assert_eq!(attempts[2].status, Status::Unset);
    assert_eq!(
        attrs_of(&attempts, "resend.class"),
        [
            Some("overloaded".into()),
            Some("overloaded".into()),
            Some("success".into())
        ]
    );
    // The URL without its query; the server's address and port.
    let port = i64::from(server.addr().port());
    for a in &attempts {
        assert_eq!(attr(a, "http.request.method").as_deref(), Some("GET"));
        assert_eq!(
            attr(a, "url.full"),
            Some(format!("http://127.0.0.1:{port}/quote"))
        );
        assert_eq!(attr(a, "server.address").as_deref(), Some("127.0.0.1"));
        assert_eq!(int(a, "server.port"), Some(port));
        assert_eq!(attr(a, "rpc.system"), None);
    }

    // The call: its upstream, attempts, outcome and why it stopped.
    assert_eq!(attr(call, "resend.upstream").as_deref(), Some("upstream"));
    assert_eq!(attr(call, "http.request.method").as_deref(), Some("GET"));
    assert_eq!(int(call, "resend.attempts"), Some(3));
    assert_eq!(attr(call, "resend.outcome").as_deref(), Some("success"));
    assert_eq!(attr(call, "resend.stop").as_deref(), Some("final"));
    assert_eq!(attr(call, "error.type"), None);
    assert_eq!(call.status, Status::Unset);
    let elapsed: f64 = attr(call, "resend.elapsed_ms").unwrap().parse().unwrap();
    assert!(
        elapsed >= 2000.0,
        "two waits of a second at least: {elapsed} ms"
    );

    // Each wait, an event of the call with its reason: the overload floor
    // after the bare 503, the server's Retry-After after the second.
    let waits = events(call, "waiting to retry");
    assert_eq!(waits.len(), 2, "{:#?}", call.events);
    assert_eq!(waits[0]["resend.wait.reason"], "overloaded");
    assert_eq!(waits[0]["http.request.resend_count"], "1");
    assert_eq!(waits[1]["resend.wait.reason"], "retry_after");
    assert_eq!(waits[1]["http.request.resend_count"], "2");
    let planned: f64 = waits[1]["resend.wait_ms"].parse().unwrap();
    assert!(planned >= 1000.0, "{planned}");

    // The retries metric: one call, two retries.
    let upstream_get = labels(&[
        ("resend.upstream", "upstream"),
        ("http.request.method", "GET"),
    ]);
    assert_eq!(
        t.points_of("resend.client.call.retries"),
        [Point {
            attrs: upstream_get.clone(),
            count: 1,
            sum: 2.0
        }]
    );
    let mut ended = upstream_get.clone();
    ended.insert("resend.outcome".into(), "success".into());
    assert_eq!(
        t.points_of("resend.client.call.attempts"),
        [Point {
            attrs: ended,
            count: 1,
            sum: 3.0
        }]
    );
    // A retry-delay record per wait, by its reason.
    let delays = t.points_of("resend.client.retry.delay");
    assert_eq!(delays.len(), 2, "{delays:#?}");
    assert_eq!(delays.iter().map(|p| p.count).sum::<u64>(), 2);
    for p in &delays {
        assert_eq!(p.count, 1);
        assert_eq!(p.attr("resend.upstream"), Some("upstream"));
        assert!(p.sum >= 1.0, "{p:?}");
    }
    let mut reasons: Vec<_> = delays
        .iter()
        .map(|p| p.attr("resend.wait.reason").unwrap().to_owned())
        .collect();
    reasons.sort();
    assert_eq!(reasons, ["overloaded", "retry_after"]);
    // Nothing that did not happen.
    let points = t.points();
    for none in [
        "resend.client.call.transparent_retries",
        "resend.client.retry_budget.exhausted",
        "resend.client.outcome_unknown",
        "grpc.client.call.retries",
        "grpc.client.call.retry_delay",
    ] {
        assert!(!points.contains_key(none), "{none}: {points:#?}");
    }
}

/// A retry that finds no budget token waits for one, and says so: the
/// floor's one token paid for the first retry, whose failure spends the
/// floor and pauses it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wait_for_a_budget_token_says_so() {
    let t = Telemetry::start();
    let server = server(
        Script::new()
            .then_n(2, Reply::status(503))
            .otherwise(Reply::ok()),
    )
    .await;
    // A floor of 0.2 retries a second keeps one token.
    let budget =
        tower_resend::retry::RetryBudget::new(0.2, 0.2, Duration::from_secs(10)).expect("a budget");
    let client = stack()
        .budget(budget)
        .meter(&t.meter())
        .service(transport());
    let resp = client.oneshot(get(server.uri("/x"))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    drop(resp);

    let call = &t.named("resend.call")[0];
    let reasons: Vec<_> = events(call, "waiting to retry")
        .into_iter()
        .map(|e| e["resend.wait.reason"].clone())
        .collect();
    assert_eq!(reasons, ["overloaded", "budget"]);
    let budget: Vec<_> = t
        .points_of("resend.client.retry.delay")
        .into_iter()
        .filter(|p| p.attr("resend.wait.reason") == Some("budget"))
        .collect();
    assert_eq!(budget.len(), 1);
    assert_eq!(budget[0].count, 1);
    // It waited, and a token came: not exhausted.
    assert!(budget[0].sum > 0.0);
    assert!(t
        .points_of("resend.client.retry_budget.exhausted")
        .is_empty());
}

// 2. The ends a call can come to.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_empty_retry_budget_is_counted() {
    let t = Telemetry::start();
    let server = server(Script::new().otherwise(Reply::status(503))).await;
    let none = RetryBudget::new(0.0, 0.0, Duration::from_secs(10)).unwrap();
    let client = stack()
        .budget(none)
        .retry(|r| r.max_budget_wait(Duration::ZERO))
        .meter(&t.meter())
        .service(transport());
    // The 503 comes back: there was no token for the retry.
    let resp = client.oneshot(get(server.uri("/x"))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(resp);

    assert_eq!(
        t.points_of("resend.client.retry_budget.exhausted"),
        [Point {
            attrs: labels(&[("resend.upstream", "upstream")]),
            count: 1,
            sum: 1.0
        }]
    );
    let call = &t.named("resend.call")[0];
    assert_eq!(attr(call, "resend.stop").as_deref(), Some("budget"));
    assert_eq!(attr(call, "resend.outcome").as_deref(), Some("overloaded"));
    assert_eq!(attr(call, "error.type").as_deref(), Some("503"));
    assert!(events(call, "waiting to retry").is_empty());
    assert_eq!(t.named("GET").len(), 1);
    assert!(t.points_of("resend.client.outcome_unknown").is_empty());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_outcome_unknown_is_counted() {
    let t = Telemetry::start();
    let server = server(Script::new().otherwise(Reply::status(503))).await;
    let client = stack().meter(&t.meter()).service(transport());
    // A POST without a key may have been processed: not resent.
    let req = Request::post(server.uri("/charges"))
        .body(Full::new(Bytes::from_static(b"amount=100")))
        .unwrap();
    let err = client.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown);
    assert_eq!(server.arrival_count(), 1);

    assert_eq!(
        t.points_of("resend.client.outcome_unknown"),
        [Point {
            attrs: labels(&[
                ("resend.upstream", "upstream"),
                ("http.request.method", "POST")
            ]),
            count: 1,
            sum: 1.0
        }]
    );
    let call = &t.named("resend.call")[0];
    assert_eq!(
        attr(call, "resend.outcome").as_deref(),
        Some("outcome_unknown")
    );
    assert_eq!(attr(call, "error.type").as_deref(), Some("outcome_unknown"));
    assert_eq!(
        attr(call, "resend.stop").as_deref(),
        Some("outcome_unknown")
    );
    assert!(matches!(call.status, Status::Error { .. }));
    let attempts = t.named("POST");
    assert_eq!(attrs_of(&attempts, "error.type"), [Some("503".into())]);
    assert!(t
        .points_of("resend.client.retry_budget.exhausted")
        .is_empty());
    assert!(t.points_of("resend.client.call.retries").is_empty());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn attempt_timeouts_are_the_attempts_error_type_and_the_call_is_exhausted() {
    let t = Telemetry::start();
    let server = server(Script::new().otherwise(Reply::never())).await;
    let client = stack()
        .attempt_timeout(Duration::from_secs(1))
        .max_attempts(2)
        .meter(&t.meter())
        .service(transport());
    let err = client.oneshot(get(server.uri("/slow"))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::RetriesExhausted);

    let attempts = t.named("GET");
    assert_eq!(
        attrs_of(&attempts, "error.type"),
        [
            Some("attempt_timeout".into()),
            Some("attempt_timeout".into())
        ]
    );
    assert_eq!(
        attrs_of(&attempts, "http.response.status_code"),
        [None, None]
    );
    let call = &t.named("resend.call")[0];
    assert_eq!(
        attr(call, "error.type").as_deref(),
        Some("retries_exhausted")
    );
    assert_eq!(attr(call, "resend.stop").as_deref(), Some("max_attempts"));
    assert_eq!(
        events(call, "waiting to retry")[0]["resend.wait.reason"],
        "backoff"
    );
    let retries = t.points_of("resend.client.call.retries");
    assert_eq!((retries[0].count, retries[0].sum), (1, 1.0));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_call_dropped_by_its_caller_ends_its_spans_cancelled() {
    let t = Telemetry::start();
    let server = server(Script::new().otherwise(Reply::never())).await;
    let client = stack().meter(&t.meter()).service(transport());
    let cut = tokio::time::timeout(
        Duration::from_secs(1),
        client.oneshot(get(server.uri("/hang"))),
    )
    .await;
    assert!(cut.is_err(), "the caller gave up first");

    let call = &t.named("resend.call")[0];
    assert_eq!(attr(call, "resend.outcome").as_deref(), Some("cancelled"));
    assert_eq!(attr(call, "error.type").as_deref(), Some("cancelled"));
    assert_eq!(attr(call, "resend.stop"), None);
    let attempts = t.named("GET");
    assert_eq!(
        attrs_of(&attempts, "error.type"),
        [Some("cancelled".into())]
    );
    assert_eq!(attempts[0].parent_span_id, call.span_context.span_id());
    let ended = t.points_of("resend.client.call.attempts");
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].attr("resend.outcome"), Some("cancelled"));
    // No attempt had ended.
    assert_eq!((ended[0].count, ended[0].sum), (1, 0.0));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retries_of_attempts_that_were_not_sent_are_transparent() {
    let t = Telemetry::start();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let client = stack().meter(&t.meter()).service(transport());
    let uri: http::Uri = format!("http://127.0.0.1:{port}/x").parse().unwrap();
    let err = client.oneshot(get(uri)).await.unwrap_err();
    assert!(err.is_not_sent(), "{err}");

    let attempts = t.named("GET");
    assert_eq!(attempts.len(), 3);
    assert!(attrs_of(&attempts, "error.type")
        .iter()
        .all(|e| e.as_deref() == Some("not_sent")));
    let transparent = t.points_of("resend.client.call.transparent_retries");
    assert_eq!(
        transparent,
        [Point {
            attrs: labels(&[
                ("resend.upstream", "upstream"),
                ("http.request.method", "GET")
            ]),
            count: 1,
            sum: 2.0
        }]
    );
    assert!(t.points_of("resend.client.call.retries").is_empty());
}

// 3. gRPC: the gRPC attributes, and gRFC A96's metrics.

/// An answer that is ready at once.
type Answered = std::future::Ready<Result<Response<String>, Infallible>>;

/// A gRPC-shaped upstream that answers UNAVAILABLE twice, then OK, in its
/// headers (trailers-only).
fn grpc_flaky() -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<String>,
    Error = Infallible,
    Future = Answered,
> + Clone {
    let calls = Arc::new(AtomicU32::new(0));
    service_fn(move |_req: Request<Full<Bytes>>| {
        let code = match calls.fetch_add(1, Ordering::SeqCst) {
            0 | 1 => "14",
            _ => "0",
        };
        std::future::ready(Ok(Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", code)
            .body(String::new())
            .unwrap()))
    })
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn grpc_calls_say_their_method_and_status_and_record_a96_metrics() {
    let t = Telemetry::start();
    let client = stack().meter(&t.meter()).service(grpc_flaky());
    // A key makes the call replay-safe: UNAVAILABLE may have been processed.
    let req = Request::post("http://ledger.test/ledger.Ledger/Charge")
        .header("content-type", "application/grpc")
        .header("idempotency-key", "charge-1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client.oneshot(req).await.unwrap();
    assert_eq!(resp.headers()["grpc-status"], "0");
    drop(resp);

    let attempts = t.named("ledger.Ledger/Charge");
    assert_eq!(attempts.len(), 3);
    for a in &attempts {
        assert_eq!(attr(a, "rpc.system").as_deref(), Some("grpc"));
        assert_eq!(attr(a, "rpc.service").as_deref(), Some("ledger.Ledger"));
        assert_eq!(attr(a, "rpc.method").as_deref(), Some("Charge"));
        assert_eq!(attr(a, "url.full"), None);
        assert_eq!(a.span_kind, SpanKind::Client);
    }
    let codes: Vec<_> = attempts
        .iter()
        .map(|a| int(a, "rpc.grpc.status_code"))
        .collect();
    assert_eq!(codes, [Some(14), Some(14), Some(0)]);
    assert_eq!(
        attrs_of(&attempts, "error.type"),
        [Some("UNAVAILABLE".into()), Some("UNAVAILABLE".into()), None]
    );

    let grpc = labels(&[
        ("grpc.method", "ledger.Ledger/Charge"),
        ("grpc.target", "upstream"),
    ]);
    assert_eq!(
        t.points_of("grpc.client.call.retries"),
        [Point {
            attrs: grpc.clone(),
            count: 1,
            sum: 2.0
        }]
    );
    let delay = t.points_of("grpc.client.call.retry_delay");
    assert_eq!(delay.len(), 1);
    assert_eq!((&delay[0].attrs, delay[0].count), (&grpc, 1));
    assert!(delay[0].sum >= 2.0, "two overload floors: {:?}", delay[0]);
    // Each wait too, as for HTTP; the HTTP retries metric is not recorded.
    let waits = t.points_of("resend.client.retry.delay");
    assert_eq!(waits.iter().map(|p| p.count).sum::<u64>(), 2);
    assert!(t.points_of("resend.client.call.retries").is_empty());
    assert!(t
        .points_of("grpc.client.call.transparent_retries")
        .is_empty());
}

// 4. The circuit breaker's changes of state.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn breaker_state_changes_are_counted_whichever_order_the_meter_comes_in() {
    let t = Telemetry::start();
    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&healthy);
    let upstream = service_fn(move |_req: Request<Full<Bytes>>| {
        let status = if flag.load(Ordering::SeqCst) {
            StatusCode::OK
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        std::future::ready(Ok::<_, Infallible>(
            Response::builder()
                .status(status)
                .body(String::new())
                .unwrap(),
        ))
    });
    let breaker = || {
        CircuitBreakerLayer::new()
            .min_throughput(2)
            .probes(1)
            .break_duration(Duration::from_secs(1))
    };
    let after = stack()
        .name("after")
        .max_attempts(1)
        .circuit_breaker_with(breaker())
        .meter(&t.meter())
        .service(upstream.clone());
    let before = stack()
        .name("before")
        .max_attempts(1)
        .meter(&t.meter())
        .circuit_breaker_with(breaker())
        .service(upstream);
    let call = |svc| async move {
        let req = Request::get("http://up.test/x")
            .body(Full::new(Bytes::new()))
            .unwrap();
        tower::ServiceExt::oneshot(svc, req).await
    };
    for _ in 0..2 {
        assert!(call(after.clone()).await.is_ok());
        assert!(call(before.clone()).await.is_ok());
    }
    // Open: refused at once.
    let refused = call(after.clone()).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::CircuitOpen);
    assert_eq!(
        call(before.clone()).await.unwrap_err().kind(),
        ErrorKind::CircuitOpen
    );
    // After the break, a probe that succeeds closes it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    healthy.store(true, Ordering::SeqCst);
    assert!(call(after.clone()).await.is_ok());
    assert!(call(before.clone()).await.is_ok());

    let mut changes: Vec<_> = t
        .points_of("resend.client.breaker.state_changes")
        .into_iter()
        .map(|p| {
            (
                p.attr("resend.upstream").unwrap().to_owned(),
                p.attr("resend.breaker.state").unwrap().to_owned(),
                p.sum,
            )
        })
        .collect();
    changes.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let want: Vec<(String, String, f64)> = ["after", "before"]
        .into_iter()
        .flat_map(|u| ["closed", "half_open", "open"].map(|s| (u.to_owned(), s.to_owned(), 1.0)))
        .collect();
    assert_eq!(changes, want);
    // The refused attempt says why, and so does its call.
    let refused_attempt = t
        .named("GET")
        .into_iter()
        .find(|a| attr(a, "error.type").as_deref() == Some("circuit_open"));
    assert!(refused_attempt.is_some());
    assert!(t
        .named("resend.call")
        .iter()
        .any(|c| attr(c, "resend.stop").as_deref() == Some("circuit_open")));
}

// 5. Without a meter: spans, and no metrics.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn without_a_meter_nothing_is_recorded_but_the_spans_are_there() {
    let t = Telemetry::start();
    let server = server(
        Script::new()
            .then(Reply::status(503))
            .otherwise(Reply::ok()),
    )
    .await;
    let client = stack().service(transport());
    let resp = client
        .oneshot(
            Request::builder()
                .method(Method::GET)
                .uri(server.uri("/x"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    drop(resp);
    assert_eq!(t.named("GET").len(), 2);
    assert_eq!(t.named("resend.call").len(), 1);
    assert!(t.points().is_empty(), "{:#?}", t.points());
}

/// A layer on its own takes a meter too, and names the upstream it was
/// given.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_retry_layer_on_its_own_records_too() {
    let t = Telemetry::start();
    let calls = Arc::new(AtomicU32::new(0));
    let upstream = service_fn(move |_req: Request<Full<Bytes>>| {
        let status = match calls.fetch_add(1, Ordering::SeqCst) {
            0 => StatusCode::BAD_GATEWAY,
            _ => StatusCode::OK,
        };
        std::future::ready(Ok::<_, Infallible>(
            Response::builder().status(status).body(()).unwrap(),
        ))
    });
    let client = RetryLayer::new()
        .upstream("alone")
        .seed(1)
        .meter(&t.meter())
        .layer(upstream);
    let resp = client
        .oneshot(
            Request::get("http://up.test/x")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    drop(resp);
    let retries = t.points_of("resend.client.call.retries");
    assert_eq!(retries[0].attr("resend.upstream"), Some("alone"));
    assert_eq!((retries[0].count, retries[0].sum), (1, 1.0));
    let attempts = t.named("GET");
    assert_eq!(
        attrs_of(&attempts, "error.type"),
        [Some("502".into()), None]
    );
    assert_eq!(
        attr(&attempts[0], "url.full").as_deref(),
        Some("http://up.test/x")
    );
    assert_eq!(int(&attempts[0], "server.port"), Some(80));
}

/// `http.client.request.duration`, as the HTTP client conventions name it:
/// one record per request sent (each attempt), with its method, server,
/// scheme, status and, for an answer of 400 or more, `error.type`; the
/// time from sending to the answer.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_attempt_records_the_http_client_request_duration() {
    let t = Telemetry::start();
    let server = server(
        Script::new()
            .then(Reply::status(503).delay(Duration::from_millis(30)))
            .otherwise(Reply::ok().delay(Duration::from_millis(20))),
    )
    .await;
    let client = stack().no_budget().meter(&t.meter()).service(transport());
    let resp = client.oneshot(get(server.uri("/quote"))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    drop(resp);

    let mut points = t.points_of("http.client.request.duration");
    points.sort_by(|a, b| {
        a.attr("http.response.status_code")
            .cmp(&b.attr("http.response.status_code"))
    });
    assert_eq!(points.len(), 2, "{points:#?}");
    let port = server.addr().port().to_string();
    for (p, status, error, least) in [
        (&points[0], "200", None, 0.020),
        (&points[1], "503", Some("503"), 0.030),
    ] {
        assert_eq!(p.count, 1, "{p:?}");
        assert_eq!(p.attr("http.request.method"), Some("GET"));
        assert_eq!(p.attr("server.address"), Some("127.0.0.1"));
        assert_eq!(p.attr("server.port"), Some(port.as_str()));
        assert_eq!(p.attr("url.scheme"), Some("http"));
        assert_eq!(p.attr("http.response.status_code"), Some(status));
        assert_eq!(p.attr("error.type"), error);
        assert_eq!(p.attr("resend.upstream"), Some("upstream"));
        assert!(p.sum >= least && p.sum < least + 0.010, "{p:?}");
    }
}

/// A hedged attempt says on its span how many copies went and which one
/// answered, and the copies are counted by which one won.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hedged_attempt_says_which_copy_answered() {
    let t = Telemetry::start();
    let server = server(
        Script::new()
            .then(Reply::ok().delay(Duration::from_secs(1)))
            .otherwise(Reply::ok()),
    )
    .await;
    let client = stack()
        .hedge(Duration::from_millis(10))
        .meter(&t.meter())
        .service(transport());
    let resp = client.clone().oneshot(get(server.uri("/x"))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let hedged = resp
        .extensions()
        .get::<tower_resend::hedge::Hedged>()
        .copied();
    assert_eq!(hedged.map(|h| (h.sent, h.won)), Some((2, 2)));
    drop(resp);

    let attempts = t.named("GET");
    assert_eq!(attempts.len(), 1, "{attempts:#?}");
    assert_eq!(int(&attempts[0], "resend.hedge.sent"), Some(2));
    assert_eq!(int(&attempts[0], "resend.hedge.won"), Some(2));

    // A second call answers before the backup is due: one copy, the first.
    let resp = client.oneshot(get(server.uri("/y"))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    drop(resp);
    let mut copies = t.points_of("resend.client.hedge.copies");
    copies.sort_by(|a, b| {
        a.attr("resend.hedge.winner")
            .cmp(&b.attr("resend.hedge.winner"))
    });
    let winner = |w: &str| labels(&[("resend.upstream", "upstream"), ("resend.hedge.winner", w)]);
    assert_eq!(
        copies,
        [
            Point {
                attrs: winner("backup"),
                count: 1,
                sum: 2.0
            },
            Point {
                attrs: winner("first"),
                count: 1,
                sum: 1.0
            }
        ]
    );
}

/// A hedge layer of its own records on the meter it is given, under its
/// upstream's name.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hedge_layer_on_its_own_records_too() {
    let t = Telemetry::start();
    let sends = Arc::new(AtomicU32::new(0));
    let upstream = {
        let sends = Arc::clone(&sends);
        service_fn(move |_: Request<Full<Bytes>>| {
            // The first copy stalls a second; the backup answers at once.
            let first = sends.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        })
    };
    let svc = tower_resend::hedge::HedgeLayer::new(Duration::from_millis(10))
        .upstream("upstream")
        .meter(&t.meter())
        .layer(upstream);
    let req = Request::get("http://upstream/x")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = svc.oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(sends.load(Ordering::SeqCst), 2);
    assert_eq!(
        t.points_of("resend.client.hedge.copies"),
        [Point {
            attrs: labels(&[
                ("resend.upstream", "upstream"),
                ("resend.hedge.winner", "backup")
            ]),
            count: 1,
            sum: 2.0
        }]
    );
}

/// Over a fleet, each attempt's span and metrics name the instance it went
/// to, not the name in the request's URI: A answers 503, B 200, and the
/// call's second attempt goes to B.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn over_a_fleet_each_attempt_names_its_instance() {
    let t = Telemetry::start();
    let a = server(Script::new().otherwise(Reply::status(503))).await;
    let b = server(Script::new().otherwise(Reply::ok())).await;
    let fleet = tower_resend::fleet::FleetLayer::fixed([
        format!("http://{}", a.addr()),
        format!("http://{}", b.addr()),
    ])
    .unwrap();
    let client = stack()
        .no_budget()
        .meter(&t.meter())
        .fleet(fleet)
        .service(transport());
    // Until a call's first attempt goes to A.
    for _ in 0..20 {
        let req = get("http://inventory/quote".parse().unwrap());
        let resp = client.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        if a.arrival_count() > 0 {
            break;
        }
    }
    assert_eq!(a.arrival_count(), 1);
    let ports: Vec<Option<i64>> = t
        .named("GET")
        .iter()
        .filter(|s| attr(s, "resend.class").is_some())
        .map(|s| int(s, "server.port"))
        .collect();
    let (pa, pb) = (i64::from(a.addr().port()), i64::from(b.addr().port()));
    assert!(
        ports.contains(&Some(pa)) && ports.contains(&Some(pb)),
        "{ports:?}"
    );
    assert!(
        ports.iter().all(|p| *p == Some(pa) || *p == Some(pb)),
        "{ports:?}"
    );

    let points = t.points_of("http.client.request.duration");
    let seen: Vec<Option<&str>> = points.iter().map(|p| p.attr("server.port")).collect();
    let (sa, sb) = (pa.to_string(), pb.to_string());
    assert!(seen.contains(&Some(sa.as_str())), "{seen:?}");
    assert!(seen.contains(&Some(sb.as_str())), "{seen:?}");
    assert!(points
        .iter()
        .all(|p| p.attr("server.address") == Some("127.0.0.1")));
}

/// The adaptive throttle's probability is a gauge: 0 while the upstream
/// accepts, above it once it rejects most attempts.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_throttle_probability_is_a_gauge() {
    let t = Telemetry::start();
    let throttle = tower_resend::retry::AdaptiveThrottle::new().meter(&t.meter());
    let ok = server(Script::new().otherwise(Reply::status(200))).await;
    let client = stack()
        .adaptive_throttle(throttle.clone())
        .service(transport());
    client.clone().oneshot(get(ok.uri("/a"))).await.unwrap();
    let gauge = t.points_of("resend.client.throttle.probability");
    assert_eq!(gauge.len(), 1, "{gauge:?}");
    assert_eq!(gauge[0].sum, 0.0);

    let overloaded = server(Script::new().otherwise(Reply::status(503))).await;
    let client = stack()
        .max_attempts(1)
        .adaptive_throttle(throttle.clone())
        .service(transport());
    for _ in 0..40 {
        let _ = client.clone().oneshot(get(overloaded.uri("/b"))).await;
    }
    let gauge = t.points_of("resend.client.throttle.probability");
    assert!(gauge[0].sum > 0.3, "{gauge:?}");
    assert!((gauge[0].sum - throttle.probability()).abs() < 1e-9);
}

// 5. A pacing layer (feature `quota`).

/// A pacing layer's wait for a reset and its refusal: events in the
/// attempt's span, the refused attempt's `error.type`, and the layer's
/// instruments.
#[cfg(feature = "quota")]
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_pacing_layers_wait_and_refusal_are_recorded() {
    use tower_resend::quota::PaceLayer;

    let t = Telemetry::start();
    let server = server(
        Script::new()
            .then(Reply::ok().header("ratelimit", "\"default\";r=0;t=2"))
            .otherwise(Reply::ok().header("ratelimit", "\"default\";r=0;t=60")),
    )
    .await;
    let client = stack()
        .pace(PaceLayer::new().meter(&t.meter()))
        .service(transport());
    client.clone().oneshot(get(server.uri("/x"))).await.unwrap();
    // Spent for 2 s: this call waits for the reset.
    client.clone().oneshot(get(server.uri("/x"))).await.unwrap();
    // Spent for 60 s, past the deadline: refused, not sent.
    let err = client.oneshot(get(server.uri("/x"))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::QuotaSpent);

    let attempts = t.named("GET");
    assert_eq!(attempts.len(), 3);
    let waits = events(&attempts[1], "waiting for the upstream's quota");
    assert_eq!(waits.len(), 1, "{:?}", attempts[1].events);
    assert_eq!(
        waits[0].get("resend.quota.wait_ms").map(String::as_str),
        Some("2000")
    );
    assert_eq!(
        waits[0].get("resend.quota.reason").map(String::as_str),
        Some("spent")
    );
    assert_eq!(
        attr(&attempts[2], "error.type").as_deref(),
        Some("quota_spent")
    );
    let call = &t.named("resend.call")[2];
    assert_eq!(attr(call, "resend.stop").as_deref(), Some("quota_spent"));

    assert_eq!(
        t.points_of("resend.client.quota.wait"),
        [Point {
            attrs: labels(&[("resend.quota.reason", "spent")]),
            count: 1,
            sum: 2.0
        }]
    );
    assert_eq!(t.points_of("resend.client.quota.refused")[0].sum, 1.0);
    let remaining = t.points_of("resend.client.quota.remaining");
    assert_eq!(remaining.len(), 1, "{remaining:?}");
    assert_eq!(remaining[0].attr("resend.quota.policy"), Some("default"));
    assert_eq!(remaining[0].sum, 0.0);
}

/// A pacing layer's values set aside, by why: a reset past the cap
/// (clamped), a malformed field, a negative count; and, with its quotas
/// shared in a Redis that refuses connections, each call placed by the
/// process's own view.
#[cfg(feature = "quota")]
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_pacing_layers_set_aside_values_and_fallbacks_are_counted() {
    use tower_resend::quota::PaceLayer;

    let t = Telemetry::start();
    let server = server(
        Script::new()
            .then(Reply::ok().header("ratelimit", "\"default\";r=5;t=1000000000"))
            .then(Reply::ok().header("ratelimit", "\"default\";r=abc;t=2"))
            .otherwise(Reply::ok().header("ratelimit", "\"default\";r=-3;t=2")),
    )
    .await;
    let pace = PaceLayer::new().meter(&t.meter());
    let client = stack().pace(pace.clone()).service(transport());
    for _ in 0..3 {
        client.clone().oneshot(get(server.uri("/x"))).await.unwrap();
    }
    let mut set_aside: Vec<(String, f64)> = t
        .points_of("resend.client.quota.set_aside")
        .iter()
        .map(|p| {
            let why = p.attr("resend.quota.set_aside").unwrap_or_default();
            (why.to_owned(), p.sum)
        })
        .collect();
    set_aside.sort_by(|a, b| a.0.cmp(&b.0));
    let want = [("malformed", 1.0), ("negative", 1.0), ("past_cap", 1.0)];
    let want: Vec<(String, f64)> = want.iter().map(|(w, n)| ((*w).to_owned(), *n)).collect();
    assert_eq!(set_aside, want);
    assert_eq!(pace.stats().doubted, 3);
    assert!(t.points_of("resend.client.quota.fallbacks").is_empty());

    #[cfg(feature = "quota-redis")]
    {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("a URL");
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(Some(Duration::from_millis(100)));
        let manager = redis::aio::ConnectionManager::new_lazy_with_config(client, config)
            .expect("a lazy manager");
        let quota = tower_resend::quota::RedisQuota::new(manager, "upstream")
            .timeout(Duration::from_millis(50));
        let pace = PaceLayer::new().meter(&t.meter()).shared_in(quota);
        let shared = stack().pace(pace.clone()).service(transport());
        for _ in 0..2 {
            shared.clone().oneshot(get(server.uri("/x"))).await.unwrap();
        }
        assert_eq!(pace.stats().fallbacks, 2);
        let fallbacks = t.points_of("resend.client.quota.fallbacks");
        assert_eq!(fallbacks.len(), 1, "{fallbacks:?}");
        assert_eq!(fallbacks[0].sum, 2.0);
    }
}
