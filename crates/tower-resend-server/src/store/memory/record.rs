//! A record as the memory store keeps it: one boxed byte buffer a record,
//! and nothing else.
//!
//! What a record says (its expiry, its lease's token, its request's
//! fingerprint, its scope and key, and once finished its response) is
//! written end to end in one `Box<[u8]>`: one allocation a record, and a
//! map slot of 16 bytes. A response kept as a `StoredResponse` would hold
//! three or more (its header map, its body, its key), each rounded up by
//! the allocator, and a map slot of a hundred bytes or more.
//!
//! ```text
//! 0   expires      u64, little-endian: nanoseconds since the store's epoch
//! 8   token        two u64s, little-endian
//! 24  fingerprint  32 bytes
//! 56  lengths      the scope's, then the key's, LEB128 (a byte each, most)
//! ..  scope, key
//! ..  response     finished records only (see `put_response`)
//! ```

use std::hash::{BuildHasher, Hasher};

use bytes::Bytes;
use foldhash::fast::RandomState;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use super::super::{Claim, Fingerprint, LeaseToken, RecordKey, StoredResponse};

/// The bytes before the lengths of the scope and key.
const HEAD: usize = 56;
const EXPIRES: usize = 0;
const TOKEN: usize = 8;
const FINGERPRINT: usize = 24;

/// What a finished record costs beyond its own bytes, counted against the
/// store's byte bound: the allocator's header and rounding (8 to 24
/// bytes), its map slot (16 bytes and a control byte, in a table between
/// 7/16 and 7/8 full: 20 to 40), and its entry in its shard's queue (8 to
/// 16).
pub(super) const OVERHEAD: usize = 64;

/// Response flags.
const BODY_OMITTED: u8 = 1;
const TRAILERS: u8 = 2;

/// One record: a lease, or a finished one (see the module's docs).
pub(super) struct Record(Box<[u8]>);

impl Record {
    /// `claim`'s lease, until `expires`.
    pub(super) fn lease(claim: &Claim<'_>, expires: u64) -> Self {
        Self::build(claim, expires, 0, |_| {})
    }

    /// `claim`'s finished record of `response`, until `expires`; without
    /// its body (and saying so) unless `body`.
    pub(super) fn finished(
        claim: &Claim<'_>,
        expires: u64,
        response: &StoredResponse,
        body: bool,
    ) -> Self {
        let len = response_len(response, body);
        Self::build(claim, expires, len, |out| put_response(out, response, body))
    }

    fn build(
        claim: &Claim<'_>,
        expires: u64,
        tail: usize,
        put_tail: impl FnOnce(&mut Vec<u8>),
    ) -> Self {
        let RecordKey { scope, key } = claim.key;
        let (s, k) = (scope.len(), key.len());
        let mut out = Vec::with_capacity(HEAD + varint_len(s) + varint_len(k) + s + k + tail);
        out.extend_from_slice(&expires.to_le_bytes());
        out.extend_from_slice(&claim.token.0[0].to_le_bytes());
        out.extend_from_slice(&claim.token.0[1].to_le_bytes());
        out.extend_from_slice(&claim.fingerprint.0);
        put_varint(&mut out, s);
        put_varint(&mut out, k);
        out.extend_from_slice(scope.as_bytes());
        out.extend_from_slice(key.as_bytes());
        put_tail(&mut out);
        Self(out.into_boxed_slice())
    }

    fn u64_at(&self, at: usize) -> u64 {
        let mut b = [0; 8];
        b.copy_from_slice(&self.0[at..at + 8]);
        u64::from_le_bytes(b)
    }

    /// When it expires, in nanoseconds since the store's epoch.
    pub(super) fn expires(&self) -> u64 {
        self.u64_at(EXPIRES)
    }

    /// Its lease holds until `expires` now.
    pub(super) fn set_expires(&mut self, expires: u64) {
        self.0[EXPIRES..EXPIRES + 8].copy_from_slice(&expires.to_le_bytes());
    }

    /// Its lease's token.
    pub(super) fn token(&self) -> LeaseToken {
        LeaseToken([self.u64_at(TOKEN), self.u64_at(TOKEN + 8)])
    }

    /// Its request's fingerprint.
    pub(super) fn fingerprint(&self) -> Fingerprint {
        let mut f = [0; 32];
        f.copy_from_slice(&self.0[FINGERPRINT..FINGERPRINT + 32]);
        Fingerprint(f)
    }

    /// Its scope, its key, and its response's bytes (none for a lease).
    #[inline(always)]
    fn parts(&self) -> (&[u8], &[u8], &[u8]) {
        let (scope, at) = varint_at(&self.0, HEAD);
        let (key, at) = varint_at(&self.0, at);
        let (scope, rest) = self.0[at..].split_at(scope);
        let (key, response) = rest.split_at(key);
        (scope, key, response)
    }

    /// Whether it is the record of `key`.
    pub(super) fn is(&self, key: &RecordKey<'_>) -> bool {
        let (s, k, _) = self.parts();
        s == key.scope.as_bytes() && k == key.key.as_bytes()
    }

    /// Its scope and key.
    pub(super) fn key(&self) -> (&[u8], &[u8]) {
        let (s, k, _) = self.parts();
        (s, k)
    }

    /// The hash of its scope and key (as [`hash`]).
    pub(super) fn hash(&self, hasher: &RandomState) -> u64 {
        let (s, k, _) = self.parts();
        hash(hasher, s, k)
    }

    /// Whether it is finished.
    pub(super) fn is_done(&self) -> bool {
        !self.parts().2.is_empty()
    }

    /// Its response's bytes, once finished (read by [`read_response`]).
    pub(super) fn response(&self) -> Option<&[u8]> {
        let (_, _, response) = self.parts();
        (!response.is_empty()).then_some(response)
    }

    /// What it costs, as the store's byte bound counts it.
    pub(super) fn cost(&self) -> usize {
        self.0.len() + OVERHEAD
    }
}

/// The hash of a record's scope and key: the scope's length first, so that
/// the same bytes split another way hash (and compare) apart.
pub(super) fn hash(hasher: &RandomState, scope: &[u8], key: &[u8]) -> u64 {
    let mut h = hasher.build_hasher();
    h.write_usize(scope.len());
    h.write(scope);
    h.write(key);
    h.finish()
}

/// The bytes `put_response` writes.
fn response_len(response: &StoredResponse, body: bool) -> usize {
    let map = |m: &HeaderMap| {
        varint_len(m.len())
            + m.iter()
                .map(|(n, v)| {
                    let (n, v) = (n.as_str().len(), v.len());
                    varint_len(n) + n + varint_len(v) + v
                })
                .sum::<usize>()
    };
    let body = if body { response.body.len() } else { 0 };
    3 + map(&response.headers) + response.trailers.as_ref().map_or(0, map) + body
}

/// A response, compactly: its status (u16, little-endian), its flags
/// (body omitted, trailers), its headers (a count, then each name and
/// value, each after its length, as LEB128 varints), its trailers if it
/// has them (the same), then its body to the end.
fn put_response(out: &mut Vec<u8>, response: &StoredResponse, body: bool) {
    out.extend_from_slice(&response.status.as_u16().to_le_bytes());
    let omitted = response.body_omitted || (!body && !response.body.is_empty());
    let flags = if omitted { BODY_OMITTED } else { 0 }
        | if response.trailers.is_some() {
            TRAILERS
        } else {
            0
        };
    out.push(flags);
    put_map(out, &response.headers);
    if let Some(trailers) = &response.trailers {
        put_map(out, trailers);
    }
    if body {
        out.extend_from_slice(&response.body);
    }
}

fn put_map(out: &mut Vec<u8>, map: &HeaderMap) {
    put_varint(out, map.len());
    for (name, value) in map {
        put_varint(out, name.as_str().len());
        out.extend_from_slice(name.as_str().as_bytes());
        put_varint(out, value.len());
        out.extend_from_slice(value.as_bytes());
    }
}

fn varint_len(mut n: usize) -> usize {
    let mut len = 1;
    while n >= 0x80 {
        n >>= 7;
        len += 1;
    }
    len
}

fn put_varint(out: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// The LEB128 number at `at` in a record's bytes (which the store wrote),
/// and where it ends: a byte, most often, read at once.
#[inline(always)]
fn varint_at(bytes: &[u8], at: usize) -> (usize, usize) {
    match bytes[at] {
        b @ 0..0x80 => (usize::from(b), at + 1),
        _ => long_varint_at(bytes, at),
    }
}

fn long_varint_at(bytes: &[u8], mut at: usize) -> (usize, usize) {
    let (mut n, mut shift) = (0usize, 0);
    loop {
        let b = bytes[at];
        at += 1;
        n |= usize::from(b & 0x7f) << shift;
        if b < 0x80 {
            return (n, at);
        }
        shift += 7;
    }
}

/// What `put_response` wrote; `None` if it is not such a response.
pub(super) fn read_response(bytes: &[u8]) -> Option<StoredResponse> {
    let mut r = Reader(bytes);
    let status = r.take(2)?;
    let status = StatusCode::from_u16(u16::from_le_bytes([status[0], status[1]])).ok()?;
    let flags = r.take(1)?[0];
    let headers = r.map()?;
    let trailers = if flags & TRAILERS != 0 {
        Some(r.map()?)
    } else {
        None
    };
    Some(StoredResponse {
        status,
        headers,
        body: Bytes::copy_from_slice(r.0),
        body_omitted: flags & BODY_OMITTED != 0,
        trailers,
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn varint(&mut self) -> Option<usize> {
        let mut n = 0usize;
        for shift in (0..usize::BITS).step_by(7) {
            let b = self.take(1)?[0];
            n |= usize::from(b & 0x7f).checked_shl(shift)?;
            if b < 0x80 {
                return Some(n);
            }
        }
        None
    }

    fn chunk(&mut self) -> Option<&'a [u8]> {
        let n = self.varint()?;
        self.take(n)
    }

    fn map(&mut self) -> Option<HeaderMap> {
        let n = self.varint()?;
        let mut map = HeaderMap::with_capacity(n.min(self.0.len() / 2));
        for _ in 0..n {
            let name = HeaderName::from_bytes(self.chunk()?).ok()?;
            let value = HeaderValue::from_bytes(self.chunk()?).ok()?;
            map.append(name, value);
        }
        Some(map)
    }
}
