//! Cross-crate and multi-process tests for Kindred.
//!
//! Tests that span crates live here, in `tests/tests/`, with this library as their shared harness
//! (the rust-libp2p `swarm-test` pattern): real `kindred` node processes on loopback, killed and
//! restarted mid-round; hostile peers sending malformed, oversize and forged packets; private
//! swarms with right and wrong keys. Single-crate behaviour is tested in its own crate.
