//! The `MemoryStore`'s memory: bytes a record, for 1 M finished records of
//! a small response, for 1 M live leases, and for `MemoryStore::new()` at
//! its default 100 000-record bound.
//!
//! Two figures each: the bytes allocated (a counting global allocator
//! around the system one) and the resident memory the process gained
//! (`/proc/self/statm`), each case in a process of its own so that one
//! case's freed memory is not the next one's. Also the bytes the store
//! counts against its byte bound (`MemoryStore::bytes`).
//!
//! Each record's scope and key are 45 bytes (a 17-byte scope, a 28-byte
//! key); a finished one's response is a 200 with a 100-byte body, with no
//! header or with `content-type: text/plain; charset=utf-8` (what axum
//! gives a `String`).
//!
//! `cargo bench -p tower-resend-benches --bench memory_store`

#![allow(clippy::print_stdout)] // a bench reports on standard output

use std::alloc::System;
use std::process::Command;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower_resend_server::store::{
    Begin, Claim, Fingerprint, LeaseState, LeaseToken, RecordKey, Store, StoredResponse, Ttl,
};
use tower_resend_server::MemoryStore;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The environment variable that runs one case in a child process.
const CASE: &str = "RESEND_MEMORY_CASE";

const TTL: tokio::time::Duration = tokio::time::Duration::from_secs(3600);

/// A case: its name, how many records, whether they are finished, and the
/// store.
struct Case {
    name: &'static str,
    records: usize,
    finished: bool,
    headers: bool,
    store: fn() -> MemoryStore,
}

const CASES: &[Case] = &[
    Case {
        name: "1 M finished records (200, 100-byte body, no header)",
        records: 1_000_000,
        finished: true,
        headers: false,
        store: || MemoryStore::new().max_records(2_000_000).max_bytes(1 << 40),
    },
    Case {
        name: "1 M finished records (200, 100-byte body, content-type)",
        records: 1_000_000,
        finished: true,
        headers: true,
        store: || MemoryStore::new().max_records(2_000_000).max_bytes(1 << 40),
    },
    Case {
        name: "1 M live leases",
        records: 1_000_000,
        finished: false,
        headers: false,
        store: || MemoryStore::new().max_records(2_000_000).max_bytes(1 << 40),
    },
    Case {
        name: "MemoryStore::new() at its bound (100 000 finished, no header)",
        records: 100_000,
        finished: true,
        headers: false,
        store: MemoryStore::new,
    },
    Case {
        name: "MemoryStore::new() at its bound (100 000 finished, content-type)",
        records: 100_000,
        finished: true,
        headers: true,
        store: MemoryStore::new,
    },
];

/// The resident memory of this process, in bytes.
fn resident() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn live(region: &Region<'_, System>) -> isize {
    let c = region.change();
    c.bytes_allocated as isize - c.bytes_deallocated as isize
}

fn response(headers: bool) -> StoredResponse {
    let mut map = HeaderMap::new();
    if headers {
        map.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
    }
    StoredResponse::new(StatusCode::OK, map, Bytes::from(vec![b'x'; 100]))
}

/// Fills a store as `case` says; prints one row.
fn run(case: &Case) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let ttl = Ttl {
        lease: TTL,
        record: TTL,
    };
    let response = response(case.headers);
    // The keys are made first, outside the counted region.
    let keys: Vec<String> = (0..case.records)
        .map(|i| format!("01JD9ZKX4Q7M3C8V0H2N{i:08}"))
        .collect();
    let scope = "tenant-0000000001";
    let (rss, region) = (resident(), Region::new(GLOBAL));
    let store = (case.store)();
    rt.block_on(async {
        for k in &keys {
            let claim = Claim {
                key: RecordKey { scope, key: k },
                fingerprint: Fingerprint([7; 32]),
                token: LeaseToken::random(),
            };
            let begun = store.begin(&claim, ttl).await;
            assert!(matches!(begun, Ok(Begin::Acquired)), "{begun:?}");
            if case.finished {
                let done = store.complete(&claim, &response, ttl).await;
                assert!(matches!(done, Ok(LeaseState::Held)), "{done:?}");
            }
        }
    });
    let (allocated, gained) = (live(&region), resident() as isize - rss as isize);
    let n = store.len() as f64;
    println!(
        "| {} | {} | {:.0} | {:.0} | {:.1} MiB | {:.0} |",
        case.name,
        store.len(),
        allocated as f64 / n,
        gained as f64 / n,
        allocated as f64 / (1 << 20) as f64,
        store.bytes() as f64 / n,
    );
    drop(store);
}

fn main() {
    if let Ok(i) = std::env::var(CASE) {
        let i: usize = i.parse().unwrap_or(0);
        run(&CASES[i]);
        return;
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    println!("| case | records | allocated B/record | resident B/record | allocated | counted B/record |");
    println!("|---|---:|---:|---:|---:|---:|");
    for i in 0..CASES.len() {
        let status = Command::new(&exe)
            .env(CASE, i.to_string())
            .status()
            .unwrap_or_else(|e| panic!("{exe:?}: {e}"));
        assert!(status.success(), "case {i}: {status}");
    }
}
