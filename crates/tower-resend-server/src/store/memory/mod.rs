//! The in-process store: [`MemoryStore`], its bounds and its operations.
//! Its records are in `shard.rs` (a map of them and the order they expire
//! in), each one a byte buffer laid out in `record.rs`.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use foldhash::fast::RandomState;
use tokio::time::Instant;

use super::{Begin, Claim, LeaseState, RecordKey, Store, StoreError, StoredResponse, Ttl};

mod record;
mod shard;

use record::Record;
use shard::Shard;

/// The default bound on the records a [`MemoryStore`] holds: 100 000.
pub const DEFAULT_MAX_RECORDS: usize = 100_000;
/// The default bound on the bytes a [`MemoryStore`]'s finished records
/// cost: 64 MiB.
pub const DEFAULT_MAX_BYTES: usize = 64 * 1024 * 1024;

/// The records are split into this many maps, each behind its own lock, by
/// the hash of their key: requests for keys in different shards do not wait
/// for each other.
const SHARDS: usize = 16;

/// Idempotency records in this process's memory: the embedded default.
///
/// Records and leases expire on tokio's clock. Memory is bounded: at most
/// [`max_records`](Self::max_records) records (leases and finished ones)
/// and [`max_bytes`](Self::max_bytes) bytes of finished records, counted
/// as what they cost the process ([`bytes`](Self::bytes)): their key and
/// response, and a fixed overhead each for the allocator and the maps
/// (64 bytes). A finished record of a small response (a 40-byte key, a 2xx
/// with a 100-byte body) costs about 250 bytes; a live lease, about 150.
/// When a new lease or a stored response would pass a bound:
///
/// 1. expired finished records are dropped, in every shard;
/// 2. then expired leases (work whose holder neither finished nor let go,
///    which in one process is rare) are looked for in every shard, at most
///    once a second;
/// 3. then the oldest finished records are evicted, one at a time, only as
///    many as it takes to fit the new one, and counted
///    ([`evicted`](Self::evicted)) and logged (a warning per eviction). A
///    retry of an evicted key runs its work again: size the bounds for a
///    record TTL's worth of keys;
/// 4. only a store full of *live leases* (work in progress) refuses a new
///    key: the layer answers 503.
///
/// A response larger than the byte bound by itself is stored without its
/// body (replays carry `Idempotent-Body-Omitted: true`).
///
/// Clones share the records. Only requests served by this process see them:
/// behind a load balancer with several instances, use a shared store.
///
/// ```
/// use tower_resend_server::{IdempotencyLayer, MemoryStore};
///
/// let store = MemoryStore::new().max_records(10_000).max_bytes(16 << 20);
/// assert!(store.is_empty());
/// assert_eq!(store.bytes(), 0);
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
    max_records: usize,
    max_bytes: usize,
}

struct Shared {
    shards: [Mutex<Shard>; SHARDS],
    hasher: RandomState,
    /// What records' expiries count from: they are kept as nanoseconds
    /// since it, in eight bytes rather than an `Instant`'s sixteen.
    epoch: Instant,
    records: AtomicUsize,
    bytes: AtomicUsize,
    evicted: AtomicU64,
    /// When expired leases were last looked for (step 2 above).
    purged: Mutex<Option<Instant>>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("bytes", &self.bytes())
            .field("max_records", &self.max_records)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `d` in nanoseconds, saturating.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Shared {
    /// The hash of a record's scope and key.
    fn hash(&self, key: &RecordKey<'_>) -> u64 {
        record::hash(&self.hasher, key.scope.as_bytes(), key.key.as_bytes())
    }

    /// The shard of a record whose hash is `hash`: from bits the shard's
    /// table does not use (it indexes by the low ones and tags by the top
    /// seven).
    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        &self.shards[(hash >> 32) as usize % SHARDS]
    }

    /// Now, in nanoseconds since the epoch.
    fn now(&self) -> u64 {
        nanos(Instant::now().saturating_duration_since(self.epoch))
    }

    /// A record is gone: its count and bytes with it.
    fn forget(&self, record: &Record) {
        self.records.fetch_sub(1, Relaxed);
        if record.is_done() {
            self.bytes.fetch_sub(record.cost(), Relaxed);
        }
    }
}

impl MemoryStore {
    /// An empty store with the default bounds ([`DEFAULT_MAX_RECORDS`],
    /// [`DEFAULT_MAX_BYTES`]).
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                shards: std::array::from_fn(|_| Mutex::default()),
                hasher: RandomState::default(),
                epoch: Instant::now(),
                records: AtomicUsize::new(0),
                bytes: AtomicUsize::new(0),
                evicted: AtomicU64::new(0),
                purged: Mutex::new(None),
            }),
            max_records: DEFAULT_MAX_RECORDS,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }

    /// At most `n` records (leases and finished ones). Default
    /// [`DEFAULT_MAX_RECORDS`] (100 000).
    #[must_use]
    pub fn max_records(mut self, n: usize) -> Self {
        self.max_records = n;
        self
    }

    /// At most `n` bytes of finished records, as [`bytes`](Self::bytes)
    /// counts them. Default [`DEFAULT_MAX_BYTES`] (64 MiB).
    #[must_use]
    pub fn max_bytes(mut self, n: usize) -> Self {
        self.max_bytes = n;
        self
    }

    /// How many records the store holds, expired ones not yet dropped
    /// included.
    pub fn len(&self) -> usize {
        self.shared.records.load(Relaxed)
    }

    /// True when the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes its finished records cost, as its byte bound counts them:
    /// each one's key and response, and a fixed overhead for the allocator
    /// and the maps (64 bytes). Within a quarter of the memory they take.
    pub fn bytes(&self) -> usize {
        self.shared.bytes.load(Relaxed)
    }

    /// Finished records evicted to make room since the store was made.
    pub fn evicted(&self) -> u64 {
        self.shared.evicted.load(Relaxed)
    }

    /// Whether `records` more records and `bytes` more bytes fit.
    fn fits(&self, records: usize, bytes: usize) -> bool {
        self.len() + records <= self.max_records && self.bytes() + bytes <= self.max_bytes
    }

    /// Makes room for `records` records and `bytes` bytes (see the type's
    /// docs): expired records dropped, then the oldest finished ones evicted,
    /// only as many as it takes. False when it cannot: the store is full of
    /// live leases. Called with no shard locked: it locks each in turn.
    fn make_room(&self, records: usize, bytes: usize) -> bool {
        if self.fits(records, bytes) {
            return true;
        }
        let instant = Instant::now();
        let now = nanos(instant.saturating_duration_since(self.shared.epoch));
        for shard in &self.shared.shards {
            lock(shard).sweep(now, &self.shared);
        }
        if !self.fits(records, bytes) && self.may_purge(instant) {
            let purged: usize = self
                .shared
                .shards
                .iter()
                .map(|s| lock(s).purge_leases(now, &self.shared))
                .sum();
            if purged > 0 {
                tracing::debug!(purged, "idempotency memory store: expired leases dropped");
            }
        }
        let mut evicted = 0u64;
        while !self.fits(records, bytes) {
            // The shard whose oldest finished record is the oldest.
            let oldest = self
                .shared
                .shards
                .iter()
                .filter_map(|s| lock(s).oldest_done().map(|at| (at, s)))
                .min_by_key(|(at, _)| *at);
            let Some((_, shard)) = oldest else { break };
            if lock(shard).evict_oldest(&self.shared) {
                evicted += 1;
            }
        }
        if evicted > 0 {
            self.shared.evicted.fetch_add(evicted, Relaxed);
            tracing::warn!(
                evicted,
                records = self.len(),
                bytes = self.bytes(),
                "idempotency memory store full: its oldest finished records were evicted, and a retry of their keys runs again"
            );
        }
        self.fits(records, bytes)
    }

    /// True when expired leases were last looked for a second or more ago
    /// (or never); notes that they are looked for now.
    fn may_purge(&self, now: Instant) -> bool {
        let mut last = self
            .shared
            .purged
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if last.is_some_and(|at| now.saturating_duration_since(at) < Duration::from_secs(1)) {
            return false;
        }
        *last = Some(now);
        true
    }

    fn begin_now(&self, claim: &Claim<'_>, ttl: Ttl) -> Result<Begin, StoreError> {
        let key = &claim.key;
        let hash = self.shared.hash(key);
        let now = self.shared.now();
        let shard = self.shared.shard(hash);
        // Room without making any (the usual case): one lock, one look.
        let mut room = self.fits(1, 0);
        loop {
            let mut guard = lock(shard);
            guard.sweep(now, &self.shared);
            // Held, or finished: say what holds it. (Also after making
            // room, when the lock was let go and another request took it.)
            if let Some(found) = guard.live(hash, key, now) {
                let fingerprint = found.fingerprint();
                let Some(bytes) = found.response() else {
                    return Ok(Begin::InProgress { fingerprint });
                };
                return match record::read_response(bytes) {
                    Some(response) => Ok(Begin::Completed {
                        fingerprint,
                        response: Box::new(response),
                    }),
                    // (It wrote it: a bug, failing closed.)
                    None => Err(StoreError::new(
                        "memory store: a finished record that does not decode",
                    )),
                };
            }
            if room {
                let lease = Record::lease(claim, now.saturating_add(nanos(ttl.lease)));
                guard.write(hash, lease, &self.shared);
                return Ok(Begin::Acquired);
            }
            // Making room locks every shard in turn: not with this one held.
            drop(guard);
            if !self.make_room(1, 0) {
                return Err(StoreError::new(
                    "memory store full of live leases: no room for a new key",
                ));
            }
            room = true;
        }
    }

    fn renew_now(&self, claim: &Claim<'_>, ttl: Ttl) -> LeaseState {
        let key = &claim.key;
        let hash = self.shared.hash(key);
        let now = self.shared.now();
        let expires = now.saturating_add(nanos(ttl.lease));
        let mut shard = lock(self.shared.shard(hash));
        shard.sweep(now, &self.shared);
        match shard.live_mut(hash, key, now) {
            Some(r) if r.token() != claim.token => return LeaseState::Lost,
            Some(r) if r.is_done() => return LeaseState::Completed,
            // Its own lease, renewed in place.
            Some(r) => r.set_expires(expires),
            // None at all (expired, or the store lost it): written anew.
            None => shard.write(hash, Record::lease(claim, expires), &self.shared),
        }
        LeaseState::Held
    }

    fn complete_now(&self, claim: &Claim<'_>, response: &StoredResponse, ttl: Ttl) -> LeaseState {
        let key = &claim.key;
        let hash = self.shared.hash(key);
        let now = self.shared.now();
        let expires = now.saturating_add(nanos(ttl.record));
        // Without its body if it is too large for the store by itself.
        let mut record = Record::finished(claim, expires, response, true);
        if record.cost() > self.max_bytes && !response.body.is_empty() {
            record = Record::finished(claim, expires, response, false);
        }
        let cost = record.cost();
        let shard = self.shared.shard(hash);
        // Room without making any (the usual case): one lock, one look.
        let mut room = self.fits(0, cost);
        loop {
            let mut guard = lock(shard);
            guard.sweep(now, &self.shared);
            match guard.live(hash, key, now) {
                Some(r) if r.token() != claim.token => return LeaseState::Lost,
                Some(r) if r.is_done() => return LeaseState::Held,
                _ => {}
            }
            if room {
                // Its own lease (the usual case), or a lost one's leftovers,
                // gives way to the finished record; a lease let go meanwhile
                // is written anew.
                guard.write(hash, record, &self.shared);
                return LeaseState::Held;
            }
            drop(guard);
            // (A lease counts for no bytes: only the response's need room.
            // A store that cannot make it still keeps the response, over
            // its bound for a moment, rather than lose the work's end.)
            self.make_room(0, cost);
            room = true;
        }
    }

    fn release_now(&self, claim: &Claim<'_>) {
        let key = &claim.key;
        let hash = self.shared.hash(key);
        let mine = |r: &Record| r.token() == claim.token && !r.is_done();
        lock(self.shared.shard(hash)).remove_if(hash, key, mine, &self.shared);
    }
}

impl Store for MemoryStore {
    fn begin(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        std::future::ready(self.begin_now(claim, ttl))
    }

    fn renew(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        std::future::ready(Ok(self.renew_now(claim, ttl)))
    }

    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        std::future::ready(Ok(self.complete_now(claim, response, ttl)))
    }

    fn release(&self, claim: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.release_now(claim);
        std::future::ready(Ok(()))
    }
}

#[cfg(test)]
mod tests;
