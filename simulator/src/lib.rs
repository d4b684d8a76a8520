//! `kindred-sim`'s library: virtual Kindred networks, from a compact Kademlia model of 10^6
//! nodes to learning runs of thousands of virtual nodes training real models, all driven through
//! the same keying (`kindred-routing`), SimHash (`kindred-kernels`), distillation and synthesis
//! (`kindred-distill`) code as the real node.
//!
//! # Tiers
//! - [`routing`]: a sans-IO Kademlia model in virtual time. Node ids are `u64` points of the XOR
//!   metric, nodes are `u32` indices, k-buckets live in one flat array. Lookups replicate
//!   libp2p-kad's closest-peers iterator (α-parallel, stall handling, termination on the `k`
//!   closest) and run as independent state machines with their own event queues; a global clock
//!   advances in epochs, between which churn, table repair and record storage are applied in a
//!   deterministic order. Semantic workload: every node announces its real band keys
//!   ([`kindred_routing::keys`]) and queriers look them up with multi-probe; recall@k is checked
//!   against brute force.
//! - [`learn`]: the learning tier (virtual nodes training candle models, distilling, finding
//!   partners through the routing model, merging), comparing policies in one run.
//! - [`calibrate`]: the model against a real swarm of `kindred-routing` nodes at the same N.
//!
//! Every run is a pure function of its configuration and seed: the same seed gives the same
//! figures, whatever the thread count.

pub mod calibrate;
pub mod cohorts;
pub mod csv;
pub mod experiment;
pub mod learn;
pub mod mem;
pub mod plot;
pub mod rng;
pub mod routing;
pub mod stats;

/// Progress callback of every long run: `(stage, done, total)`. Runs call it from worker
/// threads, hence `Sync`.
pub type ProgressFn<'a> = &'a (dyn Fn(&str, u64, u64) + Sync);
