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
    /// Calibration: a real swarm of kindred-routing nodes (N = 64 and 256 by default) in one
    /// process and the model at the same N, on the same workload: requests per lookup, success.
    Calibrate(cmd::calibrate::CalibrateArgs),
    /// Results on real MNIST: the selective-compression evaluation table (all-reduce, top-k,
    /// sign, selective, gossip) plus Kindred and the oracle, under IID, rotation and
    /// label-permutation clusters, several seeds, a poisoning run and cluster purity.
    Experiment(cmd::experiment::ExperimentArgs),
    /// Cohort tier: the hub exchange's core for up to 10^6 virtual nodes without training
    /// (synthetic update sketches per task, a DHT model, churn): how fast each task's nodes
    /// form one bounded tree, its depth, hub load, purity and bytes per node.
    Cohorts(cmd::cohorts::CohortsArgs),
}

/// candle asks for its thread count on every tensor operation, and unless `RAYON_NUM_THREADS`
/// is set that means parsing `/proc/cpuinfo` each time: about 40 % of the CPU time of a learning
/// run here. Training commands therefore re-run themselves once with the variable set (to the
/// available parallelism, which is what rayon would use anyway). Returns the child's exit code
/// when it re-ran.
fn rerun_with_rayon_threads() -> anyhow::Result<Option<i32>> {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return Ok(None);
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let status = std::process::Command::new(std::env::current_exe()?)
        .args(std::env::args_os().skip(1))
        .env("RAYON_NUM_THREADS", threads.to_string())
        .status()?;
    Ok(Some(status.code().unwrap_or(1)))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Learn(_) | Command::Experiment(_))
        && let Some(code) = rerun_with_rayon_threads()?
    {
        std::process::exit(code);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Routing(args) => cmd::routing::run(&args),
        Command::Learn(args) => cmd::learn::run(&args),
        Command::Calibrate(args) => cmd::calibrate::run(&args),
        Command::Experiment(args) => cmd::experiment::run(&args),
        Command::Cohorts(args) => cmd::cohorts::run_cmd(&args),
    }
}
