//! The published examples of the peers whose fields the pacing layer
//! reads, pasted as they are: GitHub's rate-limit headers and the IETF
//! draft's own.

use std::time::Duration;

use http::{HeaderName, HeaderValue, StatusCode};
use tokio::time::Instant;
use tower::Layer;

use super::tests_pace::*;
use super::{PaceLayer, QuotaReader, DEFAULT_RESET_CAP};

/// The headers of a published example, pasted as they are: `name: value`
/// a line.
fn pasted(block: &str) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    for line in block.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':').unwrap();
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).unwrap(),
            HeaderValue::from_str(value.trim()).unwrap(),
        );
    }
    headers
}

/// GitHub's REST docs' example of its rate-limit headers, as published
/// ("Checking the status of your rate limit"). Its reset is an epoch time
/// (2023-08-09T14:29:23Z): read an hour before it, with the cap raised to
/// GitHub's hour, the layer spreads the 4 999 calls left over the hour,
/// one every 720 ms; under the default cap of 10 minutes the reset is
/// read as the cap, and counted.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn githubs_published_example_paces_its_hour() {
    const GITHUB: &str = "
x-ratelimit-limit: 5000
x-ratelimit-remaining: 4999
x-ratelimit-used: 1
x-ratelimit-reset: 1691591363
x-ratelimit-resource: core
";
    let headers = pasted(GITHUB);
    let reset = std::time::UNIX_EPOCH + Duration::from_secs(1_691_591_363);
    let an_hour_before = reset - 3600 * S;

    // The reader: GitHub's form, its count, its reset an hour away.
    let hour = QuotaReader::new().cap(3600 * S);
    let reading = hour.read(StatusCode::OK, &headers, an_hour_before);
    assert_eq!(reading.quotas.len(), 1, "{reading:?}");
    let q = &reading.quotas[0];
    assert_eq!(q.form, super::Form::XRateLimit);
    assert_eq!(
        (&*q.policy, q.limit, q.remaining),
        ("default", Some(5000), 4999)
    );
    assert_eq!(q.reset, 3600 * S);
    assert!(reading.doubted.is_empty());
    // Under the default cap: ten minutes, doubted as past the cap.
    let reading = QuotaReader::new().read(StatusCode::OK, &headers, an_hour_before);
    assert_eq!(reading.quotas[0].reset, DEFAULT_RESET_CAP);
    assert_eq!(reading.doubted[0].doubt, super::Doubt::PastCap);
    // Read after its reset (the docs' example is from 2023): whole again.
    let later = reset + 60 * S;
    let reading = QuotaReader::new().read(StatusCode::OK, &headers, later);
    assert_eq!(reading.quotas[0].reset, Duration::ZERO);

    // The layer, its wall clock an hour before the reset.
    let up = Scripted::default();
    let fields = headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap().to_owned()));
    up.set_fields(200, fields.collect());
    let layer = PaceLayer::new().reader(hour).wall_clock(an_hour_before);
    let svc = layer.layer(up.service());
    call(svc.clone(), 10 * S).await.unwrap();
    let stats = layer.stats();
    assert_eq!(stats.quotas[0].remaining, 4999);
    assert_eq!(stats.quotas[0].reset, 3600 * S);
    // Three calls at once (the pace's and a burst of two), then one every
    // 3600 s / 4999 ≈ 720 ms.
    let start = Instant::now();
    for _ in 0..3 {
        call(svc.clone(), 10 * S).await.unwrap();
    }
    assert_eq!(start.elapsed(), Duration::ZERO);
    call(svc.clone(), 10 * S).await.unwrap();
    let first = start.elapsed();
    assert!(
        first > Duration::ZERO && first <= 3 * 720 * Duration::from_millis(1),
        "{first:?}"
    );
    call(svc.clone(), 10 * S).await.unwrap();
    let gap = start.elapsed() - first;
    assert!(
        gap >= Duration::from_millis(715) && gap <= Duration::from_millis(725),
        "{gap:?}"
    );
}

/// The IETF draft's own examples (draft-ietf-httpapi-ratelimit-headers):
/// a policy of 100 calls per 10 s, and an answer that says 50 are left
/// for 30 s.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_ietf_drafts_examples() {
    let headers = pasted(
        r#"
RateLimit-Policy: "default";q=100;w=10
RateLimit: "default";r=50;t=30
"#,
    );
    let reading = QuotaReader::new().read(StatusCode::OK, &headers, std::time::SystemTime::now());
    let q = &reading.quotas[0];
    assert_eq!(q.form, super::Form::Ietf);
    assert_eq!(
        (&*q.policy, q.limit, q.remaining, q.reset, q.window),
        ("default", Some(100), 50, 30 * S, Some(10 * S))
    );
    // The layer: 50 calls over 30 s, one every 600 ms once the burst is out.
    let up = Scripted::answering(
        200,
        &[
            ("ratelimit-policy", "\"default\";q=100;w=10"),
            ("ratelimit", "\"default\";r=50;t=30"),
        ],
    );
    let layer = PaceLayer::new().burst(0);
    let svc = layer.layer(up.service());
    call(svc.clone(), 10 * S).await.unwrap();
    let start = Instant::now();
    call(svc.clone(), 10 * S).await.unwrap();
    call(svc.clone(), 10 * S).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(600));
}
