//! Loopback throughput (placeholder).
fn main() {}
