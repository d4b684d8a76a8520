//! What a learning run does: data setting, policies, training, evaluation, hostile nodes.

use kindred_distill::{
    AggregateCheck, EmbeddingConfig, MIN_GAIN_SHARE, Policy, PullConfig, SynthConfig,
};
use kindred_routing::{CosineGate, Discovery, KeyConfig};
use kindred_trainer::{Arch, Task, TrainConfig};

/// How tasks differ between nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// One task, IID shards.
    Iid,
    /// `clusters` tasks, images rotated by `c` quarter turns (feature shift).
    Rotation {
        /// Number of task clusters (≤ 4 distinct rotations).
        clusters: usize,
    },
    /// `clusters` tasks, labels shifted by `c` (concept shift).
    Label {
        /// Number of task clusters (≤ 10 distinct shifts).
        clusters: usize,
    },
}

impl Setting {
    /// Number of task clusters.
    pub fn clusters(&self) -> usize {
        match *self {
            Self::Iid => 1,
            Self::Rotation { clusters } | Self::Label { clusters } => clusters.max(1),
        }
    }

    /// Task of cluster `c`.
    pub fn task(&self, c: usize) -> Task {
        match self {
            Self::Iid => Task::IDENTITY,
            Self::Rotation { .. } => Task::rotation_cluster(c),
            Self::Label { .. } => Task::label_cluster(c),
        }
    }

    /// Short name (`iid`, `rotation4`, `label4`).
    pub fn name(&self) -> String {
        match self {
            Self::Iid => "iid".into(),
            Self::Rotation { clusters } => format!("rotation{clusters}"),
            Self::Label { clusters } => format!("label{clusters}"),
        }
    }
}

/// Whom a node merges with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partners {
    /// Nobody: local training only.
    Local,
    /// Everybody: the global average of every node's update, applied by every node.
    AllReduce,
    /// Its true task cluster: the cluster average (the oracle clustering).
    Oracle,
    /// `fanout` peers drawn uniformly at random each round.
    Gossip {
        /// Peers per round.
        fanout: usize,
    },
    /// The top-m peers found through the routing model (band keys + multi-probe lookups),
    /// ranked by sketch cosine.
    Semantic,
    /// The hub exchange (`kindred_routing::cohort`): a node finds a few peers of its task
    /// through a cheap search ([`HubConfig`]), pushes its packet to the lowest-ranked peer of
    /// its cohort, which merges every member's update it admits and sends the distilled merge
    /// back; members learn each other from their hub's answers.
    Hub,
}

/// What goes on the wire.
#[derive(Debug, Clone, PartialEq)]
pub enum Compression {
    /// The dense f32 update.
    Full,
    /// A `kindred-distill` packet body under this policy (with error feedback per node).
    Distill(Policy),
}

/// How a node combines its own update with its partners'.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Merge {
    /// Sample-weighted mean of everything, no norm or cosine checks; claimed samples are
    /// bounded as every merge bounds them (`kindred_distill::cap_samples` at the default
    /// `SynthConfig::max_samples_ratio`).
    Mean,
    /// `kindred_distill::synthesize`: norm clipping, cosine gate, similarity weights.
    Robust(SynthConfig),
}

/// One policy compared in a run.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// Name in tables, CSV and JSON.
    pub name: String,
    /// Partner selection.
    pub partners: Partners,
    /// Wire format.
    pub compression: Compression,
    /// Merge rule.
    pub merge: Merge,
    /// Model gossip averaging on top of the merge (semantic partners only), if any.
    pub consensus: Option<Consensus>,
}

/// Top-k density of the hub exchange's packets (`PolicySpec::kindred`): the node's
/// ([`Policy::HUB_DENSITY`]).
pub const HUB_DENSITY: f32 = Policy::HUB_DENSITY;

impl PolicySpec {
    /// Kindred: its packets and robust merge in the hub exchange ([`Partners::Hub`]), where
    /// every member of a cohort applies the merge its hub made of the cohort's updates. Packets
    /// go out at [`HUB_DENSITY`] from the first: the exchange starts after
    /// [`HubConfig::local_rounds`] of training alone, which do the distiller's warm-up's job (the
    /// first updates are the largest), and its warm-up changed nothing measurable after them
    /// (seeds 1-16: iid 90.98 against 90.97%, rotation 91.29 against 91.32%, 12-29 B less per
    /// node per round).
    pub fn kindred() -> Self {
        Self {
            name: "kindred".into(),
            partners: Partners::Hub,
            compression: Compression::Distill(Policy::hub()),
            // A hub's merge takes `SynthConfig::for_hub` of its cohort's size (`hub.rs`).
            merge: Merge::Robust(SynthConfig::for_node(true)),
            consensus: None,
        }
    }

    /// The pairwise exchange (`kindred_routing`'s round lookup): distilled packets, semantic
    /// partners whose bodies a node fetches, robust merge, and a pull toward one merged
    /// partner's model snapshot every other round. What the node ran before the hub exchange.
    pub fn kindred_pairwise() -> Self {
        Self {
            name: "kindred-pairwise".into(),
            partners: Partners::Semantic,
            compression: Compression::Distill(Policy::default()),
            merge: Merge::Robust(SynthConfig::for_node(true)),
            consensus: Some(Consensus::default()),
        }
    }

    /// The pairwise exchange without model snapshots (the node's `snapshot_every = 0`):
    /// merging updates only, what the snapshots are measured against.
    pub fn kindred_pairwise_no_snapshots() -> Self {
        Self {
            name: "kindred-pairwise-no-snapshots".into(),
            ..Self::kindred_pairwise().without_snapshots()
        }
    }

    /// This policy with model snapshots off, as a node with `snapshot_every = 0`: its robust
    /// merge's gate then stays at `min_cosine` (`SynthConfig::for_node(false)`).
    pub fn without_snapshots(self) -> Self {
        Self {
            merge: match self.merge {
                Merge::Robust(_) => Merge::Robust(SynthConfig::for_node(false)),
                m => m,
            },
            consensus: None,
            ..self
        }
    }

    /// Random gossip with Kindred's packets and merge and the given fan-out.
    pub fn gossip(fanout: usize) -> Self {
        Self {
            name: "gossip".into(),
            partners: Partners::Gossip { fanout },
            compression: Compression::Distill(Policy::default()),
            merge: Merge::Robust(SynthConfig::for_node(false)),
            consensus: None,
        }
    }

    /// Global full-precision all-reduce (FedAvg-style: everyone applies the global mean).
    pub fn allreduce() -> Self {
        Self {
            name: "allreduce".into(),
            partners: Partners::AllReduce,
            compression: Compression::Full,
            merge: Merge::Mean,
            consensus: None,
        }
    }

    /// Local training only.
    pub fn local() -> Self {
        Self {
            name: "local".into(),
            partners: Partners::Local,
            compression: Compression::Full,
            merge: Merge::Mean,
            consensus: None,
        }
    }

    /// Oracle clustering: full-precision average within the true task cluster.
    pub fn oracle() -> Self {
        Self {
            name: "oracle".into(),
            partners: Partners::Oracle,
            compression: Compression::Full,
            merge: Merge::Mean,
            consensus: None,
        }
    }

    /// Dense updates cut to the top 2% per layer, int8 values, averaged by all-reduce (with error
    /// feedback): the "8-bit top-k (k = 0.02) + ring" row of the evaluation table.
    pub fn topk8_allreduce() -> Self {
        Self {
            name: "topk8+allreduce".into(),
            partners: Partners::AllReduce,
            compression: Compression::Distill(Policy {
                dense_max_elems: 0,
                tau_low: -1.0,
                tau_high: f32::MAX,
                warmup: Vec::new(),
                density: 0.02,
                ..Policy::default()
            }),
            merge: Merge::Mean,
            consensus: None,
        }
    }

    /// Every multi-dimensional layer sent as 1-bit signs (with error feedback), averaged by
    /// all-reduce: the "SignSGD + ring" row. 1-D layers (biases) stay dense f16.
    pub fn sign_allreduce() -> Self {
        Self {
            name: "sign+allreduce".into(),
            partners: Partners::AllReduce,
            compression: Compression::Distill(Policy {
                dense_max_elems: 0,
                tau_low: f32::MAX,
                tau_high: f32::MAX,
                warmup: Vec::new(),
                ..Policy::default()
            }),
            merge: Merge::Mean,
            consensus: None,
        }
    }

    /// Kindred's selective (hybrid, per-layer) policy averaged by all-reduce.
    pub fn selective_allreduce() -> Self {
        Self {
            name: "selective+allreduce".into(),
            partners: Partners::AllReduce,
            compression: Compression::Distill(Policy::default()),
            merge: Merge::Mean,
            consensus: None,
        }
    }

    /// The rows of the selective-compression evaluation table plus Kindred, the pairwise
    /// exchange and the oracle, the baseline (`allreduce`) first: what `kindred-sim experiment`
    /// compares.
    pub fn evaluation_table() -> Vec<Self> {
        vec![
            Self::allreduce(),
            Self::topk8_allreduce(),
            Self::sign_allreduce(),
            Self::selective_allreduce(),
            Self {
                name: "selective+gossip4".into(),
                ..Self::gossip(4)
            },
            Self::kindred(),
            Self::kindred_pairwise(),
            Self::oracle(),
        ]
    }

    /// Kindred without the robust merge (its hubs take a plain sample-weighted mean of what
    /// their members pushed): what the robust merge is measured against under poisoning.
    pub fn kindred_plain_merge() -> Self {
        Self {
            name: "kindred-plain-merge".into(),
            merge: Merge::Mean,
            ..Self::kindred()
        }
    }

    /// The five standard policies (Kindred, random gossip with `fanout` peers, all-reduce,
    /// local, oracle).
    pub fn standard(fanout: usize) -> Vec<Self> {
        vec![
            Self::kindred(),
            Self::gossip(fanout),
            Self::allreduce(),
            Self::local(),
            Self::oracle(),
        ]
    }
}

/// What a hostile node does to its update before sending it, and what it claims.
///
/// A hostile node trains honestly; the attack changes what it sends (its update, the model
/// snapshot it serves, and as a hub the merge it serves) and, for the inflating attacks, the
/// training samples its signed headers claim. Names for the command line: [`Attack::name`],
/// parsed back by [`Attack::parse`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attack {
    /// Multiply by a factor.
    Scale(f32),
    /// Negate.
    SignFlip,
    /// Replace by Gaussian noise of the same norm.
    Noise,
    /// Claim [`kindred_proto::MAX_SAMPLES`] training samples (the most a header may claim; a
    /// claim of `u64::MAX` is refused on the wire or clamped to it by the merge), with the
    /// update multiplied by the factor: 1 sends an honest update, 2 an honest-looking scaled
    /// one, −1 a flipped one. The robust merge caps every claim
    /// (`kindred_distill::SynthConfig::max_samples_ratio`).
    InflateSamples(f32),
    /// Claim [`kindred_proto::MAX_SAMPLES`] training samples with Gaussian noise of the
    /// update's norm: a poisoned update that late in training passes a noise-level cosine gate,
    /// with all the weight a claim can buy.
    InflateNoise,
    /// Send the largest finite values the wire admits: every dense f32 value ±`f32::MAX`,
    /// f16 ±65504, every int8 value ±127 at the largest scale whose 127 steps stay finite,
    /// sign layers at a scale of `f32::MAX` (receivers refuse non-finite values, not huge
    /// ones). Signs follow the honest update, and the layer encodings and top-k indices are the
    /// honest packet's, so the header and the body's size look honest.
    MaxFinite,
    /// Another task's update: the output layer's rows (weight and bias) rolled by one class,
    /// so it teaches label `y + 1` what the node's data taught label `y`. Its direction and
    /// norm are an honest update's (the first layer dominates both); its output layer points
    /// at the wrong classes (`kindred_distill::check_head`).
    Relabel,
}

impl Attack {
    /// The attacks of the poisoning run of `kindred-sim experiment`, assigned to hostile nodes
    /// in turn: ×10, sign flip, noise, an honest-looking ×2 update claiming `MAX_SAMPLES`,
    /// noise claiming `MAX_SAMPLES`, and the largest finite values.
    pub fn poisoning() -> Vec<Self> {
        vec![
            Self::Scale(10.0),
            Self::SignFlip,
            Self::Noise,
            Self::InflateSamples(2.0),
            Self::InflateNoise,
            Self::MaxFinite,
        ]
    }

    /// The training samples a hostile node's header claims when it trained on `trained`.
    pub fn claim(self, trained: u64) -> u64 {
        match self {
            Self::InflateSamples(_) | Self::InflateNoise => kindred_proto::MAX_SAMPLES,
            Self::Scale(_) | Self::SignFlip | Self::Noise | Self::MaxFinite | Self::Relabel => {
                trained
            }
        }
    }

    /// A short name: `scale:10`, `sign-flip`, `noise`, `inflate:2`, `inflate-noise`,
    /// `max-finite`, `relabel`.
    ///
    /// ```
    /// use kindred_simulator::learn::Attack;
    /// for a in Attack::poisoning().into_iter().chain([Attack::Relabel]) {
    ///     assert_eq!(Attack::parse(&a.name()), Some(a));
    /// }
    /// ```
    pub fn name(self) -> String {
        match self {
            Self::Scale(f) => format!("scale:{f}"),
            Self::SignFlip => "sign-flip".into(),
            Self::Noise => "noise".into(),
            Self::InflateSamples(f) => format!("inflate:{f}"),
            Self::InflateNoise => "inflate-noise".into(),
            Self::MaxFinite => "max-finite".into(),
            Self::Relabel => "relabel".into(),
        }
    }

    /// Parse a [`Attack::name`]; `scale` alone is ×10 and `inflate` alone ×1. `None` for an
    /// unknown name or a factor that is not a finite number.
    pub fn parse(name: &str) -> Option<Self> {
        let (kind, factor) = match name.split_once(':') {
            Some((k, f)) => (k, Some(f.parse::<f32>().ok().filter(|f| f.is_finite())?)),
            None => (name, None),
        };
        match (kind, factor) {
            ("scale", f) => Some(Self::Scale(f.unwrap_or(10.0))),
            ("inflate", f) => Some(Self::InflateSamples(f.unwrap_or(1.0))),
            ("sign-flip", None) => Some(Self::SignFlip),
            ("noise", None) => Some(Self::Noise),
            ("inflate-noise", None) => Some(Self::InflateNoise),
            ("max-finite", None) => Some(Self::MaxFinite),
            ("relabel", None) => Some(Self::Relabel),
            _ => None,
        }
    }
}

/// Hostile nodes: a fraction of the nodes, each using one of the attacks (round-robin).
#[derive(Debug, Clone, PartialEq)]
pub struct Hostile {
    /// Share of nodes that are hostile.
    pub fraction: f64,
    /// Attacks, assigned to hostile nodes in turn.
    pub attacks: Vec<Attack>,
}

/// Gossip averaging of models on top of merging updates: every `every` rounds each semantic node
/// fetches one of the partners it merged that round, at random, as a model snapshot
/// (`kindred_distill::snapshot`, int8) and moves part of the way toward it
/// (`kindred_distill::pull`), as the node does (`snapshot_every`, `snapshot_share`).
///
/// Merging updates alone lets nodes' models drift apart; the consensus figure
/// ([`crate::learn::PolicyReport::consensus_accuracy`]) measures how far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Consensus {
    /// Rounds between pulls (1: every round); rounds `every − 1`, `2·every − 1`, ... pull.
    pub every: u64,
    /// The step toward the partner.
    pub pull: PullConfig,
}

impl Default for Consensus {
    /// The node's defaults: every other round, half way.
    fn default() -> Self {
        Self {
            every: 2,
            pull: PullConfig::default(),
        }
    }
}

/// How nodes of the hub exchange ([`Partners::Hub`]) find their cohort and check their hub.
///
/// A node first trains alone for [`HubConfig::local_rounds`] rounds. A node needs one peer of its
/// task to join a cohort: the hub's answers list the rest. So it then searches the DHT with a few
/// band keys only, and only while it is its own hub (which it is while it knows nobody): in its
/// first 3 exchange rounds, then every [`HubConfig::search_every`] rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HubConfig {
    /// Rounds a node trains alone before it takes part in the exchange. Default 2.
    ///
    /// Why: a node's embedding is the sketch of its cumulative update, and nodes that merged are
    /// keyed on what their cohort learned, not on their data. A node that joined another task's
    /// cohort while models were young (in round 0 the first updates of one rotated task sit at
    /// sketch cosine 0.44-0.55 at the least with each other, those of two tasks at up to
    /// 0.63-0.67) looked like that task from then on, and no later check could tell; rotation
    /// purity from round 3 was 0.94-0.98 on some seeds. When a node that trained alone first
    /// pushes (its third round of training), the sketches of one task sit at 0.80 or more with
    /// each other and those of different rotations at 0.75 at most (`kindred-sim learn
    /// --setting rotation --policies local`, seeds 1, 2, 5, 8), and the hub's model is
    /// informative for the data check ([`HubConfig::min_gain_share`]): purity is 1.000 from the
    /// first exchange round on 16 seeds of rotation and label, and accuracy is as high.
    pub local_rounds: u64,
    /// The band keys searched. Default 3 bands of 4 bits: few keys, each so wide that nearly
    /// every peer of the task shares one (a band of 4 bits matches a peer at sketch cosine 0.9
    /// with probability 0.54, so 3 bands find 90% of them), which the cosine gate then sorts;
    /// 4 bands of 8 bits left a task in fragments for 5-15 rounds.
    pub keys: KeyConfig,
    /// Multi-probe keys a search looks up while the node's view is small after its first
    /// search (`kindred_routing::exchange::ExchangeConfig::probes`). Default 3.
    pub probes: usize,
    /// After its first 3 exchange rounds, a node that is its own hub searches every this many
    /// rounds, to meet cohorts of its task it has not met. Default 10: a search costs its hub
    /// about 165 KB of Kademlia traffic at 64 nodes, and against 5 it saves 0.47 KB per node per
    /// round on iid (seeds 1-3) for 0.02 point of accuracy. With bounded hubs
    /// ([`HubConfig::fanout`]) roots search every
    /// `kindred_routing::exchange::ExchangeConfig::tree_search_every` rounds instead.
    pub search_every: u64,
    /// One node in this many, the lowest ranks, is a hub candidate
    /// ([`kindred_routing::is_hub_candidate`]): in the first [`HubConfig::candidate_rounds`]
    /// exchange rounds only candidates announce, and the others only look up. Default 4; 1 makes
    /// every node announce.
    pub candidates: u64,
    /// Exchange rounds, from the first, in which only hub candidates announce. Default 2: a node
    /// that found no candidate in its first exchange round looks up again in the second, and
    /// announces from the third on if it is still alone (a cohort without candidates).
    pub candidate_rounds: u64,
    /// Most peers a node's cohort view holds. Default 1,024.
    pub max_members: usize,
    /// What a member checks before applying its hub's merge.
    pub check: AggregateCheck,
    /// The share of its own gain on its shard that a node's data must see a hub's model keep
    /// before the node pushes to it and adopts it, and a merge keep before the node (a member or
    /// the hub) applies it (`kindred_distill::check_by_data`). Default
    /// `kindred_distill::MIN_GAIN_SHARE`.
    pub min_gain_share: f32,
    /// Top-k density a hub distills its merge at, in place of the members' policy density.
    /// Default `None`: the members' density, and in a tree ([`HubConfig::fanout`]) at least
    /// [`TREE_MERGE_DENSITY`] ([`HubConfig::merge_density`]).
    pub density: Option<f32>,
    /// Rounds per rank window (`kindred_routing::exchange::ExchangeConfig::rank_window`).
    /// Default 100.
    pub rank_window: u64,
    /// Bounded hubs: most pushes a hub or sub-hub admits in a round
    /// (`kindred_routing::exchange::ExchangeConfig::fanout`). Default `None`: one hub per
    /// cohort.
    pub fanout: Option<usize>,
    /// What goes wrong on the way: lost messages, crashing hubs, rank-grinding attackers.
    pub faults: Faults,
}

/// Faults the hub exchange runs under (`kindred-sim learn --msg-loss`, `--hub-crash`,
/// `--down-rounds`, `--hostile-low-rank`). Default: none.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    /// Each exchange message (a push, an answer, a model fetch or its reply, a served merge)
    /// is lost with this probability.
    pub msg_loss: f64,
    /// Each round, each node that served as a hub in the previous round crashes with this
    /// probability: it is down (it neither trains nor answers) for
    /// [`Faults::down_rounds`] rounds and comes back from what it persisted (its exchange
    /// snapshot, its model and its distillers), losing what it held in memory.
    pub hub_crash: f64,
    /// Rounds a crashed hub stays down. Default 0 (use at least 1 with `hub_crash`).
    pub down_rounds: u64,
    /// Hostile nodes ground their identities for the lowest hub ranks: each is hub of every
    /// cohort that knows it, as far as identities decide.
    pub hostile_low_rank: bool,
}

/// The least top-k density a tree's (sub-)hubs distill their merges at
/// ([`HubConfig::merge_density`]), against the members' 6.7%.
///
/// Why: in a tree a task's updates are distilled at each level, members' packets, then a
/// sub-hub's merge of them, then the root's, and each level drops entries (error feedback
/// sends them late). `kindred-sim learn --nodes 1000 --rounds 30 --setting label --fanout 64`,
/// seeds 1-3: 0.48 ± 0.12 point under the oracle at 10% against 0.58 ± 0.13 at 6.7% (with
/// the first form of `ExchangeConfig::stranded_after`), for 6-7% more bytes (BENCHMARKS.md,
/// bounded hubs). Sub-hubs' merges at the members' density
/// times the updates they hold gained 0.04 for 8% more bytes, dense ones nothing for 1.5x.
pub const TREE_MERGE_DENSITY: f32 = 0.1;

impl HubConfig {
    /// The top-k density a hub distills its merges at when its members distill at `members`:
    /// [`HubConfig::density`] if set, else `members`, and at least [`TREE_MERGE_DENSITY`] in
    /// a tree.
    ///
    /// ```
    /// use kindred_simulator::learn::HubConfig;
    ///
    /// let one_hub = HubConfig::default();
    /// assert_eq!(one_hub.merge_density(0.067), 0.067);
    /// let tree = HubConfig { fanout: Some(64), ..HubConfig::default() };
    /// assert_eq!(tree.merge_density(0.067), 0.1);
    /// let set = HubConfig { density: Some(0.05), ..tree };
    /// assert_eq!(set.merge_density(0.067), 0.05);
    /// ```
    pub fn merge_density(&self, members: f32) -> f32 {
        match (self.density, self.fanout) {
            (Some(d), _) => d,
            (None, Some(_)) => members.max(TREE_MERGE_DENSITY),
            (None, None) => members,
        }
    }
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            local_rounds: 2,
            keys: kindred_routing::exchange::ExchangeConfig::keys(),
            probes: kindred_routing::exchange::ExchangeConfig::default().probes,
            search_every: 10,
            candidates: 4,
            candidate_rounds: 2,
            max_members: 1024,
            check: AggregateCheck::default(),
            min_gain_share: MIN_GAIN_SHARE,
            density: None,
            rank_window: kindred_routing::exchange::ExchangeConfig::default().rank_window,
            fanout: kindred_routing::exchange::ExchangeConfig::default().fanout,
            faults: Faults::default(),
        }
    }
}

/// Everything a learning run depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct LearnConfig {
    /// Virtual nodes.
    pub nodes: usize,
    /// Rounds.
    pub rounds: usize,
    /// Seed of everything random (data split, initial model, minibatches, partners).
    pub seed: u64,
    /// Task setting.
    pub setting: Setting,
    /// Model architecture.
    pub arch: Arch,
    /// Local training per round.
    pub train: TrainConfig,
    /// Policies compared (each on its own copy of every node, from the same initial model).
    pub policies: Vec<PolicySpec>,
    /// Bodies a node fetches (semantic partners). Default `kindred-routing`'s 16.
    pub top_m: usize,
    /// Which candidates are fetched and followed. Default `kindred-routing`'s (floor 0.5, at
    /// most 4 times the nearest candidate's distance).
    pub gate: CosineGate,
    /// Multi-probe keys per round lookup. Default `kindred-routing`'s 8.
    pub probes: usize,
    /// Shards of each hot band a refresh lookup asks. Default `kindred-routing`'s 2
    /// (`LookupConfig::refresh_shards`; 0: every shard).
    pub refresh_shards: u32,
    /// When semantic nodes search the DHT and whom they follow in between. Default
    /// `kindred-routing`'s (rounds 0-2, then every 10th; 32 peers followed).
    pub discovery: Discovery,
    /// Embedding parameters (network-wide).
    pub embedding: EmbeddingConfig,
    /// Share of MNIST held out for evaluation. Default 0.2.
    pub eval_fraction: f64,
    /// Evaluation digits per cluster (from the held-out part) behind the accuracy tracked every
    /// round. Default 500. The final accuracy is measured on every held-out digit (2,000 of
    /// MNIST's 10,000 at the default `eval_fraction`): a 500-digit estimate of a 90% accuracy
    /// has a standard error of 1.3 points, wider than the differences a comparison of policies
    /// has to resolve.
    pub eval_examples: usize,
    /// Honest nodes whose accuracy is tracked every round (spread over clusters); the final
    /// round evaluates every node. Default 64.
    pub eval_nodes: usize,
    /// Hostile nodes, if any.
    pub hostile: Option<Hostile>,
    /// The hub exchange's search and check ([`Partners::Hub`]).
    pub hub: HubConfig,
}

impl LearnConfig {
    /// Defaults: the MNIST MLP, 4 label-shift clusters, the five standard policies.
    pub fn new(nodes: usize, rounds: usize) -> Self {
        let lookup = kindred_routing::LookupConfig::default();
        Self {
            nodes,
            rounds,
            seed: 1,
            setting: Setting::Label { clusters: 4 },
            arch: Arch::MLP,
            train: TrainConfig::default(),
            policies: PolicySpec::standard(lookup.top_m),
            top_m: lookup.top_m,
            gate: lookup.gate,
            probes: lookup.probes,
            refresh_shards: lookup.refresh_shards,
            discovery: Discovery::default(),
            // As the node: the cumulative update already separates tasks; centring it by
            // peer updates would remove exactly that signal.
            embedding: EmbeddingConfig {
                center: false,
                ..EmbeddingConfig::default()
            },
            eval_fraction: 0.2,
            eval_examples: 500,
            eval_nodes: 64,
            hostile: None,
            hub: HubConfig::default(),
        }
    }
}
