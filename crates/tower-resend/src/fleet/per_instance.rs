//! A transport per instance, for clients that connect to one address each
//! (a tonic `Channel`): made the first time an attempt goes to the
//! instance, then reused.

use std::collections::{HashMap, HashSet};
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use http::uri::{Authority, Scheme};
use http::{Request, Uri};
use tower_service::Service;

use crate::error::{BoxError, Error};
use crate::vocab::{Elsewhere, Tried};

/// The most transports kept when the requests say nothing of their fleet
/// (no retry layer above the fleet's records them); past it, the one used
/// longest ago is dropped. Under a stack, the transports are those of the
/// fleet's instances, however many: one that leaves takes its transport.
const KEEP_UNKNOWN_FLEET: usize = 256;

/// One transport per instance of a [fleet](super), made by `make` from the
/// instance's base URI the first time an attempt goes there. For tonic,
/// whose `Channel` connects to one endpoint, `make` is
/// `|base| Endpoint::from(base).connect_lazy()`, and the stack's transport
/// `TonicTransport::new(PerInstance::new(..))`.
///
/// ```
/// use std::convert::Infallible;
/// use tower::{service_fn, ServiceExt};
/// use tower_resend::fleet::{FleetLayer, PerInstance};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_resend::BoxError> {
/// // Each instance's own client (here, one that says where it goes).
/// let clients = PerInstance::new(|base: http::Uri| {
///     service_fn(move |_req: http::Request<String>| {
///         let base = base.clone();
///         async move { Ok::<_, Infallible>(http::Response::new(base.to_string())) }
///     })
/// });
/// let fleet = FleetLayer::fixed(["http://10.0.0.1:50051"])?;
/// let stack = tower_resend::stack().fleet(fleet).service(clients);
/// let resp = stack.oneshot(http::Request::new(String::new())).await?;
/// assert_eq!(resp.status(), 200);
/// # Ok(()) }
/// ```
///
/// A request goes to the transport of its URI's scheme and authority (the
/// fleet layer wrote them); one without an authority fails, not sent.
///
/// The base `make` is given is the instance's scheme and authority only
/// (`http://10.0.0.1:50051/`), whatever path the fleet's base has: the
/// fleet has already put each request's path under that one, so a client
/// that prefixes its origin's path (tonic's `Grpc::with_origin`) would
/// send it twice. tonic's `Channel` keeps the request's path as it is.
pub struct PerInstance<S, F> {
    make: Arc<F>,
    made: Arc<Made<S>>,
}

/// Each instance's transport, by scheme and authority.
type Transports<S> = HashMap<(Scheme, Authority), Arc<Kept<S>>>;

/// The transports made so far: a map an attempt loads without a lock or a
/// count that every thread writes, made again whole (under `changing`)
/// only when a transport is made or goes.
struct Made<S> {
    transports: ArcSwap<Transports<S>>,
    changing: Mutex<()>,
    /// Attempts so far, for the one used longest ago (counted only where
    /// the requests do not name their fleet).
    uses: AtomicU64,
}

/// One instance's transport. An attempt clones it under its own lock
/// (a transport need not be `Sync`); attempts to other instances do not
/// wait on it.
struct Kept<S> {
    transport: Mutex<S>,
    /// When it was last used, in [`Made::uses`].
    used: AtomicU64,
}

impl<S, F> PerInstance<S, F>
where
    F: Fn(Uri) -> S,
{
    /// Makes each instance's transport with `make`, given its scheme and
    /// authority as a URI (`http://10.0.0.1:50051/`, without the path of
    /// the fleet's base: see above).
    pub fn new(make: F) -> Self {
        Self {
            make: Arc::new(make),
            made: Arc::new(Made {
                transports: ArcSwap::from_pointee(HashMap::new()),
                changing: Mutex::new(()),
                uses: AtomicU64::new(0),
            }),
        }
    }

    /// The transport for `scheme` and `authority`, made if need be;
    /// `fleet`, the fleet the request's call uses, if it says.
    fn transport(
        &self,
        scheme: Scheme,
        authority: Authority,
        fleet: Option<Arc<dyn Elsewhere>>,
    ) -> S
    where
        S: Clone,
    {
        let key = (scheme, authority);
        let known = fleet.is_some();
        let found = self.made.transports.load().get(&key).cloned();
        if let Some(kept) = found {
            return self.use_kept(&kept, known);
        }
        // The first attempt to this instance (or one racing it): made, and
        // the map made again, under the lock.
        let _changing = self
            .made
            .changing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = self.made.transports.load_full();
        if let Some(kept) = now.get(&key) {
            return self.use_kept(kept, known);
        }
        let mut next = Transports::clone(&now);
        match fleet {
            // Instances left the fleet: their transports go (looked over
            // only when there are more transports than instances).
            Some(fleet) if next.len() >= fleet.len() => {
                let held: HashSet<Authority> = fleet
                    .authorities()
                    .iter()
                    .map(|a| Authority::clone(a))
                    .collect();
                next.retain(|(_, a), _| held.contains(a));
            }
            Some(_) => {}
            None if next.len() >= KEEP_UNKNOWN_FLEET => {
                let oldest = next
                    .iter()
                    .min_by_key(|(_, kept)| kept.used.load(Ordering::Relaxed))
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    next.remove(&k);
                }
            }
            None => {}
        }
        let base = Uri::builder()
            .scheme(key.0.clone())
            .authority(key.1.clone())
            .path_and_query("/")
            .build();
        // (A scheme and an authority that came from a URI make one again.)
        let svc = match base {
            Ok(base) => (self.make)(base),
            Err(_) => (self.make)(Uri::default()),
        };
        let kept = Arc::new(Kept {
            transport: Mutex::new(svc.clone()),
            used: AtomicU64::new(self.made.uses.fetch_add(1, Ordering::Relaxed)),
        });
        next.insert(key, kept);
        self.made.transports.store(Arc::new(next));
        svc
    }

    /// A clone of `kept`'s transport; its use counted when the request
    /// names no fleet (`known`: it does, and the fleet says which go).
    fn use_kept(&self, kept: &Kept<S>, known: bool) -> S
    where
        S: Clone,
    {
        if !known {
            let now = self.made.uses.fetch_add(1, Ordering::Relaxed);
            kept.used.store(now, Ordering::Relaxed);
        }
        kept.transport
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl<S, F> Clone for PerInstance<S, F> {
    fn clone(&self) -> Self {
        Self {
            make: Arc::clone(&self.make),
            made: Arc::clone(&self.made),
        }
    }
}

impl<S, F> std::fmt::Debug for PerInstance<S, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerInstance")
            .field("transports", &self.made.transports.load().len())
            .finish_non_exhaustive()
    }
}

impl<S, F, B> Service<Request<B>> for PerInstance<S, F>
where
    F: Fn(Uri) -> S,
    S: Service<Request<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
    S::Error: Into<BoxError>,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    /// Always ready: each instance's transport is made ready in the call.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (Some(scheme), Some(authority)) =
            (req.uri().scheme().cloned(), req.uri().authority().cloned())
        else {
            let e = Error::connect(
                "a request without a scheme and an authority: no instance to send it to".into(),
            );
            return Box::pin(std::future::ready(Err(e.into())));
        };
        let fleet = req.extensions().get::<Tried>().and_then(Tried::fleet);
        let mut svc = self.transport(scheme, authority, fleet);
        Box::pin(async move {
            poll_fn(|cx| svc.poll_ready(cx)).await.map_err(Into::into)?;
            svc.call(req).await.map_err(Into::into)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tower::ServiceExt;

    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn one_transport_per_instance_made_once() {
        let made = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&made);
        let per = PerInstance::new(move |base: Uri| {
            count.fetch_add(1, Ordering::SeqCst);
            tower::service_fn(move |_: Request<()>| {
                let base = base.clone();
                async move { Ok::<_, Infallible>(base.to_string()) }
            })
        });
        for (uri, expect) in [
            ("http://10.0.0.1:80/a", "http://10.0.0.1:80/"),
            ("http://10.0.0.2:80/b", "http://10.0.0.2:80/"),
            ("http://10.0.0.1:80/c", "http://10.0.0.1:80/"),
        ] {
            let req = Request::get(uri).body(()).unwrap();
            assert_eq!(per.clone().oneshot(req).await.unwrap(), expect);
        }
        assert_eq!(made.load(Ordering::SeqCst), 2);
        let relative = Request::get("/no/authority").body(()).unwrap();
        let err = Error::from_box(per.oneshot(relative).await.unwrap_err());
        assert!(err.is_not_sent(), "{err}");
    }

    /// A fleet the call names through its record, holding `held`.
    struct Held(Mutex<Vec<Arc<Authority>>>);

    impl Elsewhere for Held {
        fn has_other(&self, _: &[u64]) -> bool {
            true
        }

        fn failing(&self) -> bool {
            false
        }

        fn len(&self) -> usize {
            self.0.lock().unwrap().len()
        }

        fn authorities(&self) -> Vec<Arc<Authority>> {
            self.0.lock().unwrap().clone()
        }
    }

    /// Transports are kept for the fleet's instances, however many, and an
    /// instance that leaves the fleet takes its transport with it.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_transport_goes_with_its_instance() {
        let per = PerInstance::new(|_base: Uri| {
            tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(()) })
        });
        let authority = |i: usize| -> Arc<Authority> {
            Arc::new(format!("10.0.{}.{}:80", i / 256, i % 256).parse().unwrap())
        };
        let fleet = Arc::new(Held(Mutex::new((0..300).map(authority).collect())));
        let send = |i: usize| {
            let tried = Tried::default();
            tried.record(
                i as u64,
                &authority(i),
                Arc::clone(&fleet) as Arc<dyn Elsewhere>,
            );
            let mut req = Request::get(format!("http://{}/x", authority(i)))
                .body(())
                .unwrap();
            req.extensions_mut().insert(tried);
            per.clone().oneshot(req)
        };
        // More instances than the 256 kept when no fleet is named: all kept.
        for i in 0..300 {
            send(i).await.unwrap();
        }
        let kept = |p: &PerInstance<_, _>| p.made.transports.load().len();
        assert_eq!(kept(&per), 300);
        // The first hundred leave; a newcomer's transport makes room.
        *fleet.0.lock().unwrap() = (100..301).map(authority).collect();
        send(300).await.unwrap();
        assert_eq!(kept(&per), 201);
    }

    /// Without a fleet named by the requests, at most 256 transports are
    /// kept: past them, the one used longest ago goes, and one in use
    /// stays.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn without_a_fleet_the_transport_used_longest_ago_goes() {
        let per = PerInstance::new(|_base: Uri| {
            tower::service_fn(|_: Request<()>| async { Ok::<_, Infallible>(()) })
        });
        let send = |i: usize| {
            let req = Request::get(format!("http://10.0.{}.{}:80/x", i / 256, i % 256))
                .body(())
                .unwrap();
            per.clone().oneshot(req)
        };
        for i in 0..KEEP_UNKNOWN_FLEET {
            send(i).await.unwrap();
        }
        // The first is used again: the second is now the oldest.
        send(0).await.unwrap();
        send(KEEP_UNKNOWN_FLEET).await.unwrap();
        let held = per.made.transports.load();
        assert_eq!(held.len(), KEEP_UNKNOWN_FLEET);
        let has = |i: usize| {
            let authority: Authority = format!("10.0.{}.{}:80", i / 256, i % 256).parse().unwrap();
            held.contains_key(&(Scheme::HTTP, authority))
        };
        assert!(has(0), "the one used again stays");
        assert!(!has(1), "the one used longest ago goes");
        assert!(has(KEEP_UNKNOWN_FLEET));
    }

    /// A fleet whose base has a path, over a channel per instance (as for
    /// gRPC): the channel is made from the scheme and authority alone, and
    /// the path reaches it once, under the base's.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_base_path_reaches_the_instance_once() {
        let made = Arc::new(Mutex::new(Vec::new()));
        let bases = Arc::clone(&made);
        let per = PerInstance::new(move |base: Uri| {
            bases.lock().unwrap().push(base.to_string());
            tower::service_fn(move |req: Request<String>| async move {
                http::Response::builder()
                    .header("sent-to", req.uri().to_string())
                    .body(String::new())
            })
        });
        let fleet = crate::fleet::FleetLayer::fixed(["http://10.0.0.1:50051/grpc"]).unwrap();
        let stack = crate::stack().fleet(fleet).service(per);
        let req = Request::post("http://upstream/pkg.Service/Method")
            .body(String::new())
            .unwrap();
        let resp = stack.oneshot(req).await.unwrap();
        assert_eq!(
            resp.headers()["sent-to"],
            "http://10.0.0.1:50051/grpc/pkg.Service/Method"
        );
        assert_eq!(*made.lock().unwrap(), ["http://10.0.0.1:50051/"]);
    }
}
