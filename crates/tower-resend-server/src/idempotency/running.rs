//! The keys whose work runs in this process, so that a duplicate sent to
//! this process is told "in progress" by it, whatever the store's lease
//! says.
//!
//! A lease is the store's word on who runs a key, and it can lapse while
//! its holder still works: store calls slower than the lease allows, a
//! process that stalls (see the module docs). Past it, the store grants the
//! key to the next request, and the work runs twice. But a duplicate that
//! reaches the process where the work still runs needs no store to know
//! it is in progress: this process asks itself first. It cannot speak for
//! another process's work (there the lease is all there is), nor for work
//! it does not run (a key it has no entry for is the store's to answer).

use std::hash::{BuildHasher, Hasher};
use std::sync::{Mutex, PoisonError};

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use crate::store::{Fingerprint, LeaseToken};

/// How many locks the keys are spread over (a power of two): requests of
/// different keys rarely wait on one another.
const SHARDS: usize = 16;

/// The keys one layer's services run, by a hash of (scope, key), with the
/// fingerprint of the request that runs each and its lease's token.
pub(crate) struct Running {
    hasher: RandomState,
    shards: [Mutex<HashTable<Entry>>; SHARDS],
}

/// A request's scope and key (as the header's bytes: no text made of them).
pub(crate) type Key<'a> = (&'a str, &'a [u8]);

/// A key that runs here: its hash, its request's fingerprint, its lease.
struct Entry {
    hash: u64,
    fingerprint: Fingerprint,
    token: LeaseToken,
}

impl Default for Running {
    fn default() -> Self {
        Self {
            hasher: RandomState::default(),
            shards: std::array::from_fn(|_| Mutex::default()),
        }
    }
}

impl Running {
    /// The hash `key` is kept under (the scope's length first, so that the
    /// same bytes split another way hash apart), and its shard. (Found
    /// again at each step rather than kept: kept, it would grow every keyed
    /// request's future.)
    fn find(&self, (scope, key): Key<'_>) -> (u64, &Mutex<HashTable<Entry>>) {
        let mut h = self.hasher.build_hasher();
        h.write_usize(scope.len());
        h.write(scope.as_bytes());
        h.write(key);
        let hash = h.finish();
        // Bits the table inside uses for neither its slot (the low ones) nor
        // its tag (the top seven).
        (hash, &self.shards[(hash >> 32) as usize % SHARDS])
    }

    /// The fingerprint of the request whose work runs here under `key`, if
    /// one does. (Two keys that share a hash, one in 2^64, would make the
    /// other's requests wait or be refused as they would be under its key:
    /// never run twice.)
    pub(crate) fn runs(&self, key: Key<'_>) -> Option<Fingerprint> {
        let (hash, shard) = self.find(key);
        let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        shard.find(hash, |e| e.hash == hash).map(|e| e.fingerprint)
    }

    /// `key` runs here from now, for a request of `fingerprint`, under the
    /// lease of `token`.
    pub(crate) fn start(&self, key: Key<'_>, fingerprint: Fingerprint, token: LeaseToken) {
        let (hash, shard) = self.find(key);
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = Entry {
            hash,
            fingerprint,
            token,
        };
        match shard.find_mut(hash, |e| e.hash == hash) {
            Some(taken_over) => *taken_over = entry,
            None => {
                shard.insert_unique(hash, entry, |e| e.hash);
            }
        }
    }

    /// `key` no longer runs here under the lease of `token` (an entry of
    /// another lease, which took the key over, stays).
    pub(crate) fn end(&self, key: Key<'_>, token: LeaseToken) {
        let (hash, shard) = self.find(key);
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        if let Ok(entry) = shard.find_entry(hash, |e| e.hash == hash && e.token == token) {
            entry.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key runs from its start to its end, with the fingerprint of the
    /// request that runs it; keys of other scopes are others; the end of a
    /// lease that was taken over leaves its successor's entry.
    #[test]
    fn a_key_runs_from_its_start_to_its_end_for_its_fingerprint() {
        let running = Running::default();
        let (a, b) = (Fingerprint([1; 32]), Fingerprint([2; 32]));
        let key = ("alice", &b"k"[..]);
        let theirs = ("bob", &b"k"[..]);
        let (first, second) = (LeaseToken::random(), LeaseToken::random());
        assert_eq!(running.runs(key), None);
        running.start(key, a, first);
        running.start(theirs, b, first);
        assert_eq!(
            (running.runs(key), running.runs(theirs)),
            (Some(a), Some(b))
        );
        running.end(key, first);
        assert_eq!((running.runs(key), running.runs(theirs)), (None, Some(b)));
        running.start(key, a, first);
        running.start(key, b, second);
        running.end(key, first);
        assert_eq!(running.runs(key), Some(b));
        running.end(key, second);
        assert_eq!(running.runs(key), None);
    }
}
