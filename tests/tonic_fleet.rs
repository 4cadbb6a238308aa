//! Fleets over gRPC: three tonic servers of one service, a tonic `Channel`
//! per instance ([`PerInstance`]). One instance bad: no retry goes back to
//! it; one instance stalling: every hedged copy goes elsewhere; three of
//! four gone: every call goes on to the fourth, its refusals uncounted.
//!
//! `cargo test -p tower-resend-tests --features tonic --test tonic_fleet`

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use std::time::Duration;

use http::Uri;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Endpoint;
use tonic::Code;
use tower::ServiceExt;
use tower_resend::classify::GrpcClassifier;
use tower_resend::fleet::{FleetLayer, Outliers, PerInstance};
use tower_resend::tonic::TonicTransport;

use common::grpc::{answer, call, Do, GrpcServer, GET_BALANCE};

/// Second copies or attempts that reached `s`.
fn seconds(s: &GrpcServer) -> usize {
    s.arrivals()
        .iter()
        .filter(|a| a.previous.as_deref() == Some("1"))
        .count()
}

/// The stack over the three servers, a channel to each.
fn fleet_stack(
    servers: &[GrpcServer; 3],
    outliers: Outliers,
    hedge: Option<Duration>,
) -> impl tower::Service<
    http::Request<tonic::body::Body>,
    Response = http::Response<
        impl http_body::Body<Data = bytes::Bytes, Error = impl std::fmt::Debug> + Send,
    >,
    Error = tower_resend::Error,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    let fleet = FleetLayer::fixed(servers.iter().map(|s| format!("http://{}", s.addr)))
        .unwrap()
        .outliers(outliers);
    let channels = PerInstance::new(|base: Uri| Endpoint::from(base).connect_lazy());
    tower_resend::stack()
        .retry(|r| r.classifier(GrpcClassifier::new().idempotent(GET_BALANCE)))
        .fleet(fleet)
        .maybe_hedge(hedge)
        .hedge_share(1.0)
        .service(TonicTransport::new(channels))
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_bad_instance_of_three_over_grpc() {
    let servers = [
        GrpcServer::start(|_, _| Do::Status(Code::Unavailable, None)).await,
        GrpcServer::start(|_, _| Do::Answer).await,
        GrpcServer::start(|_, _| Do::Answer).await,
    ];
    let stack = fleet_stack(&servers, Outliers::default().off(), None);
    let mut set = JoinSet::new();
    for t in 0..10 {
        let stack = stack.clone();
        set.spawn(async move {
            for _ in 0..30 {
                let resp = stack.clone().oneshot(call(GET_BALANCE, None)).await;
                let (balance, code) =
                    answer(resp.unwrap_or_else(|e| panic!("task {t}: {e}"))).await;
                assert_eq!((balance.amount, code), (100, Some(Code::Ok)));
            }
        });
    }
    while let Some(done) = set.join_next().await {
        done.expect("every call answered");
    }
    let [a, b, c] = &servers;
    let (sb, sc) = (seconds(b), seconds(c));
    assert_eq!(seconds(a), 0, "no retry back to A");
    assert!(sb + sc >= 50, "B {sb}, C {sc}");
    assert!(
        sb * 100 >= (sb + sc) * 30 && sc * 100 >= (sb + sc) * 30,
        "B {sb}, C {sc}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hedged_grpc_copy_goes_to_another_instance() {
    let servers = [
        GrpcServer::start(|_, _| Do::Hang).await,
        GrpcServer::start(|_, _| Do::Answer).await,
        GrpcServer::start(|_, _| Do::Answer).await,
    ];
    let stack = fleet_stack(
        &servers,
        Outliers::default().off(),
        Some(Duration::from_millis(10)),
    );
    let mut set = JoinSet::new();
    for _ in 0..10 {
        let stack = stack.clone();
        set.spawn(async move {
            let mut took = Vec::new();
            for _ in 0..30 {
                let start = Instant::now();
                let resp = stack
                    .clone()
                    .oneshot(call(GET_BALANCE, None))
                    .await
                    .unwrap();
                let (balance, _) = answer(resp).await;
                assert_eq!(balance.amount, 100);
                took.push(start.elapsed());
            }
            took
        });
    }
    let mut took = Vec::new();
    while let Some(done) = set.join_next().await {
        took.extend(done.expect("every call answered"));
    }
    took.sort();
    let p99 = took[took.len() * 99 / 100];
    assert!(p99 < Duration::from_millis(50), "p99 {p99:?}");
    let [a, _, _] = &servers;
    assert!(a.arrival_count() > 0, "A was picked first now and then");
    assert_eq!(seconds(a), 0, "no copy after the first went to A");
}

/// Three instances of four gone (their ports refuse): over gRPC too, a
/// call whose first attempts meet them goes on to the fourth uncounted,
/// as gRPC's own transparent retries do not count toward `maxAttempts`
/// (gRFC A6). Each call has a fleet and channels of its own, so that one
/// call's refusals set nothing aside for the next; with refusals counted,
/// a quarter of the calls (their three attempts all refused) failed.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn refused_grpc_attempts_go_on_to_an_instance_that_answers_uncounted() {
    let live = GrpcServer::start(|_, _| Do::Answer).await;
    let gone = common::closed_addrs(3);
    let mut refused_in_all = 0;
    for n in 0..40 {
        let mut bases: Vec<String> = gone.iter().map(|a| format!("http://{a}")).collect();
        bases.push(format!("http://{}", live.addr));
        let channels = PerInstance::new(|base: Uri| Endpoint::from(base).connect_lazy());
        let stack = tower_resend::stack()
            .retry(|r| r.classifier(GrpcClassifier::new().idempotent(GET_BALANCE)))
            .fleet(FleetLayer::fixed(bases).unwrap())
            .service(TonicTransport::new(channels));
        let resp = match stack.oneshot(call(GET_BALANCE, None)).await {
            Ok(resp) => resp,
            Err(e) => panic!("call {n}: {e}"),
        };
        let attempts = resp
            .extensions()
            .get::<tower_resend::retry::Attempts>()
            .expect("the attempts")
            .clone();
        let (balance, code) = answer(resp).await;
        assert_eq!((balance.amount, code), (100, Some(Code::Ok)), "call {n}");
        let refused = attempts.iter().count() - 1;
        assert!(
            attempts
                .iter()
                .take(refused)
                .all(|a| a.class() == tower_resend::classify::Class::NotSent),
            "call {n}: {attempts}"
        );
        refused_in_all += refused;
    }
    assert_eq!(live.arrival_count(), 40);
    assert!(refused_in_all > 20, "{refused_in_all} attempts refused");
}
