//! The learning tier: thousands of virtual nodes training real candle models on real MNIST,
//! packing their updates with `kindred-distill`, finding partners (among them through the
//! routing model) and merging with `kindred_distill::synthesize`, under several policies at once.
//!
//! [`run()`] executes a [`LearnConfig`]: every [`PolicySpec`] (partner selection × wire format ×
//! merge rule) runs on its own copy of the nodes from the same initial model, shards and
//! minibatches; [`LearnReport`] holds per-round accuracy, traffic, partners and purity per policy.
//! The building blocks (settings, compression policies, hostile nodes) are public so that
//! experiments (`kindred-sim experiment`) can compose their own tables from the same loop.
//!
//! Data: MNIST's 10,000 test digits (the only part shipped with Kindred), split into training and
//! held-out evaluation digits; every task cluster uses the whole training part under its own
//! transform and shares it out among its nodes, so with 1,000 nodes and 4 clusters a node holds
//! 32 digits. Accuracy is measured on held-out digits under the node's own task.

pub mod config;
pub mod run;

pub use config::{
    Attack, Compression, Consensus, Faults, Hostile, HubConfig, LearnConfig, Merge, Partners,
    PolicySpec, Setting, TREE_MERGE_DENSITY,
};
pub use run::{LearnError, LearnReport, PolicyReport, RoundStats, run};
