//! The Kindred node as a library: everything the `kindred` binary is made of, usable by the
//! simulator and by tests.
//!
//! - [`trainer`]: real MNIST data, per-node tasks (rotation / label-permutation clusters) and
//!   shards, and the built-in candle models (MLP, CNN) over a flat parameter vector.
//! - [`store`]: crash-safe state — sled records plus atomically written, content-addressed blobs.

pub mod store;
pub mod trainer;
