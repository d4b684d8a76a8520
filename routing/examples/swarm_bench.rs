//! Round-lookup benchmark: N real routing nodes on loopback (TCP by default) in one process,
//! holding updates from planted clusters; every node announces, then every node runs its round
//! lookup. Reports recall@5 against brute force, Kademlia requests per provider lookup (from
//! kad's own query statistics), lookup latency, and bodies fetched across clusters.
//!
//! ```text
//! cargo run --release -p kindred-routing --example swarm_bench -- --nodes 64
//! ```
//!
//! The last line of output is one JSON object:
//! `{"nodes":…,"recall_at_5":…,"requests_per_lookup_p50":…,"lookup_ms_p50":…,"lookup_ms_p95":…,"cross_cluster_bodies":…}`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::num::NonZeroUsize;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use kindred_routing::TransportKind;
use support::*;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum JoinMode {
    /// Dial node 0, then a Kademlia bootstrap per node.
    Bootstrap,
    /// Give each node its 20 XOR-closest and 20 random peers (no join traffic).
    Seeded,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Transport {
    Tcp,
    Memory,
}

/// Planted-cluster round lookups over a local swarm.
#[derive(Parser, Debug)]
struct Args {
    /// Nodes in the swarm.
    #[arg(long, default_value_t = 64)]
    nodes: usize,
    /// Planted clusters (tasks). Default: 4, or N/8 below 32 nodes, so that every node's 5
    /// nearest neighbours are in its own cluster.
    #[arg(long)]
    clusters: Option<usize>,
    /// Noise norm around each cluster direction (0.25 ≈ 14° from the direction).
    #[arg(long, default_value_t = 0.25)]
    noise: f32,
    /// Seed of the embeddings and identities.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Byte transport.
    #[arg(long, value_enum, default_value_t = Transport::Tcp)]
    transport: Transport,
    /// How routing tables are filled before the measured round.
    #[arg(long, value_enum, default_value_t = JoinMode::Bootstrap)]
    join: JoinMode,
    /// Rounds to run; only the last is measured (earlier rounds let nodes learn which bands
    /// are hot and shard them).
    #[arg(long, default_value_t = 1)]
    rounds: u64,
    /// Round lookups run at the same time (1 measures an uncontended lookup).
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// Override the Kademlia replication factor k (default: the crate's).
    #[arg(long)]
    replication: Option<usize>,
    /// Override the Kademlia parallelism α (default: the crate's).
    #[arg(long)]
    alpha: Option<usize>,
    /// Override the provider quorum (0: no early finish).
    #[arg(long)]
    quorum: Option<usize>,
    /// Override the number of multi-probe keys.
    #[arg(long)]
    probes: Option<usize>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    anyhow::ensure!(args.nodes >= 2, "need at least two nodes");
    let clusters = args.clusters.unwrap_or((args.nodes / 8).clamp(1, 4));
    anyhow::ensure!(clusters >= 1, "need at least one cluster");
    let spec = SwarmSpec {
        nodes: args.nodes,
        clusters,
        noise: args.noise,
        seed: args.seed,
        kind: match args.transport {
            Transport::Tcp => TransportKind::Tcp,
            Transport::Memory => TransportKind::Memory,
        },
        join: match args.join {
            JoinMode::Bootstrap => Join::Bootstrap,
            JoinMode::Seeded => Join::Seeded {
                closest: 20,
                random: 20,
            },
        },
        configure: {
            let (k, alpha, quorum, probes) =
                (args.replication, args.alpha, args.quorum, args.probes);
            Box::new(move |c| {
                if let Some(k) = k.and_then(NonZeroUsize::new) {
                    c.kad.replication_factor = k;
                }
                if let Some(a) = alpha.and_then(NonZeroUsize::new) {
                    c.kad.parallelism = a;
                }
                if let Some(q) = quorum {
                    c.core.lookup.provider_quorum = q;
                }
                if let Some(p) = probes {
                    c.core.lookup.probes = p;
                }
            })
        },
    };
    let t = Instant::now();
    let nodes = start_swarm(&spec).await;
    println!(
        "{} nodes started and bootstrapped in {:.1}s",
        args.nodes,
        t.elapsed().as_secs_f64()
    );
    let mut nodes = nodes;
    for round in 1..=args.rounds.max(1) {
        if round > 1 {
            warm_up(&nodes, 8).await;
            next_round(&mut nodes, &spec, round);
        }
        let t = Instant::now();
        let failed = announce_all(&nodes).await;
        println!(
            "round {round}: announced in {:.1}s ({failed} key publications failed)",
            t.elapsed().as_secs_f64()
        );
    }
    let t = Instant::now();
    let f = measure(&nodes, args.parallel).await;
    println!(
        "{} round lookups in {:.1}s ({} at a time)",
        args.nodes,
        t.elapsed().as_secs_f64(),
        args.parallel
    );
    let mut served = 0u64;
    let mut rejects = std::collections::BTreeMap::new();
    let mut failures = std::collections::BTreeMap::new();
    for n in &nodes {
        let m = n.handle.metrics().await.context("node stopped")?;
        served += m.body.responses_sent.bytes + m.headers.responses_sent.bytes;
        for (k, v) in m.rejects {
            *rejects.entry(k).or_insert(0u64) += v;
        }
        for (k, v) in m.request_failures {
            *failures.entry(k).or_insert(0u64) += v;
        }
    }
    println!("rejects {rejects:?}; request failures {failures:?}");
    shutdown(nodes).await;

    let r = &f.requests_per_lookup;
    let mean = r.iter().map(|&x| f64::from(x)).sum::<f64>() / r.len().max(1) as f64;
    println!(
        "recall@5 {:.3}; kad requests per provider lookup p50 {} p95 {} max {} mean {:.1} \
         (3·log2 N = {:.1}); {:.1} provider lookups and {:.1} header requests per round lookup; \
         {} bodies fetched, {} across clusters; {:.1} KiB served per node",
        f.recall_at_5,
        percentile(r, 50.0),
        percentile(r, 95.0),
        r.last().copied().unwrap_or(0),
        mean,
        3.0 * (args.nodes as f64).log2(),
        f.key_lookups_per_round,
        f.header_requests_per_round,
        f.bodies,
        f.cross_cluster_bodies,
        served as f64 / 1024.0 / args.nodes as f64,
    );
    println!(
        "{}",
        serde_json::json!({
            "nodes": f.nodes,
            "recall_at_5": (f.recall_at_5 * 1000.0).round() / 1000.0,
            "requests_per_lookup_p50": percentile(r, 50.0),
            "lookup_ms_p50": (percentile(&f.lookup_ms, 50.0) * 10.0).round() / 10.0,
            "lookup_ms_p95": (percentile(&f.lookup_ms, 95.0) * 10.0).round() / 10.0,
            "cross_cluster_bodies": f.cross_cluster_bodies,
        })
    );
    Ok(())
}
