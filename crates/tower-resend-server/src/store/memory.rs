//! The in-process store.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hashbrown::hash_table::{Entry, HashTable};
use tokio::time::Instant;

use super::{
    Begin, Claim, Fingerprint, LeaseState, LeaseToken, RecordKey, Store, StoreError,
    StoredResponse, Ttl,
};

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
/// [`max_bytes`](Self::max_bytes) bytes of stored responses. When the store
/// fills up, expired records are swept out first; if that frees nothing, the
/// finished records nearest their expiry (the oldest, as every record is
/// kept as long) are evicted, an eighth of the bound at a time, with a
/// warning, and counted ([`evicted`](Self::evicted)). A retry of an evicted
/// key runs its work again, so size the bound for a record TTL's worth of
/// keys. Only a store full of *live leases* (work in progress) refuses new
/// keys (the layer answers 503).
///
/// A record is 65 bytes, its scope and key, and its stored response; with
/// its slot in the table, a UUID key with a small JSON answer takes about
/// 200 bytes. Finished records of up to 4 KiB are kept in blocks of 16 KiB
/// per shard, in the order they come, and a block is freed once its last
/// record has gone (a shard keeps up to 32 emptied blocks, 512 KiB, for the
/// records that follow): records kept as long as each other (one layer's
/// record TTL) free their blocks in turn. A record kept much longer than those
/// around it (two layers with different TTLs on one store) keeps its block,
/// whose unused room `max_bytes` does not count.
///
/// The records are split into 16 shards by the hash of their key (randomly
/// seeded), each behind its own lock, so concurrent requests seldom wait for
/// each other and a growing table moves only its shard's records.
///
/// Clones share the records. Only requests served by this process see them:
/// behind a load balancer with several instances, use a shared store.
///
/// ```
/// use tower_resend_server::{IdempotencyLayer, MemoryStore};
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
/// which every request changes as it clones the store, the hasher and the
/// epoch, which every request reads, each shard, and each counter. Packed
/// together, a write to one would take the line from the other core for all
/// of them (false sharing), and every request on a two-core server paid for
/// that.
struct Shared {
    fixed: Padded<Fixed>,
    shards: [Padded<Mutex<Shard>>; SHARDS],
    /// Records in all shards: changed only under the lock of the shard
    /// whose table gains or loses the record, so it never underflows.
    records: Padded<AtomicUsize>,
    /// Bytes of stored responses in all shards, kept like `records`.
    bytes: Padded<AtomicUsize>,
    /// Finished records evicted to make room, in all.
    evicted: Padded<std::sync::atomic::AtomicU64>,
}

/// What never changes after the store is made.
struct Fixed {
    /// Randomly seeded (SipHash), so that keys chosen by callers cannot be
    /// made to collide.
    hasher: RandomState,
    /// Records keep their expiry as nanoseconds after this instant: 8 bytes
    /// rather than a 16-byte `Instant`.
    epoch: Instant,
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
    /// record's expiry, lowered whenever one is set), so a sweep before it
    /// would free nothing. `None` when there is no record to expire.
    next_expiry: Option<u64>,
    /// Where its records' bytes are.
    blocks: Blocks,
}

/// A slot of a shard's table: 24 bytes, the record itself out of line.
/// The table of a busy store holds millions of slots, and finding or adding
/// a key touches a slot at random: small slots keep more of the table in
/// the CPU's caches, and growing it moves 24 bytes per record. A sweep or
/// an eviction reads the slots alone, in order, and never the records.
struct Slot {
    /// The low 32 bits of its key's hash, from which the table's hash is
    /// made ([`table_hash`]): growing the table rehashes nothing.
    hash: u32,
    /// When the record expires, in ticks of 1/64 s after the store's
    /// epoch, rounded up ([`coarse`]): fine enough that a sweep reads the
    /// exact expiry of the records of one tick only, not of a second's.
    until_t: u32,
    /// The bytes of its stored response; 0 for a lease (a finished record's
    /// response holds at least its 8-byte head).
    size: u32,
    place: Place,
}

/// The hash a shard's table files a slot under, from the 32 bits the slot
/// keeps: the low bits pick the bucket, the top ones the tag.
fn table_hash(hash: u32) -> u64 {
    let h = u64::from(hash);
    h | (h << 32)
}

/// A tick of a slot's expiry: 1/64 s, in nanoseconds. A `u32` of them
/// spans two years; a later expiry is kept as `u32::MAX`, whose record is
/// read for its exact one.
const TICK: u64 = 1_000_000_000 / 64;

/// An expiry in ticks after the epoch, rounded up (so a record is swept
/// only once it has expired); `u32::MAX` for one past the span.
fn coarse(until: u64) -> u32 {
    u32::try_from(until.div_ceil(TICK)).unwrap_or(u32::MAX)
}

/// The start of the tick of a coarse expiry, in nanoseconds.
fn from_coarse(until_t: u32) -> u64 {
    u64::from(until_t) * TICK
}

// A record's bytes: its header, then its scope's and its key's bytes, then,
// once it is done, its response as `StoredResponse::encode` writes it.
/// Expiry: nanoseconds after the store's epoch (`u64`, little-endian).
const UNTIL: std::ops::Range<usize> = 0..8;
/// `LEASED` or `DONE`.
const STATE: usize = 8;
/// The lease's token (`u128`, little-endian), kept once done: a holder
/// whose `complete` is repeated (its first answer was lost) finds its own.
const TOKEN: std::ops::Range<usize> = 9..25;
const FINGERPRINT: std::ops::Range<usize> = 25..57;
/// The scope's length and the key's (`u32`, little-endian).
const SCOPE_LEN: std::ops::Range<usize> = 57..61;
const KEY_LEN: std::ops::Range<usize> = 61..65;
const HEADER: usize = 65;
const LEASED: u8 = 0;
const DONE: u8 = 1;

/// The bytes of a shard's blocks of finished records.
const BLOCK: usize = 16 * 1024;
/// Finished records up to this size go in a shared block; larger ones in a
/// block of their own.
const SHARED_MAX: usize = BLOCK / 4;

/// Where a record's bytes are: a block of its shard, and where in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Place {
    block: u32,
    at: u32,
    len: u32,
}

/// A block of records: a shared one, which finished records are appended
/// to, or one record's own (a lease, or a large finished record).
struct Block {
    /// Its records, one after the other (a shared block's capacity is
    /// [`BLOCK`]: records are written into it, never past it).
    bytes: Vec<u8>,
    /// Records in it that are still in the table.
    live: u32,
}

/// The records of a shard.
///
/// A finished record lives as long as its TTL, while everything else a
/// request allocates goes within the request: a finished record of its own
/// allocation is carved out of the heap among short-lived blocks (a
/// server's buffers), which, with glibc's allocator, sends allocations of
/// every size down its slow paths and over cold memory (measured: about a
/// microsecond per request, against a third of one with jemalloc). So
/// finished records are appended to shared blocks of 16 KiB, one allocation
/// per ~80 records, written in order; a block is freed (or kept for the
/// next ones, up to 32 a shard) when its last record goes. Records of one
/// store share its record TTL and so leave a block in the order they came;
/// a record kept much longer than its neighbours (a layer with another
/// TTL on the same store) keeps its block, whose unused room is not counted
/// in [`max_bytes`](MemoryStore::max_bytes).
///
/// Leases, which live as long as a handler, are blocks of their own, whose
/// room is kept for the next leases when they go.
#[derive(Default)]
struct Blocks {
    blocks: Vec<Option<Block>>,
    /// Indices of `blocks` that hold none.
    free: Vec<u32>,
    /// The shared block finished records are appended to.
    current: Option<u32>,
    /// Shared blocks emptied, kept to be the next ones (at most
    /// [`SPARE_BLOCKS`]): a sweep empties many at once, which the records
    /// that follow fill again, so that a busy store's blocks are not handed
    /// back and forth with the allocator (whose large blocks take its slow
    /// paths).
    spares: Vec<Vec<u8>>,
    /// Leases' records given back, kept for the next leases (at most
    /// [`SPARE_LEASES`], of [`LEASE_KEPT`] bytes at most): a lease is taken
    /// and given back by every keyed request.
    lease_spares: Vec<Vec<u8>>,
}

/// Emptied shared blocks a shard keeps: 512 KiB, never more than the shard
/// held at once.
const SPARE_BLOCKS: usize = 32;
/// Leases' records a shard keeps for the next leases.
const SPARE_LEASES: usize = 64;
/// The largest lease record kept for another (a UUID key's takes ~110).
const LEASE_KEPT: usize = 512;

impl Blocks {
    fn get(&self, place: Place) -> Rec<'_> {
        let bytes = match self.blocks.get(place.block as usize) {
            Some(Some(block)) => {
                let at = place.at as usize;
                block.bytes.get(at..at + place.len as usize)
            }
            _ => None,
        };
        // (Every place in the table is one `put` made and `remove` not yet
        // unmade; an empty record reads as an expired lease.)
        Rec(bytes.unwrap_or_default())
    }

    fn get_mut(&mut self, place: Place) -> &mut [u8] {
        let bytes = match self.blocks.get_mut(place.block as usize) {
            Some(Some(block)) => {
                let at = place.at as usize;
                block.bytes.get_mut(at..at + place.len as usize)
            }
            _ => None,
        };
        bytes.unwrap_or_default()
    }

    /// An index for a new block.
    fn add(&mut self, block: Block) -> Result<u32, StoreError> {
        if let Some(i) = self.free.pop() {
            self.blocks[i as usize] = Some(block);
            return Ok(i);
        }
        let i = u32::try_from(self.blocks.len())
            .map_err(|_| StoreError::new("memory store shard holds 2^32 blocks"))?;
        self.blocks.push(Some(block));
        Ok(i)
    }

    /// Puts a record: a finished one of up to [`SHARED_MAX`] bytes at the
    /// end of the shared block, any other in a block of its own.
    #[cfg(test)]
    fn put(&mut self, record: Vec<u8>) -> Result<Place, StoreError> {
        if record.len() <= SHARED_MAX && Rec(&record).is_done() {
            return self.put_shared(record.len(), |out| {
                out.extend_from_slice(&record);
                Ok(())
            });
        }
        self.put_own(record)
    }

    /// Puts a finished record, written where it is kept.
    fn put_done(&mut self, done: &Done<'_>) -> Result<Place, StoreError> {
        let len = done.len();
        if len <= SHARED_MAX {
            return self.put_shared(len, |out| done.write(out));
        }
        let mut record = Vec::with_capacity(len);
        done.write(&mut record)?;
        self.put_own(record)
    }

    /// Puts a lease's record (its header, scope and key), written into
    /// the room of one given back if there is one.
    fn put_lease(
        &mut self,
        key: &RecordKey<'_>,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        until: u64,
    ) -> Result<Place, StoreError> {
        let mut record = self.lease_spares.pop().unwrap_or_default();
        record.clear();
        record.reserve_exact(HEADER + key.scope.len() + key.key.len());
        start_into(
            &mut record,
            key,
            LEASED,
            token.as_u128(),
            fingerprint,
            until,
        )?;
        self.put_own(record)
    }

    fn put_own(&mut self, record: Vec<u8>) -> Result<Place, StoreError> {
        let len = u32::try_from(record.len())
            .map_err(|_| StoreError::new("an idempotency record of 4 GiB or more"))?;
        let block = self.add(Block {
            bytes: record,
            live: 1,
        })?;
        Ok(Place { block, at: 0, len })
    }

    /// Writes a record of `len` bytes at the end of the shared block (a new
    /// one if it has no room).
    fn put_shared(
        &mut self,
        len: usize,
        write: impl FnOnce(&mut Vec<u8>) -> Result<(), StoreError>,
    ) -> Result<Place, StoreError> {
        let room = self
            .current
            .and_then(|i| self.blocks.get(i as usize)?.as_ref())
            .is_some_and(|b| b.bytes.len() + len <= BLOCK);
        if !room {
            let bytes = self
                .spares
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(BLOCK));
            let old = self.current.take();
            self.current = Some(self.add(Block { bytes, live: 0 })?);
            // The old block goes once its records have.
            if let Some(old) = old {
                self.release_if_empty(old);
            }
        }
        let i = self.current.unwrap_or_default();
        let Some(Some(block)) = self.blocks.get_mut(i as usize) else {
            return Err(StoreError::new("memory store block missing"));
        };
        let at = block.bytes.len();
        if let Err(e) = write(&mut block.bytes) {
            block.bytes.truncate(at);
            return Err(e);
        }
        // (What was written: `len` unless a record's size was misjudged,
        // which grows the block rather than lose it.)
        let len = block.bytes.len() - at;
        block.live += 1;
        Ok(Place {
            block: i,
            at: u32::try_from(at).unwrap_or_default(),
            len: u32::try_from(len).unwrap_or_default(),
        })
    }

    /// Takes a record out: its block goes with its last record (the shared
    /// block being filled starts again from the start).
    fn remove(&mut self, place: Place) {
        if let Some(Some(block)) = self.blocks.get_mut(place.block as usize) {
            block.live = block.live.saturating_sub(1);
        }
        self.release_if_empty(place.block);
    }

    fn release_if_empty(&mut self, i: u32) {
        let Some(slot) = self.blocks.get_mut(i as usize) else {
            return;
        };
        if slot.as_ref().is_none_or(|b| b.live > 0) {
            return;
        }
        if self.current == Some(i) {
            if let Some(block) = slot {
                block.bytes.clear();
            }
            return;
        }
        if let Some(mut block) = slot.take() {
            // A shared block (its capacity is the block's), or a record of
            // its own: a lease, or a large finished record.
            let capacity = block.bytes.capacity();
            if capacity == BLOCK && self.spares.len() < SPARE_BLOCKS {
                block.bytes.clear();
                self.spares.push(block.bytes);
            } else if capacity <= LEASE_KEPT && self.lease_spares.len() < SPARE_LEASES {
                self.lease_spares.push(block.bytes);
            }
            self.free.push(i);
        }
    }
}

/// The length of a scope or key as the header keeps it.
fn len32(bytes: &[u8]) -> Result<[u8; 4], StoreError> {
    u32::try_from(bytes.len())
        .map(u32::to_le_bytes)
        .map_err(|_| StoreError::new("an idempotency scope of 4 GiB or more"))
}

/// A record's header and key, with room for `extra` bytes more.
#[cfg(test)]
fn start(
    key: &RecordKey<'_>,
    state: u8,
    token: u128,
    fingerprint: &Fingerprint,
    until: u64,
    extra: usize,
) -> Result<Vec<u8>, StoreError> {
    let (scope, k) = (key.scope.len(), key.key.len());
    let mut out = Vec::with_capacity(HEADER + scope + k + extra);
    start_into(&mut out, key, state, token, fingerprint, until)?;
    Ok(out)
}

/// A record's header and key, written at the end of `out`.
fn start_into(
    out: &mut Vec<u8>,
    key: &RecordKey<'_>,
    state: u8,
    token: u128,
    fingerprint: &Fingerprint,
    until: u64,
) -> Result<(), StoreError> {
    let (scope, k) = (key.scope.as_bytes(), key.key.as_bytes());
    let (scope_len, key_len) = (len32(scope)?, len32(k)?);
    let mut header = [0; HEADER];
    header[UNTIL].copy_from_slice(&until.to_le_bytes());
    header[STATE] = state;
    header[TOKEN].copy_from_slice(&token.to_le_bytes());
    header[FINGERPRINT].copy_from_slice(&fingerprint.0);
    header[SCOPE_LEN].copy_from_slice(&scope_len);
    header[KEY_LEN].copy_from_slice(&key_len);
    out.extend_from_slice(&header);
    out.extend_from_slice(scope);
    out.extend_from_slice(k);
    Ok(())
}

/// A lease's record: its header, and its scope and key (~110 bytes for a
/// UUID key).
#[cfg(test)]
fn lease(
    key: &RecordKey<'_>,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
    until: u64,
) -> Result<Vec<u8>, StoreError> {
    start(key, LEASED, token.as_u128(), fingerprint, until, 0)
}

/// A finished record for the claim (its key, fingerprint and token),
/// holding `response` (or, with `slim`, its status and headers only).
struct Done<'a> {
    claim: &'a Claim<'a>,
    response: &'a StoredResponse,
    slim: bool,
    until: u64,
}

impl Done<'_> {
    #[allow(dead_code)]
    fn body(&self) -> &[u8] {
        if self.slim {
            &[]
        } else {
            &self.response.body
        }
    }

    /// Its stored response, encoded.
    fn encoded(&self) -> Vec<u8> {
        let mut r = self.response.clone();
        if self.slim {
            r.body = bytes::Bytes::new();
            r.body_omitted = true;
        }
        r.encode()
    }

    /// The bytes of its stored response.
    fn size(&self) -> usize {
        self.encoded().len()
    }

    /// The bytes of the record.
    fn len(&self) -> usize {
        let key = &self.claim.key;
        HEADER + key.scope.len() + key.key.len() + self.size()
    }

    /// Writes the record at the end of `out`.
    fn write(&self, out: &mut Vec<u8>) -> Result<(), StoreError> {
        let (claim, response) = (self.claim, self.response);
        let token = claim.token.as_u128();
        start_into(out, &claim.key, DONE, token, &claim.fingerprint, self.until)?;
        let _ = response;
        out.extend_from_slice(&self.encoded());
        Ok(())
    }
}

/// A finished record's bytes (for tests).
#[cfg(test)]
fn done(
    claim: &Claim<'_>,
    response: &StoredResponse,
    slim: bool,
    until: u64,
) -> Result<Vec<u8>, StoreError> {
    let done = Done {
        claim,
        response,
        slim,
        until,
    };
    let mut out = Vec::with_capacity(done.len());
    done.write(&mut out)?;
    Ok(out)
}

/// A lease's record taken over by `token`, in place (a lease and a new one
/// for the same key have the same size).
fn lease_again(bytes: &mut [u8], fingerprint: &Fingerprint, token: &LeaseToken, until: u64) {
    set_until(bytes, until);
    if let Some(t) = bytes.get_mut(TOKEN) {
        t.copy_from_slice(&token.as_u128().to_le_bytes());
    }
    if let Some(f) = bytes.get_mut(FINGERPRINT) {
        f.copy_from_slice(&fingerprint.0);
    }
}

fn set_until(bytes: &mut [u8], until: u64) {
    if let Some(u) = bytes.get_mut(UNTIL) {
        u.copy_from_slice(&until.to_le_bytes());
    }
}

/// A record's bytes, read (see the layout above). The store made them,
/// with their header: a short one reads as an expired lease.
#[derive(Clone, Copy)]
struct Rec<'a>(&'a [u8]);

impl Rec<'_> {
    fn array<const N: usize>(&self, at: std::ops::Range<usize>) -> [u8; N] {
        let mut b = [0; N];
        if let Some(s) = self.0.get(at) {
            if s.len() == N {
                b.copy_from_slice(s);
            }
        }
        b
    }

    fn u32_at(&self, at: std::ops::Range<usize>) -> usize {
        u32::from_le_bytes(self.array(at)) as usize
    }

    /// Where the scope and key end and the response begins.
    fn key_end(&self) -> usize {
        HEADER + self.u32_at(SCOPE_LEN) + self.u32_at(KEY_LEN)
    }

    fn is(&self, key: &RecordKey<'_>) -> bool {
        let scope_end = HEADER + self.u32_at(SCOPE_LEN);
        self.0.get(HEADER..scope_end) == Some(key.scope.as_bytes())
            && self.0.get(scope_end..self.key_end()) == Some(key.key.as_bytes())
    }

    fn until(&self) -> u64 {
        u64::from_le_bytes(self.array(UNTIL))
    }

    fn fingerprint(&self) -> Fingerprint {
        Fingerprint(self.array(FINGERPRINT))
    }

    fn is_lease(&self) -> bool {
        self.0.get(STATE) != Some(&DONE)
    }

    #[cfg(test)]
    fn is_done(&self) -> bool {
        !self.is_lease()
    }

    fn is_leased_by(&self, token: &LeaseToken) -> bool {
        self.is_lease() && self.is_by(token)
    }

    fn is_by(&self, token: &LeaseToken) -> bool {
        self.array::<16>(TOKEN) == token.as_u128().to_le_bytes()
    }

    /// The bytes of its stored response: 0 for a lease (its slot keeps
    /// them too).
    #[cfg(test)]
    fn size(&self) -> usize {
        if self.is_lease() {
            0
        } else {
            self.0.len().saturating_sub(self.key_end())
        }
    }

    /// What `begin` says about a live record.
    fn answer(&self) -> Result<Begin, StoreError> {
        let fingerprint = self.fingerprint();
        if self.is_lease() {
            return Ok(Begin::InProgress { fingerprint });
        }
        match self
            .0
            .get(self.key_end()..)
            .and_then(StoredResponse::decode)
        {
            Some(response) => Ok(Begin::Completed {
                fingerprint,
                response,
            }),
            None => Err(StoreError::new("a stored response could not be decoded")),
        }
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
                fixed: Padded(Fixed {
                    hasher: RandomState::new(),
                    epoch: Instant::now(),
                }),
                shards: std::array::from_fn(|_| Padded::default()),
                records: Padded(AtomicUsize::new(0)),
                bytes: Padded(AtomicUsize::new(0)),
                evicted: Padded(std::sync::atomic::AtomicU64::new(0)),
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
        let mut h = self.shared.fixed.hasher.build_hasher();
        let (scope, k) = (key.scope.as_bytes(), key.key.as_bytes());
        // Neither a scope (UTF-8) nor a key (ASCII) holds 0xff. The hasher
        // reads its input as one stream, so one write of the three (copied
        // together, as a usual scope and key fit) hashes as three would,
        // with less work at their seams.
        let mut joined = [0; 128];
        let n = scope.len() + 1 + k.len();
        if let Some(out) = joined.get_mut(..n) {
            let (s, rest) = out.split_at_mut(scope.len());
            s.copy_from_slice(scope);
            if let Some((sep, tail)) = rest.split_first_mut() {
                *sep = 0xff;
                tail.copy_from_slice(k);
            }
            h.write(out);
        } else {
            h.write(scope);
            h.write_u8(0xff);
            h.write(k);
        }
        h.finish()
    }

    /// Now, as nanoseconds after the store's epoch.
    fn now(&self) -> u64 {
        let since = Instant::now().saturating_duration_since(self.shared.fixed.epoch);
        u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
    }

    /// The shard of a key: bits of its hash that its table does not keep
    /// (the slots keep the low 32).
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

    fn begin_now(&self, claim: &Claim<'_>, ttl: Ttl) -> Result<Begin, StoreError> {
        let (key, fingerprint, token) = (&claim.key, claim.fingerprint, &claim.token);
        let now = self.now();
        let until = after(now, ttl.lease);
        let hash = self.hash(key);
        let mut tries = 0;
        loop {
            let mut guard = self.shard(hash);
            let (found, blocks, next_expiry) = entry(&mut guard, hash, key);
            let full = match found {
                Entry::Occupied(mut e) => {
                    let slot = e.get_mut();
                    let r = blocks.get(slot.place);
                    if r.until() > now {
                        return r.answer();
                    }
                    // Expired: a dead holder's lease, or an old record. Take it over.
                    if r.is_lease() {
                        lease_again(blocks.get_mut(slot.place), &fingerprint, token, until);
                    } else {
                        let old = slot.place;
                        slot.place = blocks.put_lease(key, &fingerprint, token, until)?;
                        blocks.remove(old);
                        self.shared.bytes.fetch_sub(slot.size as usize, Relaxed);
                        slot.size = 0;
                    }
                    slot.until_t = coarse(until);
                    false
                }
                Entry::Vacant(e) => {
                    if self.shared.bytes.load(Relaxed) > self.max_bytes || !self.reserve_record() {
                        true
                    } else {
                        let placed = blocks.put_lease(key, &fingerprint, token, until);
                        self.insert(e, hash, placed.map(|place| (0, place)), until)?;
                        false
                    }
                }
            };
            if !full {
                expires_at(next_expiry, until);
                return Ok(Begin::Acquired);
            }
            drop(guard);
            // Full: expired records are swept to make room; if that freed
            // nothing, the oldest finished ones are evicted.
            match tries {
                0 => self.sweep(now),
                1 => self.evict(),
                _ => return Err(StoreError::new("memory store is full of live leases")),
            }
            tries += 1;
        }
    }

    /// Puts `record` in a vacant slot whose record is already counted
    /// (`reserve_record`); uncounts it if the record could not be made.
    fn insert(
        &self,
        slot: hashbrown::hash_table::VacantEntry<'_, Slot>,
        hash: u64,
        placed: Result<(u32, Place), StoreError>,
        until: u64,
    ) -> Result<(), StoreError> {
        match placed {
            Ok((size, place)) => {
                slot.insert(Slot {
                    hash: hash as u32,
                    until_t: coarse(until),
                    size,
                    place,
                });
                Ok(())
            }
            Err(err) => {
                self.shared.records.fetch_sub(1, Relaxed);
                Err(err)
            }
        }
    }

    fn renew_now(&self, claim: &Claim<'_>, ttl: Ttl) -> Result<LeaseState, StoreError> {
        let key = &claim.key;
        let until = after(self.now(), ttl.lease);
        let hash = self.hash(key);
        let mut guard = self.shard(hash);
        let (found, blocks, next_expiry) = entry(&mut guard, hash, key);
        match found {
            Entry::Occupied(mut e) => {
                let slot = e.get_mut();
                if !blocks.get(slot.place).is_leased_by(&claim.token) {
                    return Ok(LeaseState::Lost);
                }
                set_until(blocks.get_mut(slot.place), until);
                slot.until_t = coarse(until);
            }
            Entry::Vacant(e) => {
                // The record is gone (swept after it expired unrenewed):
                // the lease is written anew.
                if !self.reserve_record() {
                    return Err(StoreError::new("memory store is full"));
                }
                let placed = blocks.put_lease(key, &claim.fingerprint, &claim.token, until);
                self.insert(e, hash, placed.map(|place| (0, place)), until)?;
            }
        }
        expires_at(next_expiry, until);
        Ok(LeaseState::Held)
    }

    fn complete_now(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> Result<LeaseState, StoreError> {
        let key = &claim.key;
        let until = after(self.now(), ttl.record);
        let hash = self.hash(key);
        let full = Done {
            claim,
            response,
            slim: false,
            until,
        };
        // Kept whole if its bytes fit the bound; otherwise the operation's
        // outcome without its body, rather than forget that it ran.
        let to_keep = |this: &Self| {
            if fits(this, full.size()) {
                return Done { ..full };
            }
            let slim = Done { slim: true, ..full };
            this.shared.bytes.fetch_add(slim.size(), Relaxed);
            slim
        };
        let mut guard = self.shard(hash);
        let (found, blocks, next_expiry) = entry(&mut guard, hash, key);
        match found {
            Entry::Occupied(mut e) => {
                let slot = e.get_mut();
                let r = blocks.get(slot.place);
                if !r.is_lease() && r.is_by(&claim.token) {
                    // Stored already: this is the holder's `complete` again.
                    return Ok(LeaseState::Held);
                }
                if !r.is_leased_by(&claim.token) {
                    return Ok(LeaseState::Lost);
                }
                let done = to_keep(self);
                // The lease's record is freed here, while it is in the caches.
                let (old, size) = (slot.place, size32(done.size())?);
                slot.place = blocks.put_done(&done)?;
                blocks.remove(old);
                (slot.size, slot.until_t) = (size, coarse(until));
            }
            Entry::Vacant(e) => {
                // The lease is gone (swept after it expired unrenewed): the
                // finished record is written anew.
                if !self.reserve_record() {
                    return Err(StoreError::new("memory store is full"));
                }
                let done = to_keep(self);
                let placed =
                    size32(done.size()).and_then(|size| Ok((size, blocks.put_done(&done)?)));
                self.insert(e, hash, placed, until)?;
            }
        }
        expires_at(next_expiry, until);
        Ok(LeaseState::Held)
    }

    fn release_now(&self, claim: &Claim<'_>) {
        let key = &claim.key;
        let hash = self.hash(key);
        let mut guard = self.shard(hash);
        let Shard { table, blocks, .. } = &mut *guard;
        if let Ok(e) = table.find_entry(table_hash(hash as u32), |s| is(s, hash, key, blocks)) {
            let place = e.get().place;
            if blocks.get(place).is_leased_by(&claim.token) {
                // A lease holds no bytes.
                e.remove();
                blocks.remove(place);
                self.shared.records.fetch_sub(1, Relaxed);
            }
        }
    }

    /// Finished records evicted to make room since the store was made.
    pub fn evicted(&self) -> u64 {
        self.shared.evicted.load(Relaxed)
    }

    /// Evicts the finished records nearest their expiry: an eighth of the
    /// record bound (at least one), or, when the bytes bound is what is
    /// full, enough to come back under seven eighths of it. Live leases are
    /// never evicted. One pass over every shard to find the threshold, one
    /// to remove: at an eighth of the bound a time, a few visits per record
    /// evicted.
    fn evict(&self) {
        let mut untils: Vec<(u32, usize)> = Vec::new();
        for shard in &self.shared.shards {
            let shard = lock(shard);
            untils.extend(
                shard
                    .table
                    .iter()
                    .filter(|s| s.size > 0)
                    .map(|s| (s.until_t, s.size as usize)),
            );
        }
        if untils.is_empty() {
            return;
        }
        untils.sort_unstable_by_key(|&(until, _)| until);
        let by_count = (self.max_records / 8).max(1);
        let over = self
            .shared
            .bytes
            .load(Relaxed)
            .saturating_sub(self.max_bytes / 8 * 7);
        let (mut n, mut freed) = (0, 0);
        while n < untils.len() && (n < by_count || freed < over) {
            freed += untils[n].1;
            n += 1;
        }
        let threshold = untils[n - 1].0;
        let (mut freed, mut removed) = (0, 0);
        for shard in &self.shared.shards {
            let mut guard = lock(shard);
            let Shard { table, blocks, .. } = &mut *guard;
            table.retain(|s| {
                let evict = s.size > 0 && s.until_t <= threshold;
                if evict {
                    freed += s.size as usize;
                    removed += 1;
                    blocks.remove(s.place);
                }
                !evict
            });
        }
        self.shared.bytes.fetch_sub(freed, Relaxed);
        self.shared.records.fetch_sub(removed, Relaxed);
        self.shared.evicted.fetch_add(removed as u64, Relaxed);
        tracing::warn!(
            evicted = removed,
            bytes = freed,
            "idempotency memory store full: evicted its oldest finished records (a retry of their keys runs again)"
        );
    }

    /// Drops the expired records of every shard, one shard at a time.
    fn sweep(&self, now: u64) {
        for shard in &self.shared.shards {
            let mut guard = lock(shard);
            let Shard {
                table,
                blocks,
                next_expiry,
            } = &mut *guard;
            if next_expiry.is_none_or(|t| t > now) {
                // Nothing has expired yet: spare the full scan.
                continue;
            }
            let (mut freed, mut removed) = (0, 0);
            let mut next: Option<u32> = None;
            table.retain(|s| {
                // Only a record whose expiry falls in the current tick (or
                // past the span of ticks) is read for its exact one: the
                // records, unlike the slots, are not in the caches.
                let keep = match from_coarse(s.until_t) {
                    _ if s.until_t == u32::MAX => blocks.get(s.place).until() > now,
                    end if end <= now => false,
                    end if end.saturating_sub(TICK) >= now => true,
                    _ => blocks.get(s.place).until() > now,
                };
                if keep {
                    next = Some(next.map_or(s.until_t, |t| t.min(s.until_t)));
                } else {
                    freed += s.size as usize;
                    removed += 1;
                    blocks.remove(s.place);
                }
                keep
            });
            // (The start of the tick the first of them expires in: no
            // sweep before it frees anything.)
            *next_expiry = next.map(|t| from_coarse(t.saturating_sub(1)));
            self.shared.bytes.fetch_sub(freed, Relaxed);
            self.shared.records.fetch_sub(removed, Relaxed);
        }
    }
}

/// The entry of `key` (whose hash is `hash`) in its shard's table, with
/// the shard's blocks and its bound on the next expiry.
fn entry<'a>(
    shard: &'a mut Shard,
    hash: u64,
    key: &RecordKey<'_>,
) -> (Entry<'a, Slot>, &'a mut Blocks, &'a mut Option<u64>) {
    let Shard {
        table,
        blocks,
        next_expiry,
    } = shard;
    let found = table.entry(
        table_hash(hash as u32),
        |s| is(s, hash, key, blocks),
        |s| table_hash(s.hash),
    );
    (found, blocks, next_expiry)
}

/// Whether `slot` is the record of `key` (whose hash is `hash`).
fn is(slot: &Slot, hash: u64, key: &RecordKey<'_>, blocks: &Blocks) -> bool {
    slot.hash == hash as u32 && blocks.get(slot.place).is(key)
}

/// The bytes of a record's stored response, as a slot keeps them.
fn size32(size: usize) -> Result<u32, StoreError> {
    u32::try_from(size).map_err(|_| StoreError::new("an idempotency response of 4 GiB or more"))
}

/// Adds `size` bytes to the count of stored responses, unless that would
/// pass the bound.
fn fits(store: &MemoryStore, size: usize) -> bool {
    store
        .shared
        .bytes
        .fetch_update(Relaxed, Relaxed, |b| {
            b.checked_add(size)
                .filter(|&total| total <= store.max_bytes)
        })
        .is_ok()
}

/// Lowers a shard's `next_expiry` to `until`.
fn expires_at(next_expiry: &mut Option<u64>, until: u64) {
    *next_expiry = Some(next_expiry.map_or(until, |t| t.min(until)));
}

/// `now` plus `ttl`, in nanoseconds, saturating.
fn after(now: u64, ttl: std::time::Duration) -> u64 {
    now.saturating_add(u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX))
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
        std::future::ready(self.renew_now(claim, ttl))
    }

    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        std::future::ready(self.complete_now(claim, response, ttl))
    }

    fn release(&self, claim: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.release_now(claim);
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

    /// The fingerprint the tests' requests have, unless they say otherwise.
    const FP: Fingerprint = Fingerprint([0; 32]);

    fn claim<'a>(key: RecordKey<'a>, fingerprint: Fingerprint, token: LeaseToken) -> Claim<'a> {
        Claim {
            key,
            fingerprint,
            token,
        }
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
            trailers: None,
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn leases_and_records_expire_on_tokio_time() {
        let s = MemoryStore::new();
        let fp = Fingerprint([1; 32]);
        let (a, b) = (LeaseToken::random(), LeaseToken::random());
        assert_eq!(
            s.begin(&claim(key("k"), fp, a), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert!(matches!(
            s.begin(&claim(key("k"), fp, b), TTL).await.unwrap(),
            Begin::InProgress { .. }
        ));
        tokio::time::advance(Duration::from_secs(10)).await;
        // a's lease expired: b takes over, and a can no longer complete.
        assert_eq!(
            s.begin(&claim(key("k"), fp, b), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(
            s.complete(&claim(key("k"), fp, a), &resp("a"), TTL)
                .await
                .unwrap(),
            LeaseState::Lost
        );
        assert_eq!(
            s.renew(&claim(key("k"), fp, a), TTL).await.unwrap(),
            LeaseState::Lost
        );
        s.release(&claim(key("k"), fp, a)).await.unwrap();
        assert!(matches!(
            s.begin(&claim(key("k"), fp, a), TTL).await.unwrap(),
            Begin::InProgress { .. }
        ));
        assert_eq!(
            s.complete(&claim(key("k"), fp, b), &resp("b"), TTL)
                .await
                .unwrap(),
            LeaseState::Held
        );
        match s.begin(&claim(key("k"), fp, a), TTL).await.unwrap() {
            Begin::Completed { response, .. } => assert_eq!(response.body, "b"),
            other => panic!("{other:?}"),
        }
        tokio::time::advance(Duration::from_secs(100)).await;
        assert_eq!(
            s.begin(&claim(key("k"), fp, a), TTL).await.unwrap(),
            Begin::Acquired
        );
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn records_stay_small() {
        assert_eq!(std::mem::size_of::<Slot>(), 24);
        let (fp, t) = (Fingerprint([3; 32]), LeaseToken::random());
        let k = RecordKey {
            scope: "anonymous",
            key: "0b5a2f9e-3c1d-4e8a-9f7b-2d6c8e1a4b3f",
        };
        // A lease: its header, scope and key.
        let lease = lease(&k, &fp, &t, 7).unwrap();
        assert_eq!(lease.len(), 110);
        // Finished: the same, and the response as `encode` writes it.
        let r = resp("ok 21");
        let done = done(&claim(k, fp, t), &r, false, 9).unwrap();
        assert_eq!(done.len(), 110 + r.encode().len());
        let (lease, done) = (Rec(&lease), Rec(&done));
        assert_eq!((lease.size(), done.size()), (0, r.encode().len()));
        assert!(done.is(&k) && lease.is(&k));
        assert_eq!((lease.until(), done.until()), (7, 9));
        assert!(lease.is_leased_by(&t) && !done.is_lease());
    }

    /// A finished record of `n` bytes (`n` at least the header's 65 + 2),
    /// its bytes made from `seed`.
    fn finished(n: usize, seed: u8) -> Vec<u8> {
        let mut v = start(&key("k"), DONE, 0, &FP, 0, n).unwrap();
        v.resize(n, seed);
        v
    }

    /// Finished records share blocks, one per ~16 KiB of them, and read
    /// back as they were put, whatever was taken out around them; a block
    /// goes once its last record has, and emptied blocks are kept as the
    /// next. Leases and large records are blocks of their own.
    #[test]
    fn records_share_blocks_and_give_them_back() {
        let mut b = Blocks::default();
        let live = |b: &Blocks| b.blocks.iter().filter(|x| x.is_some()).count();
        let mut put: Vec<(Place, Vec<u8>)> = (0..400)
            .map(|i| {
                let r = finished(100 + i % 90, i as u8);
                (b.put(r.clone()).unwrap(), r)
            })
            .collect();
        // 400 records of 100 to 189 bytes: 58,000 bytes in four blocks.
        assert_eq!(live(&b), 4);
        // Every other one taken out: the rest read back whole.
        let mut kept = Vec::new();
        for (i, (place, r)) in put.drain(..).enumerate() {
            if i % 2 == 0 {
                b.remove(place);
            } else {
                kept.push((place, r));
            }
        }
        for (place, r) in &kept {
            assert_eq!(b.get(*place).0, &r[..]);
        }
        assert_eq!(live(&b), 4);
        // The first 150 records kept gone: the blocks that held only them
        // go (kept for the next ones), and their indices are used again.
        for (place, _) in kept.drain(..150) {
            b.remove(place);
        }
        assert!(live(&b) <= 2, "{}", live(&b));
        assert!(!b.spares.is_empty());
        for (place, r) in &kept {
            assert_eq!(b.get(*place).0, &r[..]);
        }
        let again = b.put(finished(120, 7)).unwrap();
        assert_eq!(b.get(again).0, &finished(120, 7)[..]);
        // A lease and a large record: blocks of their own, gone with them.
        let before = live(&b);
        let l = b
            .put(lease(&key("k"), &FP, &LeaseToken::random(), 1).unwrap())
            .unwrap();
        let big = b.put(finished(SHARED_MAX + 1, 9)).unwrap();
        assert_eq!((l.at, big.at), (0, 0));
        assert_eq!(live(&b), before + 2);
        assert_eq!(b.get(big).0, &finished(SHARED_MAX + 1, 9)[..]);
        b.remove(l);
        b.remove(big);
        assert_eq!(live(&b), before);
        // Everything out: no block left but the one being filled.
        b.remove(again);
        for (place, _) in kept {
            b.remove(place);
        }
        assert!(live(&b) <= 1, "{}", live(&b));
    }

    /// Emptied blocks and leases' records are kept for the next ones, up
    /// to their bounds, and what is written into them reads back as if
    /// they were new: a kept lease's old bytes never show through.
    #[test]
    fn emptied_blocks_and_leases_are_used_again_within_bounds() {
        let mut b = Blocks::default();
        // Many blocks filled, then emptied all at once (as by a sweep).
        let places: Vec<Place> = (0..(SPARE_BLOCKS + 8) * 100)
            .map(|i| b.put(finished(180, i as u8)).unwrap())
            .collect();
        for place in places {
            b.remove(place);
        }
        assert_eq!(b.spares.len(), SPARE_BLOCKS);
        // The block being filled starts again from its start; once it is
        // full, the next is the last one kept.
        let spare = b.spares.last().map(|v| v.as_ptr());
        let next: Vec<Place> = (0..100).map(|i| b.put(finished(180, i)).unwrap()).collect();
        assert_eq!(
            b.spares.len(),
            SPARE_BLOCKS - 1,
            "a kept block is taken first"
        );
        let last = next[99];
        let Some(Some(block)) = b.blocks.get(last.block as usize) else {
            panic!("no block")
        };
        assert_eq!(Some(block.bytes.as_ptr()), spare);
        for (i, place) in next.iter().enumerate() {
            assert_eq!(b.get(*place).0, &finished(180, i as u8)[..]);
        }

        // A lease with a long scope, given back: its room is kept, and the
        // shorter lease written into it reads back exactly.
        let long = RecordKey {
            scope: &"s".repeat(200),
            key: "a-long-scoped-key",
        };
        let (t1, t2) = (LeaseToken::random(), LeaseToken::random());
        let first = b.put_lease(&long, &FP, &t1, 5).unwrap();
        b.remove(first);
        assert_eq!(b.lease_spares.len(), 1);
        let short = key("k");
        let second = b.put_lease(&short, &FP, &t2, 6).unwrap();
        assert!(b.lease_spares.is_empty());
        assert_eq!(b.get(second).0, &lease(&short, &FP, &t2, 6).unwrap()[..]);
        assert!(b.get(second).is_leased_by(&t2) && b.get(second).is(&short));
        // Leases' records past the size kept, or past the count, are not kept.
        let huge = RecordKey {
            scope: &"s".repeat(LEASE_KEPT),
            key: "k",
        };
        let big = b.put_lease(&huge, &FP, &t1, 5).unwrap();
        b.remove(big);
        assert!(b.lease_spares.is_empty());
        let many: Vec<Place> = (0..SPARE_LEASES + 5)
            .map(|_| b.put_lease(&short, &FP, &t1, 5).unwrap())
            .collect();
        for place in many {
            b.remove(place);
        }
        assert_eq!(b.lease_spares.len(), SPARE_LEASES);
    }

    /// A slot keeps its expiry in ticks of 1/64 s: a sweep frees a record
    /// only once it has expired, to the tick and within it; and a record
    /// that expires past the span of the ticks (two years from the store's
    /// epoch) outlives the span, read for its exact expiry.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn sweeps_free_records_to_the_tick_and_past_the_span() {
        let s = MemoryStore::new();
        let resp = resp("ok");
        let ttl = |record: Duration| Ttl {
            lease: Duration::from_secs(5),
            record,
        };
        let done = |k: &'static str, record: Duration| {
            let s = s.clone();
            let resp = resp.clone();
            async move {
                let c = claim(key(k), FP, LeaseToken::random());
                assert_eq!(s.begin(&c, ttl(record)).await.unwrap(), Begin::Acquired);
                assert_eq!(
                    s.complete(&c, &resp, ttl(record)).await.unwrap(),
                    LeaseState::Held
                );
            }
        };
        done("short", Duration::from_millis(1_010)).await;
        done("years", Duration::from_secs(3 * 365 * 24 * 3600)).await;
        // 1.005 s on: "short" expires 5 ms later, within this tick.
        tokio::time::advance(Duration::from_millis(1_005)).await;
        s.sweep(s.now());
        assert_eq!(s.len(), 2, "swept before it expired");
        tokio::time::advance(Duration::from_millis(6)).await;
        s.sweep(s.now());
        assert_eq!(s.len(), 1, "not swept once expired");
        // Past the span of the ticks (776 days), "years" has 295 days to go.
        tokio::time::advance(Duration::from_secs(800 * 24 * 3600)).await;
        s.sweep(s.now());
        assert_eq!(s.len(), 1, "swept past the span of the ticks");
        let again = claim(key("years"), FP, LeaseToken::random());
        assert!(matches!(
            s.begin(&again, ttl(Duration::from_secs(1))).await.unwrap(),
            Begin::Completed { .. }
        ));
    }

    /// A key's hash is that of its scope, 0xff and its key as one stream,
    /// whether they are hashed joined (as a short key is) or one by one.
    #[test]
    fn the_key_hash_is_that_of_its_parts() {
        let s = MemoryStore::new();
        let apart = |k: &RecordKey<'_>| {
            let mut h = s.shared.fixed.hasher.build_hasher();
            h.write(k.scope.as_bytes());
            h.write_u8(0xff);
            h.write(k.key.as_bytes());
            h.finish()
        };
        let long = "k".repeat(200);
        for k in [
            RecordKey {
                scope: "anonymous",
                key: "0b9d6f4e-5a3c-4f7e-9d2a-1c8b7e6f5a4d",
            },
            RecordKey {
                scope: "",
                key: "k",
            },
            RecordKey {
                scope: "s",
                key: &long,
            },
        ] {
            assert_eq!(s.hash(&k), apart(&k));
        }
        assert_ne!(
            s.hash(&RecordKey {
                scope: "ab",
                key: "c"
            }),
            s.hash(&RecordKey {
                scope: "a",
                key: "bc"
            })
        );
    }

    /// Scopes and keys of any length are found again, and the same bytes
    /// split another way between scope and key are another record.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn keys_of_any_length_and_split_work_alike() {
        let s = MemoryStore::new();
        let fp = Fingerprint([2; 32]);
        let t = LeaseToken::random();
        let keys: Vec<String> = [1, 77, 78, 254].iter().map(|&n| "k".repeat(n)).collect();
        for k in &keys {
            assert_eq!(
                s.begin(&claim(key(k), fp, t), TTL).await.unwrap(),
                Begin::Acquired
            );
            let moved = RecordKey {
                scope: "sk",
                key: &k[1..],
            };
            assert_eq!(
                s.begin(&claim(moved, fp, t), TTL).await.unwrap(),
                Begin::Acquired
            );
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(
                s.complete(&claim(key(k), FP, t), &resp(["a", "b", "c", "d"][i]), TTL)
                    .await
                    .unwrap(),
                LeaseState::Held
            );
        }
        for (i, k) in keys.iter().enumerate() {
            match s.begin(&claim(key(k), fp, t), TTL).await.unwrap() {
                Begin::Completed { response, .. } => {
                    assert_eq!(response.body, ["a", "b", "c", "d"][i]);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// A finished record keeps its lease's fingerprint; one taken over
    /// after it expired gives its bytes back and takes the new one.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn finished_records_keep_their_fingerprint_and_give_back_their_bytes() {
        let s = MemoryStore::new();
        let (a, b) = (Fingerprint([0xa; 32]), Fingerprint([0xb; 32]));
        let t = LeaseToken::random();
        assert_eq!(
            s.begin(&claim(key("k"), a, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(
            s.complete(&claim(key("k"), a, t), &resp("done"), TTL)
                .await
                .unwrap(),
            LeaseState::Held
        );
        let stored = resp("done").encode().len();
        assert_eq!(s.shared.bytes.load(Relaxed), stored);
        match s.begin(&claim(key("k"), b, t), TTL).await.unwrap() {
            Begin::Completed { fingerprint, .. } => assert_eq!(fingerprint, a),
            other => panic!("{other:?}"),
        }
        tokio::time::advance(TTL.record).await;
        assert_eq!(
            s.begin(&claim(key("k"), b, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.shared.bytes.load(Relaxed), 0);
        assert_eq!(s.len(), 1);
        match s.begin(&claim(key("k"), a, t), TTL).await.unwrap() {
            Begin::InProgress { fingerprint } => assert_eq!(fingerprint, b),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn bounded_by_records_and_bytes() {
        let s = MemoryStore::new().max_records(2).max_bytes(100);
        let fp = Fingerprint([0; 32]);
        let t = LeaseToken::random();
        for k in ["a", "b"] {
            assert_eq!(
                s.begin(&claim(key(k), fp, t), TTL).await.unwrap(),
                Begin::Acquired
            );
        }
        assert!(s.begin(&claim(key("c"), fp, t), TTL).await.is_err());
        tokio::time::advance(TTL.lease).await;
        // Expired leases are swept to make room.
        assert_eq!(
            s.begin(&claim(key("c"), fp, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.len(), 1);
        let big = StoredResponse {
            body: Bytes::from(vec![b'x'; 1000]),
            ..resp("")
        };
        assert_eq!(
            s.complete(&claim(key("c"), FP, t), &big, TTL)
                .await
                .unwrap(),
            LeaseState::Held
        );
        match s.begin(&claim(key("c"), fp, t), TTL).await.unwrap() {
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
            s.begin(&claim(key("a"), fp, t), ttl).await.unwrap(),
            Begin::Acquired
        );
        // Full of a live lease: refused.
        assert!(s.begin(&claim(key("b"), fp, t), ttl).await.is_err());
        assert_eq!(
            s.complete(&claim(key("a"), FP, t), &resp("a"), ttl)
                .await
                .unwrap(),
            LeaseState::Held
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        // The finished record expired: swept, not evicted.
        assert_eq!(
            s.begin(&claim(key("b"), fp, t), ttl).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!((s.len(), s.evicted()), (1, 0));
    }

    /// A sweep reads the slots' expiries, in whole seconds, and a record's
    /// own only when it falls in the current second: a record kept 100 ms
    /// is swept 150 ms later (not evicted), and a live lease is kept.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_sweep_frees_records_kept_under_a_second() {
        let s = MemoryStore::new().max_records(2);
        let short = Ttl {
            lease: Duration::from_secs(100),
            record: Duration::from_millis(100),
        };
        let (t, other) = (LeaseToken::random(), LeaseToken::random());
        tokio::time::advance(Duration::from_millis(300)).await;
        assert_eq!(
            s.begin(&claim(key("a"), FP, t), short).await.unwrap(),
            Begin::Acquired
        );
        let (a, r) = (claim(key("a"), FP, t), resp("a"));
        assert_eq!(s.complete(&a, &r, short).await.unwrap(), LeaseState::Held);
        assert_eq!(
            s.begin(&claim(key("c"), FP, other), short).await.unwrap(),
            Begin::Acquired
        );
        tokio::time::advance(Duration::from_millis(150)).await;
        assert_eq!(
            s.begin(&claim(key("b"), FP, t), short).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!((s.len(), s.evicted()), (2, 0));
        assert!(matches!(
            s.begin(&claim(key("c"), FP, t), short).await.unwrap(),
            Begin::InProgress { .. }
        ));
    }

    /// At its bound the store evicts its oldest finished records, an eighth
    /// of the bound at a time, and refuses new keys only when it is full of
    /// live leases.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_full_store_evicts_its_oldest_finished_records_never_a_lease() {
        let s = MemoryStore::new().max_records(16);
        let t = LeaseToken::random();
        // 12 finished records, a second apart, and 4 live leases.
        for i in 0..12 {
            let k = format!("done{i}");
            assert_eq!(
                s.begin(&claim(key(&k), FP, t), TTL).await.unwrap(),
                Begin::Acquired
            );
            assert_eq!(
                s.complete(&claim(key(&k), FP, t), &resp("ok"), TTL)
                    .await
                    .unwrap(),
                LeaseState::Held
            );
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        for i in 0..4 {
            let k = format!("live{i}");
            assert_eq!(
                s.begin(&claim(key(&k), FP, t), TTL).await.unwrap(),
                Begin::Acquired
            );
        }
        assert_eq!(s.len(), 16);
        // Full, nothing expired: the two oldest finished records go (16 / 8).
        assert_eq!(
            s.begin(&claim(key("new"), FP, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!((s.len(), s.evicted()), (15, 2));
        for i in 2..12 {
            let found = s.begin(&claim(key(&format!("done{i}")), FP, t), TTL).await;
            assert!(matches!(found.unwrap(), Begin::Completed { .. }), "done{i}");
        }
        // The leases are all still there.
        for i in 0..4 {
            assert!(matches!(
                s.begin(&claim(key(&format!("live{i}")), FP, t), TTL)
                    .await
                    .unwrap(),
                Begin::InProgress { .. }
            ));
        }
        // The oldest is gone: its key runs again.
        assert_eq!(
            s.begin(&claim(key("done0"), FP, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.len(), 16);
        // A store full of leases refuses new keys.
        let leases = MemoryStore::new().max_records(3);
        for k in ["a", "b", "c"] {
            assert_eq!(
                leases.begin(&claim(key(k), FP, t), TTL).await.unwrap(),
                Begin::Acquired
            );
        }
        let err = leases
            .begin(&claim(key("d"), FP, t), TTL)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("live leases"), "{err}");
        assert_eq!((leases.len(), leases.evicted()), (3, 0));
    }

    /// Renewals extend a lease; renewing or completing a key whose record
    /// is gone writes it anew; another holder's key is lost to both.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn renewals_and_completions_of_a_lost_record() {
        let s = MemoryStore::new();
        let (mine, theirs) = (LeaseToken::random(), LeaseToken::random());
        let c = claim(key("k"), FP, mine);
        assert_eq!(s.begin(&c, TTL).await.unwrap(), Begin::Acquired);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(s.renew(&c, TTL).await.unwrap(), LeaseState::Held);
        // Renewed at 9 s for 10 s: alive at 18 s, where the first lease
        // would have ended at 10 s.
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(matches!(
            s.begin(&claim(key("k"), FP, theirs), TTL).await.unwrap(),
            Begin::InProgress { .. }
        ));
        // The record is lost (released here, as a restarted store would
        // have lost it): a renewal writes the lease anew.
        s.release(&c).await.unwrap();
        assert_eq!(s.len(), 0);
        assert_eq!(s.renew(&c, TTL).await.unwrap(), LeaseState::Held);
        assert!(matches!(
            s.begin(&claim(key("k"), FP, theirs), TTL).await.unwrap(),
            Begin::InProgress { .. }
        ));
        // Lost again, then completed: the finished record is written anew,
        // with the claim's fingerprint.
        s.release(&c).await.unwrap();
        assert_eq!(
            s.complete(&c, &resp("r"), TTL).await.unwrap(),
            LeaseState::Held
        );
        match s
            .begin(&claim(key("k"), Fingerprint([9; 32]), theirs), TTL)
            .await
            .unwrap()
        {
            Begin::Completed {
                fingerprint,
                response,
            } => {
                assert_eq!((fingerprint, &response.body[..]), (FP, &b"r"[..]));
            }
            other => panic!("{other:?}"),
        }
        // Finished: a renewal is lost; the holder's completion again is
        // answered as done, and changes nothing; another's is lost.
        assert_eq!(s.renew(&c, TTL).await.unwrap(), LeaseState::Lost);
        assert_eq!(
            s.complete(&c, &resp("x"), TTL).await.unwrap(),
            LeaseState::Held
        );
        let other = claim(key("k"), FP, theirs);
        assert_eq!(
            s.complete(&other, &resp("y"), TTL).await.unwrap(),
            LeaseState::Lost
        );
        match s.begin(&other, TTL).await.unwrap() {
            Begin::Completed { response, .. } => assert_eq!(&response.body[..], b"r"),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.len(), 1);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_bounds_hold_for_the_whole_store_across_its_shards() {
        let s = MemoryStore::new().max_records(40).max_bytes(1 << 20);
        let (fp, t) = (Fingerprint([0; 32]), LeaseToken::random());
        let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
        for k in &keys {
            assert_eq!(
                s.begin(&claim(key(k), fp, t), TTL).await.unwrap(),
                Begin::Acquired
            );
        }
        assert_eq!(s.len(), 40);
        for k in ["x", "y", "z"] {
            assert!(s.begin(&claim(key(k), fp, t), TTL).await.is_err());
        }
        // A released lease frees its slot.
        s.release(&claim(key("k0"), FP, t)).await.unwrap();
        assert_eq!(s.len(), 39);
        assert_eq!(
            s.begin(&claim(key("x"), fp, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        // Completed records keep theirs; an expired lease taken over by the
        // same key does not take a second one.
        for k in &keys[1..20] {
            assert_eq!(
                s.complete(&claim(key(k), FP, t), &resp("done"), TTL)
                    .await
                    .unwrap(),
                LeaseState::Held
            );
        }
        tokio::time::advance(TTL.lease).await;
        assert_eq!(
            s.begin(&claim(key("k30"), fp, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.len(), 40);
        // Full: the sweep visits every shard and drops the 20 expired leases
        // (k20..k39 but k30, and x), keeping the 19 live records.
        assert_eq!(
            s.begin(&claim(key("y"), fp, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        assert_eq!(s.len(), 21);
        for k in &keys[1..20] {
            assert!(matches!(
                s.begin(&claim(key(k), fp, t), TTL).await.unwrap(),
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
