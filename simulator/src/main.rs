//! `kindred-sim`: drives thousands to a million virtual Kindred nodes through the same keying,
//! distillation and synthesis code as the real node, in virtual time, and draws scaling curves
//! offline (hops, RPCs, latency, recall, bytes and accuracy as N, churn and latency grow).

use clap::Parser;

/// Kindred simulator: scaling curves for semantic routing and merging, offline.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    anyhow::bail!(
        "this build of kindred-sim has no simulation commands yet; `kindred-sim --help` lists what it supports"
    )
}
