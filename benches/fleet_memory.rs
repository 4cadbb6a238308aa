//! The memory an instance of a fleet takes: a fleet of 10 000 made, the
//! bytes allocated and still held, per instance (DESIGN section 11). A
//! bench of its own: the counting allocator it needs would slow every
//! allocation of `fleet_cost`'s threads with a count they all write.
//!
//! `cargo bench -p tower-resend-benches --bench fleet_memory`
#![allow(missing_docs, clippy::print_stdout)]

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower_resend::fleet::FleetLayer;

#[global_allocator]
static GLOBAL: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

fn main() {
    const N: usize = 10_000;
    let addresses: Vec<String> = (0..N)
        .map(|i| format!("http://10.{}.{}.{}:80", i >> 16, (i >> 8) & 255, i & 255))
        .collect();
    let region = Region::new(GLOBAL);
    let fleet = FleetLayer::fixed(addresses).expect("valid bases");
    let held = region.change();
    let per_instance = (held.bytes_allocated - held.bytes_deallocated) as f64 / N as f64;
    drop(fleet);
    println!("memory per instance (a fleet of 10 000): {per_instance:.0} B");
}
