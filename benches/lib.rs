//! Benchmarks of resend (`cargo bench -p resend-benches`); results and the
//! commands that reproduce them are in BENCHMARKS.md at the workspace root.
//! This library holds what the benchmarks share.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body_util::Empty;
use tower::Service;

/// The response body of the in-process benchmarks.
pub type Body = Empty<bytes::Bytes>;

/// An upstream that answers 200 at once, whatever the request body.
#[derive(Clone, Copy, Debug)]
pub struct Instant200;

impl<B> Service<Request<B>> for Instant200 {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<B>) -> Self::Future {
        ready(Ok(Response::new(Body::new())))
    }
}

/// tower's retry with the simplest policy a user would write: clone the
/// request, retry 5xx and errors up to `left` times.
#[derive(Clone, Copy, Debug)]
pub struct CloneAndRetry {
    /// Retries left.
    pub left: usize,
}

impl<E> tower::retry::Policy<Request<Body>, Response<Body>, E> for CloneAndRetry {
    type Future = Ready<()>;

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
