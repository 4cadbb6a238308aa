//! Instruction counts of one successful call, for `valgrind --tool=callgrind`:
//! repeatable whatever else the machine is doing, unlike wall-clock timings.
//!
//! ```sh
//! cargo bench -p resend --bench callgrind --no-run
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.both <bench binary> both 20000
//! ```
//! Variants: `bare`, `tower` (tower's Timeout), `deadline`, `attempt`, `both`
//! (deadline + attempt), `stack` (the full `resend::stack()`), `tower_retry`
//! (tower's retry with a clone-and-retry policy between two timeouts).
#![allow(missing_docs, clippy::unwrap_used)]
use http::{Request, Response};
use http_body_util::Empty;
use resend::{AttemptTimeoutLayer, DeadlineLayer};
use std::convert::Infallible;
use std::future::{ready, Ready};
use std::time::Duration;
use tower::{Service, ServiceBuilder, ServiceExt};
type Body = Empty<bytes::Bytes>;
#[derive(Clone, Copy)]
struct Instant200;
impl<B> Service<Request<B>> for Instant200 {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;
    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn call(&mut self, _req: Request<B>) -> Self::Future {
        ready(Ok(Response::new(Body::new())))
    }
}
#[derive(Clone)]
struct CloneAndRetry {
    left: usize,
}
impl<E> tower::retry::Policy<Request<Body>, Response<Body>, E> for CloneAndRetry {
    type Future = std::future::Ready<()>;
    fn retry(
        &mut self,
        _req: &mut Request<Body>,
        result: &mut Result<Response<Body>, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(r) if !r.status().is_server_error() => None,
            _ if self.left > 0 => {
                self.left -= 1;
                Some(ready(()))
            }
            _ => None,
        }
    }
    fn clone_request(&mut self, req: &Request<Body>) -> Option<Request<Body>> {
        Some(req.clone())
    }
}

async fn run<S>(svc: S, n: usize)
where
    S: Service<Request<Body>> + Clone,
    S::Error: std::fmt::Debug,
{
    for _ in 0..n {
        let r = svc
            .clone()
            .oneshot(
                Request::get("http://upstream/quote")
                    .body(Body::new())
                    .unwrap(),
            )
            .await;
        std::hint::black_box(r.unwrap());
    }
}
fn main() {
    let variant = std::env::args().nth(1).unwrap_or_default();
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        match variant.as_str() {
            "bare" => run(Instant200, n).await,
            "tower" => {
                run(
                    ServiceBuilder::new()
                        .timeout(Duration::from_secs(5))
                        .service(Instant200),
                    n,
                )
                .await
            }
            "deadline" => {
                run(
                    ServiceBuilder::new()
                        .layer(DeadlineLayer::new(Duration::from_secs(10)))
                        .service(Instant200),
                    n,
                )
                .await
            }
            "attempt" => {
                run(
                    ServiceBuilder::new()
                        .layer(AttemptTimeoutLayer::new(Duration::from_secs(5)))
                        .service(Instant200),
                    n,
                )
                .await
            }
            "both" => {
                run(
                    ServiceBuilder::new()
                        .layer(DeadlineLayer::new(Duration::from_secs(10)))
                        .layer(AttemptTimeoutLayer::new(Duration::from_secs(5)))
                        .service(Instant200),
                    n,
                )
                .await
            }
            "stack" => run(resend::stack().name("bench").service(Instant200), n).await,
            "tower_retry" => {
                run(
                    ServiceBuilder::new()
                        .timeout(Duration::from_secs(10))
                        .retry(CloneAndRetry { left: 2 })
                        .timeout(Duration::from_secs(5))
                        .service(Instant200),
                    n,
                )
                .await
            }
            "loop_bare" | "loop_stack" => {
                use http_body_util::BodyExt;
                let server = resend_testkit::TestServer::start(resend_testkit::Script::new())
                    .await
                    .unwrap();
                let uri = server.uri("/quote");
                let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
                http.set_nodelay(true);
                let bare = hyper_util::client::legacy::Client::builder(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .build::<_, Body>(http);
                let stack = resend::stack()
                    .name("bench")
                    .service(resend::hyper_client::<resend::retry::ReplayBody<Body>>(
                        Duration::from_secs(2),
                    ));
                for i in 0..n {
                    let req = Request::get(uri.clone()).body(Body::new()).unwrap();
                    if variant == "loop_bare" {
                        let r = bare.clone().oneshot(req).await.unwrap();
                        r.into_body().collect().await.unwrap();
                    } else {
                        let r = stack.clone().oneshot(req).await.unwrap();
                        r.into_body().collect().await.unwrap();
                    }
                    if i % 1000 == 0 {
                        server.take_arrivals();
                    }
                }
            }
            _ => {}
        }
    });
}
