//! The reader: gRFC A6's examples, every validation rule, hostile input.

use std::time::Duration;

use super::*;

const MS: Duration = Duration::from_millis(1);

fn name(service: &str, method: Option<&str>) -> MethodName {
    MethodName {
        service: Some(service.to_owned()),
        method: method.map(str::to_owned),
    }
}

/// gRFC A6's retry policy example.
pub(crate) const A6_RETRY: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "EchoService", "method": "UnaryEcho"}],
    "retryPolicy": {
      "maxAttempts": 4,
      "initialBackoff": "0.1s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }],
  "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
}"#;

/// gRFC A6's hedging policy example.
pub(crate) const A6_HEDGING: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "EchoService", "method": "UnaryEcho"}],
    "hedgingPolicy": {
      "maxAttempts": 4,
      "hedgingDelay": "0.5s",
      "nonFatalStatusCodes": ["UNAVAILABLE", "INTERNAL", "ABORTED"]
    }
  }],
  "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
}"#;

#[test]
fn the_a6_examples_parse_to_their_policies() {
    let c = ServiceConfig::from_json(A6_RETRY).unwrap();
    assert_eq!(
        c,
        ServiceConfig {
            methods: vec![MethodConfig {
                names: vec![name("EchoService", Some("UnaryEcho"))],
                timeout: None,
                policy: Some(MethodPolicy::Retry(RetryPolicy {
                    max_attempts: 4,
                    initial_backoff: 100 * MS,
                    max_backoff: Duration::from_secs(1),
                    backoff_multiplier: 2.0,
                    retryable_status_codes: vec![GrpcCode::Unavailable],
                    per_attempt_recv_timeout: None,
                })),
            }],
            retry_throttling: Some(RetryThrottling {
                max_tokens: 10,
                token_ratio: 0.1,
            }),
        }
    );
    let h = ServiceConfig::from_json(A6_HEDGING).unwrap();
    assert_eq!(
        h.methods[0].policy,
        Some(MethodPolicy::Hedging(HedgingPolicy {
            max_attempts: 4,
            hedging_delay: 500 * MS,
            non_fatal_status_codes: vec![
                GrpcCode::Unavailable,
                GrpcCode::Internal,
                GrpcCode::Aborted
            ],
        }))
    );
    assert_eq!(h.retry_throttling, c.retry_throttling);
    // 10 tokens, 0.1 back per success, in thousandths.
    let tokens = c.tokens().unwrap();
    assert_eq!(tokens.tokens(), Some(10_000));
}

#[test]
fn the_rest_of_the_fields_read_as_grpc_reads_them() {
    let c = ServiceConfig::from_json(
        r#"{
          "loadBalancingConfig": [{"round_robin": {}}],
          "methodConfig": [
            {"name": [{"service": "a.B", "method": "M"}, {"service": "a.C", "method": ""}],
             "timeout": "1.5s", "waitForReady": true,
             "retryPolicy": {"maxAttempts": 9, "initialBackoff": "0.000000001s",
                             "maxBackoff": "10s", "backoffMultiplier": 0.5,
                             "retryableStatusCodes": [14, "ABORTED", "UNAVAILABLE"],
                             "perAttemptRecvTimeout": "0.2s"}},
            {"name": [{}], "hedgingPolicy": {"maxAttempts": 2}},
            {"name": [{"service": "a.D"}], "retryPolicy": null}
          ]
        }"#,
    )
    .unwrap();
    let m = &c.methods[0];
    assert_eq!(m.names, [name("a.B", Some("M")), name("a.C", None)]);
    assert_eq!(m.timeout, Some(1500 * MS));
    let Some(MethodPolicy::Retry(r)) = &m.policy else {
        panic!("a retry policy")
    };
    assert_eq!(r.max_attempts, 5, "clamped to 5");
    assert_eq!(r.initial_backoff, Duration::from_nanos(1));
    assert_eq!(r.backoff_multiplier, 0.5);
    assert_eq!(
        r.retryable_status_codes,
        [GrpcCode::Unavailable, GrpcCode::Aborted]
    );
    assert_eq!(r.per_attempt_recv_timeout, Some(200 * MS));
    // The default: both empty; a hedge at once, no codes non-fatal.
    assert_eq!(
        c.methods[1].names,
        [MethodName {
            service: None,
            method: None
        }]
    );
    assert_eq!(
        c.methods[1].policy,
        Some(MethodPolicy::Hedging(HedgingPolicy {
            max_attempts: 2,
            hedging_delay: Duration::ZERO,
            non_fatal_status_codes: vec![],
        }))
    );
    assert_eq!(c.methods[2].policy, None);
    assert_eq!(c.retry_throttling, None);
    assert_eq!(
        ServiceConfig::from_json("{}").unwrap(),
        ServiceConfig::default()
    );
}

/// A retry policy with `field` replaced by `value` (`None`: removed).
fn retry_with(field: &str, value: Option<&str>) -> String {
    let mut fields = vec![
        ("maxAttempts", "3"),
        ("initialBackoff", "\"0.1s\""),
        ("maxBackoff", "\"1s\""),
        ("backoffMultiplier", "2"),
        ("retryableStatusCodes", "[\"UNAVAILABLE\"]"),
    ];
    fields.retain(|(k, _)| *k != field);
    if let Some(v) = value {
        fields.push((field, v));
    }
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("\"{k}\": {v}"))
        .collect();
    format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "s.S"}}], "retryPolicy": {{{}}}}}]}}"#,
        body.join(", ")
    )
}

fn hedging_with(body: &str) -> String {
    format!(r#"{{"methodConfig": [{{"name": [{{"service": "s.S"}}], "hedgingPolicy": {body}}}]}}"#)
}

fn error_of(json: &str) -> InvalidConfig {
    match ServiceConfig::from_json(json) {
        Ok(c) => panic!("accepted {json}: {c:?}"),
        Err(e) => e,
    }
}

#[test]
fn every_invalid_case_is_an_error_naming_its_field() {
    const RP: &str = "methodConfig[0].retryPolicy";
    let cases: Vec<(String, String, &str)> = vec![
        // retryPolicy.maxAttempts: required, an integer > 1.
        (retry_with("maxAttempts", None), format!("{RP}.maxAttempts"), "is required"),
        (retry_with("maxAttempts", Some("1")), format!("{RP}.maxAttempts"), "must be an integer greater than 1"),
        (retry_with("maxAttempts", Some("0")), format!("{RP}.maxAttempts"), "must be an integer greater than 1"),
        (retry_with("maxAttempts", Some("-3")), format!("{RP}.maxAttempts"), "must be an integer greater than 1"),
        (retry_with("maxAttempts", Some("2.5")), format!("{RP}.maxAttempts"), "must be an integer greater than 1"),
        (retry_with("maxAttempts", Some("\"3\"")), format!("{RP}.maxAttempts"), "must be an integer greater than 1"),
        // initialBackoff, maxBackoff: required, > 0.
        (retry_with("initialBackoff", None), format!("{RP}.initialBackoff"), "is required"),
        (retry_with("initialBackoff", Some("\"0s\"")), format!("{RP}.initialBackoff"), "must be greater than 0s"),
        (retry_with("initialBackoff", Some("\"100ms\"")), format!("{RP}.initialBackoff"), "must be a duration"),
        (retry_with("initialBackoff", Some("0.1")), format!("{RP}.initialBackoff"), "must be a duration string"),
        (retry_with("maxBackoff", None), format!("{RP}.maxBackoff"), "is required"),
        (retry_with("maxBackoff", Some("\"0.0s\"")), format!("{RP}.maxBackoff"), "must be greater than 0s"),
        (retry_with("maxBackoff", Some("\"-1s\"")), format!("{RP}.maxBackoff"), "must not be negative"),
        (retry_with("maxBackoff", Some("\"1.0000000001s\"")), format!("{RP}.maxBackoff"), "must be a duration"),
        // backoffMultiplier: required, > 0.
        (retry_with("backoffMultiplier", None), format!("{RP}.backoffMultiplier"), "is required"),
        (retry_with("backoffMultiplier", Some("0")), format!("{RP}.backoffMultiplier"), "must be a number greater than 0"),
        (retry_with("backoffMultiplier", Some("-2")), format!("{RP}.backoffMultiplier"), "must be a number greater than 0"),
        (retry_with("backoffMultiplier", Some("\"2\"")), format!("{RP}.backoffMultiplier"), "must be a number greater than 0"),
        // retryableStatusCodes: required, non-empty, codes.
        (retry_with("retryableStatusCodes", None), format!("{RP}.retryableStatusCodes"), "is required"),
        (retry_with("retryableStatusCodes", Some("[]")), format!("{RP}.retryableStatusCodes"), "must list at least one status code"),
        (retry_with("retryableStatusCodes", Some("\"UNAVAILABLE\"")), format!("{RP}.retryableStatusCodes"), "must be a list"),
        (retry_with("retryableStatusCodes", Some("[\"UNAVAILABLE\", \"unavailable\"]")), format!("{RP}.retryableStatusCodes[1]"), "must be a status code"),
        (retry_with("retryableStatusCodes", Some("[17]")), format!("{RP}.retryableStatusCodes[0]"), "must be a status code"),
        (retry_with("retryableStatusCodes", Some("[-1]")), format!("{RP}.retryableStatusCodes[0]"), "must be a status code"),
        (retry_with("retryableStatusCodes", Some("[\"NOPE\"]")), format!("{RP}.retryableStatusCodes[0]"), "must be a status code"),
        // perAttemptRecvTimeout: optional, > 0.
        (retry_with("perAttemptRecvTimeout", Some("\"0s\"")), format!("{RP}.perAttemptRecvTimeout"), "must be greater than 0s"),
        (retry_with("perAttemptRecvTimeout", Some("\"1\"")), format!("{RP}.perAttemptRecvTimeout"), "must be a duration"),
        // hedgingPolicy.
        (hedging_with("{}"), "methodConfig[0].hedgingPolicy.maxAttempts".into(), "is required"),
        (hedging_with(r#"{"maxAttempts": 1}"#), "methodConfig[0].hedgingPolicy.maxAttempts".into(), "must be an integer greater than 1"),
        (hedging_with(r#"{"maxAttempts": 2, "hedgingDelay": "1"}"#), "methodConfig[0].hedgingPolicy.hedgingDelay".into(), "must be a duration"),
        (hedging_with(r#"{"maxAttempts": 2, "nonFatalStatusCodes": ["OOPS"]}"#), "methodConfig[0].hedgingPolicy.nonFatalStatusCodes[0]".into(), "must be a status code"),
        (hedging_with(r#"{"maxAttempts": 2, "nonFatalStatusCodes": 14}"#), "methodConfig[0].hedgingPolicy.nonFatalStatusCodes".into(), "must be a list"),
        (hedging_with("[]"), "methodConfig[0].hedgingPolicy".into(), "must be an object"),
        // Both policies.
        (
            r#"{"methodConfig": [{"name": [{"service": "s.S"}], "hedgingPolicy": {"maxAttempts": 2},
                "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s",
                                "backoffMultiplier": 1, "retryableStatusCodes": [14]}}]}"#.into(),
            "methodConfig[0]".into(),
            "has both retryPolicy and hedgingPolicy",
        ),
        // timeout.
        (
            r#"{"methodConfig": [{"name": [{"service": "s.S"}], "timeout": "1.5"}]}"#.into(),
            "methodConfig[0].timeout".into(),
            "must be a duration",
        ),
        // Names: a method without a service, duplicates, two defaults.
        (
            r#"{"methodConfig": [{"name": [{"method": "M"}]}]}"#.into(),
            "methodConfig[0].name[0].method".into(),
            "must be empty when service is empty",
        ),
        (
            r#"{"methodConfig": [{"name": [{"service": "s.S", "method": "M"}]},
                                 {"name": [{"service": "t.T"}, {"service": "s.S", "method": "M"}]}]}"#.into(),
            "methodConfig[1].name[1]".into(),
            "names the same method as methodConfig[0].name[0]",
        ),
        (
            r#"{"methodConfig": [{"name": [{"service": "s.S"}, {"service": "s.S", "method": ""}]}]}"#.into(),
            "methodConfig[0].name[1]".into(),
            "names the same method as methodConfig[0].name[0]",
        ),
        (
            r#"{"methodConfig": [{"name": [{}]}, {"name": [{"service": ""}]}]}"#.into(),
            "methodConfig[1].name[0]".into(),
            "a second default (empty name); the first is methodConfig[0].name[0]",
        ),
        (r#"{"methodConfig": [{}]}"#.into(), "methodConfig[0].name".into(), "is required"),
        (r#"{"methodConfig": [{"name": []}]}"#.into(), "methodConfig[0].name".into(), "must list at least one name"),
        (r#"{"methodConfig": [{"name": [{"service": 1}]}]}"#.into(), "methodConfig[0].name[0].service".into(), "must be a string"),
        (r#"{"methodConfig": {}}"#.into(), "methodConfig".into(), "must be a list"),
        (r#"{"methodConfig": [7]}"#.into(), "methodConfig[0]".into(), "must be an object"),
        // retryThrottling.
        (r#"{"retryThrottling": {"tokenRatio": 0.1}}"#.into(), "retryThrottling.maxTokens".into(), "is required"),
        (r#"{"retryThrottling": {"maxTokens": 0, "tokenRatio": 0.1}}"#.into(), "retryThrottling.maxTokens".into(), "must be an integer from 1 to 1000"),
        (r#"{"retryThrottling": {"maxTokens": 1001, "tokenRatio": 0.1}}"#.into(), "retryThrottling.maxTokens".into(), "must be an integer from 1 to 1000"),
        (r#"{"retryThrottling": {"maxTokens": 1.5, "tokenRatio": 0.1}}"#.into(), "retryThrottling.maxTokens".into(), "must be an integer from 1 to 1000"),
        (r#"{"retryThrottling": {"maxTokens": 10}}"#.into(), "retryThrottling.tokenRatio".into(), "is required"),
        (r#"{"retryThrottling": {"maxTokens": 10, "tokenRatio": 0}}"#.into(), "retryThrottling.tokenRatio".into(), "must be a number greater than 0"),
        (r#"{"retryThrottling": {"maxTokens": 10, "tokenRatio": -0.5}}"#.into(), "retryThrottling.tokenRatio".into(), "must be a number greater than 0"),
        (r#"{"retryThrottling": 3}"#.into(), "retryThrottling".into(), "must be an object"),
        // The document.
        ("[]".into(), String::new(), "must be an object"),
        ("{".into(), String::new(), "not JSON"),
    ];
    for (json, path, message) in cases {
        let err = error_of(&json);
        assert_eq!(err.path(), path, "{json}: {err}");
        assert!(
            err.message().starts_with(message),
            "{json}: {err} (wanted {message:?})"
        );
        // The message names the field, as the path says.
        if !path.is_empty() {
            assert!(err.to_string().starts_with(&format!("{path}: ")), "{err}");
        }
    }
}

#[test]
fn hostile_input_is_an_error_never_a_panic() {
    let deep = "[".repeat(10_000);
    let hostile = [
        "",
        "null",
        "\u{0}",
        "{\"methodConfig\": [{\"name\": [{\"service\": \"\u{202e}\"}], \"timeout\": \"99999999999999999999.9s\"}]}",
        "{\"methodConfig\": [{\"name\": [{\"service\": \"s\"}], \"timeout\": \"1.\u{0661}s\"}]}",
        "{\"retryThrottling\": {\"maxTokens\": 1e400, \"tokenRatio\": 1e-400}}",
        "{\"retryThrottling\": {\"maxTokens\": 18446744073709551616, \"tokenRatio\": 1}}",
        "{\"methodConfig\": [{\"name\": [{\"service\": \"s\"}], \"retryPolicy\": {\"maxAttempts\": 18446744073709551615, \"initialBackoff\": \"315576000000s\", \"maxBackoff\": \"315576000000.999999999s\", \"backoffMultiplier\": 1.7976931348623157e308, \"retryableStatusCodes\": [0]}}]}",
        &deep,
    ];
    for json in hostile {
        let got = std::panic::catch_unwind(|| ServiceConfig::from_json(json));
        assert!(got.is_ok(), "panicked on {:.40}", json);
    }
    // The huge but valid one is valid, and clamped.
    let c = ServiceConfig::from_json(hostile[7]).unwrap();
    let Some(MethodPolicy::Retry(r)) = &c.methods[0].policy else {
        panic!("a retry policy")
    };
    assert_eq!(r.max_attempts, 5);
    // Every string of a few hostile bytes as a duration, and as a code.
    for s in [
        "\u{ffff}s",
        "9".repeat(400).as_str(),
        "0.9999999999s",
        "s1",
        "1ss",
    ] {
        let json = retry_with("initialBackoff", Some(&format!("{s:?}")));
        assert!(ServiceConfig::from_json(&json).is_err(), "{s}");
        let json = retry_with("retryableStatusCodes", Some(&format!("[{s:?}]")));
        assert!(ServiceConfig::from_json(&json).is_err(), "{s}");
    }
}
