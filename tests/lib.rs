//! End-to-end tests of tower-resend across crates, on loopback: the test targets
//! of this package (`cargo test -p tower-resend-tests`) run tower-resend's stacks over
//! hyper-util against `tower-resend-testkit`'s scripted server.
