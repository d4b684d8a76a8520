//! `kindred-sim routing`: one run or a sweep over node counts, churn rates and seeds.

use std::path::{Path, PathBuf};

use clap::Args;
use kindred_routing::keys::KeyConfig;
use kindred_simulator::csv::number as fmt;
use kindred_simulator::plot::{Chart, Series, line_chart};
use kindred_simulator::routing::churn::ChurnConfig;
use kindred_simulator::routing::latency::Latency;
use kindred_simulator::routing::{RoutingConfig, RoutingReport};
use kindred_simulator::stats::{linear_fit, mean, sd};
use serde_json::{Value, json};

use super::common::{Common, progress_bar, progress_to};
use super::render::{Table, json_line, note, pm};

/// Options of `kindred-sim routing`.
#[derive(Debug, Clone, Args)]
pub(crate) struct RoutingArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Online nodes; a comma-separated list runs a sweep (e.g. 1000,10000,100000).
    #[arg(long, value_delimiter = ',', required = true)]
    pub(crate) nodes: Vec<usize>,
    /// Round lookups measured per run (each looks up every band key and probe key).
    #[arg(long, default_value_t = 1000)]
    pub(crate) lookups: usize,
    /// Runs per configuration, with seeds seed, seed+1, …; figures are mean ± sd over them.
    #[arg(long, default_value_t = 1)]
    pub(crate) repeat: u64,
    /// Churn: fraction of online nodes leaving per hour (0.3 = 30 %/h; 0 = static). A
    /// comma-separated list runs a sweep.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub(crate) churn: Vec<f64>,
    /// Long-run share of time a node is online, under churn.
    #[arg(long, default_value_t = 0.8)]
    pub(crate) availability: f64,
    /// Lomax shape of session and gap lengths (heavier-tailed when smaller; > 1).
    #[arg(long, default_value_t = 2.0)]
    pub(crate) session_shape: f64,
    /// Seconds of churn before the measured round.
    #[arg(long, default_value_t = 900)]
    pub(crate) warmup_s: u64,
    /// Bucket refresh period of every node, seconds.
    #[arg(long, default_value_t = 300)]
    pub(crate) refresh_s: u64,
    /// Epoch length in seconds (effects of lookups are applied between epochs).
    #[arg(long, default_value_t = 5.0)]
    pub(crate) epoch_s: f64,
    /// Multi-probe keys per round lookup (default: kindred-routing's).
    #[arg(long)]
    pub(crate) probes: Option<usize>,
    /// LSH bands (default: kindred-routing's 16).
    #[arg(long, default_value_t = 16)]
    pub(crate) bands: u16,
    /// Bits per band (default: kindred-routing's 16).
    #[arg(long, default_value_t = 16)]
    pub(crate) band_bits: u8,
    /// Median link RTT in milliseconds (log-normal per link).
    #[arg(long, default_value_t = 80.0)]
    pub(crate) latency_median_ms: f64,
    /// Standard deviation of ln(RTT) across links.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) latency_sigma: f64,
    /// A square matrix of site-to-site RTTs in ms (replaces the log-normal model).
    #[arg(long, value_name = "FILE")]
    pub(crate) latency_matrix: Option<PathBuf>,
    /// Share of online nodes that publish an update this round.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) publish_fraction: f64,
    /// Round lookups checked against brute force (default: 2e8 / publishers, within 100..=1000).
    #[arg(long)]
    pub(crate) recall_queries: Option<usize>,
    /// k of recall@k.
    #[arg(long, default_value_t = 5)]
    pub(crate) recall_k: usize,
    /// Task clusters of the synthetic embeddings.
    #[arg(long, default_value_t = 16)]
    pub(crate) clusters: usize,
    /// Embedding dimension.
    #[arg(long, default_value_t = 64)]
    pub(crate) dim: usize,
    /// Dimensions of within-task variation.
    #[arg(long, default_value_t = 8)]
    pub(crate) latent_dim: usize,
    /// Scale of within-task variation.
    #[arg(long, default_value_t = 0.3)]
    pub(crate) spread: f32,
    /// Scale of per-node noise.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) noise: f32,
    /// Lookup parallelism α (default: kindred-routing's).
    #[arg(long)]
    pub(crate) alpha: Option<usize>,
    /// Replication factor k (default: kindred-routing's).
    #[arg(long)]
    pub(crate) replication: Option<usize>,
    /// k-bucket size.
    #[arg(long, default_value_t = 20)]
    pub(crate) bucket_size: usize,
    /// Most providers a round lookup asks for headers (default: kindred-routing's).
    #[arg(long)]
    pub(crate) max_providers: Option<usize>,
}

impl RoutingArgs {
    fn config(&self, nodes: usize, churn: f64, seed: u64) -> anyhow::Result<RoutingConfig> {
        let mut c = RoutingConfig::new(nodes, self.lookups);
        c.seed = seed;
        c.churn = (churn > 0.0).then_some(ChurnConfig {
            rate_per_hour: churn,
            shape: self.session_shape,
            availability: self.availability,
        });
        c.warmup = self.warmup_s * 1_000_000;
        c.refresh_interval = self.refresh_s * 1_000_000;
        c.epoch = (self.epoch_s * 1e6) as u64;
        if let Some(p) = self.probes {
            c.probes = p;
        }
        c.keys = KeyConfig::new(self.bands, self.band_bits)?;
        c.latency = match &self.latency_matrix {
            Some(path) => Latency::from_matrix_file(path)?,
            None => Latency::LogNormal {
                median_ms: self.latency_median_ms,
                sigma: self.latency_sigma,
            },
        };
        c.publish_fraction = self.publish_fraction;
        c.recall_queries = self.recall_queries;
        c.recall_k = self.recall_k;
        c.workload.clusters = self.clusters;
        c.workload.dim = self.dim;
        c.workload.latent_dim = self.latent_dim;
        c.workload.spread = self.spread;
        c.workload.noise = self.noise;
        if let Some(a) = self.alpha {
            c.kad.alpha = a;
        }
        if let Some(r) = self.replication {
            c.kad.replication = r;
        }
        c.kad.bucket_size = self.bucket_size;
        if let Some(m) = self.max_providers {
            c.kad.max_providers = m;
        }
        Ok(c)
    }
}

/// All runs of one configuration (one per seed).
struct Group {
    nodes: usize,
    churn: f64,
    runs: Vec<(u64, RoutingReport)>,
}

impl Group {
    fn stat(&self, f: impl Fn(&RoutingReport) -> f64) -> (f64, f64) {
        let v: Vec<f64> = self.runs.iter().map(|(_, r)| f(r)).collect();
        (mean(&v), sd(&v))
    }

    fn json(&self, peak_rss_mb: f64) -> Value {
        let m = |f: &dyn Fn(&RoutingReport) -> f64| self.stat(f).0;
        let s = |f: &dyn Fn(&RoutingReport) -> f64| self.stat(f).1;
        let first = self
            .runs
            .first()
            .map(|(_, r)| r.clone())
            .unwrap_or_default();
        let k = first.recall_k;
        let probes = first.recall_by_probes.len();
        let by_probes: Vec<f64> = (0..probes)
            .map(|p| m(&|r| r.recall_by_probes.get(p).copied().unwrap_or(f64::NAN)))
            .collect();
        let mut v = json!({
            "nodes": self.nodes,
            "lookups": first.lookups,
            "hops_p50": m(&|r| r.hops.p50),
            "rpcs_p50": m(&|r| r.rpcs.p50),
            "success": m(&|r| r.success),
            "seconds": m(&|r| r.seconds),
            "peak_rss_mb": peak_rss_mb,
            "seeds": self.runs.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            "churn_per_hour": self.churn,
            "pool": first.pool,
            "online": first.online,
            "publishers": first.publishers,
            "key_lookups": m(&|r| r.key_lookups as f64),
            "key_lookups_per_query": m(&|r| r.key_lookups_per_query),
            "hops_mean": m(&|r| r.hops.mean),
            "hops_p90": m(&|r| r.hops.p90),
            "rpcs_mean": m(&|r| r.rpcs.mean),
            "rpcs_p90": m(&|r| r.rpcs.p90),
            "latency_ms_p50": m(&|r| r.latency_ms.p50),
            "latency_ms_p90": m(&|r| r.latency_ms.p90),
            "lookup_ms_p50": m(&|r| r.duration_ms.p50),
            "timed_out": m(&|r| r.timed_out as f64),
            "recall_k": k,
            "recall_queries": first.recall_queries,
            "recall_by_probes": by_probes,
            "recall_uncapped": m(&|r| r.recall_uncapped),
            "recall_by_key_count": m(&|r| r.recall_by_key_count),
            "neighbour_cosine": m(&|r| r.neighbour_cosine),
            "found_same_task": m(&|r| r.found_same_task),
            "announce_rpcs_mean": m(&|r| r.announce_rpcs.mean),
            "dht_bytes_per_node_round": m(&|r| r.dht_bytes_per_node_round),
            "node_bytes_p50": m(&|r| r.node_bytes.p50),
            "node_bytes_p99": m(&|r| r.node_bytes.p99),
            "hot_bands": m(&|r| r.hot_bands as f64),
            "stale_entries": m(&|r| r.stale_entries),
            "table_entries": m(&|r| r.table_entries),
            "rejoins": m(&|r| r.rejoins as f64),
            "setup_seconds": m(&|r| r.setup_seconds),
            "sim_seconds": m(&|r| r.sim_seconds),
            "recall_seconds": m(&|r| r.recall_seconds),
        });
        if let Some(o) = v.as_object_mut() {
            o.insert(format!("recall_at_{k}"), json!(m(&|r| r.recall)));
            o.insert("providers_asked".into(), json!(m(&|r| r.providers_asked)));
            if self.runs.len() > 1 {
                o.insert("hops_p50_sd".into(), json!(s(&|r| r.hops.p50)));
                o.insert("hops_mean_sd".into(), json!(s(&|r| r.hops.mean)));
                o.insert("rpcs_p50_sd".into(), json!(s(&|r| r.rpcs.p50)));
                o.insert("rpcs_mean_sd".into(), json!(s(&|r| r.rpcs.mean)));
                o.insert("success_sd".into(), json!(s(&|r| r.success)));
                o.insert(format!("recall_at_{k}_sd"), json!(s(&|r| r.recall)));
            }
        }
        v
    }
}

/// Run `kindred-sim routing`.
pub(crate) fn run(args: &RoutingArgs) -> anyhow::Result<()> {
    let out = args.common.out_dir()?;
    let json = args.common.json;
    let pb = progress_bar(json);
    let mut groups: Vec<Group> = Vec::new();
    let total = args.nodes.len() * args.churn.len() * args.repeat.max(1) as usize;
    let mut run_no = 0;
    for &nodes in &args.nodes {
        for &churn in &args.churn {
            let mut g = Group {
                nodes,
                churn,
                runs: Vec::new(),
            };
            for r in 0..args.repeat.max(1) {
                run_no += 1;
                let seed = args.common.seed + r;
                let cfg = args.config(nodes, churn, seed)?;
                pb.set_prefix(format!(
                    "[{run_no}/{total}] N={nodes} churn={churn}/h seed={seed}"
                ));
                let cb = progress_to(&pb);
                let report = kindred_simulator::routing::run(&cfg, &cb)?;
                g.runs.push((seed, report));
            }
            groups.push(g);
        }
    }
    pb.finish_and_clear();
    let peak = kindred_simulator::mem::peak_rss_mb().unwrap_or(f64::NAN);

    let mut table = Table::new(
        "kindred-sim routing (mean ± sd over seeds; hops and requests per key lookup)",
        &[
            "nodes",
            "churn/h",
            "seeds",
            "hops p50",
            "hops mean",
            "rpcs p50",
            "rpcs mean",
            "first ms p50",
            "success",
            "recall@k",
            "nn cos",
            "keys/query",
            "DHT B/node/rd",
            "stale",
            "s",
        ],
    );
    for g in &groups {
        let (h50, h50s) = g.stat(|r| r.hops.p50);
        let (hm, hms) = g.stat(|r| r.hops.mean);
        let (r50, r50s) = g.stat(|r| r.rpcs.p50);
        let (rm, rms) = g.stat(|r| r.rpcs.mean);
        let (lat, lats) = g.stat(|r| r.latency_ms.p50);
        let (suc, sucs) = g.stat(|r| r.success);
        let (rec, recs) = g.stat(|r| r.recall);
        table.row(vec![
            g.nodes.to_string(),
            format!("{:.2}", g.churn),
            g.runs.len().to_string(),
            pm(h50, h50s, 2),
            pm(hm, hms, 2),
            pm(r50, r50s, 1),
            pm(rm, rms, 1),
            pm(lat, lats, 0),
            pm(suc * 100.0, sucs * 100.0, 2) + "%",
            pm(rec, recs, 3),
            format!("{:.3}", g.stat(|r| r.neighbour_cosine).0),
            format!("{:.1}", g.stat(|r| r.key_lookups_per_query).0),
            format!("{:.0}", g.stat(|r| r.dht_bytes_per_node_round).0),
            format!("{:.2}%", g.stat(|r| r.stale_entries).0 * 100.0),
            format!("{:.1}", g.stat(|r| r.seconds).0),
        ]);
    }
    table.print(json);
    note(json, &format!("peak RSS {peak:.0} MiB"));

    if let Some(dir) = &out {
        write_outputs(dir, &groups)?;
        note(json, &format!("CSV and plots written to {}", dir.display()));
    }

    let headline = groups
        .last()
        .map(|g| g.json(peak))
        .unwrap_or_else(|| json!({}));
    let mut line = headline;
    if (groups.len() > 1 || groups.iter().any(|g| g.runs.len() > 1))
        && let Some(o) = line.as_object_mut()
    {
        o.insert(
            "runs".into(),
            Value::Array(groups.iter().map(|g| g.json(peak)).collect()),
        );
    }
    json_line(&line);
    Ok(())
}

fn write_outputs(dir: &Path, groups: &[Group]) -> anyhow::Result<()> {
    // Per-run CSV.
    let header = [
        "nodes",
        "churn_per_hour",
        "seed",
        "pool",
        "online",
        "publishers",
        "lookups",
        "key_lookups",
        "key_lookups_per_query",
        "hops_p50",
        "hops_mean",
        "hops_p90",
        "rpcs_p50",
        "rpcs_mean",
        "rpcs_p90",
        "latency_ms_p50",
        "latency_ms_p90",
        "lookup_ms_p50",
        "success",
        "timed_out",
        "recall_k",
        "recall",
        "recall_uncapped",
        "neighbour_cosine",
        "found_same_task",
        "providers_asked",
        "announce_rpcs_mean",
        "dht_bytes_per_node_round",
        "node_bytes_p50",
        "node_bytes_p99",
        "hot_bands",
        "stale_entries",
        "table_entries",
        "rejoins",
        "refreshes",
        "seconds",
    ];
    let mut rows = Vec::new();
    let mut probe_rows = Vec::new();
    for g in groups {
        for (seed, r) in &g.runs {
            rows.push(vec![
                g.nodes.to_string(),
                fmt(g.churn),
                seed.to_string(),
                r.pool.to_string(),
                r.online.to_string(),
                r.publishers.to_string(),
                r.lookups.to_string(),
                r.key_lookups.to_string(),
                fmt(r.key_lookups_per_query),
                fmt(r.hops.p50),
                fmt(r.hops.mean),
                fmt(r.hops.p90),
                fmt(r.rpcs.p50),
                fmt(r.rpcs.mean),
                fmt(r.rpcs.p90),
                fmt(r.latency_ms.p50),
                fmt(r.latency_ms.p90),
                fmt(r.duration_ms.p50),
                fmt(r.success),
                r.timed_out.to_string(),
                r.recall_k.to_string(),
                fmt(r.recall),
                fmt(r.recall_uncapped),
                fmt(r.neighbour_cosine),
                fmt(r.found_same_task),
                fmt(r.providers_asked),
                fmt(r.announce_rpcs.mean),
                fmt(r.dht_bytes_per_node_round),
                fmt(r.node_bytes.p50),
                fmt(r.node_bytes.p99),
                r.hot_bands.to_string(),
                fmt(r.stale_entries),
                fmt(r.table_entries),
                r.rejoins.to_string(),
                r.refreshes.to_string(),
                fmt(r.seconds),
            ]);
            for (p, v) in r.recall_by_probes.iter().enumerate() {
                probe_rows.push(vec![
                    g.nodes.to_string(),
                    fmt(g.churn),
                    seed.to_string(),
                    p.to_string(),
                    fmt(*v),
                ]);
            }
        }
    }
    kindred_simulator::csv::write(&dir.join("routing_runs.csv"), &header, &rows)?;
    kindred_simulator::csv::write(
        &dir.join("routing_recall_by_probes.csv"),
        &["nodes", "churn_per_hour", "seed", "probes", "recall"],
        &probe_rows,
    )?;

    // Plots.
    let churns: Vec<f64> = dedup(groups.iter().map(|g| g.churn).collect());
    let sizes: Vec<usize> = {
        let mut v: Vec<usize> = groups.iter().map(|g| g.nodes).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let base_churn = churns.first().copied().unwrap_or(0.0);
    let at_churn: Vec<&Group> = groups.iter().filter(|g| g.churn == base_churn).collect();
    if sizes.len() >= 2 {
        let mut series = Vec::new();
        for (name, f) in [
            (
                "hops (mean)",
                &(|r: &RoutingReport| r.hops.mean) as &dyn Fn(&RoutingReport) -> f64,
            ),
            ("requests (mean)", &|r: &RoutingReport| r.rpcs.mean),
        ] {
            let pts: Vec<(f64, f64)> = at_churn
                .iter()
                .map(|g| (g.nodes as f64, g.stat(f).0))
                .collect();
            let err: Vec<f64> = at_churn.iter().map(|g| g.stat(f).1).collect();
            let xs: Vec<f64> = pts.iter().map(|p| p.0.log2()).collect();
            let ys: Vec<f64> = pts.iter().map(|p| p.1).collect();
            series.push(Series::new(name, pts.clone()).with_error(err));
            if let Some((a, b)) = linear_fit(&xs, &ys) {
                let fit: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, a + b * p.0.log2())).collect();
                series.push(Series::fit(format!("fit {a:.2} + {b:.3}·log2 N"), fit));
            }
        }
        line_chart(
            &dir.join("hops_rpcs_vs_nodes.svg"),
            &Chart {
                title: "Hops and requests per key lookup vs network size",
                x_label: "nodes (log scale)",
                y_label: "per lookup",
                log_x: true,
                log_y: false,
                y_range: None,
            },
            &series,
        )?;
        let pts: Vec<(f64, f64)> = at_churn
            .iter()
            .map(|g| (g.nodes as f64, g.stat(|r| r.recall).0))
            .collect();
        let err: Vec<f64> = at_churn.iter().map(|g| g.stat(|r| r.recall).1).collect();
        let nn: Vec<(f64, f64)> = at_churn
            .iter()
            .map(|g| (g.nodes as f64, g.stat(|r| r.neighbour_cosine).0))
            .collect();
        line_chart(
            &dir.join("recall_vs_nodes.svg"),
            &Chart {
                title: "Semantic recall@k vs network size (default bands and probes)",
                x_label: "nodes (log scale)",
                y_label: "recall@k / cosine",
                log_x: true,
                log_y: false,
                y_range: Some((0.0, 1.02)),
            },
            &[
                Series::new("recall@k", pts).with_error(err),
                Series::new("cosine of true k-th neighbour", nn),
            ],
        )?;
        let pts: Vec<(f64, f64)> = at_churn
            .iter()
            .map(|g| {
                (
                    g.nodes as f64,
                    g.stat(|r| r.dht_bytes_per_node_round).0 / 1024.0,
                )
            })
            .collect();
        line_chart(
            &dir.join("dht_bytes_vs_nodes.svg"),
            &Chart {
                title: "DHT traffic per node per round (announce + one round lookup)",
                x_label: "nodes (log scale)",
                y_label: "KiB sent per node per round",
                log_x: true,
                log_y: false,
                y_range: None,
            },
            &[Series::new("semantic routing (DHT only)", pts)],
        )?;
    }
    let probe_series: Vec<Series> = at_churn
        .iter()
        .map(|g| {
            let n = g.runs.first().map_or(0, |(_, r)| r.recall_by_probes.len());
            let pts = (0..n)
                .map(|p| {
                    (
                        p as f64,
                        g.stat(|r| r.recall_by_probes.get(p).copied().unwrap_or(f64::NAN))
                            .0,
                    )
                })
                .collect();
            Series::new(format!("N = {}", g.nodes), pts)
        })
        .collect();
    line_chart(
        &dir.join("recall_vs_probes.svg"),
        &Chart {
            title: "Semantic recall@k vs multi-probe keys",
            x_label: "probes",
            y_label: "recall@k",
            log_x: false,
            log_y: false,
            y_range: Some((0.0, 1.02)),
        },
        &probe_series,
    )?;
    if churns.len() >= 2 {
        let series: Vec<Series> = sizes
            .iter()
            .map(|&n| {
                let pts: Vec<(f64, f64)> = groups
                    .iter()
                    .filter(|g| g.nodes == n)
                    .map(|g| (g.churn * 100.0, g.stat(|r| r.success).0 * 100.0))
                    .collect();
                let err: Vec<f64> = groups
                    .iter()
                    .filter(|g| g.nodes == n)
                    .map(|g| g.stat(|r| r.success).1 * 100.0)
                    .collect();
                Series::new(format!("N = {n}"), pts).with_error(err)
            })
            .collect();
        line_chart(
            &dir.join("success_vs_churn.svg"),
            &Chart {
                title: "Lookup success vs churn",
                x_label: "churn (% of online nodes leaving per hour)",
                y_label: "lookups returning a provider (%)",
                log_x: false,
                log_y: false,
                y_range: None,
            },
            &series,
        )?;
    }
    Ok(())
}

fn dedup(mut v: Vec<f64>) -> Vec<f64> {
    v.dedup_by(|a, b| a == b);
    let mut out: Vec<f64> = Vec::new();
    for x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}
