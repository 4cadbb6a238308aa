//! The in-process store.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::time::Instant;

use super::{Begin, Fingerprint, LeaseToken, RecordKey, Store, StoreError, StoredResponse, Ttl};

/// The default bound on the records a [`MemoryStore`] holds: 100 000.
pub const DEFAULT_MAX_RECORDS: usize = 100_000;
/// The default bound on the bytes of stored responses a [`MemoryStore`]
/// holds: 64 MiB.
pub const DEFAULT_MAX_BYTES: usize = 64 * 1024 * 1024;

/// Idempotency records in this process's memory: the embedded default.
///
/// Records and leases expire on tokio's clock. Memory is bounded: at most
/// [`max_records`](Self::max_records) records and
/// [`max_bytes`](Self::max_bytes) bytes of stored responses; expired records
/// are swept out when the store fills up. A store that is full of live
/// records refuses new keys (the layer answers 503) rather than forget a
/// finished operation and run it twice.
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
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    max_records: usize,
    max_bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    records: HashMap<RecordKey, Record>,
    bytes: usize,
    /// No record expires before this (a lower bound on every record's
    /// `until`, lowered whenever one is set), so a sweep before it would
    /// free nothing. `None` when there is no record to expire.
    next_expiry: Option<Instant>,
}

#[derive(Debug)]
struct Record {
    fingerprint: Fingerprint,
    until: Instant,
    state: State,
}

#[derive(Debug)]
enum State {
    Leased(LeaseToken),
    Done(StoredResponse),
}

impl Record {
    /// What `begin` says about a live record.
    fn answer(&self) -> Begin {
        match &self.state {
            State::Leased(_) => Begin::InProgress {
                fingerprint: self.fingerprint,
            },
            State::Done(resp) => Begin::Completed {
                fingerprint: self.fingerprint,
                response: resp.clone(),
            },
        }
    }

    fn size(&self) -> usize {
        match &self.state {
            State::Leased(_) => 0,
            State::Done(r) => r.size(),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store with the default bounds ([`DEFAULT_MAX_RECORDS`],
    /// [`DEFAULT_MAX_BYTES`]).
    pub fn new() -> Self {
        Self {
            inner: Arc::default(),
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
        self.lock().records.len()
    }

    /// True when the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn begin_now(
        &self,
        key: &RecordKey,
        fingerprint: Fingerprint,
        token: &LeaseToken,
        ttl: Ttl,
    ) -> Result<Begin, StoreError> {
        let now = Instant::now();
        let mut inner = self.lock();
        let inner = &mut *inner;
        if inner.records.len() >= self.max_records || inner.bytes > self.max_bytes {
            // Full: a live record for the key still answers; otherwise
            // expired records are swept to make room.
            if let Some(r) = inner.records.get(key).filter(|r| r.until > now) {
                return Ok(r.answer());
            }
            inner.sweep(now);
            if inner.records.len() >= self.max_records || inner.bytes > self.max_bytes {
                return Err(StoreError::new("memory store is full of live records"));
            }
        }
        let until = now + ttl.lease;
        let fresh = Record {
            fingerprint,
            until,
            state: State::Leased(token.clone()),
        };
        // One hash of the key for the lookup and the insert.
        match inner.records.entry(key.clone()) {
            Entry::Occupied(mut e) => {
                if e.get().until > now {
                    return Ok(e.get().answer());
                }
                // Expired: a dead holder's lease, or an old record. Take it over.
                let old = e.insert(fresh);
                inner.bytes -= old.size();
            }
            Entry::Vacant(e) => {
                e.insert(fresh);
            }
        }
        inner.next_expiry = Some(inner.next_expiry.map_or(until, |t| t.min(until)));
        Ok(Begin::Acquired)
    }

    fn complete_now(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut inner = self.lock();
        let Inner {
            records,
            bytes,
            next_expiry,
        } = &mut *inner;
        match records.get_mut(key) {
            Some(r) if matches!(&r.state, State::Leased(t) if t == token) => {
                let size = response.size();
                if *bytes + size > self.max_bytes {
                    // Keep the operation's outcome, without its body, rather
                    // than forget that it ran.
                    let mut slim = response.clone();
                    slim.body = bytes::Bytes::new();
                    slim.body_omitted = true;
                    *bytes += slim.size();
                    r.state = State::Done(slim);
                } else {
                    *bytes += size;
                    r.state = State::Done(response.clone());
                }
                r.until = now + ttl.record;
                *next_expiry = Some(next_expiry.map_or(r.until, |t| t.min(r.until)));
            }
            _ => {}
        }
        Ok(())
    }

    fn release_now(&self, key: &RecordKey, token: &LeaseToken) {
        let mut inner = self.lock();
        if matches!(inner.records.get(key), Some(Record { state: State::Leased(t), .. }) if t == token)
        {
            inner.records.remove(key);
        }
    }
}

impl Inner {
    fn sweep(&mut self, now: Instant) {
        if self.next_expiry.is_none_or(|t| t > now) {
            // Nothing has expired yet: spare the full scan.
            return;
        }
        let mut freed = 0;
        let mut next: Option<Instant> = None;
        self.records.retain(|_, r| {
            let keep = r.until > now;
            if keep {
                next = Some(next.map_or(r.until, |t| t.min(r.until)));
            } else {
                freed += r.size();
            }
            keep
        });
        self.bytes -= freed;
        self.next_expiry = next;
    }
}

impl Store for MemoryStore {
    fn begin(
        &self,
        key: &RecordKey,
        fingerprint: Fingerprint,
        token: &LeaseToken,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        std::future::ready(self.begin_now(key, fingerprint, token, ttl))
    }

    fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.complete_now(key, token, response, ttl))
    }

    fn release(
        &self,
        key: &RecordKey,
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

    fn key(k: &str) -> RecordKey {
        RecordKey {
            scope: "s".into(),
            key: k.into(),
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

    #[test]
    fn lease_tokens_are_32_hex_digits() {
        let t = LeaseToken::random();
        assert_eq!(t.0.len(), 32);
        assert!(t
            .0
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_ne!(t, LeaseToken::random());
    }
}
