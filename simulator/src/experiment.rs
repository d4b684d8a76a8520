//! The results experiment: the selective-compression evaluation table, reproduced on real MNIST
//! under three data settings and several seeds, plus Kindred and the oracle, a poisoning run and
//! cluster purity.
//!
//! Why a separate driver: one learning run ([`crate::learn::run()`]) compares policies on one seed
//! and one setting. A claim such as "within a point of the oracle" needs every row on the same
//! seeds, its spread across seeds, and the derived columns (ratio to the baseline's bytes, rounds
//! to 90% of the oracle's final accuracy) computed the same way for every row. This module runs
//! the grid and aggregates it; `kindred-sim experiment` only renders the result.
//!
//! ```no_run
//! use kindred_simulator::experiment::{ExperimentConfig, run};
//! let report = run(&ExperimentConfig::default(), &|_, _, _| {})?;
//! let label = report.setting("label4").expect("label setting ran");
//! println!("{:?}", label.row("kindred").map(|r| r.accuracy.mean));
//! # Ok::<(), kindred_simulator::learn::LearnError>(())
//! ```

use crate::learn::{
    Attack, Hostile, LearnConfig, LearnError, LearnReport, PolicySpec, Setting, run as learn_run,
};
use crate::stats::{mean, sd};

/// The grid to run.
#[derive(Debug, Clone, PartialEq)]
pub struct ExperimentConfig {
    /// Seeds; every setting runs every row on each.
    pub seeds: Vec<u64>,
    /// Data settings.
    pub settings: Vec<Setting>,
    /// Rows; the first is the baseline the byte ratio is taken against, and one named `oracle`
    /// sets the "90% of the oracle" bar.
    pub rows: Vec<PolicySpec>,
    /// Share of hostile nodes in the poisoning run (0 skips it).
    pub hostile_fraction: f64,
    /// The setting of the poisoning run.
    pub poison_setting: Setting,
    /// The hostile nodes' attacks in the poisoning run, assigned in turn (default
    /// [`Attack::poisoning`]).
    pub attacks: Vec<Attack>,
    /// Nodes, rounds, training, top-m, probes and evaluation sizes, as for `kindred-sim learn`;
    /// its seed, setting, policies and hostile nodes are set per run.
    pub base: LearnConfig,
}

impl Default for ExperimentConfig {
    /// 64 nodes × 30 rounds, seeds 1-3, IID / 4 rotation / 4 label-permutation clusters, the
    /// eight rows of [`PolicySpec::evaluation_table`], 20% hostile nodes on the label setting.
    fn default() -> Self {
        Self {
            seeds: vec![1, 2, 3],
            settings: vec![
                Setting::Iid,
                Setting::Rotation { clusters: 4 },
                Setting::Label { clusters: 4 },
            ],
            rows: PolicySpec::evaluation_table(),
            hostile_fraction: 0.2,
            poison_setting: Setting::Label { clusters: 4 },
            attacks: Attack::poisoning(),
            base: LearnConfig::new(64, 30),
        }
    }
}

/// Mean and sample standard deviation over seeds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Sample standard deviation (0 with one seed).
    pub sd: f64,
}

impl Spread {
    fn of(values: &[f64]) -> Self {
        Self {
            mean: mean(values),
            sd: sd(values),
        }
    }
}

/// One row on one seed.
#[derive(Debug, Clone, PartialEq)]
pub struct RowRun {
    /// Seed.
    pub seed: u64,
    /// Final accuracy of every honest node on its cluster's held-out digits, averaged.
    pub accuracy: f64,
    /// Accuracy of the honest nodes' consensus model per cluster (their mean parameters); see
    /// [`crate::learn::PolicyReport::consensus_accuracy`].
    pub consensus: f64,
    /// Bytes per node per round, all traffic (DHT, header and body requests, payloads).
    pub bytes: f64,
    /// Of which DHT traffic (announcements and lookups).
    pub dht_bytes: f64,
    /// First round (1-based) whose tracked accuracy reached 90% of the oracle's final accuracy
    /// on the same seed; `None` if none did.
    pub rounds_to_90: Option<usize>,
    /// Share of merge partners from the node's own cluster, per round (NaN: nobody merged).
    pub purity_by_round: Vec<f64>,
    /// Tracked accuracy per round.
    pub accuracy_by_round: Vec<f64>,
}

/// One row across seeds.
#[derive(Debug, Clone, PartialEq)]
pub struct RowSummary {
    /// Row name.
    pub name: String,
    /// Final accuracy.
    pub accuracy: Spread,
    /// Consensus-model accuracy.
    pub consensus: Spread,
    /// Bytes per node per round.
    pub bytes: Spread,
    /// DHT bytes per node per round.
    pub dht_bytes: Spread,
    /// Baseline bytes ÷ this row's bytes (mean over seeds of the per-seed ratio).
    pub ratio_to_baseline: f64,
    /// Rounds to 90% of the oracle, over the seeds that reached it.
    pub rounds_to_90: Spread,
    /// Seeds that reached 90% of the oracle.
    pub reached_90: usize,
    /// Purity averaged over rounds (from round 3 on) and seeds.
    pub purity: Spread,
    /// The lowest per-round purity from round 3 on, per seed (NaN: nobody merged).
    pub purity_min_from_round_3: Vec<f64>,
    /// Per-seed runs.
    pub runs: Vec<RowRun>,
}

/// One data setting.
#[derive(Debug, Clone, PartialEq)]
pub struct SettingSummary {
    /// Setting name (`iid`, `rotation4`, `label4`).
    pub setting: String,
    /// Rows in configuration order.
    pub rows: Vec<RowSummary>,
}

impl SettingSummary {
    /// A row by name.
    pub fn row(&self, name: &str) -> Option<&RowSummary> {
        self.rows.iter().find(|r| r.name == name)
    }
}

/// The poisoning run: honest accuracy with and without the robust merge.
#[derive(Debug, Clone, PartialEq)]
pub struct PoisonSummary {
    /// Setting name.
    pub setting: String,
    /// Share of hostile nodes asked for.
    pub hostile_fraction: f64,
    /// Hostile nodes per seed.
    pub hostile_nodes: Vec<usize>,
    /// Their attacks, assigned in turn.
    pub attacks: Vec<Attack>,
    /// Kindred on the clean run of the same setting and seeds.
    pub clean: Spread,
    /// Kindred with the robust merge, honest nodes.
    pub robust: Spread,
    /// Kindred with a plain mean, honest nodes.
    pub plain: Spread,
    /// Clean − robust, per seed.
    pub robust_loss: Vec<f64>,
    /// Kindred with the robust merge, honest nodes, per seed (the order of the seeds).
    pub robust_per_seed: Vec<f64>,
    /// Bytes per node per round of the robust run (every node's traffic).
    pub robust_bytes: Spread,
}

/// Everything the experiment measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ExperimentReport {
    /// Nodes per run.
    pub nodes: usize,
    /// Rounds per run.
    pub rounds: usize,
    /// Seeds.
    pub seeds: Vec<u64>,
    /// Model parameters.
    pub params: usize,
    /// Per setting.
    pub settings: Vec<SettingSummary>,
    /// The poisoning run, if any.
    pub poisoning: Option<PoisonSummary>,
    /// Wall-clock seconds.
    pub seconds: f64,
}

impl ExperimentReport {
    /// A setting by name.
    pub fn setting(&self, name: &str) -> Option<&SettingSummary> {
        self.settings.iter().find(|s| s.setting == name)
    }
}

pub use crate::ProgressFn;

fn rounds_to(acc: &[f64], bar: f64) -> Option<usize> {
    acc.iter().position(|&a| a >= bar).map(|i| i + 1)
}

fn summarize(name: &str, runs: Vec<RowRun>, baseline: &[f64]) -> RowSummary {
    let col = |f: &dyn Fn(&RowRun) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
    let ratios: Vec<f64> = runs
        .iter()
        .zip(baseline)
        .map(|(r, b)| if r.bytes > 0.0 { b / r.bytes } else { f64::NAN })
        .collect();
    let reached: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.rounds_to_90.map(|x| x as f64))
        .collect();
    let late = |r: &RowRun| -> Vec<f64> {
        r.purity_by_round
            .iter()
            .skip(2)
            .copied()
            .filter(|p| p.is_finite())
            .collect()
    };
    let purity_means: Vec<f64> = runs
        .iter()
        .map(|r| mean(&late(r)))
        .filter(|p| p.is_finite())
        .collect();
    RowSummary {
        name: name.to_owned(),
        accuracy: Spread::of(&col(&|r| r.accuracy)),
        consensus: Spread::of(&col(&|r| r.consensus)),
        bytes: Spread::of(&col(&|r| r.bytes)),
        dht_bytes: Spread::of(&col(&|r| r.dht_bytes)),
        ratio_to_baseline: mean(&ratios),
        rounds_to_90: Spread::of(&reached),
        reached_90: reached.len(),
        purity: Spread::of(&purity_means),
        purity_min_from_round_3: runs
            .iter()
            .map(|r| late(r).into_iter().fold(f64::NAN, f64::min))
            .collect(),
        runs,
    }
}

fn row_run(report: &LearnReport, name: &str, seed: u64, bar: f64) -> Option<RowRun> {
    let p = report.policies.iter().find(|p| p.name == name)?;
    let accuracy_by_round: Vec<f64> = p.rounds.iter().map(|s| s.accuracy).collect();
    let n = p.rounds.len().max(1) as f64;
    Some(RowRun {
        seed,
        accuracy: p.final_accuracy,
        consensus: p.consensus_accuracy,
        bytes: p.bytes_per_node_round,
        dht_bytes: p.rounds.iter().map(|s| s.dht_bytes_per_node).sum::<f64>() / n,
        rounds_to_90: rounds_to(&accuracy_by_round, bar),
        purity_by_round: p.rounds.iter().map(|s| s.purity).collect(),
        accuracy_by_round,
    })
}

/// Run the grid: every setting × seed with all rows, then the poisoning run.
///
/// # Errors
/// [`LearnError`] from any learning run, or a configuration without rows or seeds.
pub fn run(
    cfg: &ExperimentConfig,
    progress: ProgressFn<'_>,
) -> Result<ExperimentReport, LearnError> {
    let wall = std::time::Instant::now();
    if cfg.rows.is_empty() || cfg.seeds.is_empty() || cfg.settings.is_empty() {
        return Err(LearnError::Config(
            "an experiment needs rows, seeds and settings".into(),
        ));
    }
    let poison = cfg.hostile_fraction > 0.0;
    let runs_total = (cfg.settings.len() * cfg.seeds.len() * cfg.rows.len()
        + if poison { 2 * cfg.seeds.len() } else { 0 }) as u64;
    let rounds = cfg.base.rounds as u64;
    let mut done_runs = 0u64;
    let mut params = 0;
    let mut settings = Vec::new();
    let mut clean_kindred: Vec<f64> = Vec::new();
    for setting in &cfg.settings {
        let mut per_row: Vec<Vec<RowRun>> = vec![Vec::new(); cfg.rows.len()];
        let mut baseline = Vec::new();
        for &seed in &cfg.seeds {
            let mut lc = cfg.base.clone();
            lc.seed = seed;
            lc.setting = *setting;
            lc.policies = cfg.rows.clone();
            lc.hostile = None;
            let label = format!("{} seed {seed}", setting.name());
            let offset = done_runs * rounds;
            let cb = |stage: &str, done: u64, _len: u64| {
                progress(
                    &format!("{label}: {stage}"),
                    offset + done,
                    runs_total * rounds,
                );
            };
            let report = learn_run(&lc, &cb)?;
            done_runs += cfg.rows.len() as u64;
            params = report.params;
            let oracle = report
                .policies
                .iter()
                .find(|p| p.name == "oracle")
                .map_or(f64::NAN, |p| p.final_accuracy);
            let bar = 0.9 * oracle;
            for (slot, row) in per_row.iter_mut().zip(&cfg.rows) {
                if let Some(r) = row_run(&report, &row.name, seed, bar) {
                    slot.push(r);
                }
            }
            baseline.push(
                report
                    .policies
                    .first()
                    .map_or(f64::NAN, |p| p.bytes_per_node_round),
            );
            if *setting == cfg.poison_setting
                && let Some(k) = report.policies.iter().find(|p| p.name == "kindred")
            {
                clean_kindred.push(k.final_accuracy);
            }
        }
        settings.push(SettingSummary {
            setting: setting.name(),
            rows: cfg
                .rows
                .iter()
                .zip(per_row)
                .map(|(row, runs)| summarize(&row.name, runs, &baseline))
                .collect(),
        });
    }
    let poisoning = if poison {
        let (mut robust, mut plain, mut hostile_nodes) = (Vec::new(), Vec::new(), Vec::new());
        let mut robust_bytes = Vec::new();
        for &seed in &cfg.seeds {
            let mut lc = cfg.base.clone();
            lc.seed = seed;
            lc.setting = cfg.poison_setting;
            lc.policies = vec![PolicySpec::kindred(), PolicySpec::kindred_plain_merge()];
            lc.hostile = Some(Hostile {
                fraction: cfg.hostile_fraction,
                attacks: cfg.attacks.clone(),
            });
            let label = format!("{} poisoned seed {seed}", cfg.poison_setting.name());
            let offset = done_runs * rounds;
            let cb = |stage: &str, done: u64, _len: u64| {
                progress(
                    &format!("{label}: {stage}"),
                    offset + done,
                    runs_total * rounds,
                );
            };
            let report = learn_run(&lc, &cb)?;
            done_runs += 2;
            hostile_nodes.push(report.hostile);
            let acc = |name: &str| {
                report
                    .policies
                    .iter()
                    .find(|p| p.name == name)
                    .map_or(f64::NAN, |p| p.final_accuracy)
            };
            robust.push(acc("kindred"));
            plain.push(acc("kindred-plain-merge"));
            robust_bytes.push(
                report
                    .policies
                    .iter()
                    .find(|p| p.name == "kindred")
                    .map_or(f64::NAN, |p| p.bytes_per_node_round),
            );
        }
        // Without the clean setting in the grid there is nothing to compare against.
        let robust_loss = if clean_kindred.len() == robust.len() {
            clean_kindred
                .iter()
                .zip(&robust)
                .map(|(c, r)| c - r)
                .collect()
        } else {
            Vec::new()
        };
        Some(PoisonSummary {
            setting: cfg.poison_setting.name(),
            hostile_fraction: cfg.hostile_fraction,
            hostile_nodes,
            attacks: cfg.attacks.clone(),
            clean: Spread::of(&clean_kindred),
            robust: Spread::of(&robust),
            plain: Spread::of(&plain),
            robust_loss,
            robust_bytes: Spread::of(&robust_bytes),
            robust_per_seed: robust,
        })
    } else {
        None
    };
    progress("done", runs_total * rounds, runs_total * rounds);
    Ok(ExperimentReport {
        nodes: cfg.base.nodes,
        rounds: cfg.base.rounds,
        seeds: cfg.seeds.clone(),
        params,
        settings,
        poisoning,
        seconds: wall.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kindred_trainer::TrainConfig;

    #[test]
    fn rounds_to_bar_is_one_based_and_none_when_never_reached() {
        assert_eq!(rounds_to(&[0.1, 0.5, 0.9], 0.5), Some(2));
        assert_eq!(rounds_to(&[0.1, 0.2], 0.5), None);
    }

    #[test]
    fn a_small_grid_aggregates_every_row_and_the_poisoning_run() {
        let mut base = LearnConfig::new(16, 3);
        base.train = TrainConfig {
            steps: 3,
            batch: 16,
            lr: 0.1,
        };
        base.eval_examples = 100;
        base.eval_nodes = 4;
        base.top_m = 3;
        let cfg = ExperimentConfig {
            seeds: vec![1, 2],
            settings: vec![Setting::Label { clusters: 2 }],
            rows: PolicySpec::evaluation_table(),
            hostile_fraction: 0.25,
            poison_setting: Setting::Label { clusters: 2 },
            attacks: Attack::poisoning(),
            base,
        };
        let r = run(&cfg, &|_, _, _| {}).unwrap();
        let s = r.setting("label2").unwrap();
        assert_eq!(s.rows.len(), 8);
        for row in &s.rows {
            assert_eq!(row.runs.len(), 2, "{}", row.name);
            assert!(row.accuracy.mean.is_finite(), "{}", row.name);
        }
        // The baseline's ratio to itself is 1; compressed rows send less.
        let ratio = |n: &str| s.row(n).unwrap().ratio_to_baseline;
        assert!((ratio("allreduce") - 1.0).abs() < 1e-12);
        assert!(ratio("topk8+allreduce") > 1.0 && ratio("sign+allreduce") > 1.0);
        // Oracle purity is 1 by construction, and its nodes hold their cluster's one model.
        let oracle = s.row("oracle").unwrap();
        assert_eq!(oracle.purity.mean, 1.0);
        assert!((oracle.consensus.mean - oracle.accuracy.mean).abs() < 1e-12);
        assert!(s.row("kindred").unwrap().consensus.mean.is_finite());
        // A hub exchange moves two compressed updates a round; the pairwise exchange fetches a
        // body per partner.
        let bytes = |n: &str| s.row(n).unwrap().bytes.mean;
        assert!(bytes("kindred") < bytes("kindred-pairwise"));
        let p = r.poisoning.unwrap();
        assert_eq!(p.robust_loss.len(), 2);
        assert!(p.hostile_nodes.iter().all(|&h| h > 0));
        assert_eq!(p.attacks, Attack::poisoning());
        assert_eq!(p.robust_per_seed.len(), 2);
        assert!(p.robust_per_seed.iter().all(|a| a.is_finite()));
        assert!(p.robust_bytes.mean > 0.0);
    }
}
