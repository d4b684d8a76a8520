//! The routing tier: a compact Kademlia model of up to 10^6 nodes in virtual time.
//!
//! See [`sim::run`] for what one run does and [`sim::RoutingReport`] for what it measures.
//! The parts, each sans-IO and testable alone:
//! - [`ids`]: node ids on the 64-bit XOR metric, sorted so id prefixes are index ranges;
//! - [`table`]: every node's k-buckets in one flat `u32` array;
//! - [`iter`]: libp2p-kad's closest-peers iterator, state for state;
//! - [`lookup`]: one lookup as a state machine with its own event queue;
//! - [`churn`], [`latency`], [`traffic`], [`records`]: the environment;
//! - [`workload`]: synthetic embeddings hashed and keyed by the real kernels and routing code.

pub mod churn;
pub mod ids;
pub mod iter;
pub mod latency;
pub mod lookup;
pub mod overlay;
pub mod records;
pub mod sim;
pub mod table;
pub mod traffic;
pub mod workload;

/// Virtual time and durations, in microseconds.
pub type Micros = u64;

pub use sim::{RoutingConfig, RoutingError, RoutingReport, run};
