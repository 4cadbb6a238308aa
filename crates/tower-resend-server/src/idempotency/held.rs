//! Final responses the store did not take when the work ended: held in
//! memory, answered from here, and stored in the background until they land.
//!
//! A store that is down when a handler ends must not turn into a second run:
//! the response is kept here, this process answers the key from it (replay
//! or 422, exactly as the store would), and a task keeps storing it, with
//! the lease still the holder's, until the store takes it. Only when it
//! cannot within the configured time is it given up: one error event, and a
//! count.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::rules::{completed, renewed, OnCompletion, OnRenewal};
use super::store_call::with_timeout;
use super::IdempotencyStats;
use crate::store::{Begin, Claim, Fingerprint, RecordKey, Store, StoredResponse, Ttl};

/// The most responses one layer holds while the store does not take them.
const MAX_HELD: usize = 10_000;

/// How long a store call may take, and how long a response is retried.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Retrying {
    pub(crate) store_timeout: Duration,
    pub(crate) retry_for: Duration,
}

/// A held response's key (scope, key), and what is held: its request's
/// fingerprint and the response.
type Map = HashMap<(Box<str>, Box<str>), (Fingerprint, StoredResponse)>;

/// The held responses of one layer, by (scope, key).
#[derive(Default)]
pub(crate) struct HeldResponses {
    /// How many are held: read first, so that a request finds nothing held
    /// without taking the lock.
    count: AtomicUsize,
    map: Mutex<Map>,
}

impl std::fmt::Debug for HeldResponses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldResponses")
            .field("count", &self.count.load(Relaxed))
            .finish()
    }
}

impl HeldResponses {
    /// What this process holds for `key`, as the store would say it.
    pub(crate) fn answer(&self, key: &RecordKey<'_>) -> Option<Begin> {
        if self.count.load(Relaxed) == 0 {
            return None;
        }
        let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(&(Box::from(key.scope), Box::from(key.key)))
            .map(|(fingerprint, response)| Begin::Completed {
                fingerprint: *fingerprint,
                response: Box::new(response.clone()),
            })
    }

    /// Holds `response` for `key`; false when too many are held already.
    /// The `held` gauge of `stats` is set under the map's lock, to the
    /// map's length: set after it, a stale length could land last and stay
    /// (as `store_restart` once saw: 19 held, with nothing held).
    fn hold(
        &self,
        key: &RecordKey<'_>,
        fingerprint: Fingerprint,
        response: StoredResponse,
        stats: &IdempotencyStats,
    ) -> bool {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if map.len() >= MAX_HELD {
            return false;
        }
        map.insert(
            (Box::from(key.scope), Box::from(key.key)),
            (fingerprint, response),
        );
        self.count.store(map.len(), Relaxed);
        stats.set_held(map.len());
        true
    }

    /// Lets go of what is held for `key` (the gauge set as in `hold`).
    fn forget(&self, key: &RecordKey<'_>, stats: &IdempotencyStats) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.remove(&(Box::from(key.scope), Box::from(key.key)));
        self.count.store(map.len(), Relaxed);
        stats.set_held(map.len());
    }
}

/// Holds `response` (the store did not take it) and stores it in the
/// background: again and again, each try bounded by the store timeout, with
/// a backoff from 100 ms to a third of the lease (5 s at most), renewing the
/// lease at each try that fails, until the store takes it or
/// `retrying.retry_for` has passed.
pub(crate) fn store_later<St: Store>(
    store: &St,
    held: &Arc<HeldResponses>,
    stats: &IdempotencyStats,
    retrying: Retrying,
    claim: &Claim<'_>,
    response: StoredResponse,
    ttl: Ttl,
) {
    if !held.hold(&claim.key, claim.fingerprint, response.clone(), stats) {
        stats.count_unstored();
        tracing::error!(
            key = claim.key.key,
            "idempotency store unavailable and too many responses held: this response is given up, and a retry of its key may run the work again"
        );
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (store, held, stats) = (store.clone(), Arc::clone(held), stats.clone());
    let (scope, key): (Box<str>, Box<str>) = (claim.key.scope.into(), claim.key.key.into());
    let (fingerprint, token) = (claim.fingerprint, claim.token);
    runtime.spawn(async move {
        let claim = Claim {
            key: RecordKey {
                scope: &scope,
                key: &key,
            },
            fingerprint,
            token,
        };
        let outcome = retry(&store, retrying, &claim, &response, ttl).await;
        held.forget(&claim.key, &stats);
        match outcome {
            Some(Late::Stored) => {
                stats.count_stored_late();
                tracing::info!(key = &*key, "idempotent response stored late: the store answers for it again");
            }
            Some(Late::LeaseLost) => {
                stats.count_lease_lost();
                tracing::error!(key = &*key, "idempotency lease lost before the response could be stored: another run of this key may have happened");
            }
            None => {
                stats.count_unstored();
                tracing::error!(
                    key = &*key,
                    period = ?retrying.retry_for,
                    "idempotency store did not take a response in time: it is given up, and a retry of its key may run the work again"
                );
            }
        }
    });
}

/// How a response held for later ended.
enum Late {
    /// The store took it (or had it already).
    Stored,
    /// Another request took the key over.
    LeaseLost,
}

/// Stores `response` until the store answers: what it answered at last
/// (stored, or the lease lost), or `None` when the time is up.
async fn retry<St: Store>(
    store: &St,
    retrying: Retrying,
    claim: &Claim<'_>,
    response: &StoredResponse,
    ttl: Ttl,
) -> Option<Late> {
    let give_up = tokio::time::Instant::now() + retrying.retry_for;
    // Never longer than a third of the lease between tries: the lease is
    // renewed at each try that does not store, so that no other process
    // takes the key over while this one holds its response.
    let most = (ttl.lease / 3).min(Duration::from_secs(5));
    let mut wait = Duration::from_millis(100).min(most);
    loop {
        let at = tokio::time::Instant::now() + wait;
        if at > give_up {
            return None;
        }
        tokio::time::sleep_until(at).await;
        let timeout = retrying.store_timeout;
        let found = with_timeout(timeout, store.complete(claim, response, ttl)).await;
        if let Err(e) = &found {
            tracing::debug!(error = %e, "idempotency store still unavailable");
        }
        match completed(found) {
            OnCompletion::Hold => {}
            OnCompletion::Stored => return Some(Late::Stored),
            OnCompletion::LeaseLost => return Some(Late::LeaseLost),
        }
        // Not stored: the lease is kept meanwhile. A renewal that finds the
        // response stored (the last `complete` landed after all) is done.
        let renewal = with_timeout(timeout, store.renew(claim, ttl)).await;
        match renewed(renewal) {
            OnRenewal::LeaseLost => return Some(Late::LeaseLost),
            OnRenewal::AlreadyStored => return Some(Late::Stored),
            OnRenewal::Renewed | OnRenewal::RenewLater => wait = (wait * 2).min(most),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response() -> StoredResponse {
        StoredResponse::new(
            http::StatusCode::CREATED,
            http::HeaderMap::new(),
            bytes::Bytes::from_static(b"done"),
        )
    }

    /// Holding and letting go keep the `held` gauge at what is held (the
    /// map's length, written under its lock).
    #[test]
    fn the_held_gauge_is_what_is_held() {
        let (held, stats) = (HeldResponses::default(), IdempotencyStats::default());
        let key = |k| RecordKey { scope: "s", key: k };
        assert!(held.hold(&key("a"), Fingerprint([0; 32]), response(), &stats));
        assert!(held.hold(&key("b"), Fingerprint([0; 32]), response(), &stats));
        assert_eq!(stats.held(), 2);
        assert!(held.answer(&key("a")).is_some());
        held.forget(&key("a"), &stats);
        assert_eq!(stats.held(), 1);
        assert!(held.answer(&key("a")).is_none());
        held.forget(&key("b"), &stats);
        held.forget(&key("b"), &stats);
        assert_eq!((stats.held(), held.count.load(Relaxed)), (0, 0));
    }
}
