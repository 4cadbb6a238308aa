//! Runnable demos of resend. Run them from the workspace root:
//! `cargo run --example quickstart`. Each starts what it calls on 127.0.0.1.

use std::time::Duration;

/// A duration as the examples print it: whole milliseconds ("1307 ms").
pub fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

/// The README's Rust blocks, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
