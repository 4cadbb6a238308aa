//! The behaviour suite of `tests/retry.rs` over gRPC: tower-resend's stack around
//! a tonic `Channel` ([`tower_resend::tonic::TonicTransport`]) with the
//! [`GrpcClassifier`] (and without naming one: the default recognises gRPC),
//! against a real tonic server on loopback (prost messages written by hand:
//! no protoc), on tokio's paused clock.
//!
//! `cargo test -p tower-resend-tests --features tonic --test tonic`

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::util::MapErr;
use tower::ServiceExt;
use tower_resend::classify::GrpcClassifier;
use tower_resend::classify::{Class, GrpcCode};
use tower_resend::retry::Stop;
use tower_resend::tonic::{grpc_status, into_status, resend_error, TonicTransport};
use tower_resend::ErrorKind;

use common::grpc::{
    answer, call, channel_to, Balance, ChargeRequest, Do, GrpcServer, CHARGE, GET_BALANCE,
};
use common::{attempts, closed_port, idle, stack, within};

const MS: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);

/// The classifier under test: GetBalance is idempotent, Charge is not.
fn classifier() -> GrpcClassifier {
    GrpcClassifier::new().idempotent(GET_BALANCE)
}

type GrpcStack = tower_resend::stack::Stack<TonicTransport<Channel>, GrpcClassifier>;

/// The suite's stack (`common::stack`: 10 s, 5 s per attempt, 3 attempts,
/// seeded) with the gRPC classifier, around `channel`.
fn grpc_stack(channel: Channel) -> GrpcStack {
    stack()
        .retry(|r| r.classifier(classifier()))
        .service(TonicTransport::new(channel))
}

// 1. UNAVAILABLE twice, then OK, on an allowlisted method.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn unavailable_twice_then_ok_on_an_idempotent_method_answers_after_three_attempts() {
    let server = GrpcServer::start(|n, _| match n {
        0 | 1 => Do::Status(Code::Unavailable, None),
        _ => Do::Answer,
    })
    .await;
    let client = grpc_stack(server.channel());

    let resp = within(client.oneshot(call(GET_BALANCE, None)))
        .await
        .expect("the third attempt answers");

    let a = attempts(&resp).clone();
    assert_eq!(a.len(), 3);
    assert_eq!(a.stop(), Stop::Final);
    assert_eq!(
        a.iter().map(|a| a.class()).collect::<Vec<_>>(),
        [Class::Overloaded, Class::Overloaded, Class::Success]
    );
    let (balance, code) = answer(resp).await;
    assert_eq!(balance.amount, 100);
    assert_eq!(code, Some(Code::Ok));
    assert_eq!(server.arrival_count(), 3);
    // Each retry tells the server how many attempts came before it.
    assert_eq!(
        server
            .arrivals()
            .into_iter()
            .map(|a| a.previous)
            .collect::<Vec<_>>(),
        [None, Some("1".to_owned()), Some("2".to_owned())]
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_trailers_only_unavailable_on_another_method_is_not_retried() {
    let server = GrpcServer::start(|_, _| Do::Status(Code::Unavailable, None)).await;
    let client = grpc_stack(server.channel());

    let err = within(client.oneshot(call(CHARGE, None)))
        .await
        .expect_err("UNAVAILABLE may have been processed");

    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown);
    assert_eq!(err.attempts(), 1);
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
}

// 2. Charge does the work, then hangs past the attempt timeout.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_charge_that_worked_then_hung_is_sent_once_and_outcome_unknown() {
    let server = GrpcServer::start(|_, _| Do::WorkThenHang).await;
    let client = stack()
        .attempt_timeout(SECOND)
        .retry(|r| r.classifier(classifier()))
        .service(TonicTransport::new(server.channel()));

    let err = within(client.oneshot(call(CHARGE, None)))
        .await
        .expect_err("nobody answers");

    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{err}");
    assert!(!err.is_not_sent());
    let history = err.history().expect("the retry layer records the call");
    assert_eq!(history.len(), 1);
    assert_eq!(history.stop(), Stop::OutcomeUnknown);
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
    assert_eq!(server.effects(), 1);
}

// 3. The same with an idempotency-key metadata entry: retried, same key.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_charge_with_an_idempotency_key_is_retried_with_the_same_key() {
    let server = GrpcServer::start(|_, _| Do::WorkThenHang).await;
    let client = stack()
        .attempt_timeout(SECOND)
        .retry(|r| r.classifier(classifier()))
        .service(TonicTransport::new(server.channel()));

    let err = within(client.oneshot(call(CHARGE, Some("charge-order-42"))))
        .await
        .expect_err("nobody answers");

    // Every attempt may have run: outcome-unknown, resend with the key.
    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{err}");
    assert_eq!(err.idempotency_key(), Some("charge-order-42"));
    assert_eq!(err.attempts(), 3);
    idle(30 * SECOND).await;
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 3);
    assert!(arrivals
        .iter()
        .all(|a| a.key.as_deref() == Some("charge-order-42") && a.path == CHARGE));
    assert_eq!(
        server.effects(),
        3,
        "no server-side dedup in this test server"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn with_idempotency_keys_on_every_charge_gets_one_key_reused_by_its_attempts() {
    let server = GrpcServer::start(|_, _| Do::WorkThenHang).await;
    let client = stack()
        .attempt_timeout(SECOND)
        .idempotency_keys()
        .retry(|r| r.classifier(classifier()))
        .service(TonicTransport::new(server.channel()));

    let err = within(client.oneshot(call(CHARGE, None)))
        .await
        .expect_err("nobody answers");

    // It may have been processed, under a key the stack chose: outcome
    // unknown, with the key to retry with.
    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{err}");
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 3);
    assert!(arrivals[0].key.is_some());
    assert!(arrivals.iter().all(|a| a.key == arrivals[0].key));
    assert_eq!(err.idempotency_key(), arrivals[0].key.as_deref());
}

// 4. A closed port: nothing sent.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_charge_to_a_closed_port_is_retried_up_to_the_cap_and_says_not_sent() {
    let addr = SocketAddr::from(([127, 0, 0, 1], closed_port()));
    let client = stack()
        .no_budget()
        .retry(|r| r.classifier(classifier()))
        .service(TonicTransport::new(channel_to(addr)));

    let err = within(client.oneshot(call(CHARGE, None)))
        .await
        .expect_err("nothing listens");

    assert_eq!(err.kind(), ErrorKind::RetriesExhausted, "{err}");
    assert!(err.is_not_sent(), "{err}");
    assert!(!err.is_outcome_unknown());
    let history = err.history().expect("the retry layer records the call");
    assert_eq!(history.len(), 3);
    assert!(
        history.iter().all(|a| a.class() == Class::NotSent),
        "{history}"
    );
}

// 5. A silent server: DeadlineExceeded by the deadline.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_silent_server_is_given_up_on_by_the_deadline_with_deadline_exceeded() {
    for seed in 0..8 {
        let server = GrpcServer::start(|_, _| Do::Hang).await;
        let client = stack()
            .seed(seed)
            .no_budget()
            .total(SECOND)
            .attempt_timeout(400 * MS)
            .retry(|r| r.classifier(classifier()))
            .service(TonicTransport::new(server.channel()));
        let start = Instant::now();
        let err = within(client.oneshot(call(GET_BALANCE, None)))
            .await
            .expect_err("nobody answers");

        let elapsed = start.elapsed();
        assert!(elapsed <= SECOND + 5 * MS, "seed {seed}: {elapsed:?}");
        assert_eq!(
            err.kind(),
            ErrorKind::DeadlineExceeded,
            "seed {seed}: {err}"
        );
        assert!(
            (2..=3).contains(&server.arrival_count()),
            "seed {seed}: {}",
            server.arrival_count()
        );
    }
}

// gRPC specifics: pushback, DEADLINE_EXCEEDED, grpc-timeout.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_pushback_of_1500_ms_makes_the_next_attempt_wait_1_5_s() {
    let server = GrpcServer::start(|n, _| match n {
        0 => Do::Status(Code::ResourceExhausted, Some("1500")),
        _ => Do::Answer,
    })
    .await;
    let client = grpc_stack(server.channel());

    // RESOURCE_EXHAUSTED was not processed: retried even for Charge.
    let resp = within(client.oneshot(call(CHARGE, None)))
        .await
        .expect("the second attempt answers");

    let a = attempts(&resp).clone();
    assert_eq!(a.len(), 2);
    assert_eq!(
        a.iter().next().and_then(|a| a.server_wait()),
        Some(1500 * MS)
    );
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    let gap = arrivals[1].at - arrivals[0].at;
    assert!(gap >= 1500 * MS, "{gap:?}");
    // Spread over half as much again, never earlier, and the first jitter.
    assert!(
        gap <= 2250 * MS + 100 * MS,
        "at most the spread and the first jitter on top: {gap:?}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_negative_or_malformed_pushback_means_do_not_retry() {
    for bad in ["-1", "soon"] {
        let server = GrpcServer::start(move |_, _| Do::Status(Code::Unavailable, Some(bad))).await;
        let client = grpc_stack(server.channel());

        let resp = within(client.oneshot(call(GET_BALANCE, None)))
            .await
            .expect("the UNAVAILABLE is returned");

        assert_eq!(grpc_status(resp.headers()), Some(Code::Unavailable));
        assert_eq!(attempts(&resp).stop(), Stop::ServerSaidNo, "{bad}");
        idle(30 * SECOND).await;
        assert_eq!(server.arrival_count(), 1, "{bad}");
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn deadline_exceeded_is_never_retried_even_on_an_idempotent_method() {
    let server = GrpcServer::start(|_, _| Do::Status(Code::DeadlineExceeded, None)).await;
    let client = grpc_stack(server.channel());

    let resp = within(client.oneshot(call(GET_BALANCE, None)))
        .await
        .expect("the status is returned");

    assert_eq!(grpc_status(resp.headers()), Some(Code::DeadlineExceeded));
    assert_eq!(attempts(&resp).len(), 1);
    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 1);
}

/// Each attempt's `grpc-timeout` is the time its caller will wait for it:
/// the call's time left or the attempt's own limit, the sooner, less the
/// margin; never more than either.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_attempt_carries_a_grpc_timeout_no_larger_than_its_time() {
    let server = GrpcServer::start(|_, _| Do::Status(Code::Unavailable, None)).await;
    let total = 10 * SECOND;
    let per_attempt = 4 * SECOND;
    let client = stack()
        .total(total)
        .attempt_timeout(per_attempt)
        .no_budget()
        .retry(|r| r.classifier(classifier()))
        .service(TonicTransport::new(server.channel()));

    let start = Instant::now();
    let resp = within(client.oneshot(call(GET_BALANCE, None)))
        .await
        .expect("the last UNAVAILABLE is returned");
    assert_eq!(attempts(&resp).len(), 3);

    let deadline = start + total;
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 3);
    for a in &arrivals {
        let sent = a.grpc_timeout.expect("every attempt carries grpc-timeout");
        let its_time = (deadline - a.at).min(per_attempt);
        assert!(
            sent <= its_time,
            "grpc-timeout {sent:?} > its time {its_time:?}"
        );
        assert!(
            sent + 10 * MS >= its_time,
            "{sent:?} far under {its_time:?}"
        );
    }
}

// A client as tonic generates it, over the stack.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_generated_style_client_calls_through_the_stack() {
    let server = GrpcServer::start(|n, path| match (n, path) {
        (0, _) => Do::Status(Code::Unavailable, None),
        (_, CHARGE) => Do::Status(Code::FailedPrecondition, None),
        _ => Do::Answer,
    })
    .await;
    let mut grpc = tonic::client::Grpc::new(grpc_stack(server.channel()));
    let msg = ChargeRequest {
        account: "acct-7".to_owned(),
        amount: 250,
    };

    grpc.ready().await.expect("ready");
    let reply = within(grpc.unary(
        tonic::Request::new(msg.clone()),
        PathAndQuery::from_static(GET_BALANCE),
        ProstCodec::<ChargeRequest, Balance>::default(),
    ))
    .await
    .expect("retried past UNAVAILABLE");
    assert_eq!(reply.into_inner().amount, 250);
    assert_eq!(server.arrival_count(), 2);

    grpc.ready().await.expect("ready");
    let status = within(grpc.unary(
        tonic::Request::new(msg),
        PathAndQuery::from_static(CHARGE),
        ProstCodec::<ChargeRequest, Balance>::default(),
    ))
    .await
    .expect_err("FAILED_PRECONDITION is final");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(server.arrival_count(), 3);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_generated_style_client_sees_the_stack_errors_as_grpc_statuses() {
    let server = GrpcServer::start(|_, path| match path {
        GET_BALANCE => Do::Hang,
        _ => Do::WorkThenHang,
    })
    .await;
    let stack = MapErr::new(
        stack()
            .total(SECOND)
            .attempt_timeout(400 * MS)
            .no_budget()
            .retry(|r| r.classifier(classifier()))
            .service(TonicTransport::new(server.channel())),
        into_status,
    );
    let mut grpc = tonic::client::Grpc::new(stack);
    let msg = ChargeRequest {
        account: "acct-7".to_owned(),
        amount: 250,
    };

    // A silent server: DEADLINE_EXCEEDED, by the deadline.
    let start = Instant::now();
    grpc.ready().await.expect("ready");
    let status = within(grpc.unary(
        tonic::Request::new(msg.clone()),
        PathAndQuery::from_static(GET_BALANCE),
        ProstCodec::<ChargeRequest, Balance>::default(),
    ))
    .await
    .expect_err("nobody answers");
    assert!(start.elapsed() <= SECOND + 5 * MS, "{:?}", start.elapsed());
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let err = resend_error(&status).expect("the resend error behind the status");
    assert!(err.is_deadline_exceeded());

    // A charge that did the work, then hung past its attempt's limit:
    // DEADLINE_EXCEEDED, as gRPC says a time limit (which already means
    // "may have completed"); outcome unknown behind it, and in its words.
    grpc.ready().await.expect("ready");
    let status = within(grpc.unary(
        tonic::Request::new(msg.clone()),
        PathAndQuery::from_static(CHARGE),
        ProstCodec::<ChargeRequest, Balance>::default(),
    ))
    .await
    .expect_err("nobody answers");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("outcome unknown"), "{status:?}");
    assert!(resend_error(&status).is_some_and(tower_resend::Error::is_outcome_unknown));
    assert_eq!(server.effects(), 1);

    // A closed port: UNAVAILABLE, and nothing was sent.
    let addr = SocketAddr::from(([127, 0, 0, 1], closed_port()));
    let mut grpc = tonic::client::Grpc::new(MapErr::new(grpc_stack(channel_to(addr)), into_status));
    grpc.ready().await.expect("ready");
    let status = within(grpc.unary(
        tonic::Request::new(msg),
        PathAndQuery::from_static(CHARGE),
        ProstCodec::<ChargeRequest, Balance>::default(),
    ))
    .await
    .expect_err("nothing listens");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(resend_error(&status).is_some_and(tower_resend::Error::is_not_sent));
}

// What tonic users expect: their own timeout, no classifier to remember,
// statuses that say what happened.

/// The stack of a generated-style client, its errors as statuses.
type StatusStack<C> = MapErr<
    tower_resend::stack::Stack<TonicTransport<Channel>, C>,
    fn(tower_resend::Error) -> Status,
>;

/// A generated-style client over `stack`, its errors as statuses.
fn grpc_client<C>(
    stack: tower_resend::stack::Stack<TonicTransport<Channel>, C>,
) -> tonic::client::Grpc<StatusStack<C>>
where
    C: Clone,
{
    tonic::client::Grpc::new(MapErr::new(stack, into_status as fn(_) -> _))
}

/// A unary call of `path` through `grpc`, with tonic's `request`.
async fn unary<S>(
    grpc: &mut tonic::client::Grpc<S>,
    path: &'static str,
    request: tonic::Request<ChargeRequest>,
) -> Result<Balance, Status>
where
    S: tonic::client::GrpcService<tonic::body::Body>,
    S::Error: Into<tower_resend::BoxError>,
    S::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<tower_resend::BoxError> + Send,
{
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(e.into().to_string()))?;
    within(grpc.unary(
        request,
        PathAndQuery::from_static(path),
        ProstCodec::<ChargeRequest, Balance>::default(),
    ))
    .await
    .map(tonic::Response::into_inner)
}

fn charge_request() -> tonic::Request<ChargeRequest> {
    tonic::Request::new(ChargeRequest {
        account: "acct-7".to_owned(),
        amount: 100,
    })
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_tonic_set_timeout_of_500_ms_under_a_3_s_budget_is_the_calls_deadline() {
    // UNAVAILABLE twice (come back in 50 ms), then silence.
    let server = GrpcServer::start(|n, _| match n {
        0 | 1 => Do::Status(Code::Unavailable, Some("50")),
        _ => Do::Hang,
    })
    .await;
    let mut grpc = grpc_client(
        stack()
            .total(3 * SECOND)
            .no_budget()
            .retry(|r| r.classifier(classifier()))
            .service(TonicTransport::new(server.channel())),
    );
    let mut request = charge_request();
    request.set_timeout(500 * MS);

    let start = Instant::now();
    let status = unary(&mut grpc, GET_BALANCE, request)
        .await
        .expect_err("the server falls silent");

    // The call ends by the caller's 500 ms, not the stack's 3 s.
    let elapsed = start.elapsed();
    assert!(elapsed <= 500 * MS, "{elapsed:?}");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let err = resend_error(&status).expect("the resend error behind the status");
    assert!(err.is_deadline_exceeded(), "{err}");
    // Every attempt carried what was left of the 500 ms, less the margin:
    // not tonic's first `500000u` again.
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 3, "{arrivals:?}");
    let mut previous = 500 * MS;
    for a in &arrivals {
        let sent = a.grpc_timeout.expect("every attempt carries grpc-timeout");
        let left = (500 * MS).saturating_sub(a.at - start);
        assert!(sent <= left, "grpc-timeout {sent:?} > time left {left:?}");
        assert!(sent + 10 * MS >= left, "{sent:?} far under {left:?}");
        assert!(sent < previous, "shrinks with each attempt: {sent:?}");
        previous = sent;
    }
    let history = err.history().expect("the retry layer records the call");
    assert!(
        history
            .to_string()
            .starts_with("#1 grpc UNAVAILABLE (overloaded), waited "),
        "{history}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn unavailable_is_retried_with_no_classifier_named() {
    let server = GrpcServer::start(|n, _| match n {
        0 | 2 => Do::Status(Code::Unavailable, None),
        _ => Do::Answer,
    })
    .await;
    // No `.retry(|r| r.classifier(..))`: the stack recognises gRPC.
    let mut grpc = grpc_client(stack().service(TonicTransport::new(server.channel())));

    // A Charge with an idempotency-key metadata entry may be sent again.
    let mut request = charge_request();
    request
        .metadata_mut()
        .insert("idempotency-key", "charge-order-42".parse().expect("ascii"));
    let balance = unary(&mut grpc, CHARGE, request)
        .await
        .expect("retried past UNAVAILABLE");
    assert_eq!(balance.amount, 100);
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), 2);
    assert!(arrivals
        .iter()
        .all(|a| a.key.as_deref() == Some("charge-order-42")));
    // The UNAVAILABLE waited the overload floor: it was read as gRPC's.
    assert!(arrivals[1].at - arrivals[0].at >= SECOND);

    // The attempts say UNAVAILABLE, not 200.
    let client = stack().service(TonicTransport::new(server.channel()));
    let resp = within(client.oneshot(call(CHARGE, Some("charge-order-43"))))
        .await
        .expect("retried past UNAVAILABLE");
    let a = attempts(&resp).clone();
    assert_eq!(
        a.iter()
            .map(|a| (a.class(), a.grpc_code()))
            .collect::<Vec<_>>(),
        [
            (Class::Overloaded, Some(GrpcCode::Unavailable)),
            (Class::Success, None)
        ]
    );
    assert!(
        a.to_string()
            .starts_with("#1 grpc UNAVAILABLE (overloaded), waited "),
        "{a}"
    );
    assert!(a.to_string().contains(", #2 200 (success); "), "{a}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn resource_exhausted_is_retried_for_any_method_with_no_classifier_named() {
    let server = GrpcServer::start(|n, _| match n {
        0 => Do::Status(Code::ResourceExhausted, Some("200")),
        _ => Do::Answer,
    })
    .await;
    let client = stack().service(TonicTransport::new(server.channel()));

    // Not processed: even a Charge without a key.
    let resp = within(client.oneshot(call(CHARGE, None)))
        .await
        .expect("the second attempt answers");
    let a = attempts(&resp);
    assert_eq!(a.len(), 2);
    let first = a.iter().next().expect("a first attempt");
    assert_eq!(first.grpc_code(), Some(GrpcCode::ResourceExhausted));
    assert_eq!(first.server_wait(), Some(200 * MS));
    assert_eq!(server.arrival_count(), 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_method_not_on_an_allowlist_is_not_resent_with_no_classifier_named() {
    let server = GrpcServer::start(|_, path| match path {
        GET_BALANCE => Do::Status(Code::Unavailable, None),
        _ => Do::WorkThenHang,
    })
    .await;
    // No classifier, so no allowlist: GetBalance is as unsafe as Charge.
    let mut grpc = grpc_client(
        stack()
            .attempt_timeout(SECOND)
            .service(TonicTransport::new(server.channel())),
    );

    let status = unary(&mut grpc, GET_BALANCE, charge_request())
        .await
        .expect_err("UNAVAILABLE may have been processed");
    // The server's own status, as grpc-go returns it; the words say what
    // is unknown.
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("verify") && status.message().contains("UNAVAILABLE"),
        "{status:?}"
    );
    let err = resend_error(&status).expect("the resend error behind the status");
    assert!(err.is_outcome_unknown());
    assert_eq!(err.attempts(), 1);

    let status = unary(&mut grpc, CHARGE, charge_request())
        .await
        .expect_err("nobody answers");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(resend_error(&status).is_some_and(tower_resend::Error::is_outcome_unknown));

    idle(30 * SECOND).await;
    assert_eq!(server.arrival_count(), 2, "each sent once");
    assert_eq!(server.effects(), 1);
}

/// A keyed Charge cut by its deadline, as a generated client sees it:
/// DEADLINE_EXCEEDED (gRPC's code for a deadline, which already says the
/// call may have completed), never UNKNOWN; behind it the outcome is
/// unknown, with the key to send it again under and advice that says so
/// in the same words.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_keyed_call_cut_by_its_deadline_is_deadline_exceeded() {
    let server = GrpcServer::start(|_, _| Do::WorkThenHang).await;
    let mut grpc = grpc_client(
        stack()
            .total(SECOND)
            .attempt_timeout(5 * SECOND)
            .service(TonicTransport::new(server.channel())),
    );
    let mut request = charge_request();
    request
        .metadata_mut()
        .insert("idempotency-key", "charge-order-9".parse().unwrap());
    let status = unary(&mut grpc, CHARGE, request)
        .await
        .expect_err("nobody answers");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status.message().contains("outcome unknown")
            && status
                .message()
                .contains("same Idempotency-Key, charge-order-9"),
        "{status:?}"
    );
    let err = resend_error(&status).expect("the resend error behind the status");
    assert!(err.is_outcome_unknown(), "{err}");
    assert_eq!(err.idempotency_key(), Some("charge-order-9"));
    assert!(
        matches!(err.retry_advice(), tower_resend::RetryAdvice::SameKey(_)),
        "{err}"
    );
    idle(30 * SECOND).await;
    assert_eq!(server.effects(), 1);
}

/// A stack named in one line, as a struct field holds it: a generated-style
/// client over a `BoxChannel` calls through the stack and sees its errors
/// as gRPC statuses.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_client_over_a_box_channel_fits_in_a_struct_field() {
    use tower_resend::tonic::{boxed_channel, BoxChannel};

    struct Clients {
        ledger: tonic::client::Grpc<BoxChannel>,
    }
    let server = GrpcServer::start(|_, path| match path {
        GET_BALANCE => Do::Hang,
        _ => Do::Status(Code::Unavailable, None),
    })
    .await;
    let mut clients = Clients {
        ledger: tonic::client::Grpc::new(boxed_channel(
            stack()
                .total(SECOND)
                .service(TonicTransport::new(server.channel())),
        )),
    };
    let status = unary(&mut clients.ledger, GET_BALANCE, charge_request())
        .await
        .expect_err("nobody answers");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    // (GetBalance is a POST no classifier called safe: outcome unknown
    // behind it.)
    assert!(resend_error(&status).is_some_and(tower_resend::Error::is_outcome_unknown));
}
