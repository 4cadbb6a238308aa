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

pub(super) fn error_of(json: &str) -> InvalidConfig {
    match ServiceConfig::from_json(json) {
        Ok(c) => panic!("accepted {json}: {c:?}"),
        Err(e) => e,
    }
}

/// The end of a message about a string that is not a duration.
const NOT_A_DURATION: &str =
    "is not a duration such as \"1.5s\" (seconds, up to 9 decimals, then \"s\")";
/// The end of a message about a value that is not a status code.
const NOT_A_CODE: &str =
    "is not a gRPC status code (a name such as \"UNAVAILABLE\", or a number from 0 to 16)";

#[test]
fn every_invalid_case_is_an_error_naming_its_field_and_quoting_its_value() {
    const RP: &str = "methodConfig[0].retryPolicy";
    const HP: &str = "methodConfig[0].hedgingPolicy";
    let at = |field: &str| format!("{RP}.{field}");
    let d = |value: &str| format!("{value} {NOT_A_DURATION}");
    let c = |value: &str| format!("{value} {NOT_A_CODE}");
    let cases: Vec<(String, String, String)> = vec![
        // retryPolicy.maxAttempts: required, an integer > 1.
        (retry_with("maxAttempts", None), at("maxAttempts"), "is required".into()),
        (retry_with("maxAttempts", Some("1")), at("maxAttempts"), "1 is not an integer greater than 1".into()),
        (retry_with("maxAttempts", Some("0")), at("maxAttempts"), "0 is not an integer greater than 1".into()),
        (retry_with("maxAttempts", Some("-3")), at("maxAttempts"), "-3 is not an integer greater than 1".into()),
        (retry_with("maxAttempts", Some("2.5")), at("maxAttempts"), "2.5 is not an integer greater than 1".into()),
        (retry_with("maxAttempts", Some("\"3\"")), at("maxAttempts"), "\"3\" is not an integer greater than 1".into()),
        // initialBackoff, maxBackoff: required, > 0.
        (retry_with("initialBackoff", None), at("initialBackoff"), "is required".into()),
        (retry_with("initialBackoff", Some("\"0s\"")), at("initialBackoff"), "\"0s\" is not greater than 0s".into()),
        (retry_with("initialBackoff", Some("\"100ms\"")), at("initialBackoff"), d("\"100ms\"")),
        (retry_with("initialBackoff", Some("0.1")), at("initialBackoff"), d("0.1")),
        (retry_with("maxBackoff", None), at("maxBackoff"), "is required".into()),
        (retry_with("maxBackoff", Some("\"0.0s\"")), at("maxBackoff"), "\"0.0s\" is not greater than 0s".into()),
        (retry_with("maxBackoff", Some("\"-1s\"")), at("maxBackoff"), "\"-1s\" is negative".into()),
        (retry_with("maxBackoff", Some("\"1.0000000001s\"")), at("maxBackoff"), "\"1.0000000001s\" has more than 9 decimals (a duration counts nanoseconds)".into()),
        // backoffMultiplier: required, > 0.
        (retry_with("backoffMultiplier", None), at("backoffMultiplier"), "is required".into()),
        (retry_with("backoffMultiplier", Some("0")), at("backoffMultiplier"), "0 is not a number greater than 0".into()),
        (retry_with("backoffMultiplier", Some("-2")), at("backoffMultiplier"), "-2 is not a number greater than 0".into()),
        (retry_with("backoffMultiplier", Some("\"2\"")), at("backoffMultiplier"), "\"2\" is not a number greater than 0".into()),
        // retryableStatusCodes: required, non-empty, codes.
        (retry_with("retryableStatusCodes", None), at("retryableStatusCodes"), "is required".into()),
        (retry_with("retryableStatusCodes", Some("[]")), at("retryableStatusCodes"), "[] is empty: it must list at least one status code".into()),
        (retry_with("retryableStatusCodes", Some("\"UNAVAILABLE\"")), at("retryableStatusCodes"), "\"UNAVAILABLE\" is not a list".into()),
        (retry_with("retryableStatusCodes", Some("[\"UNAVAILABLE\", \"UNAVAILBLE\"]")), at("retryableStatusCodes[1]"), c("\"UNAVAILBLE\"")),
        (retry_with("retryableStatusCodes", Some("[17]")), at("retryableStatusCodes[0]"), c("17")),
        (retry_with("retryableStatusCodes", Some("[-1]")), at("retryableStatusCodes[0]"), c("-1")),
        (retry_with("retryableStatusCodes", Some("[14.0]")), at("retryableStatusCodes[0]"), c("14.0")),
        (retry_with("retryableStatusCodes", Some("[\"14\"]")), at("retryableStatusCodes[0]"), c("\"14\"")),
        (retry_with("retryableStatusCodes", Some("[null]")), at("retryableStatusCodes[0]"), c("null")),
        // perAttemptRecvTimeout: optional, > 0.
        (retry_with("perAttemptRecvTimeout", Some("\"0s\"")), at("perAttemptRecvTimeout"), "\"0s\" is not greater than 0s".into()),
        (retry_with("perAttemptRecvTimeout", Some("\"1\"")), at("perAttemptRecvTimeout"), d("\"1\"")),
        // hedgingPolicy.
        (hedging_with("{}"), format!("{HP}.maxAttempts"), "is required".into()),
        (hedging_with(r#"{"maxAttempts": 1}"#), format!("{HP}.maxAttempts"), "1 is not an integer greater than 1".into()),
        (hedging_with(r#"{"maxAttempts": 2, "hedgingDelay": "1"}"#), format!("{HP}.hedgingDelay"), d("\"1\"")),
        (hedging_with(r#"{"maxAttempts": 2, "nonFatalStatusCodes": ["OOPS"]}"#), format!("{HP}.nonFatalStatusCodes[0]"), c("\"OOPS\"")),
        (hedging_with(r#"{"maxAttempts": 2, "nonFatalStatusCodes": 14}"#), format!("{HP}.nonFatalStatusCodes"), "14 is not a list".into()),
        (hedging_with("[]"), HP.into(), "[] is not an object".into()),
        // Both policies.
        (
            r#"{"methodConfig": [{"name": [{"service": "s.S"}], "hedgingPolicy": {"maxAttempts": 2},
                "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s",
                                "backoffMultiplier": 1, "retryableStatusCodes": [14]}}]}"#.into(),
            "methodConfig[0]".into(),
            "has both retryPolicy and hedgingPolicy: a method may have one or the other".into(),
        ),
        // timeout.
        (
            r#"{"methodConfig": [{"name": [{"service": "s.S"}], "timeout": "1.5"}]}"#.into(),
            "methodConfig[0].timeout".into(),
            d("\"1.5\""),
        ),
        // Names: a method without a service, duplicates, two defaults.
        (
            r#"{"methodConfig": [{"name": [{"method": "M"}]}]}"#.into(),
            "methodConfig[0].name[0].method".into(),
            "\"M\" must be empty when service is empty (an empty service names the default for every method)".into(),
        ),
        (
            r#"{"methodConfig": [{"name": [{"service": "s.S", "method": "M"}]},
                                 {"name": [{"service": "t.T"}, {"service": "s.S", "method": "M"}]}]}"#.into(),
            "methodConfig[1].name[1]".into(),
            "names the same method as methodConfig[0].name[0]".into(),
        ),
        (
            r#"{"methodConfig": [{"name": [{"service": "s.S"}, {"service": "s.S", "method": ""}]}]}"#.into(),
            "methodConfig[0].name[1]".into(),
            "names the same method as methodConfig[0].name[0]".into(),
        ),
        (
            r#"{"methodConfig": [{"name": [{}]}, {"name": [{"service": ""}]}]}"#.into(),
            "methodConfig[1].name[0]".into(),
            "a second default (empty name); the first is methodConfig[0].name[0]".into(),
        ),
        (r#"{"methodConfig": [{}]}"#.into(), "methodConfig[0].name".into(), "is required".into()),
        (r#"{"methodConfig": [{"name": []}]}"#.into(), "methodConfig[0].name".into(), "[] is empty: it must list at least one name".into()),
        (r#"{"methodConfig": [{"name": [{"service": 1}]}]}"#.into(), "methodConfig[0].name[0].service".into(), "1 is not a string".into()),
        (r#"{"methodConfig": {}}"#.into(), "methodConfig".into(), "{} is not a list".into()),
        (r#"{"methodConfig": [7]}"#.into(), "methodConfig[0]".into(), "7 is not an object".into()),
        // retryThrottling.
        (r#"{"retryThrottling": {"tokenRatio": 0.1}}"#.into(), "retryThrottling.maxTokens".into(), "is required".into()),
        (r#"{"retryThrottling": {"maxTokens": 0, "tokenRatio": 0.1}}"#.into(), "retryThrottling.maxTokens".into(), "0 is not an integer from 1 to 1000".into()),
        (r#"{"retryThrottling": {"maxTokens": 1001, "tokenRatio": 0.1}}"#.into(), "retryThrottling.maxTokens".into(), "1001 is not an integer from 1 to 1000".into()),
        (r#"{"retryThrottling": {"maxTokens": 1.5, "tokenRatio": 0.1}}"#.into(), "retryThrottling.maxTokens".into(), "1.5 is not an integer from 1 to 1000".into()),
        (r#"{"retryThrottling": {"maxTokens": 10}}"#.into(), "retryThrottling.tokenRatio".into(), "is required".into()),
        (r#"{"retryThrottling": {"maxTokens": 10, "tokenRatio": 0}}"#.into(), "retryThrottling.tokenRatio".into(), "0 is not a number greater than 0".into()),
        (r#"{"retryThrottling": {"maxTokens": 10, "tokenRatio": -0.5}}"#.into(), "retryThrottling.tokenRatio".into(), "-0.5 is not a number greater than 0".into()),
        (r#"{"retryThrottling": 3}"#.into(), "retryThrottling".into(), "3 is not an object".into()),
        // The document.
        ("[]".into(), String::new(), "[] is not an object".into()),
    ];
    for (json, path, message) in cases {
        let err = error_of(&json);
        assert_eq!(err.path(), path, "{json}: {err}");
        assert_eq!(err.message(), message, "{json}");
        // The message names the field, as the path says.
        let shown = if path.is_empty() {
            message
        } else {
            format!("{path}: {message}")
        };
        assert_eq!(err.to_string(), shown);
    }
    // Not JSON: serde_json's own words after ours.
    let err = error_of("{");
    assert_eq!(err.path(), "");
    assert!(err.message().starts_with("not JSON: "), "{err}");
}

#[test]
fn a_long_value_is_quoted_in_part() {
    let long = format!("\"{}\"", "x".repeat(200));
    let err = error_of(&retry_with("initialBackoff", Some(&long)));
    let quoted = err.message().split(' ').next().unwrap_or_default();
    assert_eq!(quoted.chars().count(), 61, "{err}");
    assert!(quoted.ends_with('…'), "{err}");
    assert!(err.message().ends_with(NOT_A_DURATION), "{err}");
    // Cut between characters, never inside one.
    let wide = format!("\"{}\"", "é".repeat(200));
    let err = error_of(&retry_with("initialBackoff", Some(&wide)));
    assert!(err.message().starts_with("\"éé"), "{err}");
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
