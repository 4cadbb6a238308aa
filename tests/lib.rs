//! End-to-end tests of resend across crates, on loopback: the test targets
//! of this package (`cargo test -p resend-tests`) run resend's stacks over
//! hyper-util against `resend-testkit`'s scripted server.
