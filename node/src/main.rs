//! `kindred`: the node a user runs, one per GPU host.
//!
//! It will train (or receive updates from a local trainer), distill each update into a signed
//! outcome packet, announce it under semantic keys in the Kademlia DHT, find the peers whose updates
//! point the same way, merge with them, and checkpoint — surviving crashes and restarts. The
//! protocol, kernels, distillation and routing it is built from live in the library crates.

use clap::Parser;

/// Kindred node: decentralised training that merges only with peers whose updates are similar.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    anyhow::bail!(
        "this build of kindred has no node commands yet; `kindred --help` lists what it supports"
    )
}
