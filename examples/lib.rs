//! Runnable demos of resend. Run them from the workspace root:
//! `cargo run --example quickstart`. Each starts what it calls on 127.0.0.1.
