//! gRPC's service config over tonic: gRFC A6's two JSON examples, as
//! written, applied to tower-resend's stack around a tonic `Channel`
//! against tonic servers on loopback (paused clock): the retry policy's
//! method retried on its codes only, the hedging policy's method hedged
//! after its delay, other methods neither, and `retryThrottling` stopping
//! retries and hedges once half its tokens are gone. grpc-go's retry
//! example, pasted as grpc-go publishes it (capitalised keys, `".01s"`),
//! and spelt with proto field names, retries as its `MaxAttempts` says.
//!
//! `cargo test -p tower-resend-tests --features service-config --test service_config`

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tonic::Code;
use tower::ServiceExt;
use tower_resend::classify::GrpcCode;
use tower_resend::retry::Stop;
use tower_resend::routes::PerRoute;
use tower_resend::service_config::{ConfiguredStack, MethodPolicy, ServiceConfig};
use tower_resend::tonic::{grpc_status, TonicTransport};

use common::grpc::{answer, call, Do, GrpcServer};
use common::{attempts, within};

const MS: Duration = Duration::from_millis(1);

/// gRFC A6's retry policy example, as the design writes it.
const A6_RETRY: &str = r#"{
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

/// gRFC A6's hedging policy example, as the design writes it.
const A6_HEDGING: &str = r#"{
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

const UNARY_ECHO: &str = "/EchoService/UnaryEcho";
const OTHER: &str = "/EchoService/OtherEcho";

type Client = PerRoute<ConfiguredStack<TonicTransport<tonic::transport::Channel>>>;

/// `json`'s stacks around a channel to `server`: 10 s a call, seeded.
fn client(json: &str, server: &GrpcServer) -> Client {
    let config = ServiceConfig::from_json(json).expect("a valid service config");
    let base = tower_resend::stack()
        .name("echo")
        .total(Duration::from_secs(10))
        .seed(7);
    config.service(base, TonicTransport::new(server.channel()))
}

/// The arrivals at `server` for `path`.
fn arrivals_for(server: &GrpcServer, path: &str) -> Vec<common::grpc::Arrival> {
    server
        .arrivals()
        .into_iter()
        .filter(|a| a.path == path)
        .collect()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_retry_policy_retries_its_method_on_its_codes_only() {
    // UnaryEcho: UNAVAILABLE twice, then an answer; then ABORTED (not in
    // retryableStatusCodes). OtherEcho, with no methodConfig: UNAVAILABLE.
    let server = GrpcServer::start(|n, path| match (path, n) {
        (UNARY_ECHO, 0 | 1) => Do::Status(Code::Unavailable, None),
        (UNARY_ECHO, 2) => Do::Answer,
        (UNARY_ECHO, _) => Do::Status(Code::Aborted, None),
        _ => Do::Status(Code::Unavailable, None),
    })
    .await;
    let echo = client(A6_RETRY, &server);

    let resp = within(echo.clone().oneshot(call(UNARY_ECHO, None)))
        .await
        .expect("the third attempt answers");
    let a = attempts(&resp).clone();
    assert_eq!(a.len(), 3);
    // Backoff as A6 says: the n-th retry waits at most
    // min(initialBackoff * multiplier^(n-1), maxBackoff).
    let waits: Vec<Duration> = a.iter().map(|a| a.waited()).collect();
    assert!(waits[1] <= 100 * MS && waits[2] <= 200 * MS, "{waits:?}");
    let (_, code) = answer(resp).await;
    assert_eq!(code, Some(Code::Ok));
    let previous: Vec<_> = arrivals_for(&server, UNARY_ECHO)
        .into_iter()
        .map(|a| a.previous)
        .collect();
    assert_eq!(previous, [None, Some("1".into()), Some("2".into())]);

    // ABORTED is not among its codes: final, sent once.
    let resp = within(echo.clone().oneshot(call(UNARY_ECHO, None)))
        .await
        .expect("an answer");
    assert_eq!(grpc_status(resp.headers()), Some(Code::Aborted));
    assert_eq!(attempts(&resp).len(), 1);
    assert_eq!(arrivals_for(&server, UNARY_ECHO).len(), 4);

    // Another method of the service: no policy, no retry.
    let resp = within(echo.clone().oneshot(call(OTHER, None)))
        .await
        .expect("an answer");
    assert_eq!(grpc_status(resp.headers()), Some(Code::Unavailable));
    assert_eq!(attempts(&resp).len(), 1);
    assert_eq!(arrivals_for(&server, OTHER).len(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_hedging_policy_hedges_its_method_after_its_delay() {
    // UnaryEcho: the first copy hangs, the second answers.
    let server = GrpcServer::start(|n, path| match (path, n) {
        (UNARY_ECHO, 0) => Do::Hang,
        (UNARY_ECHO, _) => Do::Answer,
        _ => Do::Hang,
    })
    .await;
    let echo = client(A6_HEDGING, &server);

    let resp = within(echo.clone().oneshot(call(UNARY_ECHO, None)))
        .await
        .expect("the hedged copy answers");
    let a = attempts(&resp).clone();
    assert_eq!(a.len(), 1, "one attempt, hedged");
    let first = a.iter().next().expect("an attempt");
    assert_eq!((first.copies(), first.winning_copy()), (2, 2));
    let (_, code) = answer(resp).await;
    assert_eq!(code, Some(Code::Ok));
    let arrivals = arrivals_for(&server, UNARY_ECHO);
    assert_eq!(arrivals.len(), 2);
    // The copy went out after hedgingDelay, saying it is the second.
    let gap = arrivals[1].at - arrivals[0].at;
    assert!((500 * MS..600 * MS).contains(&gap), "{gap:?}");
    assert_eq!(arrivals[1].previous.as_deref(), Some("1"));

    // Another method: not hedged; it waits out the call's 10 s alone.
    let err = within(echo.clone().oneshot(call(OTHER, None)))
        .await
        .expect_err("it never answers");
    assert!(
        err.is_deadline_exceeded() || err.is_outcome_unknown(),
        "{err}"
    );
    assert_eq!(arrivals_for(&server, OTHER).len(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_non_fatal_code_sends_the_next_copy_at_once_and_a_fatal_one_ends_the_call() {
    // UNAVAILABLE (non-fatal) at once, then an answer; then NOT_FOUND.
    let server = GrpcServer::start(|n, _| match n {
        0 => Do::Status(Code::Unavailable, None),
        1 => Do::Answer,
        2 => Do::Status(Code::NotFound, None),
        _ => Do::Answer,
    })
    .await;
    let echo = client(A6_HEDGING, &server);

    let resp = within(echo.clone().oneshot(call(UNARY_ECHO, None)))
        .await
        .expect("the second copy answers");
    let (_, code) = answer(resp).await;
    assert_eq!(code, Some(Code::Ok));
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    assert!(
        arrivals[1].at - arrivals[0].at < 500 * MS,
        "not after the delay"
    );

    let resp = within(echo.clone().oneshot(call(UNARY_ECHO, None)))
        .await
        .expect("an answer");
    assert_eq!(grpc_status(resp.headers()), Some(Code::NotFound));
    common::idle(Duration::from_secs(3)).await;
    assert_eq!(server.arrival_count(), 3, "no copy after a fatal status");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retry_throttling_stops_retries_and_hedges_at_half_its_tokens() {
    // A6's two policies on one channel, sharing its 10 tokens (0.1 back
    // per success): UnaryEcho retried, HedgedEcho hedged after 0.5 s.
    let config = r#"{
      "methodConfig": [
        {"name": [{"service": "EchoService", "method": "UnaryEcho"}],
         "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
                         "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}},
        {"name": [{"service": "EchoService", "method": "HedgedEcho"}],
         "hedgingPolicy": {"maxAttempts": 4, "hedgingDelay": "0.5s",
                           "nonFatalStatusCodes": ["UNAVAILABLE", "INTERNAL", "ABORTED"]}}
      ],
      "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
    }"#;
    const HEDGED: &str = "/EchoService/HedgedEcho";
    // UnaryEcho is down; HedgedEcho hangs; OtherEcho answers.
    let server = GrpcServer::start(|_, path| match path {
        UNARY_ECHO => Do::Status(Code::Unavailable, None),
        HEDGED => Do::Hang,
        _ => Do::Answer,
    })
    .await;
    let echo = client(config, &server);
    let unary = |echo: &Client| {
        let echo = echo.clone();
        async move {
            within(echo.oneshot(call(UNARY_ECHO, None)))
                .await
                .expect("the last UNAVAILABLE")
        }
    };

    // 10 tokens: four failed attempts leave 6, and each was retried.
    let resp = unary(&echo).await;
    assert_eq!(attempts(&resp).len(), 4);
    assert_eq!(attempts(&resp).stop(), Stop::MaxAttempts);
    // The fifth failure leaves 5, not more than half: no retry; the call
    // ends with its answer.
    let resp = unary(&echo).await;
    assert_eq!(grpc_status(resp.headers()), Some(Code::Unavailable));
    assert_eq!(attempts(&resp).len(), 1);
    assert_eq!(attempts(&resp).stop(), Stop::Budget);
    assert_eq!(arrivals_for(&server, UNARY_ECHO).len(), 5);

    // No hedge either: the hedged method's first copy waits alone.
    let hedged = |echo: &Client| {
        let mut req = call(HEDGED, None);
        req.extensions_mut()
            .insert(tower_resend::Deadline::after(Duration::from_secs(2)));
        let echo = echo.clone();
        async move { within(echo.oneshot(req)).await }
    };
    assert!(hedged(&echo).await.is_err());
    assert_eq!(arrivals_for(&server, HEDGED).len(), 1);

    // A success on any method gives 0.1 back: 5.1 is more than half, and
    // the hedges go out again (at 0.5, 1 and 1.5 s of the 2 s).
    let resp = within(echo.clone().oneshot(call(OTHER, None)))
        .await
        .expect("an answer");
    let (_, code) = answer(resp).await;
    assert_eq!(code, Some(Code::Ok));
    assert!(hedged(&echo).await.is_err());
    assert_eq!(arrivals_for(&server, HEDGED).len(), 1 + 4);
}

/// The count is the channel's: every clone of the router draws on it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_routers_clones_share_the_channels_tokens() {
    let down = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&down);
    let server = GrpcServer::start(move |_, _| {
        seen.fetch_add(1, Ordering::SeqCst);
        Do::Status(Code::Unavailable, None)
    })
    .await;
    let echo = client(A6_RETRY, &server);
    // Three clones, one count: 4 attempts (10 -> 6), then 1 (-> 5, no
    // longer more than half), then 1.
    for (i, want) in [4, 1, 1].into_iter().enumerate() {
        let resp = within(echo.clone().oneshot(call(UNARY_ECHO, None)))
            .await
            .expect("an answer");
        assert_eq!(attempts(&resp).len(), want, "call {i}");
    }
    assert_eq!(down.load(Ordering::SeqCst), 6);
}

/// grpc-go's retry example config: between the backquotes of
/// `examples/features/retry/README.md` at grpc-go
/// 4793ad0474669eafbd5346c8a3d098fdfa542498, as it is but for its two `//`
/// comment lines, removed (JSON has no comments).
const GRPC_GO_README: &str = r#"{
            "methodConfig": [{
                "name": [{"service": "grpc.examples.echo.Echo"}],

                "retryPolicy": {
                    "MaxAttempts": 4,
                    "InitialBackoff": ".01s",
                    "MaxBackoff": ".01s",
                    "BackoffMultiplier": 1.0,
                    "RetryableStatusCodes": [ "UNAVAILABLE" ]
                }
            }]
        }"#;

/// The same example's `retryPolicy` string, in
/// `examples/features/retry/client/main.go` at the same commit, as it is.
const GRPC_GO_CLIENT: &str = r#"{
		"methodConfig": [{
		  "name": [{"service": "grpc.examples.echo.Echo"}],
		  "retryPolicy": {
			  "MaxAttempts": 4,
			  "InitialBackoff": ".01s",
			  "MaxBackoff": ".01s",
			  "BackoffMultiplier": 1.0,
			  "RetryableStatusCodes": [ "UNAVAILABLE" ]
		  }
		}]}"#;

/// The README's config spelt with proto field names, which proto3's JSON
/// mapping has parsers accept beside the JSON names.
const GRPC_GO_PROTO_NAMES: &str = r#"{
  "method_config": [{
    "name": [{"service": "grpc.examples.echo.Echo"}],
    "retry_policy": {
      "max_attempts": 4,
      "initial_backoff": ".01s",
      "max_backoff": ".01s",
      "backoff_multiplier": 1.0,
      "retryable_status_codes": [ "UNAVAILABLE" ]
    }
  }]
}"#;

const GRPC_GO_ECHO: &str = "/grpc.examples.echo.Echo/UnaryEcho";

/// What grpc-go's example says: every method of `grpc.examples.echo.Echo`
/// makes up to 4 attempts, 10 ms apart at most, retrying UNAVAILABLE.
fn assert_is_grpc_gos_example(config: &ServiceConfig) {
    let [method] = config.methods.as_slice() else {
        panic!("one methodConfig: {config:?}")
    };
    let [name] = method.names.as_slice() else {
        panic!("one name: {method:?}")
    };
    assert_eq!(name.service.as_deref(), Some("grpc.examples.echo.Echo"));
    assert_eq!(name.method, None);
    assert_eq!(method.timeout, None);
    let Some(MethodPolicy::Retry(r)) = &method.policy else {
        panic!("a retry policy: {method:?}")
    };
    assert_eq!(r.max_attempts, 4);
    assert_eq!((r.initial_backoff, r.max_backoff), (10 * MS, 10 * MS));
    assert_eq!(r.backoff_multiplier, 1.0);
    assert_eq!(r.retryable_status_codes, [GrpcCode::Unavailable]);
    assert_eq!(config.retry_throttling, None);
}

/// `json` (grpc-go's example, however spelt) through a stack: against the
/// example's own server, which answers UNAVAILABLE but to every fourth call
/// (`examples/features/retry/server/main.go`), the fourth attempt answers;
/// against a server that is down, UNAVAILABLE is retried three times, four
/// attempts in all, and the call ends with it; another service's method is
/// sent once.
async fn grpc_gos_example_retries_as_it_says(json: &str) {
    let config = ServiceConfig::from_json(json).expect("grpc-go's example config");
    assert_is_grpc_gos_example(&config);

    let server = GrpcServer::start(|n, _| {
        if n % 4 == 3 {
            Do::Answer
        } else {
            Do::Status(Code::Unavailable, None)
        }
    })
    .await;
    let echo = client(json, &server);
    let resp = within(echo.oneshot(call(GRPC_GO_ECHO, None)))
        .await
        .expect("the fourth attempt answers");
    let a = attempts(&resp).clone();
    assert_eq!(a.len(), 4);
    // MaxBackoff ".01s": no retry waited longer.
    let waits: Vec<Duration> = a.iter().map(|a| a.waited()).collect();
    assert!(waits.iter().all(|w| *w <= 10 * MS), "{waits:?}");
    let (_, code) = answer(resp).await;
    assert_eq!(code, Some(Code::Ok));
    let previous: Vec<_> = server.arrivals().into_iter().map(|a| a.previous).collect();
    assert_eq!(
        previous,
        [None, Some("1".into()), Some("2".into()), Some("3".into())]
    );

    let down = GrpcServer::start(|_, _| Do::Status(Code::Unavailable, None)).await;
    let echo = client(json, &down);
    let resp = within(echo.clone().oneshot(call(GRPC_GO_ECHO, None)))
        .await
        .expect("the last UNAVAILABLE");
    assert_eq!(grpc_status(resp.headers()), Some(Code::Unavailable));
    assert_eq!(attempts(&resp).len(), 4);
    assert_eq!(attempts(&resp).stop(), Stop::MaxAttempts);
    assert_eq!(down.arrival_count(), 4);
    let resp = within(echo.oneshot(call("/grpc.examples.echo.Other/UnaryEcho", None)))
        .await
        .expect("an UNAVAILABLE");
    assert_eq!(attempts(&resp).len(), 1);
    assert_eq!(down.arrival_count(), 5);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn grpc_gos_retry_example_as_published_retries_unavailable_three_times() {
    grpc_gos_example_retries_as_it_says(GRPC_GO_README).await;
    grpc_gos_example_retries_as_it_says(GRPC_GO_CLIENT).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn grpc_gos_retry_example_with_proto_names_works_the_same() {
    grpc_gos_example_retries_as_it_says(GRPC_GO_PROTO_NAMES).await;
}

#[test]
fn a_misspelt_status_code_is_quoted_with_its_path() {
    const WHY: &str =
        "is not a gRPC status code (a name such as \"UNAVAILABLE\", or a number from 0 to 16)";
    // In grpc-go's example: the path as the document spells it.
    let json = GRPC_GO_README.replace("\"UNAVAILABLE\"", "\"UNAVAILBLE\"");
    let err = ServiceConfig::from_json(&json).expect_err("UNAVAILBLE is no status code");
    assert_eq!(
        err.path(),
        "methodConfig[0].retryPolicy.RetryableStatusCodes[0]"
    );
    assert_eq!(
        err.to_string(),
        format!("methodConfig[0].retryPolicy.RetryableStatusCodes[0]: \"UNAVAILBLE\" {WHY}")
    );
    // Second in gRFC A6's list.
    let json = A6_RETRY.replace(r#"["UNAVAILABLE"]"#, r#"["UNAVAILABLE", "UNAVAILBLE"]"#);
    let err = ServiceConfig::from_json(&json).expect_err("UNAVAILBLE is no status code");
    assert_eq!(
        err.to_string(),
        format!("methodConfig[0].retryPolicy.retryableStatusCodes[1]: \"UNAVAILBLE\" {WHY}")
    );
}

/// A method's `timeout` is its call's deadline: a call it cuts is
/// DEADLINE_EXCEEDED as a tonic client sees it, keyed or not (outcome
/// unknown behind it, with its key when it had one).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_methods_timeout_ends_the_call_deadline_exceeded() {
    let server = GrpcServer::start(|_, _| Do::WorkThenHang).await;
    let json = r#"{"methodConfig": [{
        "name": [{"service": "EchoService", "method": "UnaryEcho"}],
        "timeout": "0.5s"
    }]}"#;
    for key in [None, Some("echo-1")] {
        let started = tokio::time::Instant::now();
        let err = within(client(json, &server).oneshot(call(UNARY_ECHO, key)))
            .await
            .expect_err("the method's timeout");
        // (The channel cuts it at the grpc-timeout sent, the time left less
        // its small margin.)
        let took = started.elapsed();
        assert!(took <= 500 * MS && took >= 450 * MS, "{took:?}: {err}");
        // (A POST that may have run, keyed or not.)
        assert!(err.is_outcome_unknown(), "{err}");
        assert_eq!(err.idempotency_key(), key, "{err}");
        let status = tower_resend::tonic::into_status(err);
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    }
}
