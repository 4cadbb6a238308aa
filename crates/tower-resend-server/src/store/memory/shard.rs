//! One shard of the memory store: a map of records, and the order its
//! finished ones were written in, for the sweep of expired records and the
//! eviction of the oldest.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;

use hashbrown::hash_table::{Entry, HashTable};

use super::super::RecordKey;
use super::record::Record;
use super::Shared;

/// One shard: its records, and the order its finished ones were written
/// in. (Leases are in no queue: a lease ends as a finished record or is
/// let go, and an expired one reads as absent; the rare one left behind is
/// found when room is needed.) A record holds its key: a request finds it
/// by the hash of its scope and key, with no key built to look it up.
#[derive(Default)]
pub(super) struct Shard {
    records: HashTable<Record>,
    /// The hashes of finished records, by when they were written (and so
    /// by when they expire: a store's records are written with one layer's
    /// TTL), for the sweep, and the oldest for eviction. An entry whose
    /// hash finds no finished record is stale (the record was evicted, or
    /// taken over once expired), and dropped when it comes up.
    done: VecDeque<u64>,
}

impl Shard {
    /// The live record of `key` (`hash`), if any: one not expired by `now`.
    pub(super) fn live(&self, hash: u64, key: &RecordKey<'_>, now: u64) -> Option<&Record> {
        self.records
            .find(hash, |r| r.is(key))
            .filter(|r| r.expires() > now)
    }

    /// The same, to change.
    pub(super) fn live_mut(
        &mut self,
        hash: u64,
        key: &RecordKey<'_>,
        now: u64,
    ) -> Option<&mut Record> {
        self.records
            .find_mut(hash, |r| r.is(key))
            .filter(|r| r.expires() > now)
    }

    /// Drops the finished records whose time is up, in the queue's order.
    pub(super) fn sweep(&mut self, now: u64, shared: &Shared) {
        while let Some(&hash) = self.done.front() {
            match self.records.find_entry(hash, Record::is_done) {
                Ok(found) if found.get().expires() <= now => shared.forget(&found.remove().0),
                Ok(_) => return,
                Err(_) => {}
            }
            self.done.pop_front();
        }
    }

    /// Drops the expired leases (step 2 of the store's docs); how many.
    pub(super) fn purge_leases(&mut self, now: u64, shared: &Shared) -> usize {
        let before = self.records.len();
        self.records.retain(|r| {
            let keep = r.is_done() || r.expires() > now;
            if !keep {
                shared.forget(r);
            }
            keep
        });
        before - self.records.len()
    }

    /// When the oldest finished record expires, if any is left (stale
    /// queue entries are dropped on the way).
    pub(super) fn oldest_done(&mut self) -> Option<u64> {
        while let Some(&hash) = self.done.front() {
            if let Some(r) = self.records.find(hash, Record::is_done) {
                return Some(r.expires());
            }
            self.done.pop_front();
        }
        None
    }

    /// Evicts the oldest finished record.
    pub(super) fn evict_oldest(&mut self, shared: &Shared) -> bool {
        while let Some(hash) = self.done.pop_front() {
            if let Ok(found) = self.records.find_entry(hash, Record::is_done) {
                shared.forget(&found.remove().0);
                return true;
            }
        }
        false
    }

    /// Writes `record` (of `hash`) in place of what was there, and queues
    /// it if it is finished.
    pub(super) fn write(&mut self, hash: u64, record: Record, shared: &Shared) {
        if record.is_done() {
            shared.bytes.fetch_add(record.cost(), Relaxed);
            self.done.push_back(hash);
        }
        shared.records.fetch_add(1, Relaxed);
        let (hasher, key) = (&shared.hasher, record.key());
        match self
            .records
            .entry(hash, |r| r.key() == key, |r| r.hash(hasher))
        {
            Entry::Occupied(mut found) => {
                shared.forget(found.get());
                *found.get_mut() = record;
            }
            Entry::Vacant(slot) => {
                slot.insert(record);
            }
        }
    }

    /// Removes `key`'s record (`hash`) if `remove` says so.
    pub(super) fn remove_if(
        &mut self,
        hash: u64,
        key: &RecordKey<'_>,
        remove: impl FnOnce(&Record) -> bool,
        shared: &Shared,
    ) {
        if let Ok(found) = self.records.find_entry(hash, |r| r.is(key)) {
            if remove(found.get()) {
                shared.forget(&found.remove().0);
            }
        }
    }
}
