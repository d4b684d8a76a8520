//! `kindred-sim cohorts`: the exchange core for N virtual nodes without training.

use std::path::Path;

use clap::Args;
use kindred_simulator::cohorts::{CohortsConfig, CohortsReport, Keys, run};
use kindred_simulator::csv::number as fmt;
use kindred_simulator::plot::{Chart, Series, line_chart};
use serde_json::{Value, json};

use super::common::{Common, progress_bar, progress_to};
use super::render::{Table, json_line, note};

/// Options of `kindred-sim cohorts`.
#[derive(Debug, Clone, Args)]
pub(crate) struct CohortsArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Virtual nodes; a comma-separated list runs a sweep (e.g. 10000,100000,1000000).
    #[arg(long, value_delimiter = ',', required = true)]
    pub(crate) nodes: Vec<usize>,
    /// Tasks (clusters of the synthetic update sketches).
    #[arg(long, default_value_t = 8)]
    pub(crate) tasks: usize,
    /// Rounds.
    #[arg(long, default_value_t = 20)]
    pub(crate) rounds: u64,
    /// Most pushes a hub admits (bounded hubs, trees); 0: one hub per cohort.
    #[arg(long, default_value_t = 64)]
    pub(crate) fanout: usize,
    /// Churn: share of nodes replaced per hour by new nodes of the same task (0.3 = 30 %/h).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) churn: f64,
    /// Probability that a message is lost.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) msg_loss: f64,
    /// A packet's body on the wire, bytes.
    #[arg(long, default_value_t = 15_000)]
    pub(crate) packet_bytes: usize,
    /// Rounds each node runs alone before it takes part.
    #[arg(long)]
    pub(crate) local_rounds: Option<u64>,
    /// What nodes search and announce under: `model` (the last merge they applied, as the
    /// node keys on its cumulative update) or `update` (their own update only).
    #[arg(long, value_enum, default_value_t = KeysArg::Model)]
    pub(crate) keys: KeysArg,
    /// Scale of within-task variation of the sketches.
    #[arg(long)]
    pub(crate) spread: Option<f32>,
    /// Scale of per-node noise of the sketches.
    #[arg(long)]
    pub(crate) noise: Option<f32>,
}

/// `--keys`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum KeysArg {
    /// The sketch of the node's model.
    Model,
    /// The sketch of its own update.
    Update,
}

impl CohortsArgs {
    fn config(&self, nodes: usize) -> CohortsConfig {
        let mut c = CohortsConfig::new(nodes, self.tasks, self.rounds);
        c.seed = self.common.seed;
        c.fanout = (self.fanout > 0).then_some(self.fanout);
        c.churn_per_hour = self.churn;
        c.msg_loss = self.msg_loss;
        c.packet_bytes = self.packet_bytes;
        c.keys = match self.keys {
            KeysArg::Model => Keys::Model,
            KeysArg::Update => Keys::Update,
        };
        if let Some(l) = self.local_rounds {
            c.local_rounds = l;
        }
        if let Some(x) = self.spread {
            c.workload.spread = x;
        }
        if let Some(x) = self.noise {
            c.workload.noise = x;
        }
        c
    }
}

/// The summary fields of one run (the JSON contract).
fn summary(r: &CohortsReport) -> Value {
    json!({
        "nodes": r.nodes,
        "tasks": r.tasks,
        "rounds": r.rounds,
        "fanout": r.fanout,
        "keys": format!("{:?}", r.keys).to_lowercase(),
        "churn": r.churn,
        "rounds_to_99": r.rounds_to_99,
        "largest_tree_share_min": r.largest_tree_share_min,
        "depth_max": r.depth_max,
        "members_per_hub_max": r.members_per_hub_max,
        "bytes_per_node_round": r.bytes_per_node_round.round(),
        "dht_bytes_per_node_round": r.dht_bytes_per_node_round.round(),
        "purity_min": r.purity_min,
        "seconds": (r.seconds * 10.0).round() / 10.0,
        "peak_rss_mb": r.peak_rss_mb.map(f64::round),
    })
}

pub(crate) fn run_cmd(args: &CohortsArgs) -> anyhow::Result<()> {
    let out = args.common.out_dir()?;
    let pb = progress_bar(args.common.json);
    let mut reports = Vec::new();
    for &n in &args.nodes {
        pb.set_prefix(format!("{n} nodes"));
        let report = run(&args.config(n), &progress_to(&pb))?;
        let mut t = Table::new(
            &format!(
                "cohorts: {n} nodes, {} tasks, fan-out {}, keys {:?}, churn {}/h, seed {}",
                args.tasks,
                report.fanout.map_or("none".into(), |m| m.to_string()),
                args.keys,
                args.churn,
                args.common.seed
            ),
            &[
                "round",
                "share min",
                "share mean",
                "trees",
                "alone",
                "depth",
                "fan-in max",
                "p99",
                "purity",
                "DHT B/node",
                "exch B/node",
                "searches",
                "missed",
                "replaced",
                "s",
            ],
        );
        for r in &report.per_round {
            t.row(vec![
                r.round.to_string(),
                format!("{:.4}", r.largest_tree_share_min),
                format!("{:.4}", r.largest_tree_share_mean),
                r.trees.to_string(),
                r.alone.to_string(),
                r.depth_max.to_string(),
                r.members_per_hub_max.to_string(),
                r.members_per_hub_p99.to_string(),
                format!("{:.4}", r.purity),
                format!("{:.0}", r.dht_bytes_per_node),
                format!("{:.0}", r.exchange_bytes_per_node),
                r.searches.to_string(),
                r.missed.to_string(),
                r.replaced.to_string(),
                format!("{:.1}", r.seconds),
            ]);
        }
        pb.suspend(|| t.print(args.common.json));
        if let Some(dir) = &out {
            write_rounds(dir, &report)?;
        }
        reports.push(report);
    }
    pb.finish_and_clear();
    if let Some(dir) = &out {
        plot(dir, &reports)?;
        note(
            args.common.json,
            &format!("CSV and plots in {}", dir.display()),
        );
    }
    let last = reports.last().map(summary).unwrap_or(Value::Null);
    let line = if reports.len() > 1 {
        let mut v = last;
        if let Some(o) = v.as_object_mut() {
            o.insert("runs".into(), reports.iter().map(summary).collect());
        }
        v
    } else {
        last
    };
    json_line(&line);
    Ok(())
}

fn write_rounds(dir: &Path, r: &CohortsReport) -> anyhow::Result<()> {
    let rows: Vec<Vec<String>> = r
        .per_round
        .iter()
        .map(|x| {
            vec![
                x.round.to_string(),
                x.nodes.to_string(),
                x.replaced.to_string(),
                fmt(x.largest_tree_share_min),
                fmt(x.largest_tree_share_mean),
                x.trees.to_string(),
                x.alone.to_string(),
                x.depth_max.to_string(),
                x.members_per_hub_max.to_string(),
                x.members_per_hub_p99.to_string(),
                fmt(x.purity),
                fmt(x.dht_bytes_per_node),
                fmt(x.exchange_bytes_per_node),
                x.searches.to_string(),
                x.missed.to_string(),
                fmt(x.seconds),
            ]
        })
        .collect();
    kindred_simulator::csv::write(
        &dir.join(format!("cohorts_{}.csv", r.nodes)),
        &[
            "round",
            "nodes",
            "replaced",
            "largest_tree_share_min",
            "largest_tree_share_mean",
            "trees",
            "alone",
            "depth_max",
            "members_per_hub_max",
            "members_per_hub_p99",
            "purity",
            "dht_bytes_per_node",
            "exchange_bytes_per_node",
            "searches",
            "missed",
            "seconds",
        ],
        &rows,
    )?;
    Ok(())
}

/// Share in the largest tree, depth and bytes against round (one series per N), and the
/// summary against N.
fn plot(dir: &Path, reports: &[CohortsReport]) -> anyhow::Result<()> {
    let by_round = |f: &dyn Fn(&kindred_simulator::cohorts::CohortsRound) -> f64| -> Vec<Series> {
        reports
            .iter()
            .map(|r| {
                Series::new(
                    format!("{} nodes", r.nodes),
                    r.per_round.iter().map(|x| (x.round as f64, f(x))).collect(),
                )
            })
            .collect()
    };
    let chart = |title, y_label, y_range| Chart {
        title,
        x_label: "round",
        y_label,
        log_x: false,
        log_y: false,
        y_range,
    };
    line_chart(
        &dir.join("cohorts_share_vs_round.svg"),
        &chart(
            "Smallest share of a task's nodes in its largest tree",
            "share",
            Some((0.0, 1.02)),
        ),
        &by_round(&|x| x.largest_tree_share_min),
    )?;
    line_chart(
        &dir.join("cohorts_depth_vs_round.svg"),
        &chart("Deepest tree", "levels", None),
        &by_round(&|x| x.depth_max as f64),
    )?;
    line_chart(
        &dir.join("cohorts_bytes_vs_round.svg"),
        &chart("Bytes per node per round (DHT + exchange)", "KB", None),
        &by_round(&|x| (x.dht_bytes_per_node + x.exchange_bytes_per_node) / 1000.0),
    )?;
    if reports.len() > 1 {
        let pts = |f: &dyn Fn(&CohortsReport) -> f64| -> Vec<(f64, f64)> {
            reports.iter().map(|r| (r.nodes as f64, f(r))).collect()
        };
        line_chart(
            &dir.join("cohorts_bytes_vs_nodes.svg"),
            &Chart {
                title: "Bytes per node per round after formation vs network size",
                x_label: "nodes (log scale)",
                y_label: "KB",
                log_x: true,
                log_y: false,
                y_range: None,
            },
            &[
                Series::new("DHT + exchange", pts(&|r| r.bytes_per_node_round / 1000.0)),
                Series::new("DHT", pts(&|r| r.dht_bytes_per_node_round / 1000.0)),
            ],
        )?;
        line_chart(
            &dir.join("cohorts_depth_vs_nodes.svg"),
            &Chart {
                title: "Deepest tree and rounds to 99% vs network size",
                x_label: "nodes (log scale)",
                y_label: "levels / rounds",
                log_x: true,
                log_y: false,
                y_range: None,
            },
            &[
                Series::new("depth", pts(&|r| r.depth_max as f64)),
                Series::new(
                    "rounds to 99%",
                    pts(&|r| r.rounds_to_99.map_or(f64::NAN, |x| x as f64)),
                ),
            ],
        )?;
    }
    Ok(())
}
