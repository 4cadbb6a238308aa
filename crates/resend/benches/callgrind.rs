//! Instruction counts of one successful call, for `valgrind --tool=callgrind`:
//! repeatable whatever else the machine is doing, unlike wall-clock timings.
//!
//! ```sh
//! cargo bench -p resend --bench callgrind --no-run
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.both <bench binary> both 20000
//! ```
//! Variants: `bare`, `tower` (tower's Timeout), `deadline`, `attempt`, `both`.
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
impl Service<Request<Body>> for Instant200 {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;
    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        ready(Ok(Response::new(Body::new())))
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
        .enable_time()
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
            _ => {}
        }
    });
}
