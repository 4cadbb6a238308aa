//! The `ShedLayer`: at capacity it refuses retries before first attempts,
//! with a Retry-After (or gRPC pushback) from how fast its work drains, and
//! an overloaded server behind it keeps its goodput. In process, on tokio's
//! paused clock.
#![allow(clippy::print_stderr)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_resend::retry::Attempts;
use tower_resend_server::{
    AdaptiveLimit, IdempotencyLayer, InboundDeadlineLayer, MaybeBuffered, MemoryStore, ShedLayer,
};

const WORK: Duration = Duration::from_millis(20);
const CAPACITY: usize = 64;

/// What the client stack sends.
type Body = Full<Bytes>;
type Server = BoxCloneService<Request<Body>, Response<Full<Bytes>>, Infallible>;

/// A server that can do `CAPACITY` pieces of work of `WORK` at once; what
/// is over waits in line. The work runs in a task of its own: a caller that
/// gives up does not stop it (as a server that has started a job finishes
/// it). Counts what it finished.
fn busy_server(done: Arc<AtomicUsize>) -> Server {
    let workers = Arc::new(Semaphore::new(CAPACITY));
    BoxCloneService::new(service_fn(move |_: Request<Body>| {
        let (workers, done) = (Arc::clone(&workers), Arc::clone(&done));
        async move {
            let work = tokio::spawn(async move {
                let _worker = workers.acquire_owned().await;
                tokio::time::sleep(WORK).await;
                done.fetch_add(1, Ordering::Relaxed);
            });
            let _ = work.await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    }))
}

/// The same server behind `shed`.
fn shedding(done: Arc<AtomicUsize>, shed: &ShedLayer) -> Server {
    shedding_on(busy_server(done), shed)
}

/// `server` behind `shed`.
fn shedding_on(server: Server, shed: &ShedLayer) -> Server {
    BoxCloneService::new(
        ServiceBuilder::new()
            .layer(InboundDeadlineLayer::new(Duration::from_secs(30)))
            .layer(shed.clone())
            .service(server)
            .map_response(|r| r.map(|b| Full::new(collect_now(b)))),
    )
}

/// The same server behind tower's `LoadShed` over a `ConcurrencyLimit` of
/// its capacity, a refusal answered 503 (as an axum `HandleErrorLayer`
/// would): what a user would otherwise stack.
fn tower_load_shed(done: Arc<AtomicUsize>) -> Server {
    let shed = ServiceBuilder::new()
        .load_shed()
        .concurrency_limit(CAPACITY)
        .service(busy_server(done));
    BoxCloneService::new(service_fn(move |req| {
        let shed = shed.clone();
        async move {
            Ok::<_, Infallible>(shed.oneshot(req).await.unwrap_or_else(|_overloaded| {
                let mut resp = Response::new(Full::default());
                *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                resp
            }))
        }
    }))
}

/// A body that is all there at once, read without waiting.
fn collect_now<B: http_body::Body<Data = Bytes>>(body: B) -> Bytes {
    let mut body = std::pin::pin!(body);
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut out = Vec::new();
    while let std::task::Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) {
        if let Ok(data) = frame.into_data() {
            out.extend_from_slice(&data);
        }
    }
    Bytes::from(out)
}

fn get() -> Request<Full<Bytes>> {
    Request::get("http://server/work")
        .body(Full::default())
        .unwrap()
}

/// What a run of offered load gave, within the time the load was offered
/// (calls still retrying after it are not counted).
#[derive(Debug, Default)]
struct Run {
    calls: usize,
    /// Successes, whenever they came.
    ok_all: usize,
    ok: usize,
    ok_first: usize,
    finished_work: usize,
}

/// `rate` calls a second for `secs`, each a tower-resend client call of up
/// to 3 attempts, 3 s in all, against `server`.
async fn offer(server: Server, done: Arc<AtomicUsize>, rate: u32, secs: u32) -> Run {
    let client = tower_resend::stack()
        .no_budget()
        .max_attempts(3)
        .total(Duration::from_secs(3))
        .attempt_timeout(Duration::from_millis(500))
        .seed(3)
        .service(server);
    let gap = Duration::from_secs(1) / rate;
    let calls = (rate * secs) as usize;
    let start = Instant::now();
    let mut set = JoinSet::new();
    for i in 0..calls {
        tokio::time::sleep_until(start + gap * i as u32).await;
        let client = client.clone();
        set.spawn(async move {
            let end = start + Duration::from_secs(u64::from(secs));
            match client.oneshot(get()).await {
                Ok(resp) if resp.status() == StatusCode::OK => {
                    let first = resp.extensions().get::<Attempts>().map(Attempts::len) == Some(1);
                    (true, Instant::now() <= end, first)
                }
                _ => (false, false, false),
            }
        });
    }
    let mut run = Run {
        calls,
        ..Run::default()
    };
    while let Some(joined) = set.join_next().await {
        let (ok, in_time, first) = joined.expect("the call's task");
        run.ok_all += usize::from(ok);
        run.ok += usize::from(ok && in_time);
        run.ok_first += usize::from(ok && in_time && first);
    }
    run.finished_work = done.load(Ordering::Relaxed);
    run
}

/// Offered 1.5x its capacity (64 at once, 20 ms each: 3 200 a second) for
/// 5 s by callers retrying up to 3 attempts: behind the layer the server's
/// goodput stays at least 0.9 of its capacity, and first attempts alone
/// succeed at at least 0.8 of it; without the layer (its work queued
/// without bound, the callers giving up and retrying), and behind tower's
/// `LoadShed` + `ConcurrencyLimit` (which cannot tell retries from first
/// attempts), it is printed beside.
/// At 0.8x capacity the layer sheds nothing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_overloaded_server_keeps_its_goodput_and_serves_first_attempts() {
    const SECS: u32 = 5;
    let capacity = (CAPACITY as f64) / WORK.as_secs_f64();
    let rate = (capacity * 1.5) as u32;

    let done = Arc::new(AtomicUsize::new(0));
    let shed = ShedLayer::new(CAPACITY);
    let with = offer(shedding(Arc::clone(&done), &shed), done, rate, SECS).await;
    let stats = shed.stats();
    let done = Arc::new(AtomicUsize::new(0));
    let without = offer(busy_server(Arc::clone(&done)), done, rate, SECS).await;
    let done = Arc::new(AtomicUsize::new(0));
    let load_shed = offer(tower_load_shed(Arc::clone(&done)), done, rate, SECS).await;

    let per_sec = |n: usize| n as f64 / f64::from(SECS) / capacity;
    eprintln!(
        "offered {rate}/s (1.5x of {capacity}/s) for {SECS} s, 3 attempts, 3 s a call:\n  \
         ShedLayer: goodput {:.2} of capacity, first attempts {:.2}, {}/{} calls ok; {stats:?}\n  \
         no layer:  goodput {:.2} of capacity, first attempts {:.2}, {}/{} calls ok, {} pieces of work done\n  \
         tower LoadShed + ConcurrencyLimit: goodput {:.2} of capacity, first attempts {:.2}, {}/{} calls ok",
        per_sec(with.ok),
        per_sec(with.ok_first),
        with.ok,
        with.calls,
        per_sec(without.ok),
        per_sec(without.ok_first),
        without.ok,
        without.calls,
        without.finished_work,
        per_sec(load_shed.ok),
        per_sec(load_shed.ok_first),
        load_shed.ok,
        load_shed.calls,
    );
    assert!(per_sec(with.ok) >= 0.9, "{with:?}");
    assert!(per_sec(with.ok_first) >= 0.8, "{with:?}");
    assert!(stats.shed_retries > 0 && stats.shed() > 0, "{stats:?}");
    assert!(with.ok > without.ok, "{with:?} {without:?}");
    // tower's LoadShed refuses at capacity too, but retries take slots
    // first attempts needed.
    assert!(with.ok_first > load_shed.ok_first, "{with:?} {load_shed:?}");

    let done = Arc::new(AtomicUsize::new(0));
    let shed = ShedLayer::new(CAPACITY);
    let light = offer(
        shedding(Arc::clone(&done), &shed),
        done,
        (capacity * 0.8) as u32,
        2,
    )
    .await;
    assert_eq!(shed.stats().shed(), 0, "{:?}", shed.stats());
    assert_eq!(light.ok_all, light.calls);
}

/// A layer of one slot and one queue place over work that waits for a
/// gate: what each of a few requests gets.
struct Gated {
    shed: ShedLayer,
    gate: Arc<tokio::sync::Semaphore>,
    svc: BoxCloneService<Request<()>, Response<MaybeBuffered<String>>, Infallible>,
}

impl Gated {
    fn new() -> Self {
        let shed = ShedLayer::new(1).max_queue(1);
        let gate = Arc::new(Semaphore::new(0));
        let opened = Arc::clone(&gate);
        let svc = ServiceBuilder::new()
            .layer(shed.clone())
            .service(service_fn(move |_: Request<()>| {
                let gate = Arc::clone(&opened);
                async move {
                    // Each permit lets one piece of work through, once.
                    if let Ok(pass) = gate.acquire().await {
                        pass.forget();
                    }
                    Ok::<_, Infallible>(Response::new(String::from("done")))
                }
            }));
        Self {
            shed,
            gate,
            svc: BoxCloneService::new(svc),
        }
    }

    /// Sends a request (a retry when `previous` says attempts came before
    /// it) and lets it get as far as it can.
    async fn send(
        &self,
        previous: Option<&'static str>,
        grpc: bool,
    ) -> tokio::task::JoinHandle<Response<MaybeBuffered<String>>> {
        let mut req = Request::new(());
        if let Some(n) = previous {
            let name = if grpc {
                "grpc-previous-rpc-attempts"
            } else {
                "resend-previous-attempts"
            };
            req.headers_mut().insert(name, n.parse().unwrap());
        }
        if grpc {
            req.headers_mut()
                .insert("content-type", "application/grpc".parse().unwrap());
        }
        let task = tokio::spawn(self.svc.clone().oneshot(req).map(|r| match r {
            Ok(resp) => resp,
            Err(never) => match never {},
        }));
        tokio::task::yield_now().await;
        task
    }
}

use futures_util::FutureExt;

/// At capacity, retries go first: a retry waiting is sent away to make room
/// for a first attempt, a retry finding the queue full is refused, and a
/// first attempt is refused only when no retry waits; each refusal is a 503
/// with a Retry-After, saying nothing ran.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn at_capacity_retries_are_refused_before_first_attempts() {
    let g = Gated::new();
    let running = g.send(None, false).await;
    let waiting_retry = g.send(Some("1"), false).await;
    let first = g.send(None, false).await;
    // The waiting retry made room for the first attempt.
    let sent_away = waiting_retry.await.unwrap();
    assert_eq!(sent_away.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(sent_away.headers()["retry-after"], "1");
    let refused_retry = g.send(Some("2"), false).await.await.unwrap();
    assert_eq!(refused_retry.status(), StatusCode::SERVICE_UNAVAILABLE);
    let refused_first = g.send(None, false).await.await.unwrap();
    assert_eq!(refused_first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = collect_now_string(refused_first.into_body());
    assert!(
        body.contains("request_shed") && body.contains("nothing was done"),
        "{body}"
    );

    g.gate.add_permits(2);
    assert_eq!(running.await.unwrap().status(), StatusCode::OK);
    assert_eq!(first.await.unwrap().status(), StatusCode::OK);
    let stats = g.shed.stats();
    assert_eq!(
        (
            stats.admitted,
            stats.shed_retries,
            stats.shed_first,
            stats.shed_deadline
        ),
        (2, 2, 1, 0),
        "{stats:?}"
    );
    // Free again: a retry runs at once.
    g.gate.add_permits(1);
    assert_eq!(
        g.send(Some("1"), false).await.await.unwrap().status(),
        StatusCode::OK
    );
}

/// Over gRPC a refusal is UNAVAILABLE, trailers-only, with the wait as
/// `grpc-retry-pushback-ms`: the time the work ahead takes to drain at the
/// pace it has been finishing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_refusal_is_unavailable_with_pushback() {
    let g = Gated::new();
    // One piece of work of 200 ms sets the pace.
    let timing = g.send(None, true).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    g.gate.add_permits(1);
    timing.await.unwrap();
    let running = g.send(None, true).await;
    let waiting = g.send(None, true).await;
    let refused = g.send(Some("1"), true).await.await.unwrap();
    assert_eq!(refused.status(), StatusCode::OK, "{:?}", refused.headers());
    assert_eq!(refused.headers()["grpc-status"], "14");
    // One running and one waiting ahead of it: two rounds of 200 ms.
    assert_eq!(refused.headers()["grpc-retry-pushback-ms"], "400");
    g.gate.add_permits(2);
    assert_eq!(running.await.unwrap().status(), StatusCode::OK);
    assert_eq!(waiting.await.unwrap().status(), StatusCode::OK);
}

/// A request whose deadline would pass in the queue is refused at once,
/// and counted as such.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_deadline_that_would_pass_in_the_queue_is_refused_at_once() {
    let g = Gated::new();
    let running = g.send(None, false).await;
    let mut req = Request::new(());
    // Nothing has finished yet: the guess is 100 ms of work ahead.
    req.extensions_mut()
        .insert(tower_resend::Deadline::after(Duration::from_millis(50)));
    let started = Instant::now();
    let resp = g.svc.clone().oneshot(req).await.unwrap();
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(g.shed.stats().shed_deadline, 1);
    g.gate.add_permits(1);
    assert_eq!(running.await.unwrap().status(), StatusCode::OK);
}

fn collect_now_string(body: MaybeBuffered<String>) -> String {
    use http_body::Body as _;
    let mut body = std::pin::pin!(body);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut out = Vec::new();
    while let std::task::Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) {
        if let Ok(data) = frame.into_data() {
            out.extend_from_slice(&data);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A hedged copy says it is not a first attempt, so a server at capacity
/// sheds it before a first attempt: call A holds the one slot, its backup
/// waits in line, and call B's first attempt, arriving, sends the backup
/// away and takes its place (B's own backup, finding the line full, is
/// refused too). A ends with its first copy, B runs after it: no first
/// attempt was shed.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn at_capacity_a_hedged_copy_is_shed_before_a_first_attempt() {
    let shed = ShedLayer::new(1).max_queue(1);
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&calls);
    let server = ServiceBuilder::new()
        .layer(shed.clone())
        .service(service_fn(move |_: Request<Body>| {
            // The first request to run holds its slot a second.
            let first = seen.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok::<_, Infallible>(Response::new(String::from("done")))
            }
        }));
    let client = tower_resend::stack()
        .hedge(Duration::from_millis(10))
        .service(server);
    let a = tokio::spawn(client.clone().oneshot(get()));
    // A's backup goes out at 10 ms, and waits in line.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = tokio::spawn(client.oneshot(get()));
    let a = a.await.unwrap().unwrap();
    let b = b.await.unwrap().unwrap();
    assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK));
    let a_copies = a
        .extensions()
        .get::<Attempts>()
        .unwrap()
        .last()
        .unwrap()
        .copies();
    assert_eq!(a_copies, 2, "A was hedged");
    let stats = shed.stats();
    assert_eq!(
        (stats.admitted, stats.shed_retries, stats.shed_first),
        (2, 2, 0),
        "{stats:?}"
    );
}

/// What the server behind a layer answered: when (since the run began),
/// after how long (the layer's queue and the work), OK or not, and whether
/// to a retry or hedge.
#[derive(Clone, Copy, Debug)]
struct Answer {
    at: Duration,
    took: Duration,
    ok: bool,
    retry: bool,
}

type Log = Arc<std::sync::Mutex<Vec<Answer>>>;

/// `server` with every answer it gives written in `log`.
fn logged(server: Server, log: Log, start: Instant) -> Server {
    BoxCloneService::new(service_fn(move |req: Request<Body>| {
        let (server, log) = (server.clone(), Arc::clone(&log));
        let retry = req.headers().contains_key("resend-previous-attempts");
        async move {
            let arrived = Instant::now();
            let resp = server.oneshot(req).await?;
            log.lock().unwrap().push(Answer {
                at: arrived.duration_since(start),
                took: arrived.elapsed(),
                ok: resp.status() == StatusCode::OK,
                retry,
            });
            Ok(resp)
        }
    }))
}

/// Slots of [`WORK`] that can be taken away and given back: `busy_server`
/// whose capacity changes.
#[derive(Clone)]
struct Capacity {
    workers: Arc<Semaphore>,
    held: Arc<std::sync::Mutex<Option<tokio::sync::OwnedSemaphorePermit>>>,
}

impl Capacity {
    fn new() -> Self {
        Self {
            workers: Arc::new(Semaphore::new(CAPACITY)),
            held: Arc::default(),
        }
    }

    /// The server as `busy_server`, on these slots.
    fn server(&self) -> Server {
        let workers = Arc::clone(&self.workers);
        BoxCloneService::new(service_fn(move |_: Request<Body>| {
            let workers = Arc::clone(&workers);
            async move {
                let work = tokio::spawn(async move {
                    let _worker = workers.acquire_owned().await;
                    tokio::time::sleep(WORK).await;
                });
                let _ = work.await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
            }
        }))
    }

    /// Takes `n` slots away (once the work in them is done) until
    /// `give_back`.
    fn take(&self, n: u32) {
        let (workers, held) = (Arc::clone(&self.workers), Arc::clone(&self.held));
        tokio::spawn(async move {
            let permits = workers.acquire_many_owned(n).await.unwrap();
            *held.lock().unwrap() = Some(permits);
        });
    }

    fn give_back(&self) {
        self.held.lock().unwrap().take();
    }
}

/// The calls of `offer` (`rate` a second for `secs`, clients of up to 3
/// attempts), with the capacity taken down to 32 slots `secs / 3` in and
/// given back at `2 * secs / 3`; the limit sampled every 100 ms.
async fn offer_changing(
    server: Server,
    capacity: &Capacity,
    shed: &ShedLayer,
    rate: u32,
    secs: u32,
) -> Vec<(Duration, usize)> {
    let start = Instant::now();
    let phase = Duration::from_secs(u64::from(secs)) / 3;
    let (capacity, shed) = (capacity.clone(), shed.clone());
    let watch = tokio::spawn(async move {
        let mut limits = Vec::new();
        let mut tick = tokio::time::interval_at(start, Duration::from_millis(100));
        let (mut taken, mut given) = (false, false);
        loop {
            let now = tick.tick().await - start;
            if now >= phase && !taken {
                capacity.take(CAPACITY as u32 / 2);
                taken = true;
            }
            if now >= 2 * phase && !given {
                capacity.give_back();
                given = true;
            }
            if now >= 3 * phase {
                return limits;
            }
            limits.push((now, shed.stats().limit));
        }
    });
    let done = Arc::new(AtomicUsize::new(0));
    offer(server, done, rate, secs).await;
    watch.await.unwrap()
}

/// The p-th quantile of `xs`.
fn quantile(mut xs: Vec<Duration>, p: f64) -> Duration {
    xs.sort();
    xs.get(((xs.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

/// A server of 64 slots of 20 ms, then 32, then 64 again (5 s each),
/// offered 1.5x of 64 slots' capacity by callers of up to 3 attempts,
/// behind an adaptive `ShedLayer`: the limit follows each change within
/// 2 s (it stays between 0.9 and 1.8 times the capacity); the server's
/// goodput is at least 0.85 of each phase's capacity; the p99 of accepted
/// work (the layer's queue and the work) is at most 3 times the work's
/// own 20 ms; and first attempts are preferred: retries are more than
/// 30 % of the requests, and under 15 % (and under a third of their share
/// of the requests) of the work admitted.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_adaptive_limit_follows_a_capacity_that_changes() {
    const SECS: u32 = 15;
    let full = (CAPACITY as f64) / WORK.as_secs_f64();
    let rate = (full * 1.5) as u32;
    let capacity = Capacity::new();
    let shed = ShedLayer::adaptive(AdaptiveLimit::new());
    let log = Log::default();
    let server = shedding_on(capacity.server(), &shed);
    let server = logged(server, Arc::clone(&log), Instant::now());
    let limits = offer_changing(server, &capacity, &shed, rate, SECS).await;
    let answers = log.lock().unwrap().clone();
    let stats = shed.stats();

    let phase = Duration::from_secs(u64::from(SECS) / 3);
    let slots = [CAPACITY, CAPACITY / 2, CAPACITY];
    let mut report = String::new();
    for (i, slots) in slots.into_iter().enumerate() {
        let (from, to) = (phase * i as u32, phase * (i as u32 + 1));
        let in_phase = |at: Duration| at >= from && at < to;
        let settled: Vec<usize> = limits
            .iter()
            .filter(|(at, _)| *at >= from + Duration::from_secs(2) && in_phase(*at))
            .map(|&(_, l)| l)
            .collect();
        let ok = answers.iter().filter(|a| a.ok && in_phase(a.at)).count();
        let goodput = ok as f64 / phase.as_secs_f64() / (slots as f64 / WORK.as_secs_f64());
        report += &format!(
            "phase {i}: {slots} slots, goodput {goodput:.2}, limit from 2 s in {:?}..={:?}\n",
            settled.iter().min(),
            settled.iter().max()
        );
        assert!(goodput >= 0.85, "{report}");
        assert!(
            settled
                .iter()
                .all(|&l| (l as f64) >= slots as f64 * 0.9 && (l as f64) <= slots as f64 * 1.8),
            "{report}{limits:?}"
        );
    }
    let accepted: Vec<Duration> = answers.iter().filter(|a| a.ok).map(|a| a.took).collect();
    let p99 = quantile(accepted, 0.99);
    let admitted_retries = answers.iter().filter(|a| a.ok && a.retry).count();
    let retries = answers.iter().filter(|a| a.retry).count();
    let admitted = answers.iter().filter(|a| a.ok).count();
    eprintln!(
        "{report}p99 {p99:?}; {stats:?}; {admitted_retries} retries of {admitted} admitted, \
         {retries} of {} sent",
        answers.len()
    );
    assert!(p99 <= WORK * 3, "p99 {p99:?}");
    // Retries are near half of what is sent, a tenth of what runs.
    let share_sent = retries as f64 / answers.len() as f64;
    let share_run = admitted_retries as f64 / admitted as f64;
    assert!(share_sent > 0.3, "{share_sent}");
    assert!(
        share_run < 0.15 && share_run < share_sent / 3.0,
        "{share_run} {share_sent}"
    );
}

/// At 0.5x of its capacity, from a cold start (the initial limit 20, under
/// the 32 at once the load needs), the adaptive layer sheds nothing and
/// every call succeeds at its first attempt.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_adaptive_limit_sheds_nothing_at_half_load() {
    let capacity = (CAPACITY as f64) / WORK.as_secs_f64();
    let done = Arc::new(AtomicUsize::new(0));
    let shed = ShedLayer::adaptive(AdaptiveLimit::new());
    let light = offer(
        shedding(Arc::clone(&done), &shed),
        done,
        (capacity * 0.5) as u32,
        5,
    )
    .await;
    let stats = shed.stats();
    assert_eq!(stats.shed(), 0, "{stats:?}");
    // Every call done, each in one attempt.
    assert_eq!(light.ok_all, light.calls);
    assert_eq!(stats.admitted, light.calls as u64, "{stats:?}");
    assert!(stats.limit >= 32, "{stats:?}");
}

/// What the keyed server answers.
type KeyedResponse = Response<MaybeBuffered<MaybeBuffered<Full<Bytes>>>>;

/// A layer of one slot and no queue, answering keyed retries it would shed
/// from an `IdempotencyLayer` on a memory store; the handler counts its
/// runs and waits for the gate.
struct Keyed {
    shed: tower_resend_server::ShedLayer<tower_resend_server::shed::Replays<MemoryStore>>,
    gate: Arc<Semaphore>,
    runs: Arc<AtomicUsize>,
    svc: BoxCloneService<Request<Full<Bytes>>, KeyedResponse, Infallible>,
}

impl Keyed {
    fn new() -> Self {
        let idempotency = IdempotencyLayer::new(MemoryStore::new());
        let shed = ShedLayer::new(1).max_queue(0).replays_from(&idempotency);
        let gate = Arc::new(Semaphore::new(0));
        let runs = Arc::new(AtomicUsize::new(0));
        let (opened, counted) = (Arc::clone(&gate), Arc::clone(&runs));
        let svc = ServiceBuilder::new()
            .layer(shed.clone())
            .layer(idempotency)
            .service(service_fn(
                move |req: Request<MaybeBuffered<Full<Bytes>>>| {
                    let (gate, runs) = (Arc::clone(&opened), Arc::clone(&counted));
                    async move {
                        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        if let Ok(pass) = gate.acquire().await {
                            pass.forget();
                        }
                        let key = req.headers()["idempotency-key"]
                            .to_str()
                            .unwrap()
                            .to_owned();
                        let body = format!("charged {key}, run {n}");
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
                    }
                },
            ));
        Self {
            shed,
            gate,
            runs,
            svc: BoxCloneService::new(svc),
        }
    }

    /// A POST with `key` (if any), a retry when `retry`, let get as far as
    /// it can.
    async fn send(
        &self,
        key: Option<&'static str>,
        retry: bool,
    ) -> tokio::task::JoinHandle<KeyedResponse> {
        self.send_as(key, retry, false).await
    }

    /// [`send`](Self::send), as a gRPC call when `grpc`.
    async fn send_as(
        &self,
        key: Option<&'static str>,
        retry: bool,
        grpc: bool,
    ) -> tokio::task::JoinHandle<KeyedResponse> {
        let mut req = Request::post("/charges")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let h = req.headers_mut();
        if let Some(key) = key {
            h.insert("idempotency-key", key.parse().unwrap());
        }
        let attempts = if grpc {
            h.insert("content-type", "application/grpc".parse().unwrap());
            "grpc-previous-rpc-attempts"
        } else {
            "resend-previous-attempts"
        };
        if retry {
            h.insert(attempts, "1".parse().unwrap());
        }
        let task = tokio::spawn(self.svc.clone().oneshot(req).map(|r| match r {
            Ok(resp) => resp,
            Err(never) => match never {},
        }));
        tokio::task::yield_now().await;
        task
    }
}

fn text<B: http_body::Body<Data = Bytes>>(body: B) -> String {
    String::from_utf8(collect_now(body).to_vec()).unwrap()
}

/// At capacity, a keyed retry whose key has an answer gets its replay, not
/// a shed; one whose work still runs gets its 409; one whose key has no
/// record is shed as before, its key given back at once (it runs later as
/// any other); a keyed first attempt is shed without asking, and a keyed
/// request's shed says this attempt was not processed.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn at_capacity_a_keyed_retry_gets_its_replay_not_a_shed() {
    let k = Keyed::new();
    // "a" runs and ends: its answer is stored.
    k.gate.add_permits(1);
    let first = k.send(Some("a"), false).await.await.unwrap();
    assert_eq!(text(first.into_body()), "charged a, run 1");
    // "b" takes the one slot and holds it.
    let b = k.send(Some("b"), false).await;
    assert_eq!(k.runs.load(Ordering::SeqCst), 2);

    // A retry of "a": its stored answer, not a shed.
    let again = k.send(Some("a"), true).await.await.unwrap();
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(text(again.into_body()), "charged a, run 1");
    // A retry of "b", which still runs: its 409.
    let running = k.send(Some("b"), true).await.await.unwrap();
    assert_eq!(running.status(), StatusCode::CONFLICT);
    // A retry of "c", which never ran: shed, saying this attempt was not
    // processed.
    let shed = k.send(Some("c"), true).await.await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    let said = text(shed.into_body());
    assert!(said.contains("did not process this attempt"), "{said}");
    assert!(said.contains("same key"), "{said}");
    // A keyed first attempt: shed without asking the store.
    let first_d = k.send(Some("d"), false).await.await.unwrap();
    assert_eq!(first_d.status(), StatusCode::SERVICE_UNAVAILABLE);
    // An unkeyed retry: shed, nothing was done.
    let plain = k.send(None, true).await.await.unwrap();
    assert_eq!(plain.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(text(plain.into_body()).contains("nothing was done"));
    assert_eq!(k.runs.load(Ordering::SeqCst), 2, "nothing else ran");
    let stats = k.shed.stats();
    assert_eq!(
        (stats.replayed, stats.shed_retries, stats.shed_first),
        (2, 2, 1),
        "{stats:?}"
    );

    // "b" ends; "c" was given back, and runs now as any first attempt.
    k.gate.add_permits(2);
    assert_eq!(b.await.unwrap().status(), StatusCode::OK);
    let c = k.send(Some("c"), true).await.await.unwrap();
    assert_eq!(text(c.into_body()), "charged c, run 3");
}

/// The same over gRPC: a retry (`grpc-previous-rpc-attempts`) whose key has
/// an answer gets its replay; one whose key has none is refused
/// UNAVAILABLE with pushback, and its key is free afterwards.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn at_capacity_a_keyed_grpc_retry_gets_its_replay_not_a_shed() {
    let k = Keyed::new();
    k.gate.add_permits(1);
    let first = k.send_as(Some("a"), false, true).await.await.unwrap();
    assert_eq!(text(first.into_body()), "charged a, run 1");
    let b = k.send_as(Some("b"), false, true).await;

    let again = k.send_as(Some("a"), true, true).await.await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(text(again.into_body()), "charged a, run 1");
    let shed = k.send_as(Some("c"), true, true).await.await.unwrap();
    assert_eq!(shed.headers()["grpc-status"], "14");
    assert!(shed.headers().contains_key("grpc-retry-pushback-ms"));
    let stats = k.shed.stats();
    assert_eq!((stats.replayed, stats.shed_retries), (1, 1), "{stats:?}");

    k.gate.add_permits(2);
    assert_eq!(b.await.unwrap().status(), StatusCode::OK);
    let c = k.send_as(Some("c"), true, true).await.await.unwrap();
    assert_eq!(text(c.into_body()), "charged c, run 3");
}

/// A keyed call that the server only ever shed did nothing: each shed says
/// so (`idempotent-nothing-done: true`), and tower-resend's client ends the
/// call as overload, the server's last 503 (or UNAVAILABLE) with its
/// history, every attempt not processed, never as "outcome unknown".
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_keyed_call_only_ever_shed_ends_as_overload_not_outcome_unknown() {
    let k = Keyed::new();
    // "b" takes the one slot and holds it: everything else is shed.
    let b = k.send(Some("b"), false).await;
    let client = |total| {
        tower_resend::stack()
            .name("payments")
            .total(total)
            .max_attempts(3)
            .service(k.svc.clone())
    };
    for grpc in [false, true] {
        let call = |key: &'static str| {
            let mut req = Request::post("http://payments/charges")
                .header("idempotency-key", key)
                .body(Full::new(Bytes::new()))
                .unwrap();
            if grpc {
                req.headers_mut()
                    .insert("content-type", "application/grpc".parse().unwrap());
            }
            req
        };
        let key = if grpc { "shed-grpc" } else { "shed-http" };
        let resp = client(Duration::from_secs(10))
            .oneshot(call(key))
            .await
            .expect("the server's own answer, not outcome unknown");
        if grpc {
            assert_eq!(
                tower_resend::tonic::grpc_status(resp.headers()),
                Some(tonic::Code::Unavailable)
            );
        } else {
            assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        }
        assert_eq!(resp.headers()["idempotent-nothing-done"], "true");
        let attempts = resp.extensions().get::<Attempts>().expect("its history");
        assert_eq!(attempts.len(), 3, "{attempts}");
        assert!(attempts.none_processed(), "{attempts}");

        // The same with too little time for three attempts over HTTP (its
        // Retry-After is a whole second; a gRPC pushback is the queue's
        // drain time): still the server's answer, whatever stopped it.
        let key = if grpc { "cut-grpc" } else { "cut-http" };
        let resp = client(Duration::from_millis(1500))
            .oneshot(call(key))
            .await
            .expect("the server's own answer");
        let attempts = resp.extensions().get::<Attempts>().expect("its history");
        if !grpc {
            assert_eq!(
                attempts.stop(),
                tower_resend::retry::Stop::Deadline,
                "{attempts}"
            );
        }
        assert!(attempts.none_processed(), "{attempts}");
    }
    assert_eq!(k.runs.load(Ordering::SeqCst), 1, "only b ran");
    k.gate.add_permits(1);
    assert_eq!(b.await.unwrap().status(), StatusCode::OK);
}
