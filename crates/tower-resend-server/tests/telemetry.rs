//! What the idempotency layer tells a tracing backend and a metrics
//! pipeline, read back from the OpenTelemetry SDK's in-memory span exporter
//! (through tracing-opentelemetry) and an in-memory metric reader: a span
//! per keyed request with its outcome, the handler's spans under it; replays,
//! conflicts, lease take-overs, and the store's calls and errors counted.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry::trace::{Status, TracerProvider as _};
use opentelemetry::Value;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tower::{service_fn, Layer, ServiceExt};
use tower_resend_server::store::{Begin, Claim, LeaseState, StoredResponse, Ttl};
use tower_resend_server::{IdempotencyLayer, MaybeBuffered, MemoryStore, Store, StoreError};
use tracing_subscriber::layer::SubscriberExt;

/// The spans exported and the metrics collected in one test.
struct Telemetry {
    spans: InMemorySpanExporter,
    tracer: SdkTracerProvider,
    metrics: InMemoryMetricExporter,
    meters: SdkMeterProvider,
    _subscriber: tracing::subscriber::DefaultGuard,
}

impl Telemetry {
    fn start() -> Self {
        let spans = InMemorySpanExporter::default();
        let tracer = SdkTracerProvider::builder()
            .with_simple_exporter(spans.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(tracer.tracer("test"));
        let metrics = InMemoryMetricExporter::default();
        let meters = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(metrics.clone()).build())
            .build();
        Self {
            spans,
            tracer,
            metrics,
            meters,
            _subscriber: tracing::subscriber::set_default(
                tracing_subscriber::registry().with(layer),
            ),
        }
    }

    fn meter(&self) -> Meter {
        self.meters.meter("tower-resend-server")
    }

    fn named(&self, name: &str) -> Vec<SpanData> {
        self.tracer.force_flush().unwrap();
        let all = self.spans.get_finished_spans().unwrap();
        all.into_iter().filter(|s| s.name == name).collect()
    }

    /// The data points of `name`: attributes, and (count, sum) — a
    /// counter's is (1, its value).
    fn points(&self, name: &str) -> Vec<(BTreeMap<String, String>, u64, f64)> {
        self.meters.force_flush().unwrap();
        let all = self.metrics.get_finished_metrics().unwrap();
        let Some(last) = all.last() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for scope in last.scope_metrics() {
            for metric in scope.metrics().filter(|m| m.name() == name) {
                collect(metric.data(), &mut out);
            }
        }
        out
    }
}

type Points = Vec<(BTreeMap<String, String>, u64, f64)>;

fn collect(data: &AggregatedMetrics, out: &mut Points) {
    fn attrs<'a>(
        kvs: impl Iterator<Item = &'a opentelemetry::KeyValue>,
    ) -> BTreeMap<String, String> {
        kvs.map(|kv| (kv.key.to_string(), kv.value.to_string()))
            .collect()
    }
    fn of<T: Copy>(data: &MetricData<T>, f: fn(T) -> f64, out: &mut Points) {
        match data {
            MetricData::Histogram(h) => {
                out.extend(
                    h.data_points()
                        .map(|p| (attrs(p.attributes()), p.count(), f(p.sum()))),
                );
            }
            MetricData::Sum(s) => {
                out.extend(
                    s.data_points()
                        .map(|p| (attrs(p.attributes()), 1, f(p.value()))),
                );
            }
            MetricData::Gauge(g) => {
                out.extend(
                    g.data_points()
                        .map(|p| (attrs(p.attributes()), 1, f(p.value()))),
                );
            }
            MetricData::ExponentialHistogram(_) => {}
        }
    }
    match data {
        AggregatedMetrics::F64(d) => of(d, |v| v, out),
        AggregatedMetrics::U64(d) => of(d, |v| v as f64, out),
        AggregatedMetrics::I64(d) => of(d, |v| v as f64, out),
    }
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

fn int(span: &SpanData, key: &str) -> Option<i64> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .and_then(|kv| match kv.value {
            Value::I64(n) => Some(n),
            _ => None,
        })
}

/// The count or sum of the one data point of `name` with `attr` = `value`
/// (or with no attributes, for `None`).
fn sum_of(t: &Telemetry, name: &str, attr: Option<(&str, &str)>) -> f64 {
    t.points(name)
        .into_iter()
        .filter(|(attrs, ..)| match attr {
            None => attrs.is_empty(),
            Some((k, v)) => attrs.get(k).map(String::as_str) == Some(v),
        })
        .map(|(_, _, sum)| sum)
        .sum()
}

fn count_of(t: &Telemetry, name: &str, op: &str) -> u64 {
    t.points(name)
        .into_iter()
        .filter(|(attrs, ..)| attrs.get("resend.store.operation").map(String::as_str) == Some(op))
        .map(|(_, count, _)| count)
        .sum()
}

/// What a key that ran, was replayed, then was used with another body
/// leaves (the memory store's and the transactional mode's alike): three
/// spans of the layer's, by outcome and status, no key in any attribute;
/// the replay counted, the 422 a conflict; the store called to begin each
/// keyed request, and to complete the one that ran, without an error. The
/// spans, in order.
fn ran_replayed_mismatch(t: &Telemetry, key: &str) -> Vec<SpanData> {
    let spans = t.named("resend.idempotency");
    let outcomes: Vec<_> = spans
        .iter()
        .map(|s| attr(s, "resend.idempotency.outcome"))
        .collect();
    assert_eq!(
        outcomes,
        [
            Some("ran".into()),
            Some("replayed".into()),
            Some("mismatch".into())
        ]
    );
    let statuses: Vec<_> = spans
        .iter()
        .map(|s| int(s, "http.response.status_code"))
        .collect();
    assert_eq!(statuses, [Some(201), Some(201), Some(422)]);
    assert!(spans
        .iter()
        .all(|s| attr(s, "http.request.method").as_deref() == Some("POST")));
    assert!(spans
        .iter()
        .flat_map(|s| &s.attributes)
        .all(|kv| !kv.value.to_string().contains(key)));
    assert_eq!(sum_of(t, "resend.server.idempotency.replays", None), 1.0);
    assert_eq!(
        sum_of(
            t,
            "resend.server.idempotency.conflicts",
            Some(("resend.idempotency.conflict", "mismatch"))
        ),
        1.0
    );
    assert_eq!(
        count_of(t, "resend.server.idempotency.store.duration", "begin"),
        3
    );
    assert_eq!(
        count_of(t, "resend.server.idempotency.store.duration", "complete"),
        1
    );
    assert!(t
        .points("resend.server.idempotency.store.errors")
        .is_empty());
    spans
}

fn charge(key: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post("/charges")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// A handler with a span of its own, that answers 201.
async fn handler(
    _req: Request<MaybeBuffered<Full<Bytes>>>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let _span = tracing::info_span!("charge").entered();
    let mut resp = Response::new(Full::new(Bytes::from_static(b"charged")));
    *resp.status_mut() = StatusCode::CREATED;
    Ok(resp)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_replay_is_counted_and_every_keyed_request_has_a_span_with_its_outcome() {
    let t = Telemetry::start();
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .meter(&t.meter())
        .layer(service_fn(handler));

    let first = svc.clone().oneshot(charge("order-1", "10")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let again = svc.clone().oneshot(charge("order-1", "10")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let other = svc.clone().oneshot(charge("order-1", "99")).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    // Not keyed: no span of the layer's.
    let unkeyed = Request::post("/charges")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(
        svc.oneshot(unkeyed).await.unwrap().status(),
        StatusCode::CREATED
    );

    let spans = ran_replayed_mismatch(&t, "order-1");
    // The handler's span is the first request's child (the handler ran
    // twice: once keyed, once not).
    let handlers = t.named("charge");
    assert_eq!(handlers.len(), 2);
    assert_eq!(handlers[0].parent_span_id, spans[0].span_context.span_id());
    assert!(t
        .points("resend.server.idempotency.lease_takeovers")
        .is_empty());
    // Nothing held for the store.
    assert_eq!(sum_of(&t, "resend.server.idempotency.held", None), 0.0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_malformed_key_has_its_span_too_and_runs_nothing() {
    let t = Telemetry::start();
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .meter(&t.meter())
        .layer(service_fn(handler));
    let bad = Request::post("/charges")
        .header("idempotency-key", "")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = svc.oneshot(bad).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let spans = t.named("resend.idempotency");
    assert_eq!(spans.len(), 1);
    assert_eq!(
        attr(&spans[0], "resend.idempotency.outcome").as_deref(),
        Some("bad_request")
    );
    assert_eq!(int(&spans[0], "http.response.status_code"), Some(400));
    assert!(t.named("charge").is_empty());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_key_still_running_is_a_conflict() {
    let t = Telemetry::start();
    let go = Arc::new(tokio::sync::Notify::new());
    let wait = Arc::clone(&go);
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .meter(&t.meter())
        .layer(service_fn(
            move |_req: Request<MaybeBuffered<Full<Bytes>>>| {
                let wait = Arc::clone(&wait);
                async move {
                    wait.notified().await;
                    Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
                }
            },
        ));
    let first = tokio::spawn(svc.clone().oneshot(charge("k", "1")));
    tokio::task::yield_now().await;
    let second = svc.oneshot(charge("k", "1")).await.unwrap();
    assert_eq!(second.status(), StatusCode::CONFLICT);
    go.notify_one();
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);

    let outcomes: Vec<_> = t
        .named("resend.idempotency")
        .iter()
        .map(|s| attr(s, "resend.idempotency.outcome"))
        .collect();
    assert_eq!(outcomes, [Some("in_progress".into()), Some("ran".into())]);
    assert_eq!(
        sum_of(
            &t,
            "resend.server.idempotency.conflicts",
            Some(("resend.idempotency.conflict", "in_progress"))
        ),
        1.0
    );
}

/// A memory store whose `begin` fails while it is `down`, and whose
/// `complete` always finds the key taken over by another request.
#[derive(Clone, Debug)]
struct Faulty {
    inner: MemoryStore,
    down: bool,
}

impl Store for Faulty {
    fn begin(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        let down = self.down;
        let begin = self.inner.begin(claim, ttl);
        async move {
            if down {
                return Err(StoreError::new("store down"));
            }
            begin.await
        }
    }

    fn renew(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        self.inner.renew(claim, ttl)
    }

    fn complete(
        &self,
        _claim: &Claim<'_>,
        _response: &StoredResponse,
        _ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        // Another request took the key over meanwhile.
        std::future::ready(Ok(LeaseState::Lost))
    }

    fn release(&self, claim: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.release(claim)
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_store_that_cannot_be_reached_is_counted_and_the_span_says_so() {
    let t = Telemetry::start();
    let store = Faulty {
        inner: MemoryStore::new(),
        down: true,
    };
    let svc = IdempotencyLayer::new(store)
        .meter(&t.meter())
        .layer(service_fn(handler));
    let resp = svc.oneshot(charge("k", "1")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);

    let span = &t.named("resend.idempotency")[0];
    assert_eq!(
        attr(span, "resend.idempotency.outcome").as_deref(),
        Some("store_unavailable")
    );
    assert_eq!(int(span, "http.response.status_code"), Some(503));
    assert!(matches!(span.status, Status::Error { .. }));
    assert!(t.named("charge").is_empty(), "nothing ran");
    assert_eq!(
        sum_of(
            &t,
            "resend.server.idempotency.store.errors",
            Some(("resend.store.operation", "begin"))
        ),
        1.0
    );
    assert_eq!(
        count_of(&t, "resend.server.idempotency.store.duration", "begin"),
        1
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lease_taken_over_is_counted() {
    let t = Telemetry::start();
    let store = Faulty {
        inner: MemoryStore::new(),
        down: false,
    };
    let layer = IdempotencyLayer::new(store).meter(&t.meter());
    let stats = layer.stats();
    let svc = layer.layer(service_fn(handler));
    let resp = svc.oneshot(charge("k", "1")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);

    assert_eq!(stats.leases_lost(), 1);
    assert_eq!(
        sum_of(&t, "resend.server.idempotency.lease_takeovers", None),
        1.0
    );
    assert_eq!(
        count_of(&t, "resend.server.idempotency.store.duration", "complete"),
        1
    );
    let span = &t.named("resend.idempotency")[0];
    assert_eq!(
        attr(span, "resend.idempotency.outcome").as_deref(),
        Some("ran")
    );
}

/// The transactional mode on PostgreSQL tells the same: a span per keyed
/// request with its outcome, the handler's spans under it, the replay and
/// the conflict counted, the claim and the commit timed as the store calls
/// that begin and complete a keyed request.
#[cfg(all(feature = "postgres", feature = "axum"))]
#[path = "support/pg.rs"]
mod pg;

#[cfg(all(feature = "postgres", feature = "axum"))]
mod transactional {
    use super::*;

    use super::pg;
    use axum::routing::post;
    use tower_resend_server::{IdempotentTx, PostgresStore};

    const TABLE: &str = "resend_idempotency_tx_telemetry";

    /// A handler that works in the layer's transaction, in a span of its own.
    async fn charge_in_tx(mut tx: IdempotentTx, body: String) -> (StatusCode, String) {
        let span = tracing::info_span!("charge");
        let _entered = span.enter();
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *tx)
            .await
            .expect("the layer's transaction");
        (StatusCode::CREATED, format!("charged {body} {one}"))
    }

    // Not on the paused clock: PostgreSQL answers in real time, and a
    // paused clock would run the store's timeouts out while it is asked.
    #[allow(clippy::print_stderr)] // the skip's warning, outside CI
    #[tokio::test(flavor = "current_thread")]
    async fn transactional_requests_have_their_spans_and_counts() {
        let url = pg::url();
        let pool = pg::pool(&url, 4);
        let backend = PostgresStore::with_table(pool, TABLE)
            .expect("a valid table name")
            .transactional();
        match tokio::time::timeout(std::time::Duration::from_secs(5), backend.migrate()).await {
            Ok(Ok(())) => {}
            other if std::env::var_os("CI").is_some() => {
                panic!("PostgreSQL at {url}: {other:?}, and CI is set")
            }
            other => {
                eprintln!("WARNING: PostgreSQL at {url} is unusable ({other:?}): test SKIPPED");
                return;
            }
        }
        let t = Telemetry::start();
        let app = axum::Router::new()
            .route("/charges", post(charge_in_tx))
            .layer(IdempotencyLayer::new(backend).meter(&t.meter()));
        let key = format!("order-{}", uuid::Uuid::new_v4().simple());

        let first = app.clone().oneshot(charge(&key, "10")).await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        let again = app.clone().oneshot(charge(&key, "10")).await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        let other = app.clone().oneshot(charge(&key, "99")).await.unwrap();
        assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);

        let spans = ran_replayed_mismatch(&t, &key);
        let handlers = t.named("charge");
        assert_eq!(handlers.len(), 1, "the handler ran once");
        assert_eq!(handlers[0].parent_span_id, spans[0].span_context.span_id());
    }
}

/// The shedding layer's metrics: its limit as a gauge, what it let through
/// and what it refused (by reason) as counters, read from its stats at each
/// collection.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_shed_layer_s_limit_and_counts_are_metrics() {
    use tower_resend_server::ShedLayer;

    let t = Telemetry::start();
    let shed = ShedLayer::new(3).max_queue(0).meter(&t.meter());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let opened = Arc::clone(&gate);
    let svc = shed.layer(service_fn(move |_: Request<()>| {
        let gate = Arc::clone(&opened);
        async move {
            let _pass = gate.acquire().await;
            Ok::<_, std::convert::Infallible>(Response::new(String::new()))
        }
    }));
    let running: Vec<_> = (0..3)
        .map(|_| tokio::spawn(svc.clone().oneshot(Request::new(()))))
        .collect();
    tokio::task::yield_now().await;
    let refused = svc.clone().oneshot(Request::new(())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry = Request::builder()
        .header("resend-previous-attempts", "1")
        .body(())
        .unwrap();
    svc.clone().oneshot(retry).await.unwrap();
    gate.add_permits(3);
    for r in running {
        r.await.unwrap().unwrap();
    }

    assert_eq!(sum_of(&t, "resend.server.shed.limit", None), 3.0);
    assert_eq!(sum_of(&t, "resend.server.shed.admitted", None), 3.0);
    let refused = |reason| {
        sum_of(
            &t,
            "resend.server.shed.refused",
            Some(("resend.shed.reason", reason)),
        )
    };
    assert_eq!(
        (refused("first"), refused("retry"), refused("deadline")),
        (1.0, 1.0, 0.0)
    );
    assert_eq!(shed.stats().limit, 3);
}
