//! The pacing layer alone, and in a stack, over scripted upstreams on
//! tokio's paused clock.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};

use super::{PaceLayer, QuotaReader, DEFAULT_RESET_CAP};
use crate::deadline::Deadline;
use crate::error::{BoxError, Error, ErrorKind, RetryAdvice};
use crate::test_events::{field, Events};

pub(super) const S: Duration = Duration::from_secs(1);

/// A status, and the fields an answer carries.
pub(super) type Answer = (u16, Vec<(String, String)>);

/// The window a [`Windowed`] upstream is in, the calls it had in it, and
/// the instant (from its start) and status of every call.
pub(super) type Log = (u64, u64, Vec<(Duration, u16)>);

/// An upstream that answers every call with the status and fields it is
/// set to, and counts the calls it had.
#[derive(Clone, Default)]
pub(super) struct Scripted {
    answer: Arc<Mutex<Answer>>,
    calls: Arc<AtomicU32>,
}

impl Scripted {
    pub(super) fn answering(status: u16, fields: &[(&'static str, &str)]) -> Self {
        let s = Self::default();
        s.set(status, fields);
        s
    }

    pub(super) fn set(&self, status: u16, fields: &[(&'static str, &str)]) {
        let fields = fields
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()));
        self.set_fields(status, fields.collect());
    }

    pub(super) fn set_fields(&self, status: u16, fields: Vec<(String, String)>) {
        *self.answer.lock().unwrap() = (status, fields);
    }

    pub(super) fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    pub(super) fn service<B>(
        &self,
    ) -> impl Service<Request<B>, Response = Response<String>, Error = Infallible> + Clone {
        let s = self.clone();
        service_fn(move |_req: Request<B>| {
            s.calls.fetch_add(1, Ordering::SeqCst);
            let (status, fields) = s.answer.lock().unwrap().clone();
            async move { Ok(respond(status, &fields)) }
        })
    }
}

pub(super) fn respond<N: AsRef<str>>(status: u16, fields: &[(N, String)]) -> Response<String> {
    let mut resp = Response::new(String::new());
    *resp.status_mut() = StatusCode::from_u16(status).unwrap();
    for (name, value) in fields {
        resp.headers_mut().append(
            HeaderName::from_bytes(name.as_ref().as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    resp
}

/// An upstream with a quota of `q` calls per window of `w` (on tokio's
/// clock, from its making), stated in the IETF fields, 429 past it; it
/// keeps the instant and status of every call.
#[derive(Clone)]
pub(super) struct Windowed {
    q: u64,
    w: Duration,
    start: Instant,
    log: Arc<Mutex<Log>>,
}

impl Windowed {
    pub(super) fn new(q: u64, w: Duration) -> Self {
        Self {
            q,
            w,
            start: Instant::now(),
            log: Arc::default(),
        }
    }

    pub(super) fn served(&self) -> Vec<(Duration, u16)> {
        self.log.lock().unwrap().2.clone()
    }

    pub(super) fn service(
        &self,
    ) -> impl Service<Request<()>, Response = Response<String>, Error = Infallible> + Clone {
        let u = self.clone();
        service_fn(move |_req: Request<()>| {
            let at = u.start.elapsed();
            let window = (at.as_nanos() / u.w.as_nanos()) as u64;
            let end = u.w * (window as u32 + 1);
            let mut log = u.log.lock().unwrap();
            if log.0 != window {
                (log.0, log.1) = (window, 0);
            }
            log.1 += 1;
            let status = if log.1 > u.q { 429 } else { 200 };
            log.2.push((at, status));
            let r = u.q.saturating_sub(log.1);
            // Seconds to the reset, rounded up.
            let t = (end - at).as_nanos().div_ceil(1_000_000_000);
            let fields = vec![
                (
                    "ratelimit-policy",
                    format!("\"default\";q={};w={}", u.q, u.w.as_secs()),
                ),
                ("ratelimit", format!("\"default\";r={r};t={t}")),
            ];
            async move { Ok(respond(status, &fields)) }
        })
    }
}

/// A call with `budget` left before its deadline.
pub(super) async fn call<S>(svc: S, budget: Duration) -> Result<Response<String>, BoxError>
where
    S: Service<Request<()>, Response = Response<String>, Error = BoxError>,
{
    let mut req = Request::new(());
    req.extensions_mut().insert(Deadline::after(budget));
    svc.oneshot(req).await
}

pub(super) fn quota_spent(e: &BoxError) -> &Error {
    let e = e.downcast_ref::<Error>().expect("a tower-resend error");
    assert_eq!(e.kind(), ErrorKind::QuotaSpent, "{e}");
    e
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn pacing_spreads_the_calls_that_remain_over_the_time_that_remains() {
    let up = Windowed::new(10, 10 * S);
    let svc = PaceLayer::new().burst(0).layer(up.service());
    // The first call learns: 9 left for 10 s.
    call(svc.clone(), 60 * S).await.unwrap();
    // Nine callers at once: each takes its place, 10/9 s apart.
    let callers = (0..9).map(|_| call(svc.clone(), 60 * S));
    for r in join_all(callers).await {
        assert_eq!(r.unwrap().status(), 200);
    }
    let served = up.served();
    assert_eq!(served.len(), 10);
    assert!(
        served.iter().all(|(_, status)| *status == 200),
        "{served:?}"
    );
    for pair in served[1..].windows(2) {
        let gap = pair[1].0 - pair[0].0;
        assert!(gap >= Duration::from_millis(1100), "{served:?}");
    }
    assert!(served[9].0 < 10 * S, "{served:?}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_burst_goes_at_once_then_the_pace_holds() {
    let up = Windowed::new(10, 10 * S);
    let svc = PaceLayer::new().burst(2).layer(up.service());
    call(svc.clone(), 60 * S).await.unwrap();
    let start = Instant::now();
    let callers = (0..9).map(|_| call(svc.clone(), 60 * S));
    for r in join_all(callers).await {
        r.unwrap();
    }
    let at_once = up
        .served()
        .iter()
        .filter(|(at, _)| *at <= start.elapsed() && *at == Duration::ZERO)
        .count();
    // The first call, and three at once (the pace's one and two more).
    assert_eq!(at_once, 4, "{:?}", up.served());
    assert!(up.served().iter().all(|(_, status)| *status == 200));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_spent_quota_waits_for_its_reset_within_the_deadline() {
    let up = Scripted::answering(200, &[("ratelimit", "\"default\";r=0;t=5")]);
    let layer = PaceLayer::new();
    let svc = layer.layer(up.service());
    call(svc.clone(), 10 * S).await.unwrap();
    let start = Instant::now();
    call(svc.clone(), 10 * S).await.unwrap();
    assert_eq!(start.elapsed(), 5 * S);
    assert_eq!(up.calls(), 2);
    let stats = layer.stats();
    assert_eq!((stats.waits, stats.waited, stats.refused), (1, 5 * S, 0));
    assert_eq!(stats.pending, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_reset_past_the_deadline_is_refused_at_once_not_sent() {
    let up = Scripted::answering(200, &[("ratelimit", "\"default\";r=0;t=30")]);
    let layer = PaceLayer::new();
    let svc = layer.layer(up.service());
    call(svc.clone(), 10 * S).await.unwrap();
    let start = Instant::now();
    let err = call(svc.clone(), 10 * S).await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    let e = quota_spent(&err);
    assert_eq!(e.retry_advice(), RetryAdvice::After(30 * S));
    assert!(e.is_not_sent() && e.nothing_processed());
    assert!(e.to_string().starts_with("quota spent"), "{e}");
    assert_eq!(up.calls(), 1);
    assert_eq!(layer.stats().refused, 1);
    // Once the reset has come, calls go again.
    tokio::time::advance(30 * S).await;
    call(svc, 10 * S).await.unwrap();
    assert_eq!(up.calls(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_call_that_need_not_wait_goes_however_near_its_deadline() {
    let up = Scripted::answering(200, &[("ratelimit", "\"default\";r=5;t=10")]);
    let svc = PaceLayer::new().layer(up.service());
    call(svc.clone(), 10 * S).await.unwrap();
    call(svc.clone(), Duration::from_millis(10)).await.unwrap();
    assert_eq!(up.calls(), 2);
    // A wait it has no time for: refused, with the wait as its advice.
    up.set(200, &[("ratelimit", "\"default\";r=0;t=1")]);
    call(svc.clone(), 10 * S).await.unwrap();
    let err = call(svc, Duration::from_millis(1040)).await.unwrap_err();
    assert_eq!(quota_spent(&err).retry_advice(), RetryAdvice::After(S));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn calls_out_spend_the_quota_too() {
    // Four calls in the window, and answers that come a second late and
    // say nothing new: the calls out count, so that only three more go.
    let up = Scripted::answering(
        200,
        &[
            ("ratelimit-policy", "\"default\";q=4;w=10"),
            ("ratelimit", "\"default\";r=3;t=10"),
        ],
    );
    let slow = tower::ServiceBuilder::new()
        .then(|r: Result<Response<String>, Infallible>| async move {
            tokio::time::sleep(S).await;
            r
        })
        .service(up.service());
    let svc = PaceLayer::new().layer(slow);
    call(svc.clone(), 5 * S).await.unwrap();
    tokio::time::advance(Duration::from_millis(10)).await;
    let callers = (0..10).map(|_| call(svc.clone(), 4 * S));
    let mut refused = 0;
    for r in join_all(callers).await {
        match r {
            Ok(_) => {}
            Err(e) => {
                quota_spent(&e);
                refused += 1;
            }
        }
    }
    assert_eq!(up.calls(), 4);
    assert_eq!(refused, 7);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn clones_share_what_the_answers_said() {
    let spent = Scripted::answering(
        200,
        &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "60")],
    );
    let other = Scripted::answering(200, &[]);
    let layer = PaceLayer::new();
    let a = layer.layer(spent.service());
    let b = layer.clone().layer(other.service());
    call(a.clone(), 10 * S).await.unwrap();
    // The other service, and a clone of the first, know the quota is spent.
    let err = call(b, 10 * S).await.unwrap_err();
    assert_eq!(quota_spent(&err).retry_advice(), RetryAdvice::After(60 * S));
    quota_spent(&call(a.clone(), 10 * S).await.unwrap_err());
    assert_eq!((spent.calls(), other.calls()), (1, 0));
    assert_eq!(layer.stats().refused, 2);
    assert_eq!(layer.stats().quotas[0].remaining, 0);
}

/// Hostile or broken values: a reset of 10⁹ seconds, a negative one,
/// garbage, a long Retry-After, too many policies. No call waits past its
/// deadline or longer than the cap, nothing panics, and each value is
/// counted.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn hostile_values_never_hold_a_call_past_its_deadline_or_the_cap() {
    let many: String = (0..40)
        .map(|i| format!("p{i};r=0;t=30"))
        .collect::<Vec<_>>()
        .join(", ");
    let cases: Vec<(u16, Vec<(&'static str, String)>)> = vec![
        (
            200,
            vec![("ratelimit", "\"default\";r=0;t=1000000000".into())],
        ),
        (
            200,
            vec![
                ("x-ratelimit-remaining", "0".into()),
                ("x-ratelimit-reset", "99999999999".into()),
            ],
        ),
        (
            200,
            vec![
                ("x-ratelimit-remaining", "0".into()),
                ("x-ratelimit-reset", "-5".into()),
            ],
        ),
        (200, vec![("ratelimit", "\"default\";r=0;t=-5".into())]),
        (200, vec![("ratelimit", "\"default\";r=zero;t=5".into())]),
        (
            200,
            vec![
                ("x-ratelimit-remaining-requests", "0".into()),
                ("x-ratelimit-reset-requests", "-6m0s".into()),
            ],
        ),
        (429, vec![("retry-after", "1000000000".into())]),
        (429, vec![("retry-after", "soon".into())]),
        (200, vec![("ratelimit", many)]),
    ];
    let cap = 120 * S;
    for (status, fields) in cases {
        let up = Scripted::default();
        let owned = fields.iter().map(|(n, v)| ((*n).to_owned(), v.clone()));
        up.set_fields(status, owned.collect());
        let layer = PaceLayer::new().reader(QuotaReader::new().cap(cap));
        let svc = layer.layer(up.service());
        call(svc.clone(), 10 * S).await.unwrap();
        assert!(
            layer.stats().doubted >= 1 || layer.stats().ignored >= 1,
            "{fields:?}"
        );
        // Under a deadline: at once (a refusal advising at most the cap),
        // or sent; never a wait past the deadline.
        let start = Instant::now();
        match call(svc.clone(), 10 * S).await {
            Ok(_) => assert!(start.elapsed() < 10 * S, "{fields:?}"),
            Err(e) => {
                let RetryAdvice::After(after) = quota_spent(&e).retry_advice() else {
                    panic!("{fields:?}")
                };
                assert!(after <= cap, "{fields:?}: {after:?}");
                assert_eq!(start.elapsed(), Duration::ZERO, "{fields:?}");
            }
        }
        // Without a deadline (the layer alone): at most the cap.
        let start = Instant::now();
        svc.clone().oneshot(Request::new(())).await.unwrap();
        assert!(start.elapsed() <= cap, "{fields:?}: {:?}", start.elapsed());
    }
    assert_eq!(DEFAULT_RESET_CAP, 600 * S);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn too_many_policies_are_counted_as_ignored() {
    let many: String = (0..40)
        .map(|i| format!("p{i};r=5;t=30"))
        .collect::<Vec<_>>()
        .join(", ");
    let up = Scripted::default();
    up.set_fields(200, vec![("ratelimit".to_owned(), many)]);
    let layer = PaceLayer::new();
    call(layer.layer(up.service()), 10 * S).await.unwrap();
    let stats = layer.stats();
    assert_eq!((stats.quotas.len(), stats.ignored), (16, 24));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_429s_retry_after_holds_every_call_until_then() {
    let up = Scripted::answering(429, &[("retry-after", "3")]);
    let layer = PaceLayer::new();
    let svc = layer.layer(up.service());
    assert_eq!(call(svc.clone(), 10 * S).await.unwrap().status(), 429);
    up.set(200, &[]);
    let start = Instant::now();
    call(svc.clone(), 10 * S).await.unwrap();
    assert_eq!(start.elapsed(), 3 * S);
    // Past a deadline: at once, refused.
    up.set(429, &[("retry-after", "30")]);
    call(svc.clone(), 10 * S).await.unwrap();
    let err = call(svc, 10 * S).await.unwrap_err();
    assert_eq!(quota_spent(&err).retry_advice(), RetryAdvice::After(30 * S));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wait_and_a_refusal_are_tracing_events() {
    let events = Events::under("tower_resend::quota");
    let _second = Events::keep_callsites_open();
    let _guard = tracing::subscriber::set_default(events.clone());
    let up = Scripted::answering(200, &[("ratelimit", "\"default\";r=0;t=5")]);
    let svc = PaceLayer::new().layer(up.service());
    call(svc.clone(), 10 * S).await.unwrap();
    up.set(200, &[("ratelimit", "\"default\";r=0;t=50")]);
    call(svc.clone(), 10 * S).await.unwrap(); // waits 5 s
    call(svc.clone(), 10 * S).await.unwrap_err(); // 50 s: refused
    let got = events.got();
    let wait = got
        .iter()
        .find(|(_, m, _)| m.starts_with("waiting"))
        .expect("a wait event");
    assert_eq!(field(&wait.2, "resend.quota.wait_ms"), Some("5000"));
    assert_eq!(field(&wait.2, "resend.quota.reason"), Some("spent"));
    let refusal = got
        .iter()
        .find(|(_, m, _)| m.starts_with("not sent"))
        .expect("a refusal event");
    assert_eq!(field(&refusal.2, "error.type"), Some("quota_spent"));
    assert_eq!(field(&refusal.2, "resend.quota.reset_ms"), Some("50000"));
}

/// While every quota is far from spent, answers go unread for a while (the
/// layer counts its own calls against the last reading): an answer saying
/// the quota is suddenly spent is seen on the next reading, 100 ms on at
/// most. Near its end, every answer is read. A 429 is always read.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn far_from_spent_answers_are_read_now_and_then_near_the_end_every_one() {
    const MS: Duration = Duration::from_millis(1);
    let far = [
        ("ratelimit-policy", "\"default\";q=1000;w=100"),
        ("ratelimit", "\"default\";r=900;t=100"),
    ];
    let spent = [
        ("ratelimit-policy", "\"default\";q=1000;w=100"),
        ("ratelimit", "\"default\";r=0;t=100"),
    ];
    let up = Scripted::answering(200, &far);
    let layer = PaceLayer::new().burst(1000);
    let svc = layer.layer(up.service());
    call(svc.clone(), 200 * S).await.unwrap();
    // The upstream now says the quota is spent: not read yet, so the next
    // call goes at once, and its answer is not read either.
    up.set(200, &spent);
    let start = Instant::now();
    call(svc.clone(), 200 * S).await.unwrap();
    call(svc.clone(), 200 * S).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    // 100 ms on, the next answer is read: the call after it waits for the
    // reset.
    tokio::time::advance(100 * MS).await;
    call(svc.clone(), 200 * S).await.unwrap();
    let start = Instant::now();
    call(svc.clone(), 200 * S).await.unwrap();
    assert!(start.elapsed() >= 99 * S, "{:?}", start.elapsed());

    // Near its end (9 of 1000 left), every answer is read.
    let near = [
        ("ratelimit-policy", "\"default\";q=1000;w=100"),
        ("ratelimit", "\"default\";r=9;t=100"),
    ];
    let up = Scripted::answering(200, &near);
    let svc = PaceLayer::new().burst(1000).layer(up.service());
    call(svc.clone(), 200 * S).await.unwrap();
    up.set(200, &spent);
    call(svc.clone(), 200 * S).await.unwrap();
    let start = Instant::now();
    call(svc.clone(), 200 * S).await.unwrap();
    assert!(start.elapsed() >= 99 * S, "{:?}", start.elapsed());

    // Far from spent, a 429 is read at once.
    let up = Scripted::answering(200, &far);
    let svc = PaceLayer::new().burst(1000).layer(up.service());
    call(svc.clone(), 200 * S).await.unwrap();
    up.set(429, &[("retry-after", "30")]);
    call(svc.clone(), 200 * S).await.unwrap();
    up.set(200, &far);
    let start = Instant::now();
    call(svc, 200 * S).await.unwrap();
    assert_eq!(start.elapsed(), 30 * S);
}
