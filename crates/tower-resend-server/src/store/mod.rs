//! Where [`IdempotencyLayer`](crate::IdempotencyLayer) keeps its records.
//!
//! A [`Store`] decides, atomically, which request with a given (scope, key)
//! runs: the first one takes a *lease*; later ones see the lease (the work is
//! in progress) or the stored response (it is done). Three stores come with
//! the crate:
//!
//! - [`MemoryStore`]: in this process, the embedded default; records expire,
//!   and its memory is bounded.
//! - `RedisStore` (feature `redis`): a lease by `SET NX PX`, the result with
//!   a TTL, compare-and-set steps in Lua; on the application's
//!   `ConnectionManager`, on Redis Cluster (each record's key hash-tagged
//!   into one slot), or from a URL.
//! - `PostgresStore` (feature `postgres`): one table with a primary key on
//!   (scope, key); `INSERT ... ON CONFLICT` decides who runs. On the
//!   application's sqlx pool; its transactional mode,
//!   `PostgresTransactional`, puts the record in the handler's own
//!   transaction.
//!
//! A store that cannot answer returns a [`StoreError`]; the layer then fails
//! closed: 503, and the handler does not run.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub use self::redis::DEFAULT_PREFIX as REDIS_DEFAULT_PREFIX;
#[cfg(feature = "redis")]
mod redis;

#[cfg(feature = "postgres")]
pub use self::postgres::{PostgresStore, DEFAULT_TABLE as POSTGRES_DEFAULT_TABLE};
#[cfg(feature = "redis")]
pub use self::redis::RedisStore;
pub use memory::{MemoryStore, DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS};

/// What identifies one logical operation: the caller's scope and its key.
///
/// It borrows both: the layer lends the request's own header value and
/// scope, so no copy is made per request; a store that keeps them copies
/// what it keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecordKey<'a> {
    /// The caller's identity (see
    /// [`IdempotencyLayer::scope_with`](crate::IdempotencyLayer::scope_with)).
    pub scope: &'a str,
    /// The Idempotency-Key, 1 to 255 visible ASCII characters.
    pub key: &'a str,
}

/// A hash of what the request asks for: method, path and query, and body.
/// The same key with another fingerprint is a client error (422).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// Proof of holding a lease: only its holder may complete or release it, so
/// a holder whose lease expired and was taken over cannot disturb the new one.
///
/// 128 random bits; stores that keep text use its [`Display`](fmt::Display)
/// form, 32 lower-case hex digits.
///
/// Kept as two `u64`s (high, low) rather than a `u128`: a `u128` is aligned
/// to 16 bytes, and so would be every request's state that holds a token,
/// with padding to match.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseToken([u64; 2]);

impl LeaseToken {
    /// A fresh random token. Unique, not secret: it never leaves the server.
    pub fn random() -> Self {
        Self([fastrand::u64(..), fastrand::u64(..)])
    }

    #[cfg(test)]
    const fn from_u128(n: u128) -> Self {
        Self([(n >> 64) as u64, n as u64])
    }

    /// The token as a number, for stores that keep it as one.
    pub const fn as_u128(self) -> u128 {
        ((self.0[0] as u128) << 64) | self.0[1] as u128
    }

    /// The token as 32 lower-case hex digits, without allocating.
    pub fn to_hex(self) -> [u8; 32] {
        let mut out = [0; 32];
        for (pair, b) in out.chunks_exact_mut(2).zip(self.as_u128().to_be_bytes()) {
            pair.copy_from_slice(&hex_pair(b));
        }
        out
    }
}

/// The two lower-case hex digits of `b`.
pub(crate) fn hex_pair(b: u8) -> [u8; 2] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    [HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.as_u128())
    }
}

/// How long a lease and a finished record live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ttl {
    /// How long a lease holds before another request may take it over.
    pub lease: Duration,
    /// How long a finished record is kept.
    pub record: Duration,
}

/// What [`Store::begin`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Begin {
    /// The caller holds the lease: run the handler.
    Acquired,
    /// Another request with the same key holds a live lease.
    InProgress {
        /// Its fingerprint.
        fingerprint: Fingerprint,
    },
    /// The operation finished: its stored response.
    Completed {
        /// Its fingerprint.
        fingerprint: Fingerprint,
        /// The response to replay. (Boxed: a `Begin` passes through several
        /// steps of every keyed request, and is moved at each; a replay
        /// costs an allocation more.)
        response: Box<StoredResponse>,
    },
}

/// A final response, as stored and replayed: status, headers, body and
/// trailers (a gRPC response's `grpc-status` and `grpc-message`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers, hop-by-hop ones and `content-length` left out.
    pub headers: HeaderMap,
    /// The body, unless it was larger than the cap.
    pub body: Bytes,
    /// True when the body was larger than the cap and was not stored.
    pub body_omitted: bool,
    /// The trailers the body ended with, if any.
    pub trailers: Option<HeaderMap>,
}

/// Version 1: status, headers, body. Version 2 adds the trailers; both are
/// read.
const FORMAT_V1: u8 = 1;
const FORMAT_V2: u8 = 2;

impl StoredResponse {
    /// A response of `status`, `headers` and `body`, without trailers.
    pub fn new(status: StatusCode, headers: HeaderMap, body: Bytes) -> Self {
        Self {
            status,
            headers,
            body,
            body_omitted: false,
            trailers: None,
        }
    }

    /// Encodes the response for a store that keeps bytes: one allocation
    /// of exactly the encoded length.
    pub fn encode(&self) -> Vec<u8> {
        let trailers = self.trailers.as_ref();
        let len = 5 + map_len(&self.headers) + trailers.map_or(4, map_len) + self.body.len();
        let mut out = Vec::with_capacity(len);
        out.push(FORMAT_V2);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.push(u8::from(self.body_omitted));
        put_map(&mut out, &self.headers);
        out.push(u8::from(trailers.is_some()));
        put_map(&mut out, trailers.unwrap_or(&HeaderMap::new()));
        out.extend_from_slice(&self.body);
        out
    }

    /// Decodes what [`encode`](Self::encode) wrote (or its version 1,
    /// without trailers); `None` if the bytes are not such a record.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        let version = r.take(1)?[0];
        if version != FORMAT_V1 && version != FORMAT_V2 {
            return None;
        }
        let status = StatusCode::from_u16(u16::from_be_bytes(r.take(2)?.try_into().ok()?)).ok()?;
        let body_omitted = r.take(1)?[0] != 0;
        let headers = r.map()?;
        let trailers = if version == FORMAT_V2 {
            let some = r.take(1)?[0] != 0;
            let map = r.map()?;
            some.then_some(map)
        } else {
            None
        };
        Some(Self {
            status,
            headers,
            body: Bytes::copy_from_slice(r.0),
            body_omitted,
            trailers,
        })
    }

    /// Roughly how many bytes the record holds.
    pub fn size(&self) -> usize {
        let map = |m: &HeaderMap| {
            m.iter()
                .map(|(n, v)| n.as_str().len() + v.len() + 8)
                .sum::<usize>()
        };
        self.body.len() + map(&self.headers) + self.trailers.as_ref().map_or(0, map) + 16
    }
}

/// The entries a map's encoding holds: all of them, unless there are more
/// than a `u32` counts.
fn entry_count(map: &HeaderMap) -> u32 {
    u32::try_from(map.len()).unwrap_or(u32::MAX)
}

/// The length of [`put_map`]'s encoding of `map`.
fn map_len(map: &HeaderMap) -> usize {
    4 + map
        .iter()
        .take(entry_count(map) as usize)
        .map(|(name, value)| 8 + name.as_str().len() + value.len())
        .sum::<usize>()
}

/// A header map: its count, then each name and value.
fn put_map(out: &mut Vec<u8>, map: &HeaderMap) {
    let n = entry_count(map);
    out.extend_from_slice(&n.to_be_bytes());
    for (name, value) in map.iter().take(n as usize) {
        put(out, name.as_str().as_bytes());
        put(out, value.as_bytes());
    }
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    let n = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&n.to_be_bytes());
    out.extend_from_slice(&bytes[..n as usize]);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    fn chunk(&mut self) -> Option<&'a [u8]> {
        let n = u32::from_be_bytes(self.take(4)?.try_into().ok()?);
        self.take(usize::try_from(n).ok()?)
    }

    fn map(&mut self) -> Option<HeaderMap> {
        let n = u32::from_be_bytes(self.take(4)?.try_into().ok()?);
        let mut map = HeaderMap::new();
        for _ in 0..n {
            let name = HeaderName::from_bytes(self.chunk()?).ok()?;
            let value = HeaderValue::from_bytes(self.chunk()?).ok()?;
            map.append(name, value);
        }
        Some(map)
    }
}

/// A store could not answer. The layer fails closed on it (503).
#[derive(Debug)]
pub struct StoreError {
    message: String,
    source: Option<tower_resend::BoxError>,
    not_set_up: bool,
}

impl StoreError {
    /// An error saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
            not_set_up: false,
        }
    }

    /// An error saying `message`, caused by `source`.
    pub fn with_source(
        message: impl Into<String>,
        source: impl Into<tower_resend::BoxError>,
    ) -> Self {
        Self {
            message: message.into(),
            source: Some(source.into()),
            not_set_up: false,
        }
    }

    /// An error saying that the store is reachable but not set up: its
    /// table (or whatever the store keeps records in) is missing. The
    /// layer's 503 then says so (`idempotency_store_not_set_up`), rather
    /// than that the store cannot be reached.
    ///
    /// ```
    /// use tower_resend_server::StoreError;
    ///
    /// let e = StoreError::not_set_up("the table app.idem does not exist: run migrate()");
    /// assert!(e.is_not_set_up());
    /// assert!(!StoreError::new("timed out").is_not_set_up());
    /// ```
    #[must_use]
    pub fn not_set_up(message: impl Into<String>) -> Self {
        Self {
            not_set_up: true,
            ..Self::new(message)
        }
    }

    /// True for an error made by [`not_set_up`](Self::not_set_up).
    pub fn is_not_set_up(&self) -> bool {
        self.not_set_up
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(s) => write!(f, "idempotency store: {}: {s}", self.message),
            None => write!(f, "idempotency store: {}", self.message),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// What a request that holds (or tries to take) a lease presents to the
/// store: the record's key, the request's fingerprint and the lease's token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim<'a> {
    /// The record: the caller's scope and its key.
    pub key: RecordKey<'a>,
    /// The fingerprint of the request.
    pub fingerprint: Fingerprint,
    /// The lease's token: only its holder may renew, complete or release it.
    pub token: LeaseToken,
}

/// What [`Store::renew`] and [`Store::complete`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum LeaseState {
    /// The lease was the claim's, or the key had no record at all (the store
    /// lost it, or it expired and nobody took it), and the write was made:
    /// the lease renewed, or the response stored. `complete` also answers
    /// `Held` when the key already holds this claim's finished record (its
    /// first answer was lost).
    Held,
    /// (`renew` only.) The key holds this claim's own finished record: its
    /// response is stored already (a `complete` whose answer was lost
    /// landed). Nothing was written, and nothing is wrong.
    Completed,
    /// Another request took the key over (after the lease expired), or it
    /// is finished under another claim: nothing was written.
    Lost,
}

/// Keeps idempotency records: who holds the lease on a key, and the response
/// once the work is done.
///
/// The rules (who runs, what is replayed, when a lease ends) are the
/// layer's; a store only keeps records, and must make each of these calls
/// **atomic** for one key:
///
/// - [`begin`](Store::begin): of any number of concurrent calls, at most one
///   gets [`Begin::Acquired`] while the lease lives;
/// - [`renew`](Store::renew) and [`complete`](Store::complete): compare the
///   token and write in one step, so a holder whose lease was taken over
///   cannot disturb the new holder; where the key has no record at all, they
///   write it anew (a store that lost its data while the work ran gets the
///   lease or the response back, rather than let a retry run the work
///   again);
/// - [`release`](Store::release): compare the token and delete in one step.
///
/// A store is cloned into every request; clones share the records. The
/// layer bounds every call by its store timeout and treats an error, or no
/// answer in time, as "cannot be reached".
pub trait Store: Clone + Send + Sync + 'static {
    /// Takes the lease on `claim.key` for `ttl.lease` with `claim.token`, if
    /// no live lease or unexpired record holds it; otherwise says what does.
    fn begin(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send;

    /// Extends the lease held with `claim.token` to `ttl.lease` from now (or
    /// writes the lease anew where the key has no record). Where the key
    /// holds the claim's own finished record, writes nothing and answers
    /// [`LeaseState::Completed`].
    fn renew(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send;

    /// Stores the final response in place of the lease held with
    /// `claim.token` (or where the key has no record), with the claim's
    /// fingerprint, kept for `ttl.record`.
    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send;

    /// Drops the lease held with `claim.token`, so the next request with the
    /// key runs. Does nothing if the lease is no longer the claim's.
    fn release(&self, claim: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_token_reads_the_same_as_hex_and_as_text() {
        // Redis keeps `to_hex`, PostgreSQL the `Display` form: the same text.
        let t = LeaseToken::from_u128(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);
        assert_eq!(&t.to_hex(), b"0123456789abcdeffedcba9876543210");
        assert_eq!(t.to_string().as_bytes(), &t.to_hex());
        let r = LeaseToken::random();
        assert_eq!(r.to_string().as_bytes(), &r.to_hex());
    }

    #[test]
    fn stored_responses_round_trip_and_garbage_is_refused() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_bytes(b"b=\xff").unwrap());
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.insert("grpc-message", HeaderValue::from_static("done"));
        for trailers in [None, Some(HeaderMap::new()), Some(trailers)] {
            let r = StoredResponse {
                status: StatusCode::CREATED,
                headers: headers.clone(),
                body: Bytes::from_static(b"{\"id\":1}"),
                body_omitted: false,
                trailers,
            };
            let enc = r.encode();
            assert_eq!(enc.len(), enc.capacity(), "one exact allocation");
            assert_eq!(StoredResponse::decode(&enc), Some(r.clone()));
            for cut in 0..enc.len() - r.body.len() {
                assert_eq!(StoredResponse::decode(&enc[..cut]), None, "cut at {cut}");
            }
        }
        assert_eq!(StoredResponse::decode(b"\x03garbage"), None);
    }

    /// Records written before trailers were kept (version 1) still read.
    #[test]
    fn version_one_records_still_read() {
        let mut v1 = vec![1, 0, 201, 0, 0, 0, 0, 1];
        v1.extend_from_slice(&4u32.to_be_bytes());
        v1.extend_from_slice(b"x-id");
        v1.extend_from_slice(&1u32.to_be_bytes());
        v1.extend_from_slice(b"7");
        v1.extend_from_slice(b"body");
        let r = StoredResponse::decode(&v1).expect("a version 1 record");
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(r.headers["x-id"], "7");
        assert_eq!(r.body, "body");
        assert_eq!(r.trailers, None);
    }
}
