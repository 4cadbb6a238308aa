//! Benchmarks of resend (`cargo bench -p resend-benches`); results and the
//! commands that reproduce them are in BENCHMARKS.md at the workspace root.
