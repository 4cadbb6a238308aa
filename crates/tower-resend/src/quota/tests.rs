//! The forms of the module docs' table, a test per row; hostile values;
//! and no panic on any input.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use proptest::prelude::*;

use super::*;

const S: Duration = Duration::from_secs(1);

/// 2026-12-06T21:00:00Z.
fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_796_590_800)
}

fn headers(fields: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in fields {
        h.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    h
}

fn read(fields: &[(&str, &str)]) -> Reading {
    QuotaReader::new().read(StatusCode::OK, &headers(fields), now())
}

/// One quota's (form, policy, limit, remaining, reset).
fn one(r: &Reading) -> (Form, &str, Option<u64>, u64, Duration) {
    assert_eq!(r.quotas.len(), 1, "{r:?}");
    let q = &r.quotas[0];
    (q.form, &q.policy, q.limit, q.remaining, q.reset)
}

#[test]
fn the_ietf_fields_with_several_policies_and_partitions() {
    // The issue's example, and the draft's own shapes: a token identifier,
    // several policies over two field lines, a partition key.
    let r = read(&[
        ("ratelimit-policy", r#""default";q=100;w=60"#),
        ("ratelimit", r#""default";r=15;t=40"#),
    ]);
    assert_eq!(one(&r), (Form::Ietf, "default", Some(100), 15, 40 * S));
    assert_eq!(r.quotas[0].window, Some(60 * S));

    let r = read(&[
        ("ratelimit-policy", "burst;q=100;w=60, daily;q=1000;w=86400"),
        ("ratelimit", "burst;r=40;t=20"),
        ("ratelimit", "daily;r=900;t=300"),
    ]);
    let got: Vec<_> = r
        .quotas
        .iter()
        .map(|q| (&*q.policy, q.limit, q.remaining, q.reset))
        .collect();
    assert_eq!(
        got,
        [
            ("burst", Some(100), 40, 20 * S),
            ("daily", Some(1000), 900, 300 * S)
        ]
    );

    let r = read(&[
        ("ratelimit-policy", r#""peruser";q=10;w=1;pk=:dXNlcjE=:"#),
        ("ratelimit", r#""peruser";r=3;t=1;pk=:dXNlcjE=:"#),
    ]);
    let q = &r.quotas[0];
    assert_eq!(q.partition.as_deref(), Some(&b"user1"[..]));
    assert_eq!((q.limit, q.remaining), (Some(10), 3));
    // No reset: the window.
    let r = read(&[
        ("ratelimit-policy", r#""default";q=5;w=10"#),
        ("ratelimit", r#""default";r=1"#),
    ]);
    assert_eq!(r.quotas[0].reset, 10 * S);
    // A policy field is not needed.
    let r = read(&[("ratelimit", r#""default";r=7;t=3"#)]);
    assert_eq!(one(&r), (Form::Ietf, "default", None, 7, 3 * S));
}

#[test]
fn the_earlier_drafts_fields() {
    let r = read(&[
        ("ratelimit-limit", "100, 100;w=60"),
        ("ratelimit-remaining", "15"),
        ("ratelimit-reset", "40"),
    ]);
    assert_eq!(one(&r), (Form::Draft, "default", Some(100), 15, 40 * S));
    let r = read(&[("ratelimit", "limit=100, remaining=50, reset=5")]);
    assert_eq!(one(&r), (Form::Draft, "default", Some(100), 50, 5 * S));
}

#[test]
fn x_ratelimit_with_a_delta_or_an_epoch_reset() {
    let r = read(&[
        ("x-ratelimit-limit", "60"),
        ("x-ratelimit-remaining", "56"),
        ("x-ratelimit-reset", "30"),
    ]);
    assert_eq!(one(&r), (Form::XRateLimit, "default", Some(60), 56, 30 * S));
    // GitHub's: an epoch time, 90 s from now.
    let at = 1_796_590_800 + 90;
    let r = read(&[
        ("x-ratelimit-limit", "5000"),
        ("x-ratelimit-remaining", "4999"),
        ("x-ratelimit-reset", &at.to_string()),
        ("x-ratelimit-used", "1"),
        ("x-ratelimit-resource", "core"),
    ]);
    assert_eq!(
        one(&r),
        (Form::XRateLimit, "default", Some(5000), 4999, 90 * S)
    );
    // A time already past: whole again now.
    let r = read(&[
        ("x-ratelimit-remaining", "0"),
        ("x-ratelimit-reset", "1796590000"),
    ]);
    assert_eq!(r.quotas[0].reset, Duration::ZERO);
}

#[test]
fn x_rate_limit_with_a_dash() {
    let r = read(&[
        ("x-rate-limit-limit", "15"),
        ("x-rate-limit-remaining", "14"),
        ("x-rate-limit-reset", &(1_796_590_800 + 600).to_string()),
    ]);
    assert_eq!(
        one(&r),
        (Form::XRateDashLimit, "default", Some(15), 14, 600 * S)
    );
}

#[test]
fn the_model_apis_with_durations_and_times() {
    let r = read(&[
        ("x-ratelimit-limit-requests", "60"),
        ("x-ratelimit-remaining-requests", "59"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-limit-tokens", "150000"),
        ("x-ratelimit-remaining-tokens", "149984"),
        ("x-ratelimit-reset-tokens", "6m0s"),
    ]);
    let got: Vec<_> = r
        .quotas
        .iter()
        .map(|q| (q.form, &*q.policy, q.remaining, q.reset))
        .collect();
    assert_eq!(
        got,
        [
            (Form::ModelDuration, "requests", 59, S),
            (Form::ModelDuration, "tokens", 149_984, 360 * S)
        ]
    );
    let r = read(&[
        ("anthropic-ratelimit-requests-limit", "50"),
        ("anthropic-ratelimit-requests-remaining", "49"),
        ("anthropic-ratelimit-requests-reset", "2026-12-06T21:00:30Z"),
        ("anthropic-ratelimit-input-tokens-limit", "40000"),
        ("anthropic-ratelimit-input-tokens-remaining", "39000"),
        (
            "anthropic-ratelimit-input-tokens-reset",
            "2026-12-06T21:01:00Z",
        ),
    ]);
    let got: Vec<_> = r
        .quotas
        .iter()
        .map(|q| (q.form, &*q.policy, q.remaining, q.reset))
        .collect();
    assert_eq!(
        got,
        [
            (Form::ModelTime, "requests", 49, 30 * S),
            (Form::ModelTime, "input-tokens", 39_000, 60 * S)
        ]
    );
}

#[test]
fn a_form_of_your_own() {
    let reader = QuotaReader::new().form(
        "search",
        HeaderName::from_static("x-search-quota"),
        HeaderName::from_static("x-search-left"),
        HeaderName::from_static("x-search-reset"),
    );
    let h = headers(&[
        ("x-search-quota", "10"),
        ("x-search-left", "2"),
        ("x-search-reset", "7"),
    ]);
    let r = reader.read(StatusCode::OK, &h, now());
    assert_eq!(one(&r), (Form::Custom, "search", Some(10), 2, 7 * S));
}

#[test]
fn retry_after_on_a_429_or_a_403_only() {
    let h = headers(&[("retry-after", "12")]);
    let reader = QuotaReader::new();
    for (status, want) in [
        (StatusCode::TOO_MANY_REQUESTS, Some(12 * S)),
        (StatusCode::FORBIDDEN, Some(12 * S)),
        (StatusCode::SERVICE_UNAVAILABLE, None),
        (StatusCode::OK, None),
    ] {
        assert_eq!(reader.read(status, &h, now()).retry_after, want, "{status}");
    }
    let h = headers(&[("retry-after", "Sun, 06 Dec 2026 21:00:45 GMT")]);
    let r = reader.read(StatusCode::TOO_MANY_REQUESTS, &h, now());
    assert_eq!(r.retry_after, Some(45 * S));
}

/// A reset of 10⁹ seconds, a negative one, a malformed field: nothing
/// makes a caller wait past the cap, nothing panics, and each is doubted.
#[test]
fn hostile_values_are_bounded_and_doubted() {
    let reader = QuotaReader::new().cap(300 * S);
    let read = |status, fields: &[(&str, &str)]| reader.read(status, &headers(fields), now());
    let doubts = |r: &Reading| r.doubted.iter().map(|d| d.doubt).collect::<Vec<_>>();

    let r = read(
        StatusCode::OK,
        &[("ratelimit", r#""default";r=0;t=1000000000"#)],
    );
    assert_eq!(r.quotas[0].reset, 300 * S);
    assert_eq!(doubts(&r), [Doubt::PastCap]);
    let r = read(
        StatusCode::OK,
        &[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "999999999"),
        ],
    );
    assert_eq!(r.quotas[0].reset, 300 * S);
    let r = read(
        StatusCode::OK,
        &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "-5")],
    );
    assert!(r.quotas.is_empty());
    assert_eq!(doubts(&r), [Doubt::Negative]);
    let r = read(StatusCode::OK, &[("ratelimit", r#""default";r=-1;t=5"#)]);
    assert!(r.quotas.is_empty());
    assert_eq!(doubts(&r), [Doubt::Negative]);
    let r = read(StatusCode::OK, &[("ratelimit", "%%% not a list")]);
    assert_eq!(doubts(&r), [Doubt::Malformed]);
    // A policy field that does not parse: the counts still read.
    let r = read(
        StatusCode::OK,
        &[("ratelimit-policy", "(("), ("ratelimit", r#""d";r=1;t=2"#)],
    );
    assert_eq!(
        (r.quotas[0].limit, doubts(&r)),
        (None, vec![Doubt::Malformed])
    );
    let r = read(
        StatusCode::OK,
        &[
            ("x-ratelimit-remaining", "lots"),
            ("x-ratelimit-reset", "5"),
        ],
    );
    assert_eq!(doubts(&r), [Doubt::Malformed]);
    let r = read(
        StatusCode::OK,
        &[
            ("x-ratelimit-remaining-requests", "1"),
            ("x-ratelimit-reset-requests", "soon"),
        ],
    );
    assert_eq!(doubts(&r), [Doubt::Malformed]);
    let r = read(
        StatusCode::OK,
        &[
            ("x-ratelimit-remaining", "18446744073709551616"),
            ("x-ratelimit-reset", "1"),
        ],
    );
    assert_eq!(doubts(&r), [Doubt::Malformed]);
    let r = read(StatusCode::TOO_MANY_REQUESTS, &[("retry-after", "100000")]);
    assert_eq!(r.retry_after, Some(300 * S));
    let r = read(StatusCode::TOO_MANY_REQUESTS, &[("retry-after", "-1")]);
    assert_eq!((r.retry_after, doubts(&r)), (None, vec![Doubt::Negative]));
}

proptest! {
    /// No panic on any value of any field the reader reads.
    #[test]
    fn no_panic_on_any_input(
        values in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..80), 1..6),
        pick in proptest::collection::vec(0usize..12, 1..6),
    ) {
        const NAMES: [&str; 12] = [
            "ratelimit", "ratelimit-policy", "ratelimit-limit", "ratelimit-remaining",
            "ratelimit-reset", "x-ratelimit-remaining", "x-ratelimit-reset",
            "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
            "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset",
            "retry-after",
        ];
        let mut h = HeaderMap::new();
        for (v, &n) in values.iter().zip(&pick) {
            if let Ok(v) = HeaderValue::from_bytes(v) {
                h.append(HeaderName::from_static(NAMES[n]), v);
            }
        }
        let r = QuotaReader::new().cap(60 * S).read(StatusCode::TOO_MANY_REQUESTS, &h, now());
        prop_assert!(r.quotas.iter().all(|q| q.reset <= 60 * S));
        prop_assert!(r.retry_after.is_none_or(|w| w <= 60 * S));
    }
}
