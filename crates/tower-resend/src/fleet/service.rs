use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderMap, Method, Request, Response, Uri};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::limit::TimedOut;
use super::roster::{Roster, Sent, Unpicked};
use super::InstanceError;
use crate::classify::{Classify, HttpClassifier, RequestFacts};
use crate::error::{BoxError, Error, ErrorKind, Phase};
use crate::vocab::{Elsewhere, Tried};

/// Middleware that sends each attempt to one instance of the upstream;
/// see [`FleetLayer`](super::FleetLayer).
pub struct Fleet<S, C = HttpClassifier> {
    pub(super) inner: S,
    pub(super) roster: Arc<Roster>,
    pub(super) classifier: C,
}

impl<S: Clone, C: Clone> Clone for Fleet<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            roster: Arc::clone(&self.roster),
            classifier: self.classifier.clone(),
        }
    }
}

impl<S: std::fmt::Debug, C> std::fmt::Debug for Fleet<S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addresses: Vec<String> = self.addresses().iter().map(ToString::to_string).collect();
        f.debug_struct("Fleet")
            .field("inner", &self.inner)
            .field("instances", &addresses)
            .finish_non_exhaustive()
    }
}

impl<S, C> Fleet<S, C> {
    /// The addresses of the instances in the fleet now.
    pub fn addresses(&self) -> Vec<http::uri::Authority> {
        self.roster
            .instances()
            .iter()
            .map(|i| (*i.base.authority).clone())
            .collect()
    }
}

impl<S, C, B, R> Service<Request<B>> for Fleet<S, C>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    C: Classify<R> + Clone,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let roster = &self.roster;
        let tried = req.extensions().get::<Tried>().cloned();
        let used = tried.as_ref().map(Tried::used).unwrap_or_default();
        let sent = match roster.pick(&used, &mut fastrand::Rng::new()) {
            Ok(sent) => sent,
            // (A fixed list is never empty; a discovery may have removed
            // every instance.)
            Err(Unpicked::Empty) => {
                let e = Error::connect("no instance of the fleet is in service".into());
                return ResponseFuture::failed(e);
            }
            // Every instance's circuit is open: not sent.
            Err(Unpicked::Refused(why)) => {
                return ResponseFuture::failed(Error::circuit_open(why, None));
            }
            // Every instance the call could use is at its limit: not sent,
            // rather than queued where its caller may be gone before it is
            // served.
            Err(Unpicked::AtCapacity) => return ResponseFuture::failed(Error::at_capacity()),
        };
        let instance = &sent.instance;
        let base = &instance.base;
        // (Parts of valid URIs make a valid URI: this fails only if they
        // somehow do not, and then nothing is sent rather than sending it
        // to the request's own address.)
        let Some(uri) = base.attempt_uri(req.uri()) else {
            let e = format!(
                "no URI from instance {}{} and the request's path {:?}",
                base.authority,
                base.prefix().unwrap_or_default(),
                req.uri().path()
            );
            return ResponseFuture::failed(Error::connect(e.into()));
        };
        *req.uri_mut() = uri;
        if let Some(tried) = &tried {
            let fleet: Arc<dyn Elsewhere> = Arc::clone(roster) as Arc<dyn Elsewhere>;
            tried.record(instance.id, &base.authority, fleet);
        }
        // The attempt's span (entered by the retry layer while it calls)
        // names the instance; with no span, the authority is not parsed
        // (its bytes are one more cache miss a call over a large fleet).
        let span = tracing::Span::current();
        if !span.is_disabled() {
            span.record("server.address", base.authority.host());
            if let Some(port) = base.authority.port_u16() {
                span.record("server.port", i64::from(port));
            }
        }
        let picked = Box::new(Picked {
            tried,
            facts: Facts::of(&req),
            sent,
            roster: Arc::clone(roster),
            classifier: self.classifier.clone(),
        });
        ResponseFuture {
            inner: Some(self.inner.call(req)),
            picked: Some(picked),
            failed: None,
        }
    }
}

/// What the classifier needs of the request, kept for the answer.
struct Facts {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
}

impl Facts {
    fn of<B>(req: &Request<B>) -> Self {
        // Only the content type matters to how an answer is classified
        // (gRPC or not): the rest of the headers are not copied.
        let mut headers = HeaderMap::new();
        if let Some(ct) = req.headers().get(http::header::CONTENT_TYPE) {
            headers.insert(http::header::CONTENT_TYPE, ct.clone());
        }
        Self {
            method: req.method().clone(),
            uri: req.uri().clone(),
            headers,
        }
    }
}

/// The instance an attempt went to, and what its answer is classified
/// with to tell how the instance is doing.
struct Picked<C> {
    tried: Option<Tried>,
    sent: Sent,
    roster: Arc<Roster>,
    classifier: C,
    facts: Facts,
}

pin_project! {
    /// Response future of [`Fleet`].
    pub struct ResponseFuture<F, C> {
        #[pin]
        inner: Option<F>,
        // Boxed: the future stays small.
        picked: Option<Box<Picked<C>>>,
        // Why nothing was sent, when nothing was.
        failed: Option<Error>,
    }
}

impl<F, C> ResponseFuture<F, C> {
    /// Nothing is sent: the call fails with `error`.
    fn failed(error: Error) -> Self {
        Self {
            inner: None,
            picked: None,
            failed: Some(error),
        }
    }
}

impl<F, C> std::fmt::Debug for ResponseFuture<F, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let to = self
            .picked
            .as_ref()
            .map(|p| p.sent.instance.base.authority.to_string());
        f.debug_struct("ResponseFuture").field("to", &to).finish()
    }
}

impl<F, C, R, E> Future for ResponseFuture<F, C>
where
    F: Future<Output = Result<Response<R>, E>>,
    E: Into<BoxError>,
    C: Classify<R>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Some(inner) = this.inner.as_pin_mut() else {
            let e = this.failed.take();
            return Poll::Ready(Err(
                e.map_or_else(|| "fleet future polled after completion".into(), Into::into)
            ));
        };
        let result = std::task::ready!(inner.poll(cx)).map_err(Into::into);
        if let Some(mut p) = this.picked.take() {
            let server = &p.sent.instance.base.authority;
            if let Some(tried) = &p.tried {
                tried.answered(Arc::clone(server));
            }
            let f = &p.facts;
            let facts = RequestFacts::new(&f.method, &f.uri, &f.headers);
            let class = match &result {
                Ok(resp) => p.classifier.classify_response(&facts, resp).class(),
                Err(e) => p.classifier.classify_error(&facts, &**e).class(),
            };
            if let Some(pass) = p.sent.pass.take() {
                let error = result
                    .as_ref()
                    .err()
                    .map(|e| &**e as &(dyn std::error::Error + 'static));
                pass.settle(class, error);
            }
            let timed_out = result.as_ref().err().and_then(|e| timed_out(&**e));
            p.roster.ended(&p.sent, class, result.is_ok(), timed_out);
            let tried = p.tried.as_ref();
            return Poll::Ready(result.map_err(|e| name_instance(e, server, tried)));
        }
        Poll::Ready(result)
    }
}

/// How the attempt that failed with `e` ran out of time, if it did:
/// tower-resend's timeout below the fleet says so at the top of the box.
fn timed_out(e: &(dyn std::error::Error + 'static)) -> Option<TimedOut> {
    let e = e.downcast_ref::<Error>()?;
    match e.kind() {
        ErrorKind::AttemptTimeout => Some(TimedOut::Attempt),
        ErrorKind::DeadlineExceeded if e.phase() == Some(Phase::Attempt) => {
            Some(TimedOut::Deadline)
        }
        _ => None,
    }
}

/// Names the instance an attempt failed at, and those its call had tried,
/// on the transport's error `e` ([`InstanceError`], whose source it is).
/// tower-resend's own errors (an attempt timeout, a deadline) stay as they
/// are: the layers above read them at the top of the box.
fn name_instance(
    e: BoxError,
    instance: &Arc<http::uri::Authority>,
    tried: Option<&Tried>,
) -> BoxError {
    if e.is::<Error>() {
        return e;
    }
    let tried = tried.map(Tried::servers).unwrap_or_default();
    Box::new(InstanceError::new(Arc::clone(instance), tried, e))
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::time::Duration;

    use tower::ServiceExt;

    use super::*;
    use crate::fleet::{FleetLayer, Outliers};

    /// A transport that fails `/api/refused` with an I/O error, `/api/slow` with
    /// tower-resend's attempt timeout, and answers anything else.
    fn transport(req: Request<()>) -> std::future::Ready<Result<Response<()>, BoxError>> {
        std::future::ready(match req.uri().path() {
            "/api/refused" => Err(io::Error::from(io::ErrorKind::ConnectionRefused).into()),
            "/api/slow" => Err(Error::attempt_timeout(Duration::from_millis(100)).into()),
            _ => Ok(Response::new(())),
        })
    }

    fn get(path: &str) -> Request<()> {
        Request::get(format!("http://upstream{path}"))
            .body(())
            .unwrap()
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_transport_error_names_its_instance_and_resend_errors_stay_on_top() {
        let fleet = FleetLayer::fixed(["http://10.0.0.1:80/api"]).unwrap();
        let svc = tower_layer::Layer::layer(&fleet, tower::service_fn(transport));

        let e = svc.clone().oneshot(get("/refused")).await.unwrap_err();
        let at = e.downcast_ref::<InstanceError>().expect("named");
        assert_eq!(at.instance().as_str(), "10.0.0.1:80");
        assert_eq!(e.to_string(), "instance 10.0.0.1:80");
        let cause = e.source().and_then(|s| s.downcast_ref::<io::Error>());
        assert_eq!(
            cause.map(io::Error::kind),
            Some(io::ErrorKind::ConnectionRefused)
        );

        // The layers above read their own errors at the top of the box.
        let e = svc.clone().oneshot(get("/slow")).await.unwrap_err();
        let ours = e.downcast_ref::<Error>().expect("as it was");
        assert_eq!(ours.kind(), crate::ErrorKind::AttemptTimeout);

        // An answer is not touched.
        assert!(svc.oneshot(get("/ok")).await.is_ok());
    }

    /// A discovery may take every instance out: a call then fails, not
    /// sent, and says so.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_fleet_with_no_instance_in_service_says_so() {
        let svc = Fleet {
            inner: tower::service_fn(transport),
            roster: Arc::new(Roster::new(Outliers::default())),
            classifier: HttpClassifier::new(),
        };
        let e = Error::from_box(svc.oneshot(get("/")).await.unwrap_err());
        assert!(e.is_not_sent(), "{e}");
        assert!(
            e.to_string()
                .contains("no instance of the fleet is in service"),
            "{e}"
        );
    }
}
