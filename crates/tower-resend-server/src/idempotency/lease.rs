//! A key held by a lease in a [`Store`]: claimed with `begin`, renewed while
//! the handler runs, ended with `complete` (or `release`), each call bounded
//! by the store timeout. A response the store does not take is held in this
//! process and stored later ([`held`](super::held)).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::Either;
use http::{Extensions, StatusCode};

use super::backend::{sealed::Sealed, Claimed, KeyClaim};
use super::config::Shared;
use super::held::{self, Retrying};
use super::request::Key;
use super::rules::{Kept, Mode};
use super::store_call::call;
use super::telemetry::Op;
use crate::store::{
    Begin, Claim, Fingerprint, LeaseState, LeaseToken, RecordKey, Store, StoreError,
    StoredResponse, Ttl,
};

/// A keyed request's lease on its key. Dropped while it may hold a lease
/// that nothing was done under (`armed`: its claim is under way, or its
/// answer was lost), it releases it in the background, bounded by the store
/// timeout.
// `pub` (in a private module) as the sealed `Backend`'s associated type:
// nameable nowhere outside the crate.
#[allow(unreachable_pub)]
pub struct Lease<St: Store> {
    shared: Arc<Shared<St>>,
    scope: Cow<'static, str>,
    key: Key,
    token: LeaseToken,
    fingerprint: Fingerprint,
    ttl: Ttl,
    /// Its key runs in this process (see [`running`](super::running)), from
    /// the store's grant to the lease's end.
    runs_here: bool,
    armed: bool,
}

impl<St: Store> std::fmt::Debug for Lease<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key.as_str())
            .field("armed", &self.armed)
            .finish_non_exhaustive()
    }
}

impl<St: Store> Lease<St> {
    fn claim(&self) -> Claim<'_> {
        Claim {
            key: RecordKey {
                scope: &self.scope,
                key: self.key.as_str(),
            },
            fingerprint: self.fingerprint,
            token: self.token,
        }
    }

    fn store_timeout(&self) -> Duration {
        self.shared.config.store_timeout
    }
}

impl<St: Store> Drop for Lease<St> {
    fn drop(&mut self) {
        if std::mem::take(&mut self.runs_here) {
            let key = (&*self.scope, self.key.header_value().as_bytes());
            self.shared.config.running.end(key, self.token);
        }
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        tracing::debug!(
            key = self.key.as_str(),
            "keyed request dropped before its handler ran: dropping its idempotency lease"
        );
        let lease = Self {
            shared: Arc::clone(&self.shared),
            scope: std::mem::take(&mut self.scope),
            key: self.key.clone(),
            armed: false,
            ..*self
        };
        runtime.spawn(release(lease));
    }
}

/// `key` as [`Running`](super::running::Running) keeps it.
fn running_key<'a>(key: &RecordKey<'a>) -> super::running::Key<'a> {
    (key.scope, key.key.as_bytes())
}

/// Drops the lease, bounded by the store timeout.
async fn release<St: Store>(mut lease: Lease<St>) {
    lease.armed = false;
    let shared = Arc::clone(&lease.shared);
    let metrics = shared.config.stats.metrics();
    let claim = lease.claim();
    let released = call(metrics, Op::Release, lease.store_timeout(), || {
        shared.store.release(&claim)
    })
    .await;
    if let Err(e) = released {
        tracing::warn!(error = %e, key = lease.key.as_str(), "could not drop an idempotency lease; it will expire");
    }
}

// The sealed trait names crate-private types.
#[allow(private_interfaces)]
impl<St: Store> Sealed for St {
    const MODE: Mode = Mode::Lease;
    type Hold = Lease<St>;

    async fn claim(shared: &Arc<Shared<Self>>, c: &KeyClaim<'_>) -> Claimed<Lease<St>> {
        // Armed from here: the store may grant the lease even if its answer
        // never comes back.
        let mut lease = Lease {
            shared: Arc::clone(shared),
            scope: c.scope.clone(),
            key: c.key.clone(),
            token: LeaseToken::random(),
            fingerprint: c.fingerprint,
            ttl: c.ttl,
            runs_here: false,
            armed: true,
        };
        let config = &shared.config;
        let claim = lease.claim();
        // A response this process holds for a store that did not take it
        // answers first, then work this process runs under the key (in
        // progress, whatever the store's lease says). (Chosen in a
        // statement of its own: what it looked at is not kept while the
        // store is asked.)
        let begin = match config.held.answer(&claim.key) {
            Some(held) => Either::Left(std::future::ready(Ok(held))),
            None => match config.running.runs(running_key(&claim.key)) {
                Some(fingerprint) => {
                    Either::Left(std::future::ready(Ok(Begin::InProgress { fingerprint })))
                }
                None => {
                    let begin = || shared.store.begin(&claim, lease.ttl);
                    let metrics = config.stats.metrics();
                    Either::Right(call(metrics, Op::Begin, config.store_timeout, begin))
                }
            },
        };
        let found = begin.await;
        // Granted: the key runs here from now.
        if matches!(found, Ok(Begin::Acquired)) {
            let (fingerprint, token) = (claim.fingerprint, claim.token);
            config
                .running
                .start(running_key(&claim.key), fingerprint, token);
            lease.runs_here = true;
        }
        // The lease is ours, or may be (the store's answer was lost): armed;
        // else it holds nothing.
        lease.armed = matches!(found, Ok(Begin::Acquired) | Err(_));
        Claimed { found, hold: lease }
    }

    async fn transact(_: &Arc<Shared<Self>>) -> Result<Lease<St>, StoreError> {
        // (Not asked: a store leaves unkeyed requests to the handler.)
        Err(StoreError::new("a store holds no unkeyed requests"))
    }

    fn start(hold: &mut Lease<St>, _: &mut Extensions) {
        hold.armed = false;
    }

    fn renew_every(hold: &Lease<St>) -> Option<Duration> {
        Some(hold.ttl.lease / 3)
    }

    async fn renew(shared: &Arc<Shared<Self>>, hold: &Lease<St>) -> Result<LeaseState, StoreError> {
        let claim = hold.claim();
        let renew = || shared.store.renew(&claim, hold.ttl);
        let config = &shared.config;
        call(
            config.stats.metrics(),
            Op::Renew,
            config.store_timeout,
            renew,
        )
        .await
    }

    async fn take_back(_: &Arc<Shared<Self>>, _: &mut Lease<St>) -> bool {
        true
    }

    async fn keep(
        shared: &Arc<Shared<Self>>,
        hold: &mut Lease<St>,
        record: &StoredResponse,
        _: StatusCode,
    ) -> Kept {
        let claim = hold.claim();
        let complete = || shared.store.complete(&claim, record, hold.ttl);
        let config = &shared.config;
        let metrics = config.stats.metrics();
        Kept::Stored(call(metrics, Op::Complete, config.store_timeout, complete).await)
    }

    fn hold(shared: &Arc<Shared<Self>>, hold: Lease<St>, record: StoredResponse) {
        let config = &shared.config;
        let retrying = Retrying {
            store_timeout: config.store_timeout,
            retry_for: config.store_retry_for,
        };
        held::store_later(
            &shared.store,
            &config.held,
            &config.stats,
            retrying,
            &hold.claim(),
            record,
            hold.ttl,
        );
    }

    async fn release(_: &Arc<Shared<Self>>, hold: Lease<St>) {
        release(hold).await;
    }
}
