//! `kindred-sim experiment`: the evaluation table on real MNIST, three settings, several seeds.

use std::path::Path;

use clap::{Args, ValueEnum};
use kindred_simulator::experiment::{ExperimentConfig, ExperimentReport, RowSummary, Spread};
use kindred_simulator::learn::{Faults, LearnConfig, Setting};
use kindred_simulator::plot::{Chart, Series, line_chart};
use serde_json::{Value, json};

use super::common::{Common, TrainArgs, progress_bar, progress_to};
use super::render::{Table, json_line, note, pm};

/// Data settings of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum SettingName {
    /// One task, IID shards.
    Iid,
    /// 4 rotation clusters (feature shift).
    Rotation,
    /// 4 label-permutation clusters (concept shift).
    Label,
}

impl SettingName {
    fn setting(self) -> Setting {
        match self {
            Self::Iid => Setting::Iid,
            Self::Rotation => Setting::Rotation { clusters: 4 },
            Self::Label => Setting::Label { clusters: 4 },
        }
    }
}

/// Options of `kindred-sim experiment`.
#[derive(Debug, Clone, Args)]
pub(crate) struct ExperimentArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Seeds: `--seed`, `--seed + 1`, … (mean ± sd are over these).
    #[arg(long, default_value_t = 3)]
    pub(crate) seeds: u64,
    /// Virtual nodes per run (32-256).
    #[arg(long, default_value_t = 64)]
    pub(crate) nodes: usize,
    /// Rounds per run.
    #[arg(long, default_value_t = 30)]
    pub(crate) rounds: usize,
    /// Data settings.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "iid,rotation,label"
    )]
    pub(crate) settings: Vec<SettingName>,
    #[command(flatten)]
    pub(crate) train: TrainArgs,
    /// Share of hostile nodes in the poisoning run on the label setting (0 skips it).
    #[arg(long, default_value_t = 0.2)]
    pub(crate) hostile: f64,
}

impl ExperimentArgs {
    fn config(&self) -> anyhow::Result<ExperimentConfig> {
        anyhow::ensure!(self.seeds >= 1, "--seeds must be at least 1");
        anyhow::ensure!(
            (4..=100_000).contains(&self.nodes),
            "--nodes must be between 4 and 100000"
        );
        anyhow::ensure!(
            (0.0..1.0).contains(&self.hostile),
            "--hostile must be in [0, 1)"
        );
        let mut base = LearnConfig::new(self.nodes, self.rounds);
        base.train = self.train.config();
        let mut settings: Vec<Setting> = Vec::new();
        for s in &self.settings {
            if !settings.contains(&s.setting()) {
                settings.push(s.setting());
            }
        }
        Ok(ExperimentConfig {
            seeds: (0..self.seeds)
                .map(|i| self.common.seed.wrapping_add(i))
                .collect(),
            settings,
            hostile_fraction: self.hostile,
            base,
            ..ExperimentConfig::default()
        })
    }
}

/// The acceptance lines of the results issue, evaluated on this run.
fn acceptance(r: &ExperimentReport) -> Value {
    let get = |s: &str, row: &str| r.setting(s).and_then(|x| x.row(row));
    let acc = |s: &str, row: &str| get(s, row).map_or(f64::NAN, |x| x.accuracy.mean);
    let mut a = serde_json::Map::new();
    if let (Some(k), Some(b)) = (get("iid", "kindred"), get("iid", "allreduce")) {
        a.insert(
            "iid_kindred_within_0_5_of_baseline".into(),
            json!(b.accuracy.mean - k.accuracy.mean <= 0.005),
        );
        a.insert(
            "iid_kindred_20x_fewer_bytes".into(),
            json!(k.ratio_to_baseline >= 20.0),
        );
    }
    if r.setting("label4").is_some() {
        a.insert(
            "label_kindred_within_1_of_oracle".into(),
            json!(acc("label4", "oracle") - acc("label4", "kindred") <= 0.01),
        );
        a.insert(
            "label_kindred_30_above_global".into(),
            json!(acc("label4", "kindred") - acc("label4", "allreduce") >= 0.30),
        );
    }
    if r.setting("rotation4").is_some() {
        a.insert(
            "rotation_kindred_within_1_of_oracle".into(),
            json!(acc("rotation4", "oracle") - acc("rotation4", "kindred") <= 0.01),
        );
    }
    if let Some(p) = &r.poisoning
        && !p.robust_loss.is_empty()
    {
        a.insert(
            "poisoning_robust_loses_at_most_1".into(),
            json!(p.clean.mean - p.robust.mean <= 0.01),
        );
    }
    let clustered: Vec<&RowSummary> = r
        .settings
        .iter()
        .filter(|s| s.setting != "iid")
        .filter_map(|s| s.row("kindred"))
        .collect();
    if !clustered.is_empty() {
        a.insert(
            "purity_99_from_round_3_every_seed".into(),
            json!(
                clustered
                    .iter()
                    .all(|k| k.purity_min_from_round_3.iter().all(|&p| p >= 0.99))
            ),
        );
    }
    Value::Object(a)
}

fn spread_json(s: Spread) -> Value {
    json!({"mean": finite(s.mean), "sd": finite(s.sd)})
}

fn finite(v: f64) -> Value {
    if v.is_finite() { json!(v) } else { Value::Null }
}

fn row_json(row: &RowSummary) -> Value {
    json!({
        "accuracy_mean": finite(row.accuracy.mean),
        "accuracy_sd": finite(row.accuracy.sd),
        "consensus_accuracy_mean": finite(row.consensus.mean),
        "consensus_accuracy_sd": finite(row.consensus.sd),
        "bytes_per_node_round_mean": finite(row.bytes.mean),
        "bytes_per_node_round_sd": finite(row.bytes.sd),
        "dht_bytes_per_node_round_mean": finite(row.dht_bytes.mean),
        "ratio_to_baseline": finite(row.ratio_to_baseline),
        "rounds_to_90_mean": finite(row.rounds_to_90.mean),
        "rounds_to_90_sd": finite(row.rounds_to_90.sd),
        "seeds_reaching_90": row.reached_90,
        "purity_mean": finite(row.purity.mean),
        "purity_sd": finite(row.purity.sd),
        "purity_min_from_round_3": row.purity_min_from_round_3.iter().map(|&p| finite(p)).collect::<Vec<_>>(),
    })
}

fn summary_json(r: &ExperimentReport, faults: Faults, peak: f64) -> Value {
    let settings: serde_json::Map<String, Value> = r
        .settings
        .iter()
        .map(|s| {
            let rows: serde_json::Map<String, Value> = s
                .rows
                .iter()
                .map(|row| (row.name.clone(), row_json(row)))
                .collect();
            (s.setting.clone(), Value::Object(rows))
        })
        .collect();
    let poisoning = r.poisoning.as_ref().map_or(Value::Null, |p| {
        json!({
            "setting": p.setting,
            "hostile_fraction": p.hostile_fraction,
            "hostile_nodes": p.hostile_nodes,
            "attacks": p.attacks.iter().map(|a| a.name()).collect::<Vec<_>>(),
            "clean": spread_json(p.clean),
            "robust": spread_json(p.robust),
            "plain": spread_json(p.plain),
            "robust_loss_per_seed": p.robust_loss,
            "robust_per_seed": p.robust_per_seed,
            "robust_bytes_per_node_round": spread_json(p.robust_bytes),
        })
    });
    json!({
        "command": "experiment",
        "nodes": r.nodes,
        "rounds": r.rounds,
        "seeds": r.seeds,
        "params": r.params,
        "settings": settings,
        "poisoning": poisoning,
        "acceptance": acceptance(r),
        // The hub exchange's faults (none in the experiment: `kindred-sim learn` sets them).
        "faults": {
            "msg_loss": faults.msg_loss,
            "hub_crash": faults.hub_crash,
            "down_rounds": faults.down_rounds,
            "hostile_low_rank": faults.hostile_low_rank,
        },
        "seconds": r.seconds,
        "peak_rss_mb": finite(peak),
    })
}

/// Run `kindred-sim experiment`.
pub(crate) fn run(args: &ExperimentArgs) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let out = args.common.out_dir()?;
    let json = args.common.json;
    let pb = progress_bar(json);
    let cb = progress_to(&pb);
    let report = kindred_simulator::experiment::run(&cfg, &cb)?;
    pb.finish_and_clear();
    let peak = kindred_simulator::mem::peak_rss_mb().unwrap_or(f64::NAN);
    let pct = |s: Spread| pm(100.0 * s.mean, 100.0 * s.sd, 2);
    for s in &report.settings {
        let mut t = Table::new(
            &format!(
                "{}: {} nodes × {} rounds, MNIST MLP ({} params), seeds {:?}",
                s.setting, report.nodes, report.rounds, report.params, report.seeds
            ),
            &[
                "row",
                "accuracy %",
                "consensus %",
                "bytes/node/round",
                "of which DHT",
                "ratio",
                "rounds to 90% oracle",
                "purity",
            ],
        );
        for row in &s.rows {
            t.row(vec![
                row.name.clone(),
                pct(row.accuracy),
                pct(row.consensus),
                format!("{:.0}", row.bytes.mean),
                format!("{:.0}", row.dht_bytes.mean),
                format!("{:.1}x", row.ratio_to_baseline),
                if row.reached_90 == 0 {
                    "never".into()
                } else if row.reached_90 == row.runs.len() {
                    pm(row.rounds_to_90.mean, row.rounds_to_90.sd, 1)
                } else {
                    format!(
                        "{} ({}/{} seeds)",
                        pm(row.rounds_to_90.mean, row.rounds_to_90.sd, 1),
                        row.reached_90,
                        row.runs.len()
                    )
                },
                if row.purity.mean.is_finite() {
                    pm(row.purity.mean, row.purity.sd, 3)
                } else {
                    "-".into()
                },
            ]);
        }
        t.print(json);
    }
    if let Some(p) = &report.poisoning {
        let mut t = Table::new(
            &format!(
                "poisoning: {}, {:.0}% hostile ({}), honest nodes' accuracy %",
                p.setting,
                100.0 * p.hostile_fraction,
                p.attacks
                    .iter()
                    .map(|a| a.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            &["run", "accuracy %"],
        );
        t.row(vec!["clean (kindred)".into(), pct(p.clean)]);
        t.row(vec!["poisoned, robust merge".into(), pct(p.robust)]);
        t.row(vec!["poisoned, plain mean".into(), pct(p.plain)]);
        t.print(json);
    }
    let line = summary_json(&report, cfg.base.hub.faults, peak);
    note(
        json,
        &format!(
            "acceptance: {}\n{:.0} s, peak RSS {peak:.0} MiB",
            line["acceptance"], report.seconds
        ),
    );
    if let Some(dir) = &out {
        write_outputs(dir, &report)?;
        note(json, &format!("CSV and plots written to {}", dir.display()));
    }
    json_line(&line);
    Ok(())
}

fn write_outputs(dir: &Path, r: &ExperimentReport) -> anyhow::Result<()> {
    let f = kindred_simulator::csv::number;
    let mut summary = Vec::new();
    let mut runs = Vec::new();
    let mut rounds = Vec::new();
    for s in &r.settings {
        for row in &s.rows {
            summary.push(vec![
                s.setting.clone(),
                row.name.clone(),
                f(row.accuracy.mean),
                f(row.accuracy.sd),
                f(row.consensus.mean),
                f(row.consensus.sd),
                f(row.bytes.mean),
                f(row.bytes.sd),
                f(row.dht_bytes.mean),
                f(row.ratio_to_baseline),
                f(row.rounds_to_90.mean),
                f(row.rounds_to_90.sd),
                row.reached_90.to_string(),
                f(row.purity.mean),
                f(row.purity.sd),
            ]);
            for run in &row.runs {
                runs.push(vec![
                    s.setting.clone(),
                    row.name.clone(),
                    run.seed.to_string(),
                    f(run.accuracy),
                    f(run.consensus),
                    f(run.bytes),
                    f(run.dht_bytes),
                    run.rounds_to_90.map_or(String::new(), |x| x.to_string()),
                ]);
                for (i, (a, p)) in run
                    .accuracy_by_round
                    .iter()
                    .zip(&run.purity_by_round)
                    .enumerate()
                {
                    rounds.push(vec![
                        s.setting.clone(),
                        row.name.clone(),
                        run.seed.to_string(),
                        (i + 1).to_string(),
                        f(*a),
                        f(*p),
                    ]);
                }
            }
        }
    }
    kindred_simulator::csv::write(
        &dir.join("experiment_summary.csv"),
        &[
            "setting",
            "row",
            "accuracy_mean",
            "accuracy_sd",
            "consensus_accuracy_mean",
            "consensus_accuracy_sd",
            "bytes_per_node_round_mean",
            "bytes_per_node_round_sd",
            "dht_bytes_per_node_round_mean",
            "ratio_to_baseline",
            "rounds_to_90_mean",
            "rounds_to_90_sd",
            "seeds_reaching_90",
            "purity_mean",
            "purity_sd",
        ],
        &summary,
    )?;
    kindred_simulator::csv::write(
        &dir.join("experiment_runs.csv"),
        &[
            "setting",
            "row",
            "seed",
            "accuracy",
            "consensus_accuracy",
            "bytes_per_node_round",
            "dht_bytes_per_node_round",
            "rounds_to_90",
        ],
        &runs,
    )?;
    kindred_simulator::csv::write(
        &dir.join("experiment_rounds.csv"),
        &["setting", "row", "seed", "round", "accuracy", "purity"],
        &rounds,
    )?;
    if let Some(p) = &r.poisoning {
        kindred_simulator::csv::write(
            &dir.join("experiment_poisoning.csv"),
            &[
                "setting",
                "hostile_fraction",
                "run",
                "accuracy_mean",
                "accuracy_sd",
            ],
            &[("clean", p.clean), ("robust", p.robust), ("plain", p.plain)]
                .iter()
                .map(|(n, s)| {
                    vec![
                        p.setting.clone(),
                        f(p.hostile_fraction),
                        (*n).to_owned(),
                        f(s.mean),
                        f(s.sd),
                    ]
                })
                .collect::<Vec<_>>(),
        )?;
    }
    // Accuracy vs round per setting: mean over seeds, sd as error bars.
    for s in &r.settings {
        let series: Vec<Series> = s
            .rows
            .iter()
            .map(|row| {
                let len = row
                    .runs
                    .iter()
                    .map(|x| x.accuracy_by_round.len())
                    .min()
                    .unwrap_or(0);
                let at = |i: usize| -> Vec<f64> {
                    row.runs
                        .iter()
                        .filter_map(|x| x.accuracy_by_round.get(i).copied())
                        .collect()
                };
                let pts = (0..len)
                    .map(|i| ((i + 1) as f64, kindred_simulator::stats::mean(&at(i))))
                    .collect();
                let err = (0..len)
                    .map(|i| kindred_simulator::stats::sd(&at(i)))
                    .collect();
                Series::new(row.name.clone(), pts).with_error(err)
            })
            .collect();
        line_chart(
            &dir.join(format!("experiment_accuracy_{}.svg", s.setting)),
            &Chart {
                title: &format!(
                    "Accuracy vs round, {} ({} nodes, mean ± sd over {} seeds)",
                    s.setting,
                    r.nodes,
                    r.seeds.len()
                ),
                x_label: "round",
                y_label: "held-out accuracy (tracked honest nodes)",
                log_x: false,
                log_y: false,
                y_range: Some((0.0, 1.0)),
            },
            &series,
        )?;
    }
    // Purity of Kindred's merge partners per round, one line per clustered setting and seed.
    let series: Vec<Series> = r
        .settings
        .iter()
        .filter(|s| s.setting != "iid")
        .filter_map(|s| Some((s, s.row("kindred")?)))
        .flat_map(|(s, row)| {
            row.runs.iter().map(move |run| {
                Series::new(
                    format!("{} seed {}", s.setting, run.seed),
                    run.purity_by_round
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| p.is_finite())
                        .map(|(i, p)| ((i + 1) as f64, *p))
                        .collect(),
                )
            })
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    if !series.is_empty() {
        line_chart(
            &dir.join("experiment_purity.svg"),
            &Chart {
                title: "Kindred: share of merge partners from the node's own cluster",
                x_label: "round",
                y_label: "cluster purity",
                log_x: false,
                log_y: false,
                y_range: Some((0.0, 1.05)),
            },
            &series,
        )?;
    }
    Ok(())
}
