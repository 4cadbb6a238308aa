use std::task::{Context, Poll};
use std::time::Duration;

use http::header::HeaderName;
use http::Request;
use tower_layer::Layer;
use tower_service::Service;

use super::wire::{encode_grpc_timeout, encode_millis, parse_grpc_timeout, parse_millis};
use super::Deadline;
use crate::vocab::RetryInCharge;

/// The `grpc-timeout` header.
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// Writes the time left on each attempt into the request, so the callee can
/// give up (and say why) before the caller does.
///
/// On gRPC requests (`content-type: application/grpc…`) it writes
/// `grpc-timeout`; on other requests, when configured with
/// [`http_header`](Self::http_header), it writes that header in whole
/// milliseconds. The value is the time left before the request's
/// [`Deadline`] (or the ambient one) minus a safety [`margin`](Self::margin),
/// rounded down: never more time than is left. Given the attempt's own
/// limit ([`attempt_timeout`](Self::attempt_timeout), which
/// [`stack()`](crate::stack()) gives it), it writes no more than that
/// either: a callee that works past it works for a caller who has stopped
/// waiting (Envoy's `x-envoy-expected-rq-timeout-ms` is the per-try timeout
/// for the same reason). A budget the caller already wrote is only ever
/// lowered. Requests with neither go out untouched.
///
/// Place it inside the retry layer, so each attempt carries what is left at
/// the time it is sent.
///
/// ```
/// use std::time::Duration;
/// use http::{Request, Response};
/// use tower_resend::{deadline::DeadlineHeaderLayer, Deadline};
/// use tower::{service_fn, Layer, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let svc = DeadlineHeaderLayer::new()
///     .http_header(http::HeaderName::from_static("x-timeout-ms"))
///     .margin(Duration::from_millis(10))
///     .layer(service_fn(|req: Request<()>| async move {
///         let sent = req.headers()["x-timeout-ms"].to_str().unwrap().to_owned();
///         Ok::<_, std::convert::Infallible>(Response::new(sent))
///     }));
///
/// let mut req = Request::new(());
/// req.extensions_mut().insert(Deadline::after(Duration::from_secs(2)));
/// assert_eq!(svc.oneshot(req).await.unwrap().into_body(), "1990");
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct DeadlineHeaderLayer {
    config: Config,
}

#[derive(Clone, Debug)]
struct Config {
    // Shared: the service is cloned for every call, and a `HeaderName`
    // inline is 32 bytes more to copy each time.
    http_header: Option<std::sync::Arc<HeaderName>>,
    margin: Duration,
    /// The attempt's own limit, when the layer knows it.
    per_attempt: Option<Duration>,
}

/// The default safety margin taken off the budget written on the wire.
pub const DEFAULT_MARGIN: Duration = Duration::from_millis(5);

impl DeadlineHeaderLayer {
    /// Writes `grpc-timeout` on gRPC requests only, with the default margin
    /// ([`DEFAULT_MARGIN`], 5 ms).
    pub const fn new() -> Self {
        Self {
            config: Config {
                http_header: None,
                margin: DEFAULT_MARGIN,
                per_attempt: None,
            },
        }
    }

    /// Also writes the budget, in milliseconds, as `name` on requests that
    /// are not gRPC. Default: none.
    #[must_use]
    pub fn http_header(mut self, name: HeaderName) -> Self {
        self.config.http_header = Some(std::sync::Arc::new(name));
        self
    }

    /// Time taken off the budget before it is written, so the callee's own
    /// deadline fires first. Default: [`DEFAULT_MARGIN`] (5 ms).
    #[must_use]
    pub const fn margin(mut self, margin: Duration) -> Self {
        self.config.margin = margin;
        self
    }

    /// Each attempt's own limit, as the attempt timeout below gives it: the
    /// budget written is no more than that (or the request's own attempt
    /// limit, from its [`CallOptions`](crate::retry::CallOptions)), so a
    /// callee that honours it drops work the caller has stopped waiting
    /// for. Default: none (the call's time left alone).
    #[must_use]
    pub const fn attempt_timeout(mut self, per_attempt: Duration) -> Self {
        self.config.per_attempt = Some(super::clamp(per_attempt));
        self
    }
}

impl Default for DeadlineHeaderLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for DeadlineHeaderLayer {
    type Service = DeadlineHeader<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DeadlineHeader {
            inner,
            config: self.config.clone(),
        }
    }
}

/// Middleware that writes the time left into each request.
///
/// See [`DeadlineHeaderLayer`].
#[derive(Clone, Debug)]
pub struct DeadlineHeader<S> {
    inner: S,
    config: Config,
}

impl<S> DeadlineHeader<S> {
    /// A [`DeadlineHeaderLayer`] with the defaults.
    pub const fn layer() -> DeadlineHeaderLayer {
        DeadlineHeaderLayer::new()
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// True for requests whose content type is `application/grpc` or a subtype
/// (`application/grpc+proto`, `application/grpc-web`…).
#[inline]
pub(crate) fn is_grpc<B>(req: &Request<B>) -> bool {
    crate::classify::is_grpc(req.headers())
}

impl<S, B> Service<Request<B>> for DeadlineHeader<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    // Inline: the future is built where its caller keeps it, not moved
    // there (a move fewer a layer; see BENCHMARKS.md, `callgrind`).
    #[inline]
    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        // Which header, if any: decided before reading the clock.
        let name = if is_grpc(&req) {
            Some(GRPC_TIMEOUT)
        } else {
            self.config.http_header.as_deref().cloned()
        };
        if let Some(name) = name {
            // The request's deadline (a deadline layer's, or the caller's
            // own), and the ambient one; the attempt's own limit.
            let ext = req.extensions();
            let per_attempt = self.config.per_attempt.map(|usual| {
                RetryInCharge::of(ext)
                    .and_then(|m| m.attempt_timeout)
                    .map_or(usual, super::clamp)
            });
            let left = match (Deadline::of(ext), per_attempt) {
                (Some(d), Some(a)) => Some(d.remaining().min(a)),
                (Some(d), None) => Some(d.remaining()),
                (None, a) => a,
            };
            if let Some(left) = left {
                let budget = left.saturating_sub(self.config.margin);
                if name == GRPC_TIMEOUT {
                    set_lower(
                        &mut req,
                        name,
                        budget,
                        parse_grpc_timeout,
                        encode_grpc_timeout,
                    );
                } else {
                    set_lower(&mut req, name, budget, parse_millis, encode_millis);
                }
            }
        }
        self.inner.call(req)
    }
}

/// Writes `budget` as `name` unless the request already carries a valid,
/// smaller value there.
fn set_lower<B, P, E>(req: &mut Request<B>, name: HeaderName, budget: Duration, parse: P, encode: E)
where
    P: Fn(&[u8]) -> Result<Duration, super::InvalidTimeout>,
    E: Fn(Duration) -> http::HeaderValue,
{
    if let Some(existing) = req.headers().get(&name) {
        if parse(existing.as_bytes()).is_ok_and(|d| d <= budget) {
            return;
        }
    }
    req.headers_mut().insert(name, encode(budget));
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::CONTENT_TYPE;
    use std::convert::Infallible;
    use tower::{service_fn, ServiceExt};

    async fn sent_headers(layer: DeadlineHeaderLayer, req: Request<()>) -> http::HeaderMap {
        layer
            .layer(service_fn(|req: Request<()>| async move {
                Ok::<_, Infallible>(req.headers().clone())
            }))
            .oneshot(req)
            .await
            .unwrap()
    }

    fn grpc_request(deadline: Option<Deadline>) -> Request<()> {
        let mut req = Request::post("/pkg.Svc/Method")
            .header(CONTENT_TYPE, "application/grpc")
            .body(())
            .unwrap();
        if let Some(d) = deadline {
            req.extensions_mut().insert(d);
        }
        req
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn grpc_requests_carry_time_left_minus_margin() {
        let d = Deadline::after(Duration::from_secs(1));
        tokio::time::advance(Duration::from_millis(300)).await;
        let h = sent_headers(DeadlineHeaderLayer::new(), grpc_request(Some(d))).await;
        assert_eq!(h[GRPC_TIMEOUT], "695000u");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_attempts_limit_bounds_the_budget_written() {
        let name = HeaderName::from_static("x-deadline-ms");
        let layer = DeadlineHeaderLayer::new()
            .http_header(name.clone())
            .margin(Duration::ZERO)
            .attempt_timeout(Duration::from_millis(800));
        // The call has 3 s left, the attempt 800 ms: the attempt's.
        let mut req = Request::new(());
        req.extensions_mut()
            .insert(Deadline::after(Duration::from_secs(3)));
        assert_eq!(sent_headers(layer.clone(), req).await[&name], "800");
        // The call has 500 ms left: the call's.
        let mut req = Request::new(());
        req.extensions_mut()
            .insert(Deadline::after(Duration::from_millis(500)));
        assert_eq!(sent_headers(layer.clone(), req).await[&name], "500");
        // No deadline at all: still the attempt's, and on gRPC too.
        let h = sent_headers(layer.clone(), Request::new(())).await;
        assert_eq!(h[&name], "800");
        let h = sent_headers(layer, grpc_request(None)).await;
        assert_eq!(h[GRPC_TIMEOUT], "800000u");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn http_header_only_when_configured() {
        let mut req = Request::new(());
        req.extensions_mut()
            .insert(Deadline::after(Duration::from_secs(1)));
        let h = sent_headers(DeadlineHeaderLayer::new(), req).await;
        assert!(h.is_empty());

        let mut req = Request::new(());
        req.extensions_mut()
            .insert(Deadline::after(Duration::from_secs(1)));
        let name = HeaderName::from_static("x-deadline-ms");
        let h = sent_headers(
            DeadlineHeaderLayer::new()
                .http_header(name.clone())
                .margin(Duration::ZERO),
            req,
        )
        .await;
        assert_eq!(h[&name], "1000");
        assert!(h.get(GRPC_TIMEOUT).is_none());
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn ambient_deadline_is_used_and_no_deadline_means_no_header() {
        let h = sent_headers(DeadlineHeaderLayer::new(), grpc_request(None)).await;
        assert!(h.get(GRPC_TIMEOUT).is_none());

        let d = Deadline::after(Duration::from_millis(200));
        let h = super::super::scope(
            d,
            sent_headers(
                DeadlineHeaderLayer::new().margin(Duration::ZERO),
                grpc_request(None),
            ),
        )
        .await;
        assert_eq!(h[GRPC_TIMEOUT], "200000u");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_smaller_caller_value_is_kept_a_larger_or_broken_one_replaced() {
        let d = Some(Deadline::after(Duration::from_secs(1)));
        let layer = DeadlineHeaderLayer::new().margin(Duration::ZERO);

        let mut req = grpc_request(d);
        req.headers_mut()
            .insert(GRPC_TIMEOUT, "100m".parse().unwrap());
        assert_eq!(sent_headers(layer.clone(), req).await[GRPC_TIMEOUT], "100m");

        let mut req = grpc_request(d);
        req.headers_mut()
            .insert(GRPC_TIMEOUT, "5S".parse().unwrap());
        assert_eq!(
            sent_headers(layer.clone(), req).await[GRPC_TIMEOUT],
            "1000000u"
        );

        let mut req = grpc_request(d);
        req.headers_mut()
            .insert(GRPC_TIMEOUT, "garbage".parse().unwrap());
        assert_eq!(sent_headers(layer, req).await[GRPC_TIMEOUT], "1000000u");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_expired_deadline_writes_zero() {
        let d = Deadline::after(Duration::from_millis(3));
        tokio::time::advance(Duration::from_millis(10)).await;
        let h = sent_headers(DeadlineHeaderLayer::new(), grpc_request(Some(d))).await;
        assert_eq!(h[GRPC_TIMEOUT], "0n");
    }
}
