//! The in-process store.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hashbrown::hash_table::{Entry, HashTable};
use tokio::time::Instant;

use super::{Begin, Fingerprint, LeaseToken, RecordKey, Store, StoreError, StoredResponse, Ttl};

/// The default bound on the records a [`MemoryStore`] holds: 100 000.
pub const DEFAULT_MAX_RECORDS: usize = 100_000;
/// The default bound on the bytes of stored responses a [`MemoryStore`]
/// holds: 64 MiB.
pub const DEFAULT_MAX_BYTES: usize = 64 * 1024 * 1024;

/// The records are split into this many tables, each behind its own lock,
/// by the hash of their key: requests for keys in different shards do not
/// wait for each other, and a table that grows moves only its own records
/// (a sixteenth of them) while it holds its lock.
const SHARDS: usize = 16;

/// Idempotency records in this process's memory: the embedded default.
///
/// Records and leases expire on tokio's clock. Memory is bounded: at most
/// [`max_records`](Self::max_records) records and
/// [`max_bytes`](Self::max_bytes) bytes of stored responses; expired records
/// are swept out when the store fills up. A store that is full of live
/// records refuses new keys (the layer answers 503) rather than forget a
/// finished operation and run it twice.
///
/// The records are split into 16 shards by the hash of their key (randomly
/// seeded), each behind its own lock, so concurrent requests seldom wait for
/// each other and a growing table moves only its shard's records.
///
/// Clones share the records. Only requests served by this process see them:
/// behind a load balancer with several instances, use a shared store.
///
/// ```
/// use resend_server::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new().max_records(10_000).max_bytes(16 << 20));
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
    max_records: usize,
    max_bytes: usize,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.shared.records.load(Relaxed))
            .field("bytes", &self.shared.bytes.load(Relaxed))
            .field("max_records", &self.max_records)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

/// Each field on cache lines of its own (`Padded`): the `Arc`'s counts,
/// which every request changes as it clones the store, the hasher, which
/// every request reads, each shard, and each counter. Packed together, a
/// write to one would take the line from the other core for all of them
/// (false sharing), and every request on a two-core server paid for that.
struct Shared {
    /// Randomly seeded (SipHash), so that keys chosen by callers cannot be
    /// made to collide.
    hasher: Padded<RandomState>,
    shards: [Padded<Mutex<Shard>>; SHARDS],
    /// Records in all shards: changed only under the lock of the shard
    /// whose table gains or loses the record, so it never underflows.
    records: Padded<AtomicUsize>,
    /// Bytes of stored responses in all shards, kept like `records`.
    bytes: Padded<AtomicUsize>,
}

/// `T` aligned to 128 bytes (two cache lines, as x86's adjacent-line
/// prefetcher pairs them), so that nothing else shares its lines. (Three
/// lines of code: crossbeam's `CachePadded` does the same, and would be a
/// new dependency.)
#[derive(Default)]
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

#[derive(Default)]
struct Shard {
    /// Each slot keeps its record's hash: growing the table rehashes
    /// nothing.
    table: HashTable<Slot>,
    /// No record of this shard expires before this (a lower bound on every
    /// record's `until`, lowered whenever one is set), so a sweep before it
    /// would free nothing. `None` when there is no record to expire.
    next_expiry: Option<Instant>,
}

/// A slot of a shard's table: 16 bytes, the record itself out of line.
/// The table of a busy store holds millions of slots, and finding or adding
/// a key touches a slot at random: small slots keep more of the table in
/// the CPU's caches, and growing it moves 16 bytes per record.
struct Slot {
    hash: u64,
    record: Box<Record>,
}

impl Slot {
    fn is(&self, hash: u64, key: &RecordKey<'_>) -> bool {
        self.hash == hash && self.record.is(key)
    }
}

/// A record: 160 bytes, its scope and key inside it when they fit (as a
/// UUID key does, under the default scope or a credentials one), so that a
/// fresh key costs one allocation, not two, and finding it one pointer
/// followed, not two.
struct Record {
    fingerprint: Fingerprint,
    until: Instant,
    state: State,
    /// The scope's bytes, then the key's.
    key: KeyBytes,
    scope_len: usize,
}

enum State {
    /// The lease's token, as bytes (a `u128` would align the record to 16
    /// and make it 16 bytes larger).
    Leased([u8; 16]),
    /// The response as [`StoredResponse::encode`] writes it: one allocation.
    Done(Box<[u8]>),
}

impl State {
    fn leased(token: &LeaseToken) -> Self {
        Self::Leased(token.as_u128().to_le_bytes())
    }

    fn is_leased_by(&self, token: &LeaseToken) -> bool {
        matches!(self, Self::Leased(t) if *t == token.as_u128().to_le_bytes())
    }
}

/// Room for a scope and key held inside the record: `auth:` and 32 hex
/// digits (the default scope of a caller with credentials) and a 36-byte
/// UUID take 73.
const INLINE_KEY: usize = 78;

/// A scope's and a key's bytes, one after the other.
enum KeyBytes {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

impl KeyBytes {
    fn new(key: &RecordKey<'_>) -> Self {
        let (scope, k) = (key.scope.as_bytes(), key.key.as_bytes());
        let len = scope.len() + k.len();
        match u8::try_from(len) {
            Ok(short) if len <= INLINE_KEY => {
                let mut bytes = [0; INLINE_KEY];
                bytes[..scope.len()].copy_from_slice(scope);
                bytes[scope.len()..len].copy_from_slice(k);
                Self::Inline { len: short, bytes }
            }
            _ => Self::Heap([scope, k].concat().into_boxed_slice()),
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => bytes.get(..usize::from(*len)).unwrap_or_default(),
            Self::Heap(bytes) => bytes,
        }
    }
}

impl Record {
    fn is(&self, key: &RecordKey<'_>) -> bool {
        self.key.as_slice().split_at_checked(self.scope_len)
            == Some((key.scope.as_bytes(), key.key.as_bytes()))
    }

    /// What `begin` says about a live record.
    fn answer(&self) -> Result<Begin, StoreError> {
        match &self.state {
            State::Leased(_) => Ok(Begin::InProgress {
                fingerprint: self.fingerprint,
            }),
            State::Done(encoded) => match StoredResponse::decode(encoded) {
                Some(response) => Ok(Begin::Completed {
                    fingerprint: self.fingerprint,
                    response,
                }),
                None => Err(StoreError::new("a stored response could not be decoded")),
            },
        }
    }

    fn size(&self) -> usize {
        match &self.state {
            State::Leased(_) => 0,
            State::Done(encoded) => encoded.len(),
        }
    }
}

impl Shard {
    fn expires_at(&mut self, until: Instant) {
        self.next_expiry = Some(self.next_expiry.map_or(until, |t| t.min(until)));
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

impl MemoryStore {
    /// An empty store with the default bounds ([`DEFAULT_MAX_RECORDS`],
    /// [`DEFAULT_MAX_BYTES`]).
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                hasher: Padded(RandomState::new()),
                shards: std::array::from_fn(|_| Padded::default()),
                records: Padded(AtomicUsize::new(0)),
                bytes: Padded(AtomicUsize::new(0)),
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

    /// At most `n` bytes of stored responses. Default [`DEFAULT_MAX_BYTES`]
    /// (64 MiB).
    #[must_use]
    pub fn max_bytes(mut self, n: usize) -> Self {
        self.max_bytes = n;
        self
    }

    /// How many records the store holds, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        self.shared.records.load(Relaxed)
    }

    /// True when the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn hash(&self, key: &RecordKey<'_>) -> u64 {
        let mut h = self.shared.hasher.build_hasher();
        h.write(key.scope.as_bytes());
        // Neither a scope (UTF-8) nor a key (ASCII) holds 0xff.
        h.write_u8(0xff);
        h.write(key.key.as_bytes());
        h.finish()
    }

    /// The shard of a key: bits of its hash that the table itself uses
    /// neither for the bucket (low bits) nor for the tag (top 7 bits).
    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
        let i = (hash >> 32) as usize % SHARDS;
        lock(&self.shared.shards[i])
    }

    /// Counts one more record, unless that would pass the bound.
    fn reserve_record(&self) -> bool {
        self.shared
            .records
            .fetch_update(Relaxed, Relaxed, |n| {
                (n < self.max_records).then_some(n + 1)
            })
            .is_ok()
    }

    fn begin_now(
        &self,
        key: &RecordKey<'_>,
        fingerprint: Fingerprint,
        token: &LeaseToken,
        ttl: Ttl,
    ) -> Result<Begin, StoreError> {
        let now = Instant::now();
        let until = now + ttl.lease;
        let hash = self.hash(key);
        let mut swept = false;
        loop {
            let mut guard = self.shard(hash);
            let shard = &mut *guard;
            let full = match shard.table.entry(hash, |s| s.is(hash, key), |s| s.hash) {
                Entry::Occupied(mut e) => {
                    let r = &mut *e.get_mut().record;
                    if r.until > now {
                        return r.answer();
                    }
                    // Expired: a dead holder's lease, or an old record. Take it over.
                    self.shared.bytes.fetch_sub(r.size(), Relaxed);
                    r.fingerprint = fingerprint;
                    r.until = until;
                    r.state = State::leased(token);
                    false
                }
                Entry::Vacant(e) => {
                    // Full: expired records are swept to make room, once.
                    if self.shared.bytes.load(Relaxed) > self.max_bytes || !self.reserve_record() {
                        true
                    } else {
                        e.insert(Slot {
                            hash,
                            record: Box::new(Record {
                                fingerprint,
                                until,
                                state: State::leased(token),
                                key: KeyBytes::new(key),
                                scope_len: key.scope.len(),
                            }),
                        });
                        false
                    }
                }
            };
            if !full {
                shard.expires_at(until);
                return Ok(Begin::Acquired);
            }
            drop(guard);
            if swept {
                return Err(StoreError::new("memory store is full of live records"));
            }
            self.sweep(now);
            swept = true;
        }
    }

    fn complete_now(
        &self,
        key: &RecordKey<'_>,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let hash = self.hash(key);
        // Encoded before the lock is taken.
        let full = response.encode().into_boxed_slice();
        let mut guard = self.shard(hash);
        let shard = &mut *guard;
        let Some(Slot { record: r, .. }) = shard.table.find_mut(hash, |s| s.is(hash, key)) else {
            return Ok(());
        };
        if !r.state.is_leased_by(token) {
            return Ok(());
        }
        let fits = self
            .shared
            .bytes
            .fetch_update(Relaxed, Relaxed, |b| {
                b.checked_add(full.len())
                    .filter(|&total| total <= self.max_bytes)
            })
            .is_ok();
        r.state = State::Done(if fits {
            full
        } else {
            // Keep the operation's outcome, without its body, rather than
            // forget that it ran.
            let slim = super::encode(response.status, &response.headers, true, &[]);
            self.shared.bytes.fetch_add(slim.len(), Relaxed);
            slim.into_boxed_slice()
        });
        r.until = now + ttl.record;
        let until = r.until;
        shard.expires_at(until);
        Ok(())
    }

    fn release_now(&self, key: &RecordKey<'_>, token: &LeaseToken) {
        let hash = self.hash(key);
        let mut shard = self.shard(hash);
        if let Ok(e) = shard.table.find_entry(hash, |s| s.is(hash, key)) {
            if e.get().record.state.is_leased_by(token) {
                // A lease holds no bytes.
                e.remove();
                self.shared.records.fetch_sub(1, Relaxed);
            }
        }
    }

    /// Drops the expired records of every shard, one shard at a time.
    fn sweep(&self, now: Instant) {
        for shard in &self.shared.shards {
            let mut shard = lock(shard);
            if shard.next_expiry.is_none_or(|t| t > now) {
                // Nothing has expired yet: spare the full scan.
                continue;
            }
            let (mut freed, mut removed) = (0, 0);
            let mut next: Option<Instant> = None;
            shard.table.retain(|Slot { record: r, .. }| {
                let keep = r.until > now;
                if keep {
                    next = Some(next.map_or(r.until, |t| t.min(r.until)));
                } else {
                    freed += r.size();
                    removed += 1;
                }
                keep
            });
            shard.next_expiry = next;
            self.shared.bytes.fetch_sub(freed, Relaxed);
            self.shared.records.fetch_sub(removed, Relaxed);
        }
    }
}

impl Store for MemoryStore {
    fn begin(
        &self,
        key: &RecordKey<'_>,
        fingerprint: Fingerprint,
        token: &LeaseToken,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        std::future::ready(self.begin_now(key, fingerprint, token, ttl))
    }

    fn complete(
        &self,
        key: &RecordKey<'_>,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.complete_now(key, token, response, ttl))
    }

    fn release(
        &self,
        key: &RecordKey<'_>,
        token: &LeaseToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.release_now(key, token);
        std::future::ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::*;

    fn key(k: &str) -> RecordKey<'_> {
        RecordKey { scope: "s", key: k }
    }

    const TTL: Ttl = Ttl {
        lease: Duration::from_secs(10),
        record: Duration::from_secs(100),
    };

    fn resp(body: &'static str) -> StoredResponse {
        StoredResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from_static(body.as_bytes()),
            body_omitted: false,
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn leases_and_records_expire_on_tokio_time() {
        let s = MemoryStore::new();
        let fp = Fingerprint([1; 32]);
        let (a, b) = (LeaseToken::random(), LeaseToken::random());
        assert_eq!(
            s.begin(&key("k"), fp, &a, TTL).await.unwrap(),
            Begin::Acquired
        );
        assert!(matches!(
            s.begin(&key("k"), fp, &b, TTL).await.unwrap(),
            Begin::InProgress { .. }
        ));
        tokio::time::advance(Duration::from_secs(10)).await;
        // a's lease expired: b takes over, and a can no longer complete.
        assert_eq!(
            s.begin(&key("k"), fp, &b, TTL).await.unwrap(),
            Begin::Acquired
        );
        s.complete(&key("k"), &a, &resp("a"), TTL).await.unwrap();
        s.release(&key("k"), &a).await.unwrap();
        assert!(matches!(
            s.begin(&key("k"), fp, &a, TTL).await.unwrap(),
            Begin::InProgress { .. }
        ));
        s.complete(&key("k"), &b, &resp("b"), TTL).await.unwrap();
        match s.begin(&key("k"), fp, &a, TTL).await.unwrap() {
            Begin::Completed { response, .. } => assert_eq!(response.body, "b"),
            other => panic!("{other:?}"),
        }
        tokio::time::advance(Duration::from_secs(100)).await;
        assert_eq!(
            s.begin(&key("k"), fp, &a, TTL).await.unwrap(),
            Begin::Acquired
        );
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn records_stay_small() {
        assert_eq!(std::mem::size_of::<Slot>(), 16);
        assert_eq!(std::mem::size_of::<Record>(), 160);
    }

    /// Scopes and keys held inside the record and out of it, either side of
    /// the line, are told apart by every byte and found again.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn keys_inside_the_record_and_out_of_it_work_alike() {
        let s = MemoryStore::new();
        let fp = Fingerprint([2; 32]);
        let t = LeaseToken::random();
        // "s" and 77, 78 and 254 bytes of key: 78, 79 and 255 in all.
        let keys: Vec<String> = [77, 78, 254].iter().map(|&n| "k".repeat(n)).collect();
        for k in &keys {
            assert!(matches!(KeyBytes::new(&key(k)), KeyBytes::Inline { .. }) == (k.len() < 78));
            assert_eq!(
                s.begin(&key(k), fp, &t, TTL).await.unwrap(),
                Begin::Acquired
            );
            // The same bytes split another way are another operation.
            let moved = RecordKey {
                scope: "sk",
                key: &k[1..],
            };
            assert_eq!(s.begin(&moved, fp, &t, TTL).await.unwrap(), Begin::Acquired);
        }
        for (i, k) in keys.iter().enumerate() {
            s.complete(&key(k), &t, &resp(["a", "b", "c"][i]), TTL)
                .await
                .unwrap();
        }
        for (i, k) in keys.iter().enumerate() {
            match s.begin(&key(k), fp, &t, TTL).await.unwrap() {
                Begin::Completed { response, .. } => assert_eq!(response.body, ["a", "b", "c"][i]),
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn bounded_by_records_and_bytes() {
        let s = MemoryStore::new().max_records(2).max_bytes(100);
        let fp = Fingerprint([0; 32]);
        let t = LeaseToken::random();
        for k in ["a", "b"] {
            assert_eq!(
                s.begin(&key(k), fp, &t, TTL).await.unwrap(),
                Begin::Acquired
            );
        }
        assert!(s.begin(&key("c"), fp, &t, TTL).await.is_err());
        tokio::time::advance(TTL.lease).await;
        // Expired leases are swept to make room.
        assert_eq!(
            s.begin(&key("c"), fp, &t, TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.len(), 1);
        let big = StoredResponse {
            body: Bytes::from(vec![b'x'; 1000]),
            ..resp("")
        };
        s.complete(&key("c"), &t, &big, TTL).await.unwrap();
        match s.begin(&key("c"), fp, &t, TTL).await.unwrap() {
            Begin::Completed { response, .. } => {
                assert!(response.body_omitted);
                assert!(response.body.is_empty());
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_full_store_sweeps_records_kept_shorter_than_the_lease() {
        let s = MemoryStore::new().max_records(1);
        let ttl = Ttl {
            lease: Duration::from_secs(100),
            record: Duration::from_secs(1),
        };
        let (fp, t) = (Fingerprint([0; 32]), LeaseToken::random());
        assert_eq!(
            s.begin(&key("a"), fp, &t, ttl).await.unwrap(),
            Begin::Acquired
        );
        s.complete(&key("a"), &t, &resp("a"), ttl).await.unwrap();
        assert!(s.begin(&key("b"), fp, &t, ttl).await.is_err());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            s.begin(&key("b"), fp, &t, ttl).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.len(), 1);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_bounds_hold_for_the_whole_store_across_its_shards() {
        let s = MemoryStore::new().max_records(40).max_bytes(1 << 20);
        let (fp, t) = (Fingerprint([0; 32]), LeaseToken::random());
        let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
        for k in &keys {
            assert_eq!(
                s.begin(&key(k), fp, &t, TTL).await.unwrap(),
                Begin::Acquired
            );
        }
        assert_eq!(s.len(), 40);
        for k in ["x", "y", "z"] {
            assert!(s.begin(&key(k), fp, &t, TTL).await.is_err());
        }
        // A released lease frees its slot.
        s.release(&key("k0"), &t).await.unwrap();
        assert_eq!(s.len(), 39);
        assert_eq!(
            s.begin(&key("x"), fp, &t, TTL).await.unwrap(),
            Begin::Acquired
        );
        // Completed records keep theirs; an expired lease taken over by the
        // same key does not take a second one.
        for k in &keys[1..20] {
            s.complete(&key(k), &t, &resp("done"), TTL).await.unwrap();
        }
        tokio::time::advance(TTL.lease).await;
        assert_eq!(
            s.begin(&key("k30"), fp, &t, TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.len(), 40);
        // Full: the sweep visits every shard and drops the 20 expired leases
        // (k20..k39 but k30, and x), keeping the 19 live records.
        assert_eq!(
            s.begin(&key("y"), fp, &t, TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.len(), 21);
        for k in &keys[1..20] {
            assert!(matches!(
                s.begin(&key(k), fp, &t, TTL).await.unwrap(),
                Begin::Completed { .. }
            ));
        }
    }

    #[test]
    fn lease_tokens_are_32_hex_digits() {
        let t = LeaseToken::random();
        let hex = t.to_string();
        assert_eq!(hex.len(), 32);
        assert!(hex
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(hex.as_bytes(), t.to_hex());
        assert_eq!(u128::from_str_radix(&hex, 16).ok(), Some(t.as_u128()));
        assert_ne!(t, LeaseToken::random());
    }
}
