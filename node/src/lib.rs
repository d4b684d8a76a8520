//! The Kindred node as a library: everything the `kindred` binary is made of, usable by tests.
//!
//! - [`trainer`]: the `kindred-trainer` crate (real MNIST data, per-node tasks and shards, the
//!   built-in candle models over a flat parameter vector), re-exported; the simulator uses that
//!   crate directly, without the node's HTTP, storage and networking.
//! - [`engine`]: one node's model, distiller and store, and the two halves of a round.
//! - [`exchange`]: the hub exchange's network driver (the default exchange): runs the sans-IO
//!   core `kindred_routing::exchange` over the routing task's exchange RPCs.
//! - [`run`]: the tokio driver — routing task, local API, wall-clock round schedule, shutdown.
//! - [`api`]: the local HTTP API (status, metrics, external trainer).
//! - [`demo`]: `kindred demo`, a local swarm of real node processes and a results table.
//! - [`config`]: the TOML config file, with env and flag overrides.
//! - [`metrics`]: Prometheus metrics of the round loop and the routing layer.
//! - [`store`]: crash-safe state — sled records plus atomically written, content-addressed blobs.

pub mod api;
pub mod bench_model;
pub mod config;
pub mod demo;
pub mod engine;
pub mod exchange;
pub mod merged;
pub mod metrics;
pub mod run;
pub mod staged;
pub mod store;
pub mod update_stream;
pub use kindred_trainer as trainer;

/// The log filter a node runs with when `RUST_LOG` is not set: info, without the per-connection
/// chatter of libp2p or the index parameters `hnsw_rs` prints whenever it builds a graph.
pub const DEFAULT_LOG_FILTER: &str = "info,libp2p=warn,hnsw_rs=warn";
