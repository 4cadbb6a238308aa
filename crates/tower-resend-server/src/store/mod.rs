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
        /// The response to replay.
        response: StoredResponse,
    },
}

/// A final response, as stored and replayed: status, headers and body.
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
}

const FORMAT_VERSION: u8 = 1;

impl StoredResponse {
    /// Encodes the response for a store that keeps bytes.
    pub fn encode(&self) -> Vec<u8> {
        encode(self.status, &self.headers, self.body_omitted, &self.body)
    }

    /// Decodes what [`encode`](Self::encode) wrote; `None` if the bytes are
    /// not such a record.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        if r.take(1)? != [FORMAT_VERSION] {
            return None;
        }
        let status = StatusCode::from_u16(u16::from_be_bytes(r.take(2)?.try_into().ok()?)).ok()?;
        let body_omitted = r.take(1)?[0] != 0;
        let n = u32::from_be_bytes(r.take(4)?.try_into().ok()?);
        let mut headers = HeaderMap::new();
        for _ in 0..n {
            let name = HeaderName::from_bytes(r.chunk()?).ok()?;
            let value = HeaderValue::from_bytes(r.chunk()?).ok()?;
            headers.append(name, value);
        }
        Some(Self {
            status,
            headers,
            body: Bytes::copy_from_slice(r.0),
            body_omitted,
        })
    }

    /// Roughly how many bytes the record holds.
    pub fn size(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len() + 8)
                .sum::<usize>()
            + 16
    }
}

/// What [`StoredResponse::encode`] writes, from the parts: one allocation of
/// exactly the encoded length.
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    body_omitted: bool,
    body: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(headers, body));
    encode_into(&mut out, status, headers, body_omitted, body);
    out
}

/// The headers an encoding holds: all of them, unless there are more than
/// a `u32` counts.
fn header_count(headers: &HeaderMap) -> u32 {
    u32::try_from(headers.len()).unwrap_or(u32::MAX)
}

/// The length of what [`encode_into`] writes.
pub(crate) fn encoded_len(headers: &HeaderMap, body: &[u8]) -> usize {
    8 + headers
        .iter()
        .take(header_count(headers) as usize)
        .map(|(name, value)| 8 + name.as_str().len() + value.len())
        .sum::<usize>()
        + body.len()
}

/// [`encode`], appended to `out`.
pub(crate) fn encode_into(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    body_omitted: bool,
    body: &[u8],
) {
    let n = header_count(headers);
    out.push(FORMAT_VERSION);
    out.extend_from_slice(&status.as_u16().to_be_bytes());
    out.push(u8::from(body_omitted));
    out.extend_from_slice(&n.to_be_bytes());
    for (name, value) in headers.iter().take(n as usize) {
        put(out, name.as_str().as_bytes());
        put(out, value.as_bytes());
    }
    out.extend_from_slice(body);
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
}

/// A store could not answer. The layer fails closed on it (503).
#[derive(Debug)]
pub struct StoreError {
    message: String,
    source: Option<tower_resend::BoxError>,
}

impl StoreError {
    /// An error saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
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
        }
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
    /// the lease renewed, or the response stored.
    Held,
    /// Another request took the key over (after the lease expired), or it
    /// is finished: nothing was written.
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
    /// writes the lease anew where the key has no record).
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
        let r = StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"{\"id\":1}"),
            body_omitted: false,
        };
        assert_eq!(StoredResponse::decode(&r.encode()), Some(r.clone()));
        let enc = r.encode();
        for cut in 0..enc.len() - r.body.len() {
            assert_eq!(StoredResponse::decode(&enc[..cut]), None, "cut at {cut}");
        }
        assert_eq!(StoredResponse::decode(b"\x02garbage"), None);
    }
}
