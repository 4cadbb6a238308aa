//! The configs gRPC's implementations publish, pasted as they are, and
//! keys spelt as the big implementations accept them: in any case (grpc-go)
//! and as proto field names (proto3's JSON mapping).

use std::time::Duration;

use super::keys::Reader;
use super::tests::{error_of, A6_HEDGING, A6_RETRY};
use super::*;

const MS: Duration = Duration::from_millis(1);

fn greeter() -> MethodName {
    MethodName {
        service: Some("helloworld.Greeter".into()),
        method: Some("SayHello".into()),
    }
}

/// grpc-java's retry example, `examples/src/main/resources/io/grpc/examples/
/// retrying/retrying_service_config.json` (grpc-java
/// c0710ff35f5658ad3fad1293f7525e59e5760b68), as it is.
const GRPC_JAVA_RETRYING: &str = r#"{
  "methodConfig": [
    {
      "name": [
        {
          "service": "helloworld.Greeter",
          "method": "SayHello"
        }
      ],

      "retryPolicy": {
        "maxAttempts": 5,
        "initialBackoff": "0.5s",
        "maxBackoff": "30s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": [
          "UNAVAILABLE"
        ]
      }
    }
  ]
}"#;

/// grpc-java's hedging example, `examples/src/main/resources/io/grpc/examples/
/// hedging/hedging_service_config.json` (grpc-java
/// ac81ad98dd757ed7267e47a3e52b68a5db29c510), as it is.
const GRPC_JAVA_HEDGING: &str = r#"{
  "methodConfig": [
    {
      "name": [
        {
          "service": "helloworld.Greeter",
          "method": "SayHello"
        }
      ],

      "hedgingPolicy": {
        "maxAttempts": 3,
        "hedgingDelay": "1s"
      }
    }
  ],

  "retryThrottling": {
    "maxTokens": 10,
    "tokenRatio": 0.1
  }
}"#;

/// The example in JSON form of gRPC's `doc/service_config.md` (grpc/grpc
/// 2fb111175bf32d9a2dd5d4e7705fce202726a2b8), as it is.
const GRPC_DOC_EXAMPLE: &str = r#"{
  "loadBalancingConfig": [ { "round_robin": {} } ],
  "methodConfig": [
    {
      "name": [
        { "service": "foo", "method": "bar" },
        { "service": "baz" }
      ],
      "timeout": "1.000000001s"
    }
  ]
}"#;

/// gRFC A6's four examples (`A6-client-retries.md`, section "Configuration
/// Language", grpc/proposal 1fd061ad8e7c46422b326e5a60cf68d042476205), as
/// they are: fields of a methodConfig or of the document, which
/// [`in_document`] puts in one.
const A6_RETRY_POLICY: &str = r#""retryPolicy": {
  "maxAttempts": 4,
  "initialBackoff": "0.1s",
  "maxBackoff": "1s",
  "backoffMultiplier": 2,
  "retryableStatusCodes": [
    "UNAVAILABLE"
  ]
}"#;
const A6_HEDGING_POLICY: &str = r#""hedgingPolicy": {
  "maxAttempts": 4,
  "hedgingDelay": "0.5s",
  "nonFatalStatusCodes": [
    "UNAVAILABLE",
    "INTERNAL",
    "ABORTED"
  ]
}"#;
const A6_HEDGING_AT_ONCE: &str = r#""hedgingPolicy": {
  "maxAttempts": 4,
  "hedgingDelay": "0s",
  "nonFatalStatusCodes": [
    "UNAVAILABLE",
    "INTERNAL",
    "ABORTED"
  ]
}"#;
const A6_THROTTLING: &str = r#""retryThrottling": {
  "maxTokens": 10,
  "tokenRatio": 0.1
}"#;

/// A document with one methodConfig for every method, holding
/// `method_fields`, and `fields` of its own.
fn in_document(method_fields: &str, fields: &str) -> String {
    let fields = if fields.is_empty() {
        String::new()
    } else {
        format!(", {fields}")
    };
    format!(r#"{{"methodConfig": [{{"name": [{{}}], {method_fields}}}]{fields}}}"#)
}

#[test]
fn grpc_javas_examples_parse_to_their_policies() {
    let c = ServiceConfig::from_json(GRPC_JAVA_RETRYING).unwrap();
    assert_eq!(
        c.methods,
        [MethodConfig {
            names: vec![greeter()],
            timeout: None,
            policy: Some(MethodPolicy::Retry(RetryPolicy {
                max_attempts: 5,
                initial_backoff: 500 * MS,
                max_backoff: Duration::from_secs(30),
                backoff_multiplier: 2.0,
                retryable_status_codes: vec![GrpcCode::Unavailable],
                per_attempt_recv_timeout: None,
            })),
        }]
    );
    assert_eq!(c.retry_throttling, None);
    let c = ServiceConfig::from_json(GRPC_JAVA_HEDGING).unwrap();
    assert_eq!(
        c.methods,
        [MethodConfig {
            names: vec![greeter()],
            timeout: None,
            policy: Some(MethodPolicy::Hedging(HedgingPolicy {
                max_attempts: 3,
                hedging_delay: Duration::from_secs(1),
                non_fatal_status_codes: vec![],
            })),
        }]
    );
    assert_eq!(
        c.retry_throttling,
        Some(RetryThrottling {
            max_tokens: 10,
            token_ratio: 0.1
        })
    );
}

#[test]
fn grpcs_service_config_doc_example_parses() {
    let v = serde_json::from_str(GRPC_DOC_EXAMPLE).unwrap();
    let mut reader = Reader::default();
    let c = parse::service_config(&mut reader, &v).unwrap();
    let name = |service: &str, method: Option<&str>| MethodName {
        service: Some(service.into()),
        method: method.map(Into::into),
    };
    assert_eq!(
        c.methods,
        [MethodConfig {
            names: vec![name("foo", Some("bar")), name("baz", None)],
            timeout: Some(Duration::new(1, 1)),
            policy: None,
        }]
    );
    // Load balancing is gRPC's, not a stack's: known, and not applied.
    assert_eq!(reader.not_applied(), ["loadBalancingConfig"]);
    assert!(reader.unknown().is_empty());
}

#[test]
fn the_a6_examples_as_the_design_writes_them_parse() {
    let c = ServiceConfig::from_json(&in_document(A6_RETRY_POLICY, A6_THROTTLING)).unwrap();
    let a6 = ServiceConfig::from_json(A6_RETRY).unwrap();
    assert_eq!(c.methods[0].policy, a6.methods[0].policy);
    assert_eq!(c.retry_throttling, a6.retry_throttling);
    let c = ServiceConfig::from_json(&in_document(A6_HEDGING_POLICY, "")).unwrap();
    let a6 = ServiceConfig::from_json(A6_HEDGING).unwrap();
    assert_eq!(c.methods[0].policy, a6.methods[0].policy);
    let c = ServiceConfig::from_json(&in_document(A6_HEDGING_AT_ONCE, "")).unwrap();
    assert_eq!(
        c.methods[0].policy,
        Some(MethodPolicy::Hedging(HedgingPolicy {
            max_attempts: 4,
            hedging_delay: Duration::ZERO,
            non_fatal_status_codes: vec![
                GrpcCode::Unavailable,
                GrpcCode::Internal,
                GrpcCode::Aborted
            ],
        }))
    );
}

/// gRFC A6's retry example with its keys as grpc-go's structs name them
/// (`encoding/json` matches them whatever the case).
const A6_RETRY_CAPITALISED: &str = r#"{
  "MethodConfig": [{
    "Name": [{"Service": "EchoService", "Method": "UnaryEcho"}],
    "RetryPolicy": {
      "MaxAttempts": 4,
      "InitialBackoff": "0.1s",
      "MaxBackoff": "1s",
      "BackoffMultiplier": 2,
      "RetryableStatusCodes": ["UNAVAILABLE"]
    }
  }],
  "RetryThrottling": {"MaxTokens": 10, "TokenRatio": 0.1}
}"#;

/// The same with proto field names, as proto3's JSON mapping has parsers
/// accept them.
const A6_RETRY_PROTO_NAMES: &str = r#"{
  "method_config": [{
    "name": [{"service": "EchoService", "method": "UnaryEcho"}],
    "retry_policy": {
      "max_attempts": 4,
      "initial_backoff": "0.1s",
      "max_backoff": "1s",
      "backoff_multiplier": 2,
      "retryable_status_codes": ["UNAVAILABLE"]
    }
  }],
  "retry_throttling": {"max_tokens": 10, "token_ratio": 0.1}
}"#;

/// The same in a mix of all of those, and codes by name in any case (as
/// gRFC A6 says) and by number.
const A6_RETRY_MIXED: &str = r#"{
  "METHOD_CONFIG": [{
    "NAME": [{"SERVICE": "EchoService", "method": "UnaryEcho"}],
    "retryPolicy": {
      "max_Attempts": 4,
      "initialbackoff": "0.1s",
      "MaxBackoff": "1s",
      "BACKOFFMULTIPLIER": 2,
      "retryable_status_codes": ["unavailable", "Unavailable", 14]
    }
  }],
  "retryThrottling": {"max_tokens": 10, "TokenRatio": 0.1}
}"#;

#[test]
fn keys_in_any_case_or_as_proto_names_read_the_same() {
    let want = ServiceConfig::from_json(A6_RETRY).unwrap();
    for json in [A6_RETRY_CAPITALISED, A6_RETRY_PROTO_NAMES, A6_RETRY_MIXED] {
        assert_eq!(ServiceConfig::from_json(json), Ok(want.clone()), "{json}");
    }
    let hedging = r#"{
      "method_config": [{
        "name": [{"service": "EchoService", "method": "UnaryEcho"}],
        "hedging_policy": {
          "max_attempts": 4,
          "hedging_delay": "0.5s",
          "non_fatal_status_codes": ["UNAVAILABLE", "INTERNAL", "ABORTED"]
        }
      }],
      "retry_throttling": {"max_tokens": 10, "token_ratio": 0.1}
    }"#;
    assert_eq!(
        ServiceConfig::from_json(hedging),
        ServiceConfig::from_json(A6_HEDGING)
    );
    let c = ServiceConfig::from_json(&in_document(
        r#""timeout": "2s", "retry_policy": {"max_attempts": 2, "initial_backoff": "1s",
            "max_backoff": "1s", "backoff_multiplier": 1, "retryable_status_codes": [14],
            "per_attempt_recv_timeout": "0.2s"}"#,
        "",
    ))
    .unwrap();
    let Some(MethodPolicy::Retry(r)) = &c.methods[0].policy else {
        panic!("a retry policy: {c:?}")
    };
    assert_eq!(r.per_attempt_recv_timeout, Some(200 * MS));
    assert_eq!(c.methods[0].timeout, Some(Duration::from_secs(2)));
}

#[test]
fn an_error_names_the_field_as_the_document_spells_it() {
    let json =
        A6_RETRY_PROTO_NAMES.replace("[\"UNAVAILABLE\"]", "[\"UNAVAILABLE\", \"UNAVAILBLE\"]");
    let err = error_of(&json);
    assert_eq!(
        err.to_string(),
        "method_config[0].retry_policy.retryable_status_codes[1]: \"UNAVAILBLE\" is not a gRPC \
         status code (a name such as \"UNAVAILABLE\", or a number from 0 to 16)"
    );
    // A field that is absent is named by its JSON name; the keys that name
    // nothing beside it are listed, as one of them may be it misspelt.
    let json = A6_RETRY_CAPITALISED.replace("\"MaxAttempts\"", "\"MaxAtempts\"");
    assert_eq!(
        error_of(&json).to_string(),
        "MethodConfig[0].RetryPolicy.maxAttempts: is required (the keys here that name no \
         field: \"MaxAtempts\")"
    );
}

#[test]
fn two_keys_for_one_field_are_an_error_naming_both() {
    for (json, path, message) in [
        (
            in_document(
                r#""retryPolicy": {"maxAttempts": 2, "MaxAttempts": 4, "initialBackoff": "1s",
                   "maxBackoff": "1s", "backoffMultiplier": 1, "retryableStatusCodes": [14]}"#,
                "",
            ),
            "methodConfig[0].retryPolicy.maxAttempts",
            r#"is set twice, as "MaxAttempts" and "maxAttempts": keep one"#,
        ),
        (
            r#"{"methodConfig": [], "method_config": []}"#.to_owned(),
            "methodConfig",
            r#"is set twice, as "methodConfig" and "method_config": keep one"#,
        ),
        (
            in_document(r#""timeout": "1s", "TIMEOUT": "2s""#, ""),
            "methodConfig[0].timeout",
            r#"is set twice, as "TIMEOUT" and "timeout": keep one"#,
        ),
    ] {
        let err = error_of(&json);
        assert_eq!((err.path(), err.message()), (path, message), "{json}");
    }
}

#[test]
fn unknown_fields_are_ignored_and_listed_with_those_not_applied() {
    let json = r#"{
      "futureField": {"a": 1},
      "loadBalancingConfig": [{"round_robin": {}}],
      "healthCheckConfig": {"serviceName": "x"},
      "methodConfig": [{
        "name": [{"service": "EchoService", "method": "UnaryEcho", "version": 2}],
        "waitForReady": true,
        "max_request_message_bytes": 1024,
        "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"],
                        "jitter": 0.2}
      }],
      "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
    }"#;
    let v = serde_json::from_str(json).unwrap();
    let mut reader = Reader::default();
    let c = parse::service_config(&mut reader, &v).unwrap();
    assert_eq!(c, ServiceConfig::from_json(A6_RETRY).unwrap());
    let sorted = |paths: &[String]| {
        let mut paths = paths.to_vec();
        paths.sort();
        paths
    };
    assert_eq!(
        sorted(reader.unknown()),
        [
            "futureField",
            "methodConfig[0].name[0].version",
            "methodConfig[0].retryPolicy.jitter"
        ]
    );
    assert_eq!(
        sorted(reader.not_applied()),
        [
            "healthCheckConfig",
            "loadBalancingConfig",
            "methodConfig[0].max_request_message_bytes",
            "methodConfig[0].waitForReady"
        ]
    );
}
