//! `kindred-sim`: drives thousands to a million virtual Kindred nodes through the same keying,
//! distillation and synthesis code as the real node, in virtual time, and draws scaling curves
//! offline (hops, RPCs, latency, recall, bytes and accuracy as N, churn and latency grow).
//!
//! Every subcommand takes `--seed` (same seed, same figures), `--json` (the last stdout line is
//! one JSON object with the run's summary; the human table goes to stderr) and `--out DIR` (CSV
//! per run and SVG plots).

mod cmd;

use clap::{Parser, Subcommand};

/// Kindred simulator: scaling curves for semantic routing and merging, offline.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Routing tier: a Kademlia model of up to 10^6 nodes announcing and looking up semantic
    /// keys; hops, requests, latency, success under churn, recall@k against brute force.
    Routing(cmd::routing::RoutingArgs),
    /// Learning tier: virtual nodes train the MNIST MLP on their shards under task clusters,
    /// distill, find partners (semantic routing, gossip, all-reduce, local, oracle) and merge.
    Learn(cmd::learn::LearnArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Routing(args) => cmd::routing::run(&args),
        Command::Learn(args) => cmd::learn::run(&args),
    }
}
