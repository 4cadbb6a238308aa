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
//! - **set aside** ([`Outliers`]): consecutive failures that say "this
//!   instance" eject it for a pause that doubles while it keeps failing,
//!   never more than a share of the fleet at once; back from a pause, it is
//!   on probation.
//! - **circuits per instance**: a stack with a circuit breaker gives each
//!   instance its own circuit, with the breaker's rules; an instance whose
//!   circuit is open is passed over, and a call is refused only when every
//!   instance's circuit refuses it.
//! - **the retry layer knows**: a failure not sent (a refused connection)
//!   is retried on another instance at once, and an overloaded answer's
//!   wait (a 503's `Retry-After`, or the overload floor) is the instance's:
//!   another instance is tried after the usual backoff. A 429 (or gRPC's
//!   `RESOURCE_EXHAUSTED`) speaks for the whole service (a rate limit or a
//!   quota is the caller's wherever it goes), and so does any wait when
//!   every instance the call could use has been used.
//!
//! The instances are base URIs: each attempt's URI keeps its path and
//! query and takes the instance's scheme and authority, so one transport
//! (a hyper-util client) reaches them all; a client that connects to one
//! address (a tonic `Channel`) gets one per instance through
//! [`PerInstance`]. A fixed list, a DNS name re-resolved on an interval
//! ([`FleetLayer::dns`]), or the addresses of your own resolver or service
//! discovery ([`FleetLayer::resolved`]):
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

mod discover;
mod dns;
mod per_instance;
mod roster;
mod service;
mod slot;

use std::sync::Arc;

use http::uri::{Authority, Scheme};
use http::Uri;
use tower_layer::Layer;

use crate::classify::HttpClassifier;
use crate::error::BoxError;
pub use per_instance::PerInstance;
pub use roster::Outliers;
pub(crate) use roster::Roster;
pub use service::{Fleet, ResponseFuture};
pub(crate) use slot::sealed::Slot;
pub use slot::{FleetSlot, NoFleet};

/// Sends each attempt to one instance of the upstream; see the
/// [module docs](self).
#[derive(Clone, Debug)]
pub struct FleetLayer<C = HttpClassifier> {
    roster: Arc<Roster>,
    classifier: C,
}

/// An instance's address that is not a base URI with a scheme and an
/// authority.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidInstance {
    address: String,
}

impl std::fmt::Display for InvalidInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid instance address {:?}: expected a base URI such as \"http://10.0.0.1:8080\"",
            self.address
        )
    }
}

impl std::error::Error for InvalidInstance {}

/// A base URI's scheme and authority.
fn base(address: &str) -> Result<(Scheme, Authority), InvalidInstance> {
    let bad = || InvalidInstance {
        address: address.to_owned(),
    };
    let uri: Uri = address.parse().map_err(|_| bad())?;
    let parts = uri.into_parts();
    match (parts.scheme, parts.authority) {
        (Some(scheme), Some(authority)) => Ok((scheme, authority)),
        _ => Err(bad()),
    }
}

impl FleetLayer<HttpClassifier> {
    /// A fleet of these instances, each a base URI (`http://host:port`).
    pub fn fixed<I>(addresses: I) -> Result<Self, InvalidInstance>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let bases = addresses
            .into_iter()
            .map(|a| base(a.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
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
    /// refresh that fails keeps the last answer.
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
    /// layer and every service it made are dropped.
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
