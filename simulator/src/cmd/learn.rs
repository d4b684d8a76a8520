//! `kindred-sim learn`: virtual nodes training the MNIST MLP under several policies at once.

use std::path::Path;

use clap::{Args, ValueEnum};
use kindred_simulator::learn::{
    Attack, Compression, Consensus, Faults, Hostile, LearnConfig, LearnReport, Merge, Partners,
    PolicySpec, Setting,
};
use kindred_simulator::plot::{Chart, Series, line_chart};
use serde_json::{Value, json};

use super::common::{Common, TrainArgs, progress_bar, progress_to};
use super::render::{Table, json_line, note};

/// Data settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum SettingArg {
    /// One task, IID shards.
    Iid,
    /// Rotation clusters (feature shift).
    Rotation,
    /// Label-permutation clusters (concept shift).
    Label,
}

/// How top-k values are quantised (`kindred_distill::TopKValues`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum TopKValuesArg {
    /// One byte each, one scale per layer.
    Int8,
    /// Four bits each: a sign and eight log-spaced magnitudes.
    Log4,
}

/// Options of `kindred-sim learn`.
#[derive(Debug, Clone, Args)]
pub(crate) struct LearnArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Virtual nodes; a comma-separated list runs one experiment per size (bytes-vs-N plot).
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    pub(crate) nodes: Vec<usize>,
    /// Rounds.
    #[arg(long, default_value_t = 30)]
    pub(crate) rounds: usize,
    /// Task setting.
    #[arg(long, value_enum, default_value_t = SettingArg::Label)]
    pub(crate) setting: SettingArg,
    /// Task clusters (ignored for iid).
    #[arg(long, default_value_t = 4)]
    pub(crate) clusters: usize,
    /// Policies to compare: kindred (the hub exchange), kindred-pairwise (the pairwise
    /// exchange), kindred-pairwise-no-snapshots, kindred-plain-merge (the hub exchange with a
    /// plain mean, as in the experiment's poisoning run), gossip, allreduce, local, oracle, or a row of
    /// `kindred-sim experiment` (topk8+allreduce, sign+allreduce, selective+allreduce,
    /// selective+gossip4).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kindred,gossip,allreduce,local,oracle"
    )]
    pub(crate) policies: Vec<String>,
    #[command(flatten)]
    pub(crate) train: TrainArgs,
    /// Bodies fetched per node (semantic top-m); also the gossip fan-out (default:
    /// kindred-routing's).
    #[arg(long)]
    pub(crate) top_m: Option<usize>,
    /// Multi-probe keys per round lookup (default: kindred-routing's).
    #[arg(long)]
    pub(crate) probes: Option<usize>,
    /// Semantic nodes search the DHT in rounds 0-2 and then every this many rounds, following
    /// their best partners in between (default: kindred-routing's 10; 1 searches every round).
    #[arg(long)]
    pub(crate) discovery_every: Option<u64>,
    /// Peers a semantic node follows between discovery rounds (default: kindred-routing's 32; 0
    /// follows nobody, so the node searches the DHT every round).
    #[arg(long)]
    pub(crate) follow: Option<usize>,
    /// Shards of each hot band a node looks up when it refreshes its partners in a discovery
    /// round after its warm-up (default: kindred-routing's 2; 0 looks up every shard).
    #[arg(long)]
    pub(crate) refresh_shards: Option<u32>,
    /// Candidates farther than this multiple of the nearest candidate's distance (1 − sketch
    /// cosine) are neither fetched nor followed (default: kindred-routing's 4).
    #[arg(long)]
    pub(crate) max_distance_ratio: Option<f32>,
    /// Rounds a Kindred node trains alone before it searches for its cohort (default 2).
    #[arg(long)]
    pub(crate) hub_local_rounds: Option<u64>,
    /// After its first 3 exchange rounds, a Kindred node that is its own hub searches every this
    /// many rounds (default 10; with `--fanout`, a tree's roots search every 2 rounds:
    /// `ExchangeConfig::tree_search_every`).
    #[arg(long)]
    pub(crate) hub_search_every: Option<u64>,
    /// Share of its own gain on its shard that a Kindred node's data must see a hub's model keep
    /// before it pushes to the hub, and a merge keep before it applies it (default
    /// kindred-distill's `MIN_GAIN_SHARE`, 0.4).
    #[arg(long)]
    pub(crate) hub_min_gain_share: Option<f32>,
    /// Multi-probe keys a Kindred node looks up per search besides its band keys when, after
    /// its first search, it knows fewer than 3 peers (default 3).
    #[arg(long)]
    pub(crate) hub_probes: Option<usize>,
    /// Band keys a Kindred node searches while it is its own hub (default 3).
    #[arg(long)]
    pub(crate) hub_bands: Option<u16>,
    /// Bits per band of those keys (default 4).
    #[arg(long)]
    pub(crate) hub_band_bits: Option<u8>,
    /// Top-k density every distilling policy settles at after its warm-up (default:
    /// kindred-distill's 0.02, and 0.067 for kindred).
    #[arg(long)]
    pub(crate) density: Option<f32>,
    /// Top-k density a Kindred hub distills its merge at (default: the members' density, and
    /// at least 0.1 in a tree, `--fanout`).
    #[arg(long)]
    pub(crate) hub_density: Option<f32>,
    /// How every distilling policy quantises its top-k values (default: int8, and log4 for
    /// kindred).
    #[arg(long, value_enum)]
    pub(crate) topk_values: Option<TopKValuesArg>,
    /// Honest nodes tracked every round (all are evaluated at the end).
    #[arg(long, default_value_t = 64)]
    pub(crate) eval_nodes: usize,
    /// Held-out digits per cluster behind the accuracy tracked every round (the final accuracy
    /// uses every held-out digit).
    #[arg(long, default_value_t = 500)]
    pub(crate) eval_examples: usize,
    /// Share of hostile nodes, each using one of --attacks in turn.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) hostile: f64,
    /// What hostile nodes do, assigned in turn: scale:F (update ×F), sign-flip, noise (of the
    /// update's norm), inflate:F (claims MAX_SAMPLES training samples, update ×F; inflate is
    /// ×1), inflate-noise (claims MAX_SAMPLES, sends noise), max-finite (the largest finite
    /// values the wire admits), relabel (another task's: the output layer's rows rolled by one
    /// class), or `poisoning` for the experiment's poisoning run's list (scale:10, sign-flip,
    /// noise, inflate:2, inflate-noise, max-finite).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "scale:10,sign-flip,noise"
    )]
    pub(crate) attacks: Vec<String>,
    /// The robust merge caps each peer's claimed training samples at this multiple of the
    /// median claim of the updates merged (default: kindred-distill's
    /// `SynthConfig::max_samples_ratio`; `inf` turns the cap off).
    #[arg(long)]
    pub(crate) max_samples_ratio: Option<f32>,
    /// kindred-pairwise fetches one merged partner's model snapshot every this many rounds and
    /// moves part of the way toward it (default 2, as the node's pairwise exchange; 0: never).
    #[arg(long)]
    pub(crate) snapshot_every: Option<u64>,
    /// Share of the way kindred-pairwise moves toward the partner's model (default 0.5, as the
    /// node's pairwise exchange).
    #[arg(long)]
    pub(crate) snapshot_share: Option<f32>,
    /// The robust merge rejects a peer update whose cosine with the node's own update is below
    /// this (default: kindred-distill's 0; -1 turns the cosine check off).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) min_cosine: Option<f32>,
    /// The robust merge's cosine gate moves down to the median of the peers' cosines minus this
    /// many robust spreads when that is lower (default: kindred-distill's 3; 0 keeps it at
    /// --min-cosine).
    #[arg(long)]
    pub(crate) noise_spreads: Option<f32>,
    /// Kindred's hub exchange: each exchange message (push, answer, model fetch or reply,
    /// served merge) is lost with this probability.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) msg_loss: f64,
    /// Kindred's hub exchange: each round, each node that served as a hub in the last round
    /// crashes with this probability, and comes back after --down-rounds rounds from what it
    /// persisted (losing what it held in memory).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) hub_crash: f64,
    /// Rounds a crashed hub stays down.
    #[arg(long, default_value_t = 3)]
    pub(crate) down_rounds: u64,
    /// Hostile nodes take the lowest hub ranks in every rank window (they grind identities to
    /// be every cohort's hub).
    #[arg(long)]
    pub(crate) hostile_low_rank: bool,
    /// Kindred's hub exchange: rounds per rank window (ranks change with the window; default
    /// 100).
    #[arg(long)]
    pub(crate) hub_rank_window: Option<u64>,
    /// Kindred's hub exchange: bounded hubs, each admitting at most this many pushes a round;
    /// a cohort becomes a tree of sub-hubs (default: one hub per cohort).
    #[arg(long)]
    pub(crate) fanout: Option<usize>,
}

impl LearnArgs {
    fn config(&self, nodes: usize) -> anyhow::Result<LearnConfig> {
        let mut c = LearnConfig::new(nodes, self.rounds);
        c.seed = self.common.seed;
        c.setting = match self.setting {
            SettingArg::Iid => Setting::Iid,
            SettingArg::Rotation => Setting::Rotation {
                clusters: self.clusters,
            },
            SettingArg::Label => Setting::Label {
                clusters: self.clusters,
            },
        };
        c.train = self.train.config();
        if let Some(m) = self.top_m {
            c.top_m = m;
        }
        if let Some(p) = self.probes {
            c.probes = p;
        }
        match self.discovery_every {
            Some(0) => anyhow::bail!("--discovery-every must be at least 1"),
            Some(every) => c.discovery.every_rounds = every,
            None => {}
        }
        if let Some(f) = self.follow {
            c.discovery.follow = f;
        }
        if let Some(s) = self.refresh_shards {
            c.refresh_shards = s;
        }
        if let Some(r) = self.max_distance_ratio {
            anyhow::ensure!(
                r.is_finite() && r >= 1.0,
                "--max-distance-ratio must be a number of at least 1"
            );
            c.gate.max_distance_ratio = r;
        }
        if let Some(rounds) = self.hub_local_rounds {
            c.hub.local_rounds = rounds;
        }
        if let Some(probes) = self.hub_probes {
            c.hub.probes = probes;
        }
        if let Some(every) = self.hub_search_every {
            anyhow::ensure!(every >= 1, "--hub-search-every must be at least 1");
            c.hub.search_every = every;
        }
        if let Some(share) = self.hub_min_gain_share {
            anyhow::ensure!(
                share.is_finite() && share <= 1.0,
                "--hub-min-gain-share must be a number of at most 1"
            );
            c.hub.min_gain_share = share;
        }
        if self.hub_bands.is_some() || self.hub_band_bits.is_some() {
            let keys = kindred_routing::KeyConfig::new(
                self.hub_bands
                    .unwrap_or(u16::try_from(c.hub.keys.bands()).unwrap_or(u16::MAX)),
                self.hub_band_bits
                    .unwrap_or(u8::try_from(c.hub.keys.band_bits()).unwrap_or(u8::MAX)),
            )?;
            // Moving along the SimHash by window, as the exchange's own keys do.
            c.hub.keys = keys.rotating();
        }
        c.hub.faults = self.faults()?;
        if let Some(w) = self.hub_rank_window {
            anyhow::ensure!(w >= 1, "--hub-rank-window must be at least 1");
            c.hub.rank_window = w;
        }
        if let Some(m) = self.fanout {
            anyhow::ensure!(m >= 2, "--fanout must be at least 2");
            c.hub.fanout = Some(m);
        }
        c.eval_nodes = self.eval_nodes;
        c.eval_examples = self.eval_examples;
        c.policies = self
            .policies
            .iter()
            .map(|p| match p.as_str() {
                // `kindred-hub`: the hub exchange's name before it became Kindred's.
                "kindred" | "kindred-hub" => Ok(PolicySpec::kindred()),
                "kindred-pairwise" => Ok(PolicySpec::kindred_pairwise()),
                "kindred-pairwise-no-snapshots" => Ok(PolicySpec::kindred_pairwise_no_snapshots()),
                "kindred-plain-merge" => Ok(PolicySpec::kindred_plain_merge()),
                "gossip" => Ok(PolicySpec::gossip(c.top_m)),
                "allreduce" => Ok(PolicySpec::allreduce()),
                "local" => Ok(PolicySpec::local()),
                "oracle" => Ok(PolicySpec::oracle()),
                "kindred+snapshots" | "kindred-no-snapshots" => {
                    // Names of the pairwise exchange before the hub exchange became Kindred's.
                    anyhow::bail!(
                        "{p:?} is the pairwise exchange now: kindred-pairwise, or \
                         kindred-pairwise-no-snapshots"
                    )
                }
                other => PolicySpec::evaluation_table()
                    .into_iter()
                    .find(|row| row.name == other)
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "unknown policy {other:?} (kindred, kindred-pairwise, \
                             kindred-pairwise-no-snapshots, kindred-plain-merge, gossip, \
                             allreduce, local, oracle, \
                             topk8+allreduce, sign+allreduce, selective+allreduce, \
                             selective+gossip4)"
                        )
                    }),
            })
            .collect::<anyhow::Result<_>>()?;
        self.snapshots(&mut c.policies)?;
        self.densities(&mut c)?;
        for p in &mut c.policies {
            if let Merge::Robust(sc) = &mut p.merge {
                sc.min_cosine = self.min_cosine.unwrap_or(sc.min_cosine);
                sc.noise_spreads = self.noise_spreads.unwrap_or(sc.noise_spreads);
                sc.max_samples_ratio = self.max_samples_ratio.unwrap_or(sc.max_samples_ratio);
                sc.validate().map_err(|e| {
                    anyhow::anyhow!("--min-cosine / --noise-spreads / --max-samples-ratio: {e}")
                })?;
            }
        }
        if self.hostile > 0.0 {
            c.hostile = Some(Hostile {
                fraction: self.hostile,
                attacks: self.attacks()?,
            });
        }
        Ok(c)
    }

    /// `--msg-loss`, `--hub-crash`, `--down-rounds` and `--hostile-low-rank`.
    pub(crate) fn faults(&self) -> anyhow::Result<Faults> {
        for (name, p) in [
            ("--msg-loss", self.msg_loss),
            ("--hub-crash", self.hub_crash),
        ] {
            anyhow::ensure!(
                (0.0..=1.0).contains(&p),
                "{name} must be a probability (0 to 1), not {p}"
            );
        }
        anyhow::ensure!(
            self.hub_crash == 0.0 || self.down_rounds >= 1,
            "--down-rounds must be at least 1 with --hub-crash"
        );
        anyhow::ensure!(
            !self.hostile_low_rank || self.hostile > 0.0,
            "--hostile-low-rank needs hostile nodes (--hostile)"
        );
        Ok(Faults {
            msg_loss: self.msg_loss,
            hub_crash: self.hub_crash,
            down_rounds: self.down_rounds,
            hostile_low_rank: self.hostile_low_rank,
        })
    }

    /// The attacks of `--attacks`, in order.
    fn attacks(&self) -> anyhow::Result<Vec<Attack>> {
        let mut attacks = Vec::new();
        for name in &self.attacks {
            if name == "poisoning" {
                attacks.extend(Attack::poisoning());
                continue;
            }
            attacks.push(Attack::parse(name).ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown attack {name:?} (scale:F, sign-flip, noise, inflate:F, \
                     inflate-noise, max-finite, relabel, poisoning)"
                )
            })?);
        }
        anyhow::ensure!(!attacks.is_empty(), "--attacks needs at least one attack");
        Ok(attacks)
    }

    /// Apply `--density` and `--topk-values` to every distilling policy and `--hub-density` to
    /// the hubs.
    fn densities(&self, c: &mut LearnConfig) -> anyhow::Result<()> {
        if let Some(v) = self.topk_values {
            let mut any = false;
            for p in &mut c.policies {
                if let Compression::Distill(policy) = &mut p.compression {
                    policy.topk_values = match v {
                        TopKValuesArg::Int8 => kindred_distill::TopKValues::Int8,
                        TopKValuesArg::Log4 => kindred_distill::TopKValues::Log4,
                    };
                    any = true;
                }
            }
            anyhow::ensure!(
                any,
                "--topk-values applies to the distilling policies: add one to --policies"
            );
        }
        if let Some(d) = self.density {
            anyhow::ensure!(
                c.policies
                    .iter()
                    .any(|p| matches!(p.compression, Compression::Distill(_))),
                "--density applies to the distilling policies: add one to --policies"
            );
            for p in &mut c.policies {
                if let Compression::Distill(policy) = &mut p.compression {
                    policy.density = d;
                    policy
                        .validate()
                        .map_err(|e| anyhow::anyhow!("--density: {e}"))?;
                }
            }
        }
        if let Some(d) = self.hub_density {
            let hubs: Vec<&kindred_distill::Policy> = c
                .policies
                .iter()
                .filter(|p| p.partners == Partners::Hub)
                .filter_map(|p| match &p.compression {
                    Compression::Distill(policy) => Some(policy),
                    Compression::Full => None,
                })
                .collect();
            anyhow::ensure!(
                !hubs.is_empty(),
                "--hub-density applies to kindred: add it to --policies"
            );
            for policy in hubs {
                kindred_distill::Policy {
                    density: d,
                    ..policy.clone()
                }
                .validate()
                .map_err(|e| anyhow::anyhow!("--hub-density: {e}"))?;
            }
            c.hub.density = Some(d);
        }
        Ok(())
    }

    /// Apply `--snapshot-every` / `--snapshot-share` to the policies that pull snapshots
    /// (`--snapshot-every 0` turns them off).
    fn snapshots(&self, policies: &mut [PolicySpec]) -> anyhow::Result<()> {
        if self.snapshot_every.is_none() && self.snapshot_share.is_none() {
            return Ok(());
        }
        anyhow::ensure!(
            policies.iter().any(|p| p.consensus.is_some()),
            "--snapshot-every and --snapshot-share apply to kindred-pairwise: add it to --policies"
        );
        if let Some(share) = self.snapshot_share {
            anyhow::ensure!(
                share > 0.0 && share <= 1.0,
                "--snapshot-share must be in (0, 1]"
            );
        }
        for p in policies.iter_mut() {
            if p.consensus.is_some() && self.snapshot_every == Some(0) {
                *p = p.clone().without_snapshots();
            }
            p.consensus = p.consensus.map(|c| Consensus {
                every: self.snapshot_every.unwrap_or(c.every),
                pull: kindred_distill::PullConfig {
                    share: self.snapshot_share.unwrap_or(c.pull.share),
                    ..c.pull
                },
            });
        }
        Ok(())
    }
}

fn policy_json(r: &LearnReport) -> Value {
    let mut m = serde_json::Map::new();
    for p in &r.policies {
        let by_round = |f: &dyn Fn(&kindred_simulator::learn::RoundStats) -> f64| {
            p.rounds.iter().map(f).collect::<Vec<f64>>()
        };
        m.insert(
            p.name.clone(),
            json!({
                "final_accuracy": p.final_accuracy,
                "final_accuracy_sd": p.final_accuracy_sd,
                "final_by_cluster": p.final_by_cluster,
                "consensus_accuracy": p.consensus_accuracy,
                "bytes_per_node_round": p.bytes_per_node_round,
                "accuracy_by_round": by_round(&|s| s.accuracy),
                "purity_by_round": by_round(&|s| s.purity),
                "partners_by_round": by_round(&|s| s.partners),
                "bytes_by_round": by_round(&|s| s.bytes_per_node),
                "dht_bytes_per_node_round": p.rounds.iter().map(|s| s.dht_bytes_per_node).sum::<f64>() / p.rounds.len().max(1) as f64,
                "body_bytes_mean": p.rounds.last().map_or(0.0, |s| s.body_bytes),
                "compression_ratio_last": p.rounds.last().map_or(0.0, |s| s.compression_ratio),
                "hub_changes_per_node": p.hub_changes_per_node,
                "missed_merges": p.missed_merges,
                "members_per_hub_max": p.members_per_hub_max,
                "tree_depth_max": p.tree_depth_max,
                "largest_tree_share_by_round": by_round(&|s| s.largest_tree_share),
                "seconds": p.seconds,
            }),
        );
    }
    Value::Object(m)
}

/// Run `kindred-sim learn`.
pub(crate) fn run(args: &LearnArgs) -> anyhow::Result<()> {
    let out = args.common.out_dir()?;
    let json = args.common.json;
    let pb = progress_bar(json);
    let mut reports = Vec::new();
    for &n in &args.nodes {
        let cfg = args.config(n)?;
        pb.set_prefix(format!("N={n}"));
        let cb = progress_to(&pb);
        reports.push(kindred_simulator::learn::run(&cfg, &cb)?);
    }
    pb.finish_and_clear();
    let peak = kindred_simulator::mem::peak_rss_mb().unwrap_or(f64::NAN);
    for r in &reports {
        let mut t = Table::new(
            &format!(
                "kindred-sim learn: {} nodes × {} rounds, {} ({} params, {:.0} digits/node, {} hostile), {:.0} s",
                r.nodes, r.rounds, r.setting, r.params, r.shard_size, r.hostile, r.seconds
            ),
            &[
                "policy",
                "final acc",
                "sd",
                "consensus",
                "acc@round",
                "bytes/node/rd",
                "DHT",
                "ratio",
                "partners",
                "purity",
                "s",
            ],
        );
        for p in &r.policies {
            let last = p.rounds.last().cloned().unwrap_or_default();
            let curve: Vec<String> = p
                .rounds
                .iter()
                .enumerate()
                .filter(|(i, _)| (i + 1) % (r.rounds / 5).max(1) == 0)
                .map(|(_, s)| format!("{:.2}", s.accuracy))
                .collect();
            t.row(vec![
                p.name.clone(),
                format!("{:.4}", p.final_accuracy),
                format!("{:.4}", p.final_accuracy_sd),
                format!("{:.4}", p.consensus_accuracy),
                curve.join(" "),
                format!("{:.0}", p.bytes_per_node_round),
                format!(
                    "{:.0}",
                    p.rounds.iter().map(|s| s.dht_bytes_per_node).sum::<f64>()
                        / p.rounds.len().max(1) as f64
                ),
                format!("{:.1}", last.compression_ratio),
                format!("{:.1}", last.partners),
                if last.purity.is_finite() {
                    format!("{:.3}", last.purity)
                } else {
                    "-".into()
                },
                format!("{:.0}", p.seconds),
            ]);
        }
        t.print(json);
    }
    note(json, &format!("peak RSS {peak:.0} MiB"));
    if let Some(dir) = &out {
        write_outputs(dir, &reports)?;
        note(json, &format!("CSV and plots written to {}", dir.display()));
    }
    let last = reports.last();
    let mut line = json!({
        "nodes": last.map_or(0, |r| r.nodes),
        "rounds": args.rounds,
        "setting": last.map_or(String::new(), |r| r.setting.clone()),
        "params": last.map_or(0, |r| r.params),
        "shard_size": last.map_or(0.0, |r| r.shard_size),
        "hostile": last.map_or(0, |r| r.hostile),
        "attacks": if args.hostile > 0.0 {
            args.attacks()?.into_iter().map(Attack::name).collect::<Vec<_>>()
        } else {
            Vec::new()
        },
        "steps": args.train.steps,
        "faults": {
            "msg_loss": args.msg_loss,
            "hub_crash": args.hub_crash,
            "down_rounds": args.down_rounds,
            "hostile_low_rank": args.hostile_low_rank,
        },
        "seconds": last.map_or(0.0, |r| r.seconds),
        "peak_rss_mb": peak,
        "policies": last.map_or(json!({}), policy_json),
    });
    if reports.len() > 1
        && let Some(o) = line.as_object_mut()
    {
        o.insert(
                "runs".into(),
                Value::Array(
                    reports
                        .iter()
                        .map(|r| json!({"nodes": r.nodes, "seconds": r.seconds, "policies": policy_json(r)}))
                        .collect(),
                ),
            );
    }
    json_line(&line);
    Ok(())
}

fn write_outputs(dir: &Path, reports: &[LearnReport]) -> anyhow::Result<()> {
    let f = kindred_simulator::csv::number;
    let mut rows = Vec::new();
    for r in reports {
        for p in &r.policies {
            for s in &p.rounds {
                rows.push(vec![
                    r.nodes.to_string(),
                    r.setting.clone(),
                    p.name.clone(),
                    s.round.to_string(),
                    f(s.accuracy),
                    f(s.accuracy_sd),
                    f(s.loss),
                    f(s.bytes_per_node),
                    f(s.dht_bytes_per_node),
                    f(s.header_bytes_per_node),
                    f(s.body_bytes_per_node),
                    f(s.snapshot_bytes_per_node),
                    f(s.pulls_clipped),
                    f(s.partners),
                    f(s.candidates),
                    f(s.purity),
                    f(s.rejected),
                    f(s.body_bytes),
                    f(s.header_bytes),
                    f(s.compression_ratio),
                    f(s.searched),
                ]);
            }
        }
    }
    kindred_simulator::csv::write(
        &dir.join("learn_rounds.csv"),
        &[
            "nodes",
            "setting",
            "policy",
            "round",
            "accuracy",
            "accuracy_sd",
            "loss",
            "bytes_per_node",
            "dht_bytes_per_node",
            "header_bytes_per_node",
            "body_bytes_per_node",
            "snapshot_bytes_per_node",
            "pulls_clipped",
            "partners",
            "candidates",
            "purity",
            "rejected",
            "body_bytes",
            "header_bytes",
            "compression_ratio",
            "searched",
        ],
        &rows,
    )?;
    let mut rows = Vec::new();
    for r in reports {
        for p in &r.policies {
            rows.push(vec![
                r.nodes.to_string(),
                r.setting.clone(),
                p.name.clone(),
                f(p.final_accuracy),
                f(p.final_accuracy_sd),
                f(p.consensus_accuracy),
                f(p.bytes_per_node_round),
                f(p.seconds),
            ]);
        }
    }
    kindred_simulator::csv::write(
        &dir.join("learn_summary.csv"),
        &[
            "nodes",
            "setting",
            "policy",
            "final_accuracy",
            "final_accuracy_sd",
            "consensus_accuracy",
            "bytes_per_node_round",
            "seconds",
        ],
        &rows,
    )?;
    if let Some(r) = reports.last() {
        let series: Vec<Series> = r
            .policies
            .iter()
            .map(|p| {
                Series::new(
                    p.name.clone(),
                    p.rounds
                        .iter()
                        .map(|s| ((s.round + 1) as f64, s.accuracy))
                        .collect(),
                )
            })
            .collect();
        line_chart(
            &dir.join("accuracy_vs_round.svg"),
            &Chart {
                title: &format!(
                    "Accuracy vs round ({} nodes, {}, MNIST MLP)",
                    r.nodes, r.setting
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
    if reports.len() >= 2 {
        let names: Vec<String> = reports
            .first()
            .map(|r| r.policies.iter().map(|p| p.name.clone()).collect())
            .unwrap_or_default();
        let series: Vec<Series> = names
            .iter()
            .map(|name| {
                let pts: Vec<(f64, f64)> = reports
                    .iter()
                    .filter_map(|r| {
                        let p = r.policies.iter().find(|p| &p.name == name)?;
                        Some((r.nodes as f64, p.bytes_per_node_round / 1024.0))
                    })
                    .filter(|p| p.1 > 0.0)
                    .collect();
                Series::new(name.clone(), pts)
            })
            .filter(|s| !s.points.is_empty())
            .collect();
        line_chart(
            &dir.join("bytes_vs_nodes_by_policy.svg"),
            &Chart {
                title: "Bytes per node per round vs network size, per policy",
                x_label: "nodes (log scale)",
                y_label: "KiB per node per round (log scale)",
                log_x: true,
                log_y: true,
                y_range: None,
            },
            &series,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        learn: LearnArgs,
    }

    fn config(args: &[&str]) -> anyhow::Result<LearnConfig> {
        let cli = Cli::try_parse_from(std::iter::once("learn").chain(args.iter().copied()))?;
        cli.learn.config(64)
    }

    #[test]
    fn hub_flags_set_the_hub_config_and_bad_values_are_refused() {
        let defaults = config(&[]).unwrap().hub;
        let c = config(&[
            "--hub-search-every",
            "5",
            "--hub-min-gain-share",
            "0.3",
            "--hub-probes",
            "2",
        ])
        .unwrap();
        assert_eq!(c.hub.search_every, 5);
        assert_eq!(c.hub.probes, 2);
        assert_eq!(c.hub.min_gain_share, 0.3);
        assert_eq!(c.hub.local_rounds, defaults.local_rounds);
        assert!(config(&["--hub-search-every", "0"]).is_err());
        assert!(config(&["--hub-min-gain-share", "1.5"]).is_err());
        assert!(config(&["--hub-min-gain-share", "NaN"]).is_err());
    }
}
