//! The cohort tier: the hub exchange's core for up to 10^6 virtual nodes, without training.
//!
//! The learning tier trains a model per node, which caps it near 10^3 nodes. Whether the
//! exchange *forms* at scale (each task's nodes in one bounded tree, trees that never mix
//! tasks, per-node traffic that stays flat as N grows) does not depend on the model: it depends
//! on the core's decisions, the keys, the DHT and time. This tier runs exactly those: one
//! [`kindred_routing::exchange::Exchange`] per node, driven in virtual time as the learning
//! tier drives it (`learn/run/hub.rs`), with synthetic update sketches in place of models:
//!
//! - **Updates**: each node's sketch is the routing tier's workload ([`Embeddings`]: a task
//!   centre, within-task variation and noise), its SimHash the network-wide hyperplanes'.
//! - **Compute**: a merge is the sample-weighted mean of its inputs' sketches, with the count of
//!   nodes of each task it holds; the aggregate check passes a merge whose cosine with the
//!   node's own sketch is at least [`AGGREGATE_MIN_COSINE`], the data check one of which at least
//!   half the nodes are of the node's task; a hub's model passes if the hub is of the node's
//!   task.
//! - **DHT** ([`dht`]): the Kademlia model reduced to what a converged network does: a
//!   provider record lands on the key's holders, a lookup reaches them (the routing tier: 100%
//!   success up to 10^6 nodes) in the routing tier's measured requests (5 / 6 / 7 / 8 at
//!   10^3..10^6), each holder keeps the key's 20 latest providers, and a record carries the
//!   provider's sketch and hub, so that a lookup ranks providers without a header request each.
//! - **Keys**: the core's band keys ([`ExchangeConfig::keys`], moving with the key window)
//!   of the sketch of each searcher's model ([`Keys::Model`]): the node keys on its cumulative
//!   update, which after it applies merges is its tree's; here, the last merge it applied.
//! - **Churn**: a node leaves with probability `churn × round / 1 h` per round and a new node of
//!   the same task (a fresh identity, a fresh core) takes its place.
//!
//! Reported per round: each task's share of nodes in its largest tree, tree depth, members per
//! hub, DHT and exchange bytes per node, and purity (the share of nodes whose tree's majority
//! task is theirs).

pub mod dht;
mod driver;

use std::time::Instant;

use kindred_routing::exchange::{Exchange, ExchangeConfig};

use crate::ProgressFn;
use crate::routing::workload::{Embeddings, Signatures, Workload, WorkloadError};

pub use dht::{Dht, DhtCosts, PROVIDERS_PER_KEY, REPLICAS};

/// A merge passes the aggregate check when its sketch cosine with the node's own is at least
/// this (the tasks' centres are near-orthogonal, a task's nodes at about 0.9).
pub const AGGREGATE_MIN_COSINE: f32 = 0.5;

/// Within-task variation of the sketches. The cosine gate ([`kindred_routing::CosineGate`])
/// admits peers up to 4 times the nearest one's distance (at least 0.02), because in the
/// learning tier's runs on MNIST a task's peers sit within 3 times that distance: sketch
/// cosines of 0.94 and above. At 0.07 two nodes of a synthetic task sit near cosine 0.95 (their
/// difference is about 4 × 0.07 of a centre's norm, plus the noise); at the routing tier's 0.3
/// (built to make recall hard) near 0.6, a task the gate splits (`--spread`, BENCHMARKS.md).
pub const TASK_SPREAD: f32 = 0.07;

/// Virtual round length, ms (the learning tier's).
pub const ROUND_MS: u64 = 60_000;

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct CohortsConfig {
    /// Virtual nodes.
    pub nodes: usize,
    /// Tasks (clusters of the workload).
    pub tasks: usize,
    /// Rounds.
    pub rounds: u64,
    /// Most pushes a hub admits ([`ExchangeConfig::fanout`]); `None`: one hub per cohort.
    pub fanout: Option<usize>,
    /// Share of nodes replaced per hour (0.3 = 30 %/h).
    pub churn_per_hour: f64,
    /// Probability that one message is lost.
    pub msg_loss: f64,
    /// Seed of everything random.
    pub seed: u64,
    /// A packet's body on the wire, bytes (the MNIST MLP's hub packet: about 15 KB).
    pub packet_bytes: usize,
    /// A sealed packet header, bytes.
    pub header_bytes: usize,
    /// A hub's model snapshot, bytes (int8 of the 50,890-parameter MLP, with its header).
    pub snapshot_bytes: usize,
    /// Rounds each node runs alone before it takes part ([`ExchangeConfig::local_rounds`]).
    pub local_rounds: u64,
    /// What nodes search and announce under.
    pub keys: Keys,
    /// The synthetic sketches.
    pub workload: Workload,
}

/// The sketch a node searches, announces and ranks providers under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Keys {
    /// Its model's, as the node keys on its cumulative update (`params − origin`): once it
    /// applied a merge, the last merge it applied (its model is its tree's), before that its own
    /// update. Two roots of one task then key on their trees' means, near the task's centre.
    #[default]
    Model,
    /// Its own update's, always (a node keying on its last round's update alone).
    Update,
}

impl CohortsConfig {
    /// `nodes` nodes of `tasks` tasks for `rounds` rounds, bounded hubs of 64, no churn.
    pub fn new(nodes: usize, tasks: usize, rounds: u64) -> Self {
        Self {
            nodes,
            tasks,
            rounds,
            fanout: Some(64),
            churn_per_hour: 0.0,
            msg_loss: 0.0,
            seed: 1,
            packet_bytes: 15_000,
            header_bytes: 400,
            snapshot_bytes: 52_000,
            local_rounds: ExchangeConfig::default().local_rounds,
            keys: Keys::Model,
            workload: Workload {
                clusters: tasks,
                spread: TASK_SPREAD,
                ..Workload::default()
            },
        }
    }

    /// The exchange's configuration for every node.
    pub fn exchange(&self) -> ExchangeConfig {
        ExchangeConfig {
            local_rounds: self.local_rounds,
            fanout: self.fanout,
            ..ExchangeConfig::default()
        }
    }
}

/// What one round measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CohortsRound {
    /// The round.
    pub round: u64,
    /// Nodes that took part in the exchange (past their local rounds); the shares and purity
    /// count these.
    pub nodes: usize,
    /// Nodes replaced at the round's start (churn).
    pub replaced: usize,
    /// The smallest share, over tasks, of a task's nodes in its largest tree.
    pub largest_tree_share_min: f64,
    /// The mean of that share over tasks.
    pub largest_tree_share_mean: f64,
    /// Trees (roots of two nodes or more).
    pub trees: usize,
    /// Nodes taking part in no tree (alone).
    pub alone: usize,
    /// Deepest push chain from a node to its tree's root (1: a member of the root).
    pub depth_max: usize,
    /// Most pushes one (sub-)hub merged.
    pub members_per_hub_max: usize,
    /// The 99th percentile of that over the (sub-)hubs that merged.
    pub members_per_hub_p99: usize,
    /// Share of nodes whose tree's majority task is theirs.
    pub purity: f64,
    /// DHT bytes on the wire this round, per node.
    pub dht_bytes_per_node: f64,
    /// Exchange bytes on the wire this round (pushes, answers, merges, models), per node.
    pub exchange_bytes_per_node: f64,
    /// Searches run.
    pub searches: usize,
    /// Members that expected a merge and applied their own update.
    pub missed: usize,
    /// Wall seconds of the round.
    pub seconds: f64,
}

/// What a run measured (`kindred-sim cohorts --json` prints the summary fields).
#[derive(Debug, Clone, PartialEq)]
pub struct CohortsReport {
    /// Virtual nodes.
    pub nodes: usize,
    /// Tasks.
    pub tasks: usize,
    /// Rounds run.
    pub rounds: u64,
    /// Bounded hubs' fan-in (`None`: one hub per cohort).
    pub fanout: Option<usize>,
    /// What nodes searched under.
    pub keys: Keys,
    /// Churn, share of nodes per hour.
    pub churn: f64,
    /// The first round in which at least 99% of every task's nodes were in its largest tree.
    pub rounds_to_99: Option<u64>,
    /// The final round's smallest share, over tasks, of a task's nodes in its largest tree.
    pub largest_tree_share_min: f64,
    /// The deepest tree of any round.
    pub depth_max: usize,
    /// The most pushes one (sub-)hub merged in any round.
    pub members_per_hub_max: usize,
    /// DHT and exchange bytes per node per round, mean over the rounds from `rounds_to_99`
    /// (the last half of the run if it never formed).
    pub bytes_per_node_round: f64,
    /// Of which DHT.
    pub dht_bytes_per_node_round: f64,
    /// The lowest purity of any exchange round.
    pub purity_min: f64,
    /// Wall seconds.
    pub seconds: f64,
    /// Peak resident memory, MiB.
    pub peak_rss_mb: Option<f64>,
    /// Every round.
    pub per_round: Vec<CohortsRound>,
}

/// Why a run could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CohortsError {
    /// Inconsistent options.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The workload could not be hashed.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// Multi-probe keys could not be derived.
    #[error(transparent)]
    Probe(#[from] kindred_routing::keys::ProbeError),
}

type Core = Exchange<u32, driver::Handle>;

/// The run's nodes: a slot per node, whose occupant (an identity) churn replaces.
pub(crate) struct Swarm {
    pub(crate) config: ExchangeConfig,
    /// Per slot, its current occupant's identity.
    pub(crate) id_of: Vec<u32>,
    /// Per identity ever used, its slot.
    pub(crate) slot_of: Vec<u32>,
    /// Per slot, the occupant's core.
    pub(crate) cores: Vec<Core>,
    /// Per identity, its rank in the current rank window.
    pub(crate) ranks: Vec<u64>,
    pub(crate) window: u64,
    /// Per slot, the hub its occupant pushed to (or was) in its last round.
    pub(crate) last_hub: Vec<Option<u32>>,
    /// Per slot, the last merge its occupant applied ([`Keys::Model`]): what it searches and
    /// announces under, and what its search ranks providers against.
    pub(crate) keyed: Vec<Option<std::sync::Arc<Keyed>>>,
}

impl Swarm {
    fn new(n: usize, config: ExchangeConfig) -> Self {
        let ranks: Vec<u64> = (0..n as u32).map(|id| rank_of(id, 0)).collect();
        let cores = (0..n as u32)
            .map(|id| {
                Core::new(
                    id,
                    ranks.get(id as usize).copied().unwrap_or(u64::MAX),
                    config.clone(),
                )
                .with_first_round(0)
            })
            .collect();
        Self {
            config,
            id_of: (0..n as u32).collect(),
            slot_of: (0..n as u32).collect(),
            cores,
            ranks,
            window: 0,
            last_hub: vec![None; n],
            keyed: (0..n).map(|_| None).collect(),
        }
    }

    /// The slot of identity `id` if it is still in the swarm.
    pub(crate) fn slot(&self, id: u32) -> Option<usize> {
        let slot = *self.slot_of.get(id as usize)? as usize;
        (self.id_of.get(slot) == Some(&id)).then_some(slot)
    }

    pub(crate) fn rank(&self, id: u32) -> u64 {
        self.ranks.get(id as usize).copied().unwrap_or(u64::MAX)
    }

    /// Replace the occupant of `slot` with a new identity and a fresh core.
    fn replace(&mut self, slot: usize, round: u64) {
        let id = self.slot_of.len() as u32;
        self.slot_of.push(slot as u32);
        let rank = rank_of(id, self.window);
        self.ranks.push(rank);
        if let (Some(s), Some(core), Some(last)) = (
            self.id_of.get_mut(slot),
            self.cores.get_mut(slot),
            self.last_hub.get_mut(slot),
        ) {
            *s = id;
            *core = Core::new(id, rank, self.config.clone()).with_first_round(round);
            *last = None;
        }
        if let Some(k) = self.keyed.get_mut(slot) {
            *k = None;
        }
    }

    /// Every identity's rank in `round`'s rank window, and every core's view ranked anew.
    fn rerank(&mut self, round: u64) {
        let window = round / self.config.rank_window.max(1);
        if window == self.window {
            return;
        }
        self.window = window;
        let n = self.ranks.len() as u32;
        self.ranks = (0..n).map(|id| rank_of(id, window)).collect();
        let ranks = &self.ranks;
        for core in &mut self.cores {
            if core.rank_window() != window {
                core.rerank(window, |p| {
                    ranks.get(*p as usize).copied().unwrap_or(u64::MAX)
                });
            }
        }
    }
}

/// A merge as the searches of the nodes that applied it use it.
#[derive(Debug, Clone)]
pub(crate) struct Keyed {
    pub(crate) sig: kindred_proto::SimHash,
    pub(crate) margins: Vec<f32>,
    pub(crate) sketch: Vec<f32>,
}

/// Identity `id`'s rank in rank window `window` ([`kindred_routing::hub_rank_at`] of its bytes).
fn rank_of(id: u32, window: u64) -> u64 {
    kindred_routing::hub_rank_at(&id.to_le_bytes(), window)
}

/// Run the tier.
///
/// # Errors
/// [`CohortsError`] for an invalid configuration or workload.
///
/// ```
/// use kindred_simulator::cohorts::{CohortsConfig, run};
/// let report = run(&CohortsConfig::new(60, 2, 6), &|_, _, _| {}).unwrap();
/// assert_eq!(report.per_round.len(), 6);
/// assert!(report.purity_min > 0.9);
/// ```
pub fn run(cfg: &CohortsConfig, progress: ProgressFn<'_>) -> Result<CohortsReport, CohortsError> {
    let started = Instant::now();
    if cfg.nodes < 2 || cfg.tasks == 0 || cfg.rounds == 0 {
        return Err(CohortsError::Config(
            "needs at least 2 nodes, 1 task and 1 round".into(),
        ));
    }
    if cfg.nodes > u32::MAX as usize / 4 {
        return Err(CohortsError::Config("too many nodes".into()));
    }
    if cfg.tasks > usize::from(u16::MAX) {
        return Err(CohortsError::Config("at most 65,535 tasks".into()));
    }
    if cfg.fanout.is_some_and(|m| m < 2) {
        return Err(CohortsError::Config(
            "the fan-out must be at least 2".into(),
        ));
    }
    if !(0.0..1.0).contains(&cfg.msg_loss) || !(0.0..=3600.0).contains(&cfg.churn_per_hour) {
        return Err(CohortsError::Config(
            "message loss must be in [0, 1) and churn in [0, 3600] per hour".into(),
        ));
    }
    let n = cfg.nodes;
    progress("sketches", 0, 1);
    let workload = Workload {
        clusters: cfg.tasks,
        ..cfg.workload
    };
    let emb = Embeddings::generate(n, &workload, cfg.seed);
    let all: Vec<u32> = (0..n as u32).collect();
    let sigs = Signatures::compute(&emb, &all, n, cfg.seed ^ 0x51_6A)?;
    let mut swarm = Swarm::new(n, cfg.exchange());
    let mut dht = Dht::new(DhtCosts::for_nodes(n));
    let leave = cfg.churn_per_hour * ROUND_MS as f64 / 3_600_000.0;
    let mut per_round = Vec::new();
    for round in 0..cfg.rounds {
        progress("rounds", round, cfg.rounds);
        let t = Instant::now();
        let mut replaced = 0;
        if leave > 0.0 {
            for slot in 0..n {
                let u = crate::rng::unit_open(crate::rng::hash_words(
                    cfg.seed,
                    &[0xC4_0212, round, slot as u64],
                ));
                if u < leave {
                    swarm.replace(slot, round);
                    replaced += 1;
                }
            }
        }
        swarm.rerank(round);
        let mut r = driver::round(cfg, &emb, &sigs, &mut swarm, &mut dht, round)?;
        r.replaced = replaced;
        r.seconds = t.elapsed().as_secs_f64();
        tracing::info!(
            round,
            share_min = r.largest_tree_share_min,
            depth = r.depth_max,
            fan_in = r.members_per_hub_max,
            purity = r.purity,
            bytes = r.dht_bytes_per_node + r.exchange_bytes_per_node,
            seconds = r.seconds,
            "cohort round"
        );
        per_round.push(r);
    }
    progress("rounds", cfg.rounds, cfg.rounds);
    Ok(summarize(cfg, per_round, started))
}

/// The run's summary from its rounds.
fn summarize(cfg: &CohortsConfig, per_round: Vec<CohortsRound>, started: Instant) -> CohortsReport {
    let rounds_to_99 = per_round
        .iter()
        .find(|r| r.largest_tree_share_min >= 0.99)
        .map(|r| r.round);
    let from = rounds_to_99.unwrap_or(cfg.rounds / 2);
    let after: Vec<&CohortsRound> = per_round.iter().filter(|r| r.round >= from).collect();
    let mean = |f: &dyn Fn(&CohortsRound) -> f64| {
        after.iter().map(|r| f(r)).sum::<f64>() / after.len().max(1) as f64
    };
    let exchanged = per_round.iter().filter(|r| r.round >= cfg.local_rounds);
    CohortsReport {
        nodes: cfg.nodes,
        tasks: cfg.tasks,
        rounds: cfg.rounds,
        fanout: cfg.fanout,
        keys: cfg.keys,
        churn: cfg.churn_per_hour,
        rounds_to_99,
        largest_tree_share_min: per_round.last().map_or(0.0, |r| r.largest_tree_share_min),
        depth_max: per_round.iter().map(|r| r.depth_max).max().unwrap_or(0),
        members_per_hub_max: per_round
            .iter()
            .map(|r| r.members_per_hub_max)
            .max()
            .unwrap_or(0),
        bytes_per_node_round: mean(&|r| r.dht_bytes_per_node + r.exchange_bytes_per_node),
        dht_bytes_per_node_round: mean(&|r| r.dht_bytes_per_node),
        purity_min: exchanged.map(|r| r.purity).fold(1.0, f64::min),
        seconds: started.elapsed().as_secs_f64(),
        peak_rss_mb: crate::mem::peak_rss_mb(),
        per_round,
    }
}
