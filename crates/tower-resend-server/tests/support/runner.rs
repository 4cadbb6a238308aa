//! The client a job runner sends a failed keyed call again with, as its
//! error advises: patient (30 attempts of up to 5 s within 30 s, backoff
//! from 20 ms to 500 ms), no budget, the call's own key set by the caller.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tower::ServiceBuilder;
use tower_resend::retry::{Backoff, RetryLayer};
use tower_resend::{deadline::CallDeadlineLayer, timeout::AttemptTimeoutLayer, BoxError};

/// The runner's client, over hyper-util on loopback.
pub fn patient_client() -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = http::Response<
        impl http_body::Body<Data = Bytes, Error: Into<BoxError> + std::fmt::Debug> + Send,
    >,
    Error = BoxError,
    Future: Send,
> + Clone
       + Send
       + 'static {
    ServiceBuilder::new()
        .layer(CallDeadlineLayer::new(Duration::from_secs(30)).upstream("payments"))
        .layer(
            RetryLayer::new()
                .no_budget()
                .seed(11)
                .max_attempts(30)
                .backoff(
                    Backoff::new(Duration::from_millis(20), 2.0, Duration::from_millis(500))
                        .unwrap(),
                ),
        )
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(5)))
        .service(tower_resend::hyper_client(Duration::from_secs(1)))
}
