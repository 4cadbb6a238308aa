//! Where a layer keeps its records, and so what holds a key while its
//! handler runs: a lease in a [`Store`], or the handler's own transaction
//! ([`PostgresTransactional`](crate::PostgresTransactional)). The rules
//! ([`rules`](super::rules)) and the flow of a request
//! ([`keyed`](super::keyed)) are the same for both; a backend only does the
//! I/O of its mode.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, StatusCode};
use tower_resend::Deadline;

use super::config::Shared;
use super::request::Key;
use super::rules::{Kept, Mode};
use crate::store::{Begin, Fingerprint, LeaseState, Store, StoreError, StoredResponse, Ttl};

/// Where an [`IdempotencyLayer`](crate::IdempotencyLayer) keeps its records:
/// any [`Store`] (the memory, Redis and PostgreSQL stores, or your own), or
/// [`PostgresTransactional`](crate::PostgresTransactional) (feature
/// `postgres`). The rules are the same; what differs is what holds the key
/// while the handler runs (a lease, or the handler's transaction).
///
/// Sealed: implement [`Store`] to bring a store of your own.
pub trait Backend: sealed::Sealed {}

impl<St: Store> Backend for St {}

/// What a keyed request asks of its backend.
#[derive(Debug)]
pub(crate) struct KeyClaim<'a> {
    pub(crate) scope: &'a Cow<'static, str>,
    pub(crate) key: &'a Key,
    pub(crate) fingerprint: Fingerprint,
    /// The lease, sized from the deadline, and the record's life.
    pub(crate) ttl: Ttl,
    /// (Read by the transactional mode: how long to wait on a holder.)
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) deadline: Option<Deadline>,
}

/// What a claim found: what holds the key (for the rules), and the hold,
/// which holds the key when it is (or may be) this request's, and nothing
/// otherwise. A hold dropped before its handler starts gives the key back.
#[derive(Debug)]
pub(crate) struct Claimed<H> {
    pub(crate) found: Result<Begin, StoreError>,
    pub(crate) hold: H,
}

// The sealed trait names crate-private types: it cannot be named, nor
// implemented, outside the crate, which is its point.
#[allow(private_interfaces, private_bounds)]
pub(crate) mod sealed {
    use super::*;

    /// The I/O of a backend's mode (not nameable outside the crate).
    pub trait Sealed: Clone + Send + Sync + 'static {
        /// What holds a key while its handler runs.
        const MODE: Mode;
        /// A claimed key: a lease, or a transaction.
        type Hold: Send + Sync + 'static;

        /// Claims the key (each wait for the store bounded by its
        /// timeout), or says what holds it.
        fn claim(
            shared: &Arc<Shared<Self>>,
            claim: &KeyClaim<'_>,
        ) -> impl Future<Output = Claimed<Self::Hold>> + Send;

        /// A hold for an unsafe request without a key
        /// ([`OnArrival::Transact`](super::super::rules::OnArrival::Transact)).
        fn transact(
            shared: &Arc<Shared<Self>>,
        ) -> impl Future<Output = Result<Self::Hold, StoreError>> + Send;

        /// The handler starts now: from here on the hold is never given
        /// back on a drop (the work may have been done). What the handler
        /// needs of it goes in its request's `extensions`.
        fn start(hold: &mut Self::Hold, extensions: &mut Extensions);

        /// How often the hold is renewed while the handler runs, if at all.
        fn renew_every(hold: &Self::Hold) -> Option<Duration>;

        /// Renews the hold (bounded by the store timeout).
        fn renew(
            shared: &Arc<Shared<Self>>,
            hold: &Self::Hold,
        ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send;

        /// Takes the hold back from the ended handler: false when the
        /// handler kept it (a transaction it did not let go of).
        fn take_back(
            shared: &Arc<Shared<Self>>,
            hold: &mut Self::Hold,
        ) -> impl Future<Output = bool> + Send;

        /// Keeps `record` as the key's end (a store's `complete`; a
        /// transaction's record and commit), the handler having answered
        /// `status`.
        fn keep(
            shared: &Arc<Shared<Self>>,
            hold: &mut Self::Hold,
            record: &StoredResponse,
            status: StatusCode,
        ) -> impl Future<Output = Kept> + Send;

        /// The store did not take `record`: holds it in this process and
        /// stores it in the background.
        fn hold(shared: &Arc<Shared<Self>>, hold: Self::Hold, record: StoredResponse);

        /// Gives the key back: the lease released, the transaction rolled
        /// back.
        fn release(shared: &Arc<Shared<Self>>, hold: Self::Hold)
            -> impl Future<Output = ()> + Send;
    }
}
