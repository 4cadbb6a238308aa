//! The `MemoryStore`'s byte bound holds the process's memory, not only its
//! own count: bytes measured by a counting allocator around the system one
//! (this test binary's global allocator).
//!
//! One test in this binary: the allocator's counts are the whole process's.

use std::alloc::System;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower_resend_server::store::{
    Begin, Claim, Fingerprint, LeaseState, LeaseToken, RecordKey, Store, StoredResponse, Ttl,
};
use tower_resend_server::MemoryStore;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const TTL: Ttl = Ttl {
    lease: std::time::Duration::from_secs(10),
    record: std::time::Duration::from_secs(3600),
};

/// The bytes allocated and not freed since `region` began.
fn live(region: &Region<'_, System>) -> usize {
    let c = region.change();
    c.bytes_allocated.saturating_sub(c.bytes_deallocated)
}

/// `n` keys (about 40 bytes with their scope) through `store`, each begun
/// and completed with `response`.
async fn fill(store: &MemoryStore, n: usize, response: &StoredResponse) {
    let token = LeaseToken::random();
    for i in 0..n {
        let k = format!("01JD9ZKX4Q7M3C8V{i:08}");
        let claim = Claim {
            key: RecordKey {
                scope: "tenant-0000001",
                key: &k,
            },
            fingerprint: Fingerprint([7; 32]),
            token,
        };
        assert_eq!(store.begin(&claim, TTL).await.unwrap(), Begin::Acquired);
        assert_eq!(
            store.complete(&claim, response, TTL).await.unwrap(),
            LeaseState::Held
        );
    }
}

fn response(body: usize) -> StoredResponse {
    StoredResponse::new(
        StatusCode::OK,
        HeaderMap::new(),
        Bytes::from(vec![b'x'; body]),
    )
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_byte_bound_holds_the_memory_the_store_takes() {
    // 1 KiB records into 16 MiB, three times over: it evicts, and the
    // memory it holds is the bound's, give or take a quarter.
    let max = 16 << 20;
    let one_kib = response(1024);
    let region = Region::new(GLOBAL);
    let store = MemoryStore::new().max_records(1 << 20).max_bytes(max);
    fill(&store, 3 * max / 1024, &one_kib).await;
    let allocated = live(&region);
    let counted = store.bytes();
    assert!(store.evicted() > 0, "the store never reached its bound");
    assert!(counted <= max, "{counted} counted, over {max}");
    assert!(
        allocated <= max + max / 4,
        "{allocated} bytes allocated for a {max}-byte bound"
    );
    assert!(
        counted.abs_diff(allocated) <= allocated / 4,
        "{counted} counted, {allocated} allocated"
    );
    drop(store);

    // A default store at its 100 000-record bound, of small records (a
    // 2xx, a 100-byte body): about 250 bytes each, counted within a
    // quarter too (the store before: about 370, by the `memory_store`
    // bench).
    let small = response(100);
    let region = Region::new(GLOBAL);
    let store = MemoryStore::new();
    fill(&store, 100_000, &small).await;
    let allocated = live(&region);
    let (n, counted) = (store.len(), store.bytes());
    assert_eq!((n, store.evicted()), (100_000, 0));
    assert!(allocated / n <= 300, "{} bytes a record", allocated / n);
    assert!(
        counted.abs_diff(allocated) <= allocated / 4,
        "{counted} counted, {allocated} allocated"
    );
}
