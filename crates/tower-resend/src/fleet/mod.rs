//! Upstreams are fleets: each attempt goes to one instance, not one this
//! call has already used while another is in service, and instances that
//! keep failing are set aside.
//!
//! [`FleetLayer`] sits below the retry and hedge layers (as gRPC's retry
//! design puts retries above the load balancer), so that every retry and
//! every hedged copy is its own pick:
//!
//! - **which instance**: two chosen at random among the instances in
//!   service that this call has not used, the one with fewer requests in
//!   flight (power of two choices, as tower's `p2c::Balance`). A retry never
//!   goes back to the instance that just failed while another is in
//!   service, a hedged copy never goes where a copy of the same call is in
//!   flight, and with one instance bad the others share the retries evenly
//!   (no round-robin cursor to starve one). When the call has used them
//!   all, the one with the fewest failures.
//! - **set aside, probed, let back** ([`Outliers`]): consecutive failures
//!   that say "this instance" (or one refusal: a connection or stream
//!   refused, as gRPC's subchannel fails), while the other instances do
//!   well, set it aside (never more than a share of the fleet at once); it
//!   gets a probe every 500 ms (the fleet's probes at most 5 % of its
//!   attempts), and the first that answers well brings it back at once;
//!   when the instances in service fail as much, the ones set aside are let
//!   back (the fleet needs their capacity, and they were no outliers). A
//!   pick draws at random rather than scan the fleet, and each instance's
//!   state (its health, its circuit, its transport) lives as long as the
//!   instance is in the fleet, however large.
//! - **circuits per instance**: a stack with a circuit breaker gives each
//!   instance its own circuit, with the breaker's rules; an instance whose
//!   circuit is open is passed over, and a call is refused only when every
//!   instance's circuit refuses it.
//! - **a limit on what each instance has in flight** ([`FleetLayer::limit`],
//!   opt-in): found from the latency of its answers, and cut on its
//!   overloaded answers and attempt timeouts; none binds until an instance
//!   shows it has too much. An instance at its limit is passed over, and
//!   when every one the call could use is, the attempt fails at once, not
//!   sent ([`ErrorKind::AtCapacity`](crate::ErrorKind::AtCapacity)), rather
//!   than queue where its caller would be gone before its answer: the first
//!   attempts a fleet cannot serve are refused, the others served in time.
//! - **a limit on what the whole fleet has in flight**
//!   ([`FleetLayer::limit_total`], opt-in): the same, found from the
//!   latency of the fleet's answers, for where each process has too few
//!   attempts at each instance for a limit per instance to bind (many
//!   client processes, many instances).
//! - **the retry layer knows**: a failure not sent (a refused connection)
//!   is retried on another instance at once, without a budget token,
//!   unless the fleet fails as a whole (an outage: see
//!   [`retry`](crate::retry)); an overloaded answer's
//!   wait (a 503's `Retry-After`, or the overload floor) is the instance's:
//!   another instance is tried after the usual backoff. A 429 (or gRPC's
//!   `RESOURCE_EXHAUSTED`) speaks for the whole service (a rate limit or a
//!   quota is the caller's wherever it goes), and so does any wait when
//!   every instance the call could use has been used. A call refused at
//!   capacity (or by every instance's circuit) ends at once: a resend now
//!   would be refused too, and its error's advice says when to come back.
//!
//! The instances are base URIs: each attempt's URI takes the instance's
//! scheme and authority, and keeps the request's path and query, under
//! the base's path if it has one: with the instance
//! `http://10.0.0.1:8080/api/v2`, a request for `/orders?x=1` goes to
//! `http://10.0.0.1:8080/api/v2/orders?x=1` (joined by one `/`; a base
//! without a path, or with `/`, adds none). So one transport (a hyper-util
//! client) reaches them all; a client that connects to one address (a
//! tonic `Channel`) gets one per instance through [`PerInstance`]. A fixed
//! list, a DNS name re-resolved on an interval ([`FleetLayer::dns`]), or
//! the addresses of your own resolver or service discovery
//! ([`FleetLayer::resolved`], [`FleetLayer::discover`]):
//!
//! ```
//! use std::time::Duration;
//! use tower_resend::fleet::FleetLayer;
//!
//! let fleet = FleetLayer::fixed(["http://10.0.0.1:8080", "http://10.0.0.2:8080"]).unwrap();
//! let client = tower_resend::stack()
//!     .name("inventory")
//!     .fleet(fleet)
//!     .service(tower_resend::hyper_client(Duration::from_secs(1)));
//! # let _ = client;
//! ```
//!
//! A fleet refuses at build what it cannot honour ([`InvalidFleet`]): an
//! empty list (a fleet needs at least one instance), and a base with a
//! query or a fragment (a request's query is its own). A resolver's fleet
//! must resolve to an address before its first call, and keeps its last
//! answer when a refresh answers nothing; a discovery may take every
//! instance out for a while, and calls then fail, not sent, saying that
//! no instance of the fleet is in service. When an attempt fails at an
//! instance, its error ([`InstanceError`]) names the instance and those
//! the call had tried, and the call's error says it with its cause:
//!
//! ```
//! use tower::{service_fn, ServiceExt};
//! use tower_resend::fleet::FleetLayer;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_resend::BoxError> {
//! let fleet = FleetLayer::fixed(["http://10.0.0.1:8080/api/v2"])?;
//! // A transport that says where it was asked to send the request.
//! let echo = service_fn(|req: http::Request<String>| async move {
//!     http::Response::builder().header("sent-to", req.uri().to_string()).body(String::new())
//! });
//! let client = tower_resend::stack().fleet(fleet).service(echo);
//! let req = http::Request::get("http://inventory/orders?x=1").body(String::new())?;
//! let resp = client.oneshot(req).await?;
//! assert_eq!(resp.headers()["sent-to"], "http://10.0.0.1:8080/api/v2/orders?x=1");
//!
//! // A transport that fails: the call's error names the instance.
//! let refusing = service_fn(|_: http::Request<String>| async {
//!     Err::<http::Response<String>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
//! });
//! let fleet = FleetLayer::fixed(["http://10.0.0.1:8080"])?;
//! let client = tower_resend::stack().max_attempts(1).fleet(fleet).service(refusing);
//! let req = http::Request::get("http://inventory/orders").body(String::new())?;
//! let e = client.oneshot(req).await.unwrap_err();
//! assert!(e.to_string().contains("instance 10.0.0.1:8080: connection refused"), "{e}");
//!
//! let empty: [&str; 0] = [];
//! let e = FleetLayer::fixed(empty).unwrap_err();
//! assert!(e.to_string().starts_with("a fleet needs at least one instance"));
//! let e = FleetLayer::fixed(["http://10.0.0.1:8080/api?v=2"]).unwrap_err();
//! assert!(e.to_string().contains("a base URI cannot have a query"));
//! # Ok(()) }
//! ```

mod base;
mod discover;
mod dns;
mod error;
mod gauge;
mod limit;
mod outliers;
mod per_instance;
mod roster;
mod service;
mod slot;

use std::sync::Arc;

use http::uri::Scheme;
use http::Uri;
use tower_layer::Layer;

use crate::classify::HttpClassifier;
use crate::error::BoxError;

/// The name of earlier versions.
#[doc(hidden)]
#[deprecated(note = "renamed: tower_resend::fleet::InvalidFleet")]
pub type InvalidInstance = InvalidFleet;
use base::Base;
pub use error::{InstanceError, InvalidFleet};
pub use limit::InstanceLimit;
pub use outliers::Outliers;
pub use per_instance::PerInstance;
pub(crate) use roster::Roster;
pub use service::{Fleet, ResponseFuture};
pub(crate) use slot::sealed::WrapsFleet;
pub use slot::{FleetSlot, NoFleet};

/// Sends each attempt to one instance of the upstream; see the
/// [module docs](self).
#[derive(Clone, Debug)]
pub struct FleetLayer<C = HttpClassifier> {
    roster: Arc<Roster>,
    classifier: C,
}

impl FleetLayer<HttpClassifier> {
    /// A fleet of these instances, each a base URI: `http://host:port`,
    /// or `http://host:port/api/v2` for an API under a path, which every
    /// request's path then goes under.
    ///
    /// An error names what cannot be honoured: no instance at all, an
    /// address that is not a base URI (no scheme or no authority), or one
    /// with a query or a fragment.
    pub fn fixed<I>(addresses: I) -> Result<Self, InvalidFleet>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let bases = addresses
            .into_iter()
            .map(|a| Base::parse(a.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        if bases.is_empty() {
            return Err(InvalidFleet::empty());
        }
        let roster = Roster::new(Outliers::default());
        roster.set(&bases);
        Ok(Self {
            roster: Arc::new(roster),
            classifier: HttpClassifier::new(),
        })
    }

    /// A fleet of every address `host` resolves to, on `port` over
    /// `scheme` (`tokio::net::lookup_host`), resolved now (an error if it
    /// cannot be) and again every `every` in a task of its own, which ends
    /// when the layer and every service it made are dropped. An address
    /// gone from the answer stops being used from the next refresh; a
    /// refresh that fails, or answers no address, keeps the last answer.
    /// The instances' base URIs are `scheme://address:port`, without a
    /// path.
    pub async fn dns(
        scheme: Scheme,
        host: &str,
        port: u16,
        every: std::time::Duration,
    ) -> std::io::Result<Self> {
        let host = host.to_owned();
        Self::resolved(scheme, move || dns::lookup(host.clone(), port), every).await
    }

    /// As [`dns`](Self::dns), with the addresses from `resolve`: a
    /// resolver of your own (hickory, a service-discovery client), called
    /// now and every `every`.
    pub async fn resolved<R, F>(
        scheme: Scheme,
        resolve: R,
        every: std::time::Duration,
    ) -> std::io::Result<Self>
    where
        R: Fn() -> F + Send + 'static,
        F: std::future::Future<Output = std::io::Result<Vec<std::net::SocketAddr>>> + Send,
    {
        let roster = Arc::new(Roster::new(Outliers::default()));
        dns::start(&roster, scheme, resolve, every).await?;
        Ok(Self {
            roster,
            classifier: HttpClassifier::new(),
        })
    }
}

impl FleetLayer<HttpClassifier> {
    /// A fleet kept to a [`Discover`](tower::discover::Discover) stream of
    /// instances' base URIs, your own service discovery: its first
    /// instances are waited for (an error if the stream ends or fails
    /// first), then a task of its own follows the stream, adding what it
    /// inserts and taking out what it removes, until the stream ends or the
    /// layer and every service it made are dropped. A base's path is kept
    /// as [`fixed`](Self::fixed) keeps it; an insert that is not a base
    /// URI (or has a query) is refused, and the fleet kept as it was. A
    /// stream that removes every instance leaves calls failing, not sent,
    /// until it inserts one.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use tower::discover::Change;
    /// use tower_resend::fleet::FleetLayer;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_resend::BoxError> {
    /// // Your discovery's stream of changes; here, two instances, as a list.
    /// let found: Vec<Result<Change<u32, http::Uri>, Infallible>> = vec![
    ///     Ok(Change::Insert(1, "http://10.0.0.1:8080".parse()?)),
    ///     Ok(Change::Insert(2, "http://10.0.0.2:8080".parse()?)),
    /// ];
    /// let fleet = FleetLayer::discover(futures_util::stream::iter(found)).await?;
    /// # let _ = fleet; Ok(()) }
    /// ```
    pub async fn discover<D>(discover: D) -> Result<Self, BoxError>
    where
        D: tower::discover::Discover<Service = Uri> + Send + 'static,
        D::Key: Eq + Send,
        D::Error: Into<BoxError>,
    {
        let roster = Arc::new(Roster::new(Outliers::default()));
        discover::start(&roster, discover).await?;
        Ok(Self {
            roster,
            classifier: HttpClassifier::new(),
        })
    }
}

impl<C> FleetLayer<C> {
    /// Sets instances aside by `outliers` (default: [`Outliers::default`]).
    #[must_use]
    pub fn outliers(self, outliers: Outliers) -> Self {
        self.roster.set_outliers(outliers);
        self
    }

    /// Limits the attempts in flight at each instance by a limit found from
    /// the latency of its answers (default: no limit), so that when the
    /// fleet gets more than it serves, the first attempts it cannot serve
    /// fail at once instead of queueing past their callers' patience.
    ///
    /// Opt-in, because a limit found from latency cannot tell a queue from
    /// work that got slower on its own (a heavier mix of requests): until
    /// its rules learn the new time, it may refuse calls the instance
    /// would have served. And it sheds a little more than the excess of a
    /// mild overload: on loopback, one instance of three gone for 3 s
    /// under 70 % load (the two left at 105 %), it refused 8 % of the calls
    /// while it lasted, which the stack without it answered, later.
    ///
    /// - **None binds until an instance shows it has too much**: an
    ///   overloaded answer (a 503, a 429, gRPC's UNAVAILABLE or
    ///   RESOURCE_EXHAUSTED) or an attempt timeout cuts its limit to half
    ///   of what it had in flight; a window (100 ms and ten answers at
    ///   least) whose mean latency is surely more than 1.5 times the
    ///   fastest window seen (beyond three standard errors of its answers'
    ///   times, so that a few slow answers of a long tail cut nothing) cuts
    ///   it to what it served (in flight × fastest / now, at most halved).
    ///   One cut for the attempts sent under one limit.
    /// - **It grows while latency holds**: a window within the tolerance
    ///   in which a pick found the instance at its limit grows the limit by
    ///   its square root; ten windows in a row within the tolerance, the
    ///   limit not reached, and it lapses: none binds again. Latency that a
    ///   cut did not bring down is the work's own, and the fastest from
    ///   then on.
    /// - **The pick passes over an instance at its limit**, as over one
    ///   whose circuit is open; when every instance the call could use is
    ///   at its limit, the attempt fails at once with
    ///   [`ErrorKind::AtCapacity`](crate::ErrorKind::AtCapacity): not sent,
    ///   nothing processed, [`RetryAdvice::After`](crate::RetryAdvice::After)
    ///   a second. The retry layer does not resend it (a resend now would
    ///   be refused too): the call ends with it, at once.
    ///
    /// The settings ([`InstanceLimit`]) are a floor (1), the tolerance
    /// (1.5) and the window (100 ms). What it costs an attempt: picks read
    /// each instance's limit with one atomic load and take a place with a
    /// compare-and-swap; an answer adds its time (and its square) with two
    /// atomic adds. Once a window, the answer that closes it moves the
    /// limit, under a `try_lock` that no attempt waits on. The pick stays
    /// O(1): over a large fleet, when its random draws find only instances
    /// at their limit, the call is refused without a look over the whole
    /// fleet (with a quarter of it with room, one call in a hundred may
    /// be). [`limits`](Self::limits) says where each instance's limit
    /// stands.
    ///
    /// On loopback, three instances that each serve one request at a time
    /// in 10 ms (300 a second), 400 calls a second for 5 s, attempts of
    /// 200 ms: without a limit, 253 calls got their answer (the instances
    /// worked 2 154 times for callers that had gone); with it, 1 461 (538
    /// refused at once, 50 attempts for callers gone). Under no overload,
    /// answers of 1 to 61 ms with a long tail, 3 to 100 callers: no limit
    /// bound and nothing was refused (`tests/fleet/limit.rs`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::{service_fn, ServiceExt};
    /// use tower_resend::fleet::{FleetLayer, InstanceLimit};
    /// use tower_resend::{ErrorKind, RetryAdvice};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), tower_resend::BoxError> {
    /// let fleet = FleetLayer::fixed(["http://10.0.0.1:8080"])?.limit(InstanceLimit::adaptive());
    /// // An instance that sheds `/shed` (503) and takes a second over `/slow`.
    /// let instance = service_fn(|req: http::Request<String>| async move {
    ///     let status = match req.uri().path() {
    ///         "/shed" => 503,
    ///         "/slow" => {
    ///             tokio::time::sleep(Duration::from_secs(1)).await;
    ///             200
    ///         }
    ///         _ => 200,
    ///     };
    ///     http::Response::builder().status(status).body(String::new())
    /// });
    /// let client = tower_resend::stack().max_attempts(1).fleet(fleet.clone()).service(instance);
    /// let get = |path: &str| http::Request::get(format!("http://inventory{path}")).body(String::new());
    ///
    /// // No limit binds until the instance shows it has too much.
    /// assert_eq!(fleet.limits()[0].1, None);
    /// let shed = client.clone().oneshot(get("/shed")?).await?;
    /// assert_eq!(shed.status(), 503);
    /// // Half of the one it had in flight, never under the floor: one.
    /// assert_eq!(fleet.limits()[0].1, Some(1));
    ///
    /// // One call in flight: the next fails at once, not sent.
    /// let slow = tokio::spawn(client.clone().oneshot(get("/slow")?));
    /// tokio::task::yield_now().await;
    /// let e = client.clone().oneshot(get("/orders")?).await.unwrap_err();
    /// assert_eq!(e.kind(), ErrorKind::AtCapacity);
    /// assert!(e.is_not_sent());
    /// assert_eq!(e.retry_advice(), RetryAdvice::After(Duration::from_secs(1)));
    /// assert_eq!(slow.await??.status(), 200);
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn limit(self, limit: InstanceLimit) -> Self {
        self.roster.set_limit(limit);
        self
    }

    /// Each instance's address, and its limit on attempts in flight now:
    /// `None` while none binds (no [`limit`](Self::limit), or the
    /// instance has not shown it has too much since its limit lapsed).
    pub fn limits(&self) -> Vec<(http::uri::Authority, Option<u32>)> {
        self.roster
            .instances()
            .iter()
            .map(|i| ((*i.base.authority).clone(), i.limit()))
            .collect()
    }

    /// Limits this process's attempts in flight to the fleet as a whole,
    /// found from the latency of the fleet's answers by the rules of
    /// [`limit`](Self::limit): first attempts the fleet cannot serve fail at
    /// once, not sent, with
    /// [`ErrorKind::AtCapacity`](crate::ErrorKind::AtCapacity), instead of
    /// queueing behind work whose callers are gone.
    ///
    /// Where a limit per instance cannot bind, this one can: a process
    /// among a hundred, calling a hundred instances, has well under one
    /// attempt in flight at each, and a limit cannot go under one; its
    /// attempts in flight to them all are a few, and grow a hundredfold
    /// when every queue does. On servers that work on for callers that
    /// have gone (a FIFO queue, no deadline read), that is what gives
    /// their capacity back after a slowdown: in the `storm` bench's work
    /// x4 for 5 s (10 000 callers, 100 instances), goodput is back 1 s
    /// after the trigger, where without it the queues take 14 s to drain.
    ///
    /// It differs from the limit per instance in what it reads: the fleet's
    /// latency only. An overloaded answer (a 503, a 429) is one instance's,
    /// which the pick routes around, and cuts nothing; an attempt that ran
    /// out of time is a sample of its time, so one instance that times out
    /// among many moves no window. Both limits may be set; an attempt then
    /// needs room in both.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use futures_util::future::join_all;
    /// use tower::{service_fn, ServiceExt};
    /// use tower_resend::fleet::{FleetLayer, InstanceLimit};
    /// use tower_resend::ErrorKind;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), tower_resend::BoxError> {
    /// let fleet = FleetLayer::fixed(["http://10.0.0.1:8080", "http://10.0.0.2:8080"])?
    ///     .limit_total(InstanceLimit::adaptive());
    /// // Instances that answer in 10 ms, and in 500 ms over `/slow`.
    /// let instance = service_fn(|req: http::Request<String>| async move {
    ///     let ms = if req.uri().path() == "/slow" { 500 } else { 10 };
    ///     tokio::time::sleep(Duration::from_millis(ms)).await;
    ///     Ok::<_, Infallible>(http::Response::new(String::new()))
    /// });
    /// let client = tower_resend::stack().max_attempts(1).fleet(fleet.clone()).service(instance);
    /// let get = |path: &str| http::Request::get(format!("http://inventory{path}")).body(String::new());
    /// let calls = |path: &str, n| {
    ///     join_all((0..n).map(|_| client.clone().oneshot(get(path).unwrap())))
    /// };
    ///
    /// // A window (100 ms, ten answers) of the fleet at its fastest.
    /// tokio::time::sleep(Duration::from_millis(100)).await;
    /// calls("/orders", 12).await;
    /// assert_eq!(fleet.total_limit(), None);
    /// // Then one fifty times as slow, 12 in flight: it served 12 at once
    /// // in the time it served 600; cut to half (at most halved).
    /// calls("/slow", 12).await;
    /// assert_eq!(fleet.total_limit(), Some(6));
    ///
    /// // Six in flight: the next fails at once, not sent, though each
    /// // instance has only three.
    /// let slow = calls("/slow", 6);
    /// let refused = async {
    ///     tokio::task::yield_now().await;
    ///     client.clone().oneshot(get("/orders").unwrap()).await
    /// };
    /// let (slow, refused) = tokio::join!(slow, refused);
    /// let e = refused.unwrap_err();
    /// assert_eq!(e.kind(), ErrorKind::AtCapacity);
    /// assert!(e.is_not_sent());
    /// assert!(slow.iter().all(Result::is_ok));
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn limit_total(self, limit: InstanceLimit) -> Self {
        self.roster.set_total(limit);
        self
    }

    /// The limit on this process's attempts in flight to the whole fleet
    /// now: `None` while none binds (no [`limit_total`](Self::limit_total),
    /// or the fleet has not shown it has too much since the limit lapsed).
    pub fn total_limit(&self) -> Option<u32> {
        self.roster.total_limit()
    }

    /// Classifies answers with `classifier` to tell an instance's failures
    /// (a stack gives its retry classifier).
    #[must_use]
    pub fn classifier<C2>(self, classifier: C2) -> FleetLayer<C2> {
        FleetLayer {
            roster: self.roster,
            classifier,
        }
    }
}

impl<S, C: Clone> Layer<S> for FleetLayer<C> {
    type Service = Fleet<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        Fleet {
            inner,
            roster: Arc::clone(&self.roster),
            classifier: self.classifier.clone(),
        }
    }
}
