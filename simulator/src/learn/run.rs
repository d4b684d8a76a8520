//! The round loop of a learning run.
//!
//! Every policy runs on its own copy of every node, from the same initial model, with the same
//! shards and the same minibatches, so policies differ only in what they exchange and merge.
//! Per round and policy:
//!
//! 1. **Train**: every node runs `TrainConfig::steps` SGD steps from its parameters on its shard
//!    (`kindred_trainer::Model::train`); its update is the parameter change. Hostile nodes
//!    then corrupt theirs, and the inflating attacks claim `kindred_proto::MAX_SAMPLES` in
//!    their headers ([`Attack`]); a node sending the largest finite values keeps its update
//!    and rewrites its packet body instead (step 2). Every sample-weighted merge bounds claims
//!    as the node does (`kindred_distill::cap_samples`).
//! 2. **Pack**: with [`Compression::Distill`] each node's `kindred_distill::Distiller` (its own
//!    error-feedback residual) turns the update into a packet body, an embedding and SimHash
//!    margins; the packet is sealed with the node's ed25519 key (`kindred_proto::seal`) so its
//!    wire size is exact, and peers see the decoded body (`kindred_distill::decode`).
//! 3. **Partners**: nobody, everybody, the true cluster, random peers, or the semantic partners.
//!    Semantic nodes search as the node does (each drives a [`kindred_routing::Follower`]): in
//!    discovery rounds (and when they have nobody left to follow) the candidates are the
//!    providers their band-key and probe lookups returned in the routing model ([`Overlay`]);
//!    in the rounds between, the peers they follow, each asked for its newest header.
//!    Candidates are ranked by sketch cosine, and the top `m` the cosine gate admits
//!    ([`kindred_routing::CosineGate`]) are fetched.
//! 4. **Merge**: a plain mean, or `kindred_distill::synthesize` of the node's own (dense) update
//!    with its partners' decoded updates; the node adds the result to its parameters, and folds
//!    accepted peer updates into its embedding's running mean.
//! 5. **Consensus** (a policy with [`crate::learn::Consensus`], `kindred`): every few
//!    rounds each node fetches one partner it merged, of the half whose updates agree most with
//!    its own (`kindred_distill::snapshot_partner`), as a model snapshot
//!    (`kindred_distill::snapshot`) and moves part of the way toward it
//!    (`kindred_distill::pull`).
//!
//! Bytes per node per round are all bytes on the wire that round divided by the number of
//! nodes: DHT messages, header, body and snapshot fetches (each with a 64-byte request), or an
//! all-reduce (a ring all-reduce moves `2·(n − 1)/n` payloads per node).
//!
//! One simplification: a node that searches between discovery rounds (it had nobody left to
//! follow) announces and looks up in a routing round of its own, so it finds only the nodes
//! searching in the same round, not every node that announced at the window's start. That
//! undercounts what it finds, never what it costs.

mod hub;

use std::time::Instant;

use kindred_distill::{
    Distiller, Embedder, Layout, SynthConfig, UpdateRef, cap_samples, decode, pull, snapshot,
    snapshot_partner, synthesize,
};
use kindred_proto::{
    DenseValues, Embedding, HeaderFields, LayerPayload, ModelSpec, PacketBody, SIMHASH_BITS,
    SignBits, SimHash, TopK, TopK4, seal,
};
use kindred_routing::{Follower, RoundPlan};
use kindred_trainer::{Arch, CLASSES, Examples, Mnist, Model, ModelError, Split};
use libp2p_identity::ed25519;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rayon::prelude::*;

use super::config::{Attack, Compression, Consensus, LearnConfig, Merge, Partners, PolicySpec};
use crate::routing::overlay::{Overlay, Search};
use crate::stats::{mean, sd};

/// Bytes of a header or body request.
const REQUEST_BYTES: f64 = 64.0;

/// Why a learning run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LearnError {
    /// MNIST could not be loaded.
    #[error("MNIST: {0}")]
    Data(#[from] kindred_trainer::DataError),
    /// The model failed.
    #[error("model: {0}")]
    Model(#[from] ModelError),
    /// Distillation failed.
    #[error("distill: {0}")]
    Distill(#[from] kindred_distill::DistillError),
    /// A distiller could not be configured.
    #[error("distill config: {0}")]
    DistillConfig(#[from] kindred_distill::ConfigError),
    /// A body could not be decoded.
    #[error("decode: {0}")]
    Decode(#[from] kindred_distill::DecodeError),
    /// A packet could not be sealed.
    #[error("seal: {0}")]
    Seal(#[from] kindred_proto::SealError),
    /// Synthesis failed.
    #[error("synthesize: {0}")]
    Synth(#[from] kindred_distill::SynthError),
    /// Embedding failed.
    #[error("embed: {0}")]
    Embed(#[from] kindred_distill::EmbedError),
    /// Multi-probe failed.
    #[error("probe: {0}")]
    Probe(#[from] kindred_routing::keys::ProbeError),
    /// A model snapshot could not be made or used.
    #[error("consensus: {0}")]
    Consensus(#[from] kindred_distill::ConsensusError),
    /// An invalid configuration.
    #[error("invalid learning configuration: {0}")]
    Config(String),
}

/// One round of one policy.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RoundStats {
    /// Round (0-based).
    pub round: usize,
    /// Mean accuracy of the tracked honest nodes after the round.
    pub accuracy: f64,
    /// Its spread across those nodes.
    pub accuracy_sd: f64,
    /// Mean local training loss of honest nodes.
    pub loss: f64,
    /// All bytes on the wire this round / nodes.
    pub bytes_per_node: f64,
    /// Of which DHT messages.
    pub dht_bytes_per_node: f64,
    /// Of which header fetches.
    pub header_bytes_per_node: f64,
    /// Of which body fetches (or all-reduce payloads).
    pub body_bytes_per_node: f64,
    /// Of which model snapshots ([`crate::learn::Consensus`]).
    pub snapshot_bytes_per_node: f64,
    /// Share of the nodes that pulled toward a partner's snapshot whose step was clipped.
    pub pulls_clipped: f64,
    /// Mean partners merged per honest node.
    pub partners: f64,
    /// Mean candidates found per honest node (semantic: providers returned by the lookups).
    pub candidates: f64,
    /// Mean share of merged partners from the node's own cluster (honest nodes that merged).
    pub purity: f64,
    /// Mean partners rejected by the merge per honest node.
    pub rejected: f64,
    /// Mean encoded packet body, bytes.
    pub body_bytes: f64,
    /// Mean encoded packet header, bytes.
    pub header_bytes: f64,
    /// Dense f32 update bytes / body bytes.
    pub compression_ratio: f64,
    /// Share of nodes that searched the DHT this round (semantic policy; the others followed
    /// their partners).
    pub searched: f64,
    /// Hub exchange: members that applied their own update because no merge came by the
    /// deadline (their hub was down, busy, lost a message, or served late).
    pub missed_merges: usize,
    /// Hub exchange: nodes whose hub changed since their last exchange round.
    pub hub_changes: usize,
    /// Hub exchange: most pushes one hub or sub-hub merged.
    pub members_per_hub_max: usize,
    /// Hub exchange: the deepest member of a cohort's tree (1: all pushed to their hub).
    pub tree_depth_max: usize,
    /// Hub exchange: the smallest share, over tasks, of a task's nodes in its largest tree.
    pub largest_tree_share: f64,
}

/// One policy over the whole run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PolicyReport {
    /// Policy name.
    pub name: String,
    /// Per round.
    pub rounds: Vec<RoundStats>,
    /// Mean final accuracy over every honest node.
    pub final_accuracy: f64,
    /// Its spread across honest nodes.
    pub final_accuracy_sd: f64,
    /// Mean final accuracy per task cluster.
    pub final_by_cluster: Vec<f64>,
    /// Final accuracy of each cluster's consensus model (the mean parameters of its honest
    /// nodes), averaged over honest nodes. Against [`Self::final_accuracy`] it splits a gap to
    /// the all-reduce in two: what the cluster learned as a whole, and how far its nodes'
    /// models have drifted apart (merging updates exerts no pull between models).
    pub consensus_accuracy: f64,
    /// Mean bytes per node per round.
    pub bytes_per_node_round: f64,
    /// Wall-clock seconds spent on this policy.
    pub seconds: f64,
    /// Hub exchange: members that applied their own update because no merge came, summed
    /// over rounds.
    pub missed_merges: usize,
    /// Hub exchange: changes of hub per node over the run.
    pub hub_changes_per_node: f64,
    /// Hub exchange: most pushes one hub or sub-hub merged in a round.
    pub members_per_hub_max: usize,
    /// Hub exchange: the deepest member of a cohort's tree in any round.
    pub tree_depth_max: usize,
}

/// A whole learning run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LearnReport {
    /// Nodes.
    pub nodes: usize,
    /// Rounds.
    pub rounds: usize,
    /// Setting name.
    pub setting: String,
    /// Model parameters.
    pub params: usize,
    /// Training digits per node (mean).
    pub shard_size: f64,
    /// Hostile nodes.
    pub hostile: usize,
    /// Per policy.
    pub policies: Vec<PolicyReport>,
    /// Wall-clock seconds.
    pub seconds: f64,
}

pub use crate::ProgressFn;

/// The prepared data of a run.
struct Data {
    train: Vec<Examples>,
    /// Per cluster, the first `eval_examples` held-out digits (accuracy tracked every round).
    eval: Vec<Examples>,
    /// Per cluster, every held-out digit (final accuracy).
    final_eval: Vec<Examples>,
    cluster: Vec<usize>,
    hostile: Vec<Option<Attack>>,
    tracked: Vec<usize>,
}

/// One policy's nodes.
struct State {
    spec: PolicySpec,
    /// The common initial model: `params[i] − origin` is node `i`'s cumulative update, whose
    /// embedding routing keys on (as the node does).
    origin: Vec<f32>,
    params: Vec<Vec<f32>>,
    distillers: Vec<Distiller>,
    /// Per node, whether it searches and whom it follows between discovery rounds (semantic
    /// policy).
    follow: Vec<Follower<u32>>,
    /// The hub exchange's cores and hub distillers (`None` for other policies).
    hubs: Option<hub::Hubs>,
    report: PolicyReport,
}

/// What a node packed this round.
struct Packed {
    /// What peers receive when it differs from the node's own dense update (the decoded body of
    /// a distilled packet); `None` when the dense update itself is sent.
    sent: Option<Vec<f32>>,
    embedding: Embedding,
    margins: [f32; SIMHASH_BITS],
    header_bytes: usize,
    body_bytes: usize,
}

/// What a node merged.
#[derive(Default)]
struct Merged {
    update: Vec<f32>,
    /// Parameters the node adopts before adding `update` (hub exchange: the model of a hub it
    /// joins).
    adopt: Option<Vec<f32>>,
    /// Bytes of the model snapshot behind `adopt`.
    adopt_bytes: f64,
    /// The candidates the node's lookup ranked, `(peer, sketch cosine)` (semantic policy).
    ranked: Vec<(u32, f32)>,
    accepted: Vec<u32>,
    rejected: usize,
    candidates: usize,
    header_bytes: f64,
    body_bytes: f64,
}

fn node_word(seed: u64, tag: u64, round: u64, node: usize) -> u64 {
    crate::rng::hash_words(seed, &[tag, round, node as u64])
}

fn prepare(cfg: &LearnConfig) -> Result<Data, LearnError> {
    let mnist = Mnist::load()?;
    let split = Split::new(mnist.len(), cfg.eval_fraction, cfg.seed);
    let clusters = cfg.setting.clusters();
    let n = cfg.nodes;
    let cluster: Vec<usize> = (0..n).map(|i| i % clusters).collect();
    // Every cluster uses the whole training split under its own task; its nodes share it out.
    let train: Vec<Examples> = (0..n)
        .into_par_iter()
        .map(|i| {
            let c = i % clusters;
            let in_cluster = (n - c).div_ceil(clusters);
            let shard = split.shard(i / clusters, in_cluster);
            Examples::new(&mnist, &shard, cfg.setting.task(c))
        })
        .collect();
    let eval_idx: Vec<usize> = split.eval.iter().take(cfg.eval_examples).copied().collect();
    let per_cluster = |idx: &[usize]| -> Vec<Examples> {
        (0..clusters)
            .map(|c| Examples::new(&mnist, idx, cfg.setting.task(c)))
            .collect()
    };
    let eval = per_cluster(&eval_idx);
    let final_eval = per_cluster(&split.eval);
    let hostile: Vec<Option<Attack>> = match &cfg.hostile {
        Some(h) if !h.attacks.is_empty() && h.fraction > 0.0 => {
            let mut k = 0;
            (0..n)
                .map(|i| {
                    let u = crate::rng::unit_open(node_word(cfg.seed, 0x4057, 0, i));
                    (u <= h.fraction).then(|| {
                        let a = h.attacks.get(k % h.attacks.len()).copied();
                        k += 1;
                        a
                    })?
                })
                .collect()
        }
        _ => vec![None; n],
    };
    let honest: Vec<usize> = (0..n)
        .filter(|&i| hostile.get(i).is_some_and(Option::is_none))
        .collect();
    let want = cfg.eval_nodes.clamp(1, honest.len().max(1));
    let step = honest.len() as f64 / want as f64;
    let tracked: Vec<usize> = (0..want)
        .filter_map(|k| honest.get((k as f64 * step) as usize).copied())
        .collect();
    Ok(Data {
        train,
        eval,
        final_eval,
        cluster,
        hostile,
        tracked,
    })
}

/// What a hostile node sends in place of `update` (its update, or its cumulative update as a
/// model snapshot). [`Attack::MaxFinite`] sends `±f32::MAX`, the largest the dense f32 wire
/// admits; a distilled packet's body is rewritten by [`maximal`] instead.
fn corrupt(update: &mut [f32], attack: Attack, arch: Arch, seed: u64) {
    match attack {
        Attack::Relabel => {
            let width = arch.head_width();
            let len = update.len();
            if let Some(head) = len
                .checked_sub(CLASSES * (width + 1))
                .and_then(|start| update.get_mut(start..))
            {
                let (weights, biases) = head.split_at_mut(CLASSES * width);
                weights.rotate_right(width);
                biases.rotate_right(1);
            }
        }
        Attack::Scale(f) | Attack::InflateSamples(f) => update.iter_mut().for_each(|x| *x *= f),
        Attack::SignFlip => update.iter_mut().for_each(|x| *x = -*x),
        Attack::Noise | Attack::InflateNoise => {
            let norm = update.iter().map(|x| x * x).sum::<f32>().sqrt();
            let mut rng = kindred_kernels::rng::SplitMix64::new(seed);
            update
                .iter_mut()
                .for_each(|x| *x = rng.next_gaussian() as f32);
            let n2 = update.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            update.iter_mut().for_each(|x| *x *= norm / n2);
        }
        Attack::MaxFinite => update.iter_mut().for_each(|x| *x = f32::MAX.copysign(*x)),
    }
}

/// The largest int8 scale a receiver accepts: `127 · scale` must stay finite.
fn max_int8_scale() -> f32 {
    let mut s = f32::MAX / 127.0;
    while !(s * 127.0).is_finite() {
        s = f32::from_bits(s.to_bits() - 1);
    }
    s
}

/// `max` with the sign of each value of `v`.
fn signed_max<T: Copy + std::ops::Neg<Output = T>>(
    v: &[T],
    max: T,
    negative: impl Fn(&T) -> bool,
) -> Vec<T> {
    v.iter()
        .map(|x| if negative(x) { -max } else { max })
        .collect()
}

/// `body` with every value at the largest magnitude its encoding can carry and a receiver
/// still decodes ([`Attack::MaxFinite`]): same layers, encodings and top-k indices, signs kept.
fn maximal(body: &PacketBody) -> PacketBody {
    let scale = max_int8_scale();
    let int8 =
        |v: &[i8]| -> Vec<i8> { v.iter().map(|&q| if q < 0 { -127 } else { 127 }).collect() };
    let layers = body
        .layers
        .iter()
        .map(|layer| match layer {
            LayerPayload::Dense(DenseValues::F32(v)) => {
                LayerPayload::Dense(DenseValues::F32(signed_max(v, f32::MAX, |x| {
                    x.is_sign_negative()
                })))
            }
            LayerPayload::Dense(DenseValues::F16(v)) => {
                LayerPayload::Dense(DenseValues::F16(signed_max(v, half::f16::MAX, |x| {
                    x.is_sign_negative()
                })))
            }
            LayerPayload::Dense(DenseValues::BF16(v)) => {
                LayerPayload::Dense(DenseValues::BF16(signed_max(v, half::bf16::MAX, |x| {
                    x.is_sign_negative()
                })))
            }
            LayerPayload::Dense(DenseValues::Int8 { values, .. }) => {
                LayerPayload::Dense(DenseValues::Int8 {
                    values: int8(values),
                    scale,
                })
            }
            LayerPayload::TopK(t) => LayerPayload::TopK(TopK {
                len: t.len,
                indices: t.indices.clone(),
                values: int8(&t.values),
                scale,
            }),
            // Every code at level 7 (its sign kept), the top level at f32::MAX.
            LayerPayload::TopK4(t) => LayerPayload::TopK4(TopK4 {
                len: t.len,
                indices: t.indices.clone(),
                codes: (t.codes.iter().enumerate())
                    .map(|(j, b)| {
                        b | if 2 * j + 1 < t.indices.len() {
                            0x77
                        } else {
                            0x07
                        }
                    })
                    .collect(),
                scale: f32::MAX,
                ratio: 1.0,
            }),
            LayerPayload::Sign(b) => LayerPayload::Sign(SignBits {
                len: b.len,
                words: b.words.clone(),
                scale: f32::MAX,
            }),
        })
        .collect();
    PacketBody { layers }
}

/// Run a learning experiment.
///
/// # Errors
/// [`LearnError`] when data, model, distillation or routing fail, or the configuration is
/// invalid.
pub fn run(cfg: &LearnConfig, progress: ProgressFn<'_>) -> Result<LearnReport, LearnError> {
    let wall = Instant::now();
    if cfg.nodes < 2 || cfg.rounds == 0 || cfg.policies.is_empty() {
        return Err(LearnError::Config(
            "need at least 2 nodes, 1 round and 1 policy".into(),
        ));
    }
    progress("load data", 0, 1);
    let data = prepare(cfg)?;
    let init = Model::new(cfg.arch, cfg.seed)?;
    let spec = init.spec().clone();
    let init_params = init.params()?;
    let layout = Layout::new(&spec);
    let keys: Vec<ed25519::Keypair> = (0..cfg.nodes)
        .map(|i| {
            let mut secret = [0u8; 32];
            let h = blake3::hash(&node_word(cfg.seed, 0x6B3, 0, i).to_le_bytes());
            secret.copy_from_slice(h.as_bytes());
            ed25519::SecretKey::try_from_bytes(secret).map(ed25519::Keypair::from)
        })
        .collect::<Result<_, _>>()
        .map_err(|e| LearnError::Config(format!("node key: {e}")))?;
    let needs_overlay = cfg
        .policies
        .iter()
        .any(|p| p.partners == Partners::Semantic);
    let overlay = needs_overlay.then(|| {
        Overlay::new(cfg.nodes, cfg.seed, spec.id())
            .with_probes(cfg.probes)
            .with_refresh_shards(cfg.refresh_shards)
    });
    let hub_overlay = cfg
        .policies
        .iter()
        .any(|p| p.partners == Partners::Hub)
        .then(|| {
            Overlay::new(cfg.nodes, cfg.seed, spec.id())
                .with_keys(cfg.hub.keys)
                .with_key_window(kindred_routing::exchange::ExchangeConfig::default().key_window)
        });
    let embedder = Embedder::new(cfg.embedding)?;
    let mut states: Vec<State> = cfg
        .policies
        .iter()
        .map(|p| {
            let distillers = match &p.compression {
                Compression::Full => Vec::new(),
                Compression::Distill(policy) => (0..cfg.nodes)
                    .map(|_| Distiller::new(spec.clone(), policy.clone(), cfg.embedding))
                    .collect::<Result<_, _>>()?,
            };
            let is_hub = p.partners == Partners::Hub;
            let hub_distillers = match &p.compression {
                Compression::Distill(policy) if is_hub => {
                    // No warm-up: a merge of a cohort's updates sheds their large first steps'
                    // noise, and its error feedback sends the rest later. Measured on iid and
                    // label4 (3 seeds each): the same accuracy, 1.2 KB less per node per round.
                    let policy = kindred_distill::Policy {
                        density: cfg.hub.merge_density(policy.density),
                        warmup: Vec::new(),
                        ..policy.clone()
                    };
                    (0..cfg.nodes)
                        .map(|_| Distiller::new(spec.clone(), policy.clone(), cfg.embedding))
                        .collect::<Result<_, _>>()?
                }
                _ => Vec::new(),
            };
            if is_hub && hub_distillers.is_empty() {
                return Err(LearnError::Config(
                    "the hub exchange needs distilled packets".into(),
                ));
            }
            Ok(State {
                spec: p.clone(),
                hubs: is_hub.then(|| hub::Hubs::new(cfg, &data, &keys, hub_distillers)),
                origin: init_params.clone(),
                params: vec![init_params.clone(); cfg.nodes],
                distillers,
                follow: vec![Follower::new(cfg.discovery, cfg.gate); cfg.nodes],
                report: PolicyReport {
                    name: p.name.clone(),
                    ..PolicyReport::default()
                },
            })
        })
        .collect::<Result<_, LearnError>>()?;
    let total = (cfg.rounds * states.len()) as u64;
    for round in 0..cfg.rounds {
        for (pi, state) in states.iter_mut().enumerate() {
            progress(
                &state.spec.name,
                (round * cfg.policies.len() + pi) as u64,
                total,
            );
            let t = Instant::now();
            let stats = step(
                cfg,
                &data,
                &spec,
                &layout,
                &keys,
                &embedder,
                Overlays {
                    semantic: overlay.as_ref(),
                    hub: hub_overlay.as_ref(),
                },
                state,
                round,
            )?;
            state.report.rounds.push(stats);
            state.report.seconds += t.elapsed().as_secs_f64();
        }
    }
    progress("final evaluation", total, total);
    let honest: Vec<usize> = (0..cfg.nodes)
        .filter(|&i| data.hostile.get(i).is_some_and(Option::is_none))
        .collect();
    for state in &mut states {
        let acc = evaluate(cfg, &data.final_eval, &data.cluster, &state.params, &honest)?;
        state.report.final_accuracy = mean(&acc);
        state.report.final_accuracy_sd = sd(&acc);
        state.report.final_by_cluster = (0..cfg.setting.clusters())
            .map(|c| {
                let v: Vec<f64> = honest
                    .iter()
                    .zip(&acc)
                    .filter(|(i, _)| data.cluster.get(**i) == Some(&c))
                    .map(|(_, a)| *a)
                    .collect();
                mean(&v)
            })
            .collect();
        state.report.consensus_accuracy =
            consensus_accuracy(cfg, &data.final_eval, &data.cluster, &state.params, &honest)?;
        let b: Vec<f64> = state
            .report
            .rounds
            .iter()
            .map(|r| r.bytes_per_node)
            .collect();
        state.report.bytes_per_node_round = mean(&b);
        state.report.missed_merges = state.report.rounds.iter().map(|r| r.missed_merges).sum();
        state.report.hub_changes_per_node = state
            .report
            .rounds
            .iter()
            .map(|r| r.hub_changes as f64)
            .sum::<f64>()
            / cfg.nodes as f64;
        let rounds = &state.report.rounds;
        state.report.members_per_hub_max = rounds
            .iter()
            .map(|r| r.members_per_hub_max)
            .max()
            .unwrap_or(0);
        state.report.tree_depth_max = rounds.iter().map(|r| r.tree_depth_max).max().unwrap_or(0);
    }
    Ok(LearnReport {
        nodes: cfg.nodes,
        rounds: cfg.rounds,
        setting: cfg.setting.name(),
        params: spec.numel() as usize,
        shard_size: data.train.iter().map(|e| e.len() as f64).sum::<f64>() / cfg.nodes as f64,
        hostile: data.hostile.iter().filter(|h| h.is_some()).count(),
        policies: states.into_iter().map(|s| s.report).collect(),
        seconds: wall.elapsed().as_secs_f64(),
    })
}

/// Accuracy of `nodes` on their clusters' digits in `eval` (one set per cluster).
fn evaluate(
    cfg: &LearnConfig,
    eval: &[Examples],
    cluster: &[usize],
    params: &[Vec<f32>],
    nodes: &[usize],
) -> Result<Vec<f64>, LearnError> {
    nodes
        .par_iter()
        .map_init(
            || Model::new(cfg.arch, 0),
            |model, &i| {
                let model = model
                    .as_mut()
                    .map_err(|e| LearnError::Config(e.to_string()))?;
                model.set_params(params.get(i).map_or(&[][..], |p| &p[..]))?;
                let c = cluster.get(i).copied().unwrap_or(0);
                let eval = eval
                    .get(c)
                    .ok_or_else(|| LearnError::Config("no eval set".into()))?;
                Ok(f64::from(model.accuracy(eval)?))
            },
        )
        .collect()
}

/// Accuracy of each cluster's consensus model, the mean parameters of its `nodes`, on the
/// cluster's digits in `eval`, weighted by the cluster's share of `nodes`.
fn consensus_accuracy(
    cfg: &LearnConfig,
    eval: &[Examples],
    cluster: &[usize],
    params: &[Vec<f32>],
    nodes: &[usize],
) -> Result<f64, LearnError> {
    let of = |k: usize| nodes.get(k).copied().unwrap_or(usize::MAX);
    let groups: Vec<usize> = (0..nodes.len())
        .map(|k| cluster.get(of(k)).copied().unwrap_or(0))
        .collect();
    let len = params.first().map_or(0, Vec::len);
    let model = |k: usize| params.get(of(k)).map_or(&[][..], |p| &p[..]);
    let means = group_means(&model, nodes.len(), &vec![1; nodes.len()], &groups, len);
    // Clusters without a node in `nodes` have no consensus to score.
    let members: Vec<f64> = (0..means.len())
        .map(|c| groups.iter().filter(|&&g| g == c).count() as f64)
        .collect();
    let scored: Vec<usize> = (0..means.len())
        .filter(|&c| members.get(c).is_some_and(|&m| m > 0.0))
        .collect();
    let acc = evaluate(
        cfg,
        eval,
        &(0..means.len()).collect::<Vec<_>>(),
        &means,
        &scored,
    )?;
    let weighted: f64 = scored
        .iter()
        .zip(&acc)
        .map(|(&c, a)| a * members.get(c).copied().unwrap_or(0.0))
        .sum();
    Ok(weighted / (nodes.len() as f64).max(1.0))
}

#[allow(clippy::too_many_arguments)]
fn step(
    cfg: &LearnConfig,
    data: &Data,
    spec: &ModelSpec,
    layout: &Layout,
    keys: &[ed25519::Keypair],
    embedder: &Embedder,
    overlays: Overlays<'_>,
    state: &mut State,
    round: usize,
) -> Result<RoundStats, LearnError> {
    let overlay = overlays.semantic;
    let n = cfg.nodes;
    let r64 = round as u64;
    // Hub exchange: hubs crash at a round's start; a node that is down neither trains nor
    // takes part (`Faults::hub_crash`).
    if let Some(h) = state.hubs.as_mut()
        && r64 >= cfg.hub.local_rounds
    {
        h.crashes(cfg, r64);
    }
    let down: Vec<bool> = (0..n)
        .map(|i| state.hubs.as_ref().is_some_and(|h| h.is_down(i, r64)))
        .collect();
    let is_down = |i: usize| down.get(i).copied().unwrap_or(false);
    // 1. Train.
    // A rank-grinding attacker wants to be its cohort's hub, so it keys its packets on its
    // honest update (`Faults::hostile_low_rank`): its sketch passes every cosine gate.
    let disguised = state.spec.partners == Partners::Hub && cfg.hub.faults.hostile_low_rank;
    #[allow(clippy::type_complexity)]
    let trained: Vec<(Vec<f32>, f32, u64, Option<Vec<f32>>)> = state
        .params
        .par_iter()
        .enumerate()
        .map_init(
            || Model::new(cfg.arch, 0),
            |model, (i, p)| -> Result<_, LearnError> {
                let model = model
                    .as_mut()
                    .map_err(|e| LearnError::Config(e.to_string()))?;
                if is_down(i) {
                    return Ok((vec![0.0; p.len()], 0.0, 1, None));
                }
                model.set_params(p)?;
                let mut rng = StdRng::seed_from_u64(node_word(cfg.seed, 0x7EA1, r64, i));
                let examples = data
                    .train
                    .get(i)
                    .ok_or_else(|| LearnError::Config("no shard".into()))?;
                let st = model.train(examples, &cfg.train, &mut rng)?;
                let mut delta = model.params()?;
                for (d, q) in delta.iter_mut().zip(p) {
                    *d -= q;
                }
                if delta.iter().any(|x| !x.is_finite()) {
                    // A model broken by what it applied (only a merge without the robust rules
                    // lets a huge update in) trains to NaN: the node has no update this round,
                    // as a node's distiller refuses a non-finite one.
                    tracing::debug!(round, node = i, "non-finite update: none sent");
                    delta.iter_mut().for_each(|x| *x = 0.0);
                }
                let attack = data.hostile.get(i).copied().flatten();
                let disguise = (disguised && attack.is_some()).then(|| delta.clone());
                // A node sending the largest finite values keeps its own update (and model)
                // honest: what it sends is rewritten when it is packed.
                if let Some(a) = attack.filter(|&a| a != Attack::MaxFinite) {
                    corrupt(&mut delta, a, cfg.arch, node_word(cfg.seed, 0xBAD, r64, i));
                }
                // Headers carry at most `MAX_ABS_LOSS` (receivers refuse more): a model broken by
                // a merge without the robust rules reports that much.
                let loss = if st.loss.is_finite() {
                    st.loss
                        .clamp(-kindred_proto::MAX_ABS_LOSS, kindred_proto::MAX_ABS_LOSS)
                } else {
                    0.0
                };
                Ok((
                    delta,
                    loss,
                    attack.map_or(st.samples, |a| a.claim(st.samples)),
                    disguise,
                ))
            },
        )
        .collect::<Result<_, _>>()?;
    let honest = |i: usize| data.hostile.get(i).is_some_and(Option::is_none);
    let loss = mean(
        &trained
            .iter()
            .enumerate()
            .filter(|(i, _)| honest(*i) && !is_down(*i))
            .map(|(_, t)| f64::from(t.1))
            .collect::<Vec<_>>(),
    );
    let samples: Vec<u64> = trained.iter().map(|t| t.2).collect();
    let losses: Vec<f32> = trained.iter().map(|t| t.1).collect();
    let (own, disguises): (Vec<Vec<f32>>, Vec<Option<Vec<f32>>>) =
        trained.into_iter().map(|t| (t.0, t.3)).unzip();

    // A hub-exchange node trains alone for its first rounds: it applies its own update and
    // sends nothing (`HubConfig::local_rounds`).
    if state.spec.partners == Partners::Hub && r64 < cfg.hub.local_rounds {
        // A disguised attacker keeps its own model honest.
        state
            .params
            .par_iter_mut()
            .zip(&own)
            .zip(&disguises)
            .for_each(|((p, u), d)| {
                let u = d.as_deref().unwrap_or(u);
                p.iter_mut().zip(u).for_each(|(x, d)| *x += d);
            });
        let acc = evaluate(cfg, &data.eval, &data.cluster, &state.params, &data.tracked)?;
        return Ok(RoundStats {
            round,
            loss,
            accuracy: mean(&acc),
            accuracy_sd: sd(&acc),
            pulls_clipped: f64::NAN,
            purity: f64::NAN,
            ..RoundStats::default()
        });
    }

    // 2. Pack. Like the node, key on the cumulative update (this round's included): one
    // round's update is mostly minibatch noise once training converges.
    let need_embedding = matches!(state.spec.partners, Partners::Semantic | Partners::Hub);
    let (params, origin) = (&state.params, &state.origin);
    let cumulative = |i: usize, delta: &[f32]| -> Vec<f32> {
        let delta = disguises.get(i).and_then(Option::as_deref).unwrap_or(delta);
        params.get(i).map_or_else(Vec::new, |p| {
            p.iter()
                .zip(origin)
                .zip(delta)
                .map(|((x, o), d)| x - o + d)
                .collect()
        })
    };
    let dense_bytes = 4 * layout.len();
    let maximal_attack = |i: usize| data.hostile.get(i) == Some(&Some(Attack::MaxFinite));
    let packed: Vec<Packed> = match &state.spec.compression {
        Compression::Full => own
            .par_iter()
            .enumerate()
            .map(|(i, delta)| -> Result<Packed, LearnError> {
                let (embedding, margins) = if need_embedding {
                    let e = embedder.embed(layout, &cumulative(i, delta), None)?;
                    (e.embedding, e.margins)
                } else {
                    (Embedding::default(), [0.0; SIMHASH_BITS])
                };
                let sent = maximal_attack(i).then(|| {
                    let mut m = delta.clone();
                    corrupt(&mut m, Attack::MaxFinite, cfg.arch, 0);
                    m
                });
                Ok(Packed {
                    sent,
                    embedding,
                    margins,
                    header_bytes: 0,
                    body_bytes: dense_bytes,
                })
            })
            .collect::<Result<_, _>>()?,
        Compression::Distill(_) => state
            .distillers
            .par_iter_mut()
            .zip(own.par_iter())
            .enumerate()
            .map(|(i, (d, delta))| -> Result<Packed, LearnError> {
                if is_down(i) {
                    // A node that is down packs nothing: its error feedback stays as it was.
                    return Ok(Packed {
                        sent: Some(vec![0.0; delta.len()]),
                        embedding: Embedding::default(),
                        margins: [0.0; SIMHASH_BITS],
                        header_bytes: 0,
                        body_bytes: 0,
                    });
                }
                let mut out = d.distill(delta)?;
                if maximal_attack(i) {
                    out.body = maximal(&out.body);
                }
                let keyed = d.embed(&cumulative(i, delta))?;
                let key = keys
                    .get(i)
                    .ok_or_else(|| LearnError::Config("no key".into()))?;
                let sealed = seal(
                    key,
                    spec,
                    HeaderFields {
                        round: r64,
                        unix_ms: 0,
                        samples: samples.get(i).copied().unwrap_or(1),
                        loss: losses.get(i).copied().unwrap_or(0.0),
                        embedding: keyed.embedding.clone(),
                    },
                    &out.body,
                )?;
                Ok(Packed {
                    sent: Some(decode(&out.body, spec)?),
                    embedding: keyed.embedding,
                    margins: keyed.margins,
                    header_bytes: sealed.header_bytes.len(),
                    body_bytes: sealed.body_bytes.len(),
                })
            })
            .collect::<Result<_, _>>()?,
    };
    let sent = |i: usize| -> &[f32] {
        match packed.get(i).and_then(|p| p.sent.as_deref()) {
            Some(s) => s,
            None => own.get(i).map_or(&[][..], |o| &o[..]),
        }
    };

    // 3 + 4. Partners and merge. A node merges its own dense update (not its compressed copy:
    // what error feedback holds back is still its own) with what its partners sent.
    let own_of = |i: usize| own.get(i).map_or(&[][..], |o| &o[..]);
    let ex = Exchange {
        packed: &packed,
        sent: &sent,
        samples: &samples,
    };
    let mut dht_total = 0f64;
    let mut searches = 0usize;
    let (mut missed, mut hub_changes) = (0usize, 0usize);
    let (mut fan_in, mut depth, mut largest) = (0usize, 0usize, f64::NAN);
    let found: Vec<Vec<u32>> = match (state.spec.partners, overlay) {
        (Partners::Semantic, Some(ov)) => {
            let sigs: Vec<SimHash> = packed.iter().map(|p| p.embedding.simhash).collect();
            let margins: Vec<[f32; SIMHASH_BITS]> = packed.iter().map(|p| p.margins).collect();
            // Per node, how it searches the DHT, or the peers it follows.
            let (searching, plans): (Vec<Search>, Vec<Option<Vec<u32>>>) = state
                .follow
                .iter_mut()
                .map(|f| match f.start_round(r64) {
                    RoundPlan::Search => (Search::Full, None),
                    RoundPlan::Refresh => (Search::Refresh, None),
                    RoundPlan::Follow(peers) => (Search::Idle, Some(peers.to_vec())),
                })
                .unzip();
            searches = searching.iter().filter(|&&s| s != Search::Idle).count();
            let window = cfg.discovery.window(r64).0;
            let r = ov.round(window, &sigs, &margins, &searching)?;
            dht_total = r.total_bytes as f64;
            r.found
                .into_iter()
                .zip(plans)
                .map(|(found, plan)| plan.unwrap_or(found))
                .collect()
        }
        (Partners::Semantic, None) => {
            return Err(LearnError::Config("semantic policy without overlay".into()));
        }
        _ => Vec::new(),
    };
    let mut merged: Vec<Merged> = match state.spec.partners {
        Partners::Hub => {
            let ov = overlays
                .hub
                .ok_or_else(|| LearnError::Config("hub policy without overlay".into()))?;
            let round = hub::Round {
                packed: &packed,
                sent: &sent,
                samples: &samples,
                losses: &losses,
                spec,
                round: r64,
                disguises: &disguises,
            };
            let hubs = state
                .hubs
                .as_mut()
                .ok_or_else(|| LearnError::Config("hub policy without its cores".into()))?;
            let h = hub::exchange(
                cfg,
                data,
                &state.spec,
                keys,
                ov,
                hubs,
                &state.params,
                &state.origin,
                &round,
            )?;
            dht_total = h.dht_bytes;
            searches = h.searched;
            missed = h.missed;
            hub_changes = h.hub_changes;
            fan_in = h.fan_in_max;
            depth = h.depth_max;
            largest = h.largest_tree_share;
            h.merged
        }
        Partners::Local => own
            .iter()
            .map(|update| Merged {
                update: update.clone(),
                ..Merged::default()
            })
            .collect(),
        Partners::AllReduce | Partners::Oracle => {
            let groups: Vec<usize> = if state.spec.partners == Partners::AllReduce {
                vec![0; n]
            } else {
                data.cluster.clone()
            };
            let means = group_means(&sent, n, &samples, &groups, layout.len());
            (0..n)
                .map(|i| {
                    let g = groups.get(i).copied().unwrap_or(0);
                    let size = groups.iter().filter(|&&x| x == g).count().max(1) as f64;
                    let payload = mean(
                        &packed
                            .iter()
                            .map(|p| p.body_bytes as f64)
                            .collect::<Vec<_>>(),
                    );
                    Merged {
                        update: means.get(g).cloned().unwrap_or_default(),
                        accepted: Vec::new(),
                        rejected: 0,
                        candidates: size as usize - 1,
                        header_bytes: 0.0,
                        body_bytes: 2.0 * (size - 1.0) / size * payload,
                        ranked: Vec::new(),
                        ..Merged::default()
                    }
                })
                .collect()
        }
        Partners::Gossip { fanout } => (0..n)
            .into_par_iter()
            .map(|i| {
                let mut rng = crate::rng::stream(cfg.seed, &[0x60551B, r64, i as u64]);
                let mut peers: Vec<u32> = Vec::with_capacity(fanout);
                let want = fanout.min(n - 1);
                while peers.len() < want {
                    let p = rng.below(n as u64) as u32;
                    if p as usize != i && !peers.contains(&p) {
                        peers.push(p);
                    }
                }
                merge_with(&state.spec, i, &peers, own_of(i), &ex, peers.len())
            })
            .collect::<Result<_, _>>()?,
        Partners::Semantic => (0..n)
            .into_par_iter()
            .map(|i| {
                let own_e = &packed.get(i).map(|p| &p.embedding);
                let cands = found.get(i).map_or(&[][..], |f| &f[..]);
                let mut ranked: Vec<(f32, u32)> = cands
                    .iter()
                    .filter(|&&c| c as usize != i)
                    .filter_map(|&c| {
                        let e = &packed.get(c as usize)?.embedding;
                        Some((own_e.map_or(0.0, |o| o.cosine(e)), c))
                    })
                    .collect();
                ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                // Headers are asked of at most `max_providers` candidates.
                ranked.truncate(kindred_routing::LookupConfig::default().max_providers);
                let mut admitted = ranked.clone();
                cfg.gate.retain_admitted(&mut admitted, |r| r.0);
                let peers: Vec<u32> = admitted.iter().take(cfg.top_m).map(|r| r.1).collect();
                let mut m = merge_with(&state.spec, i, &peers, own_of(i), &ex, cands.len())?;
                m.header_bytes = ranked
                    .iter()
                    .map(|(_, p)| {
                        REQUEST_BYTES
                            + packed
                                .get(*p as usize)
                                .map_or(0.0, |x| x.header_bytes as f64)
                    })
                    .sum();
                m.ranked = ranked.into_iter().map(|(c, p)| (p, c)).collect();
                Ok(m)
            })
            .collect::<Result<_, LearnError>>()?,
    };
    if state.spec.partners == Partners::Semantic {
        for (f, m) in state.follow.iter_mut().zip(&mut merged) {
            f.lookup_done(std::mem::take(&mut m.ranked));
        }
    }
    // 5. Apply.
    state
        .params
        .par_iter_mut()
        .zip(merged.par_iter())
        .for_each(|(p, m)| {
            if let Some(a) = &m.adopt {
                p.clone_from(a);
            }
            // As `Model::apply_update`: an update that would make a parameter non-finite is
            // not applied (only a merge without the robust rules lets one in).
            if p.iter().zip(&m.update).all(|(x, u)| (x + u).is_finite()) {
                for (x, u) in p.iter_mut().zip(&m.update) {
                    *x += u;
                }
            }
        });
    let (snapshot_total, pulls_clipped) = match state.spec.consensus {
        Some(c)
            if state.spec.partners == Partners::Semantic
                && (r64 + 1).is_multiple_of(c.every.max(1)) =>
        {
            average_models(cfg, data, spec, state, &merged, &packed, c, r64)?
        }
        _ => (merged.iter().map(|m| m.adopt_bytes).sum::<f64>(), f64::NAN),
    };
    if !state.distillers.is_empty()
        && matches!(
            state.spec.partners,
            Partners::Gossip { .. } | Partners::Semantic
        )
    {
        state
            .distillers
            .par_iter_mut()
            .zip(merged.par_iter())
            .try_for_each(|(d, m)| -> Result<(), LearnError> {
                for &a in &m.accepted {
                    d.accept_peer(sent(a as usize))?;
                }
                Ok(())
            })?;
    }
    // Statistics.
    let honest_merged: Vec<(usize, &Merged)> = merged
        .iter()
        .enumerate()
        .filter(|(i, _)| honest(*i))
        .collect();
    let avg = |f: &dyn Fn(usize, &Merged) -> f64| {
        mean(
            &honest_merged
                .iter()
                .map(|(i, m)| f(*i, m))
                .collect::<Vec<_>>(),
        )
    };
    let purity_values: Vec<f64> = match state.spec.partners {
        Partners::Oracle => vec![1.0],
        Partners::AllReduce => {
            let own_cluster = |i: usize| {
                data.cluster
                    .iter()
                    .filter(|&&c| Some(&c) == data.cluster.get(i))
                    .count()
            };
            vec![mean(
                &(0..n)
                    .map(|i| (own_cluster(i) as f64 - 1.0) / (n as f64 - 1.0))
                    .collect::<Vec<_>>(),
            )]
        }
        _ => honest_merged
            .iter()
            .filter(|(_, m)| !m.accepted.is_empty())
            .map(|(i, m)| {
                let c = data.cluster.get(*i);
                m.accepted
                    .iter()
                    .filter(|&&p| data.cluster.get(p as usize) == c)
                    .count() as f64
                    / m.accepted.len() as f64
            })
            .collect(),
    };
    let header_total: f64 = merged.iter().map(|m| m.header_bytes).sum();
    let body_total: f64 = merged.iter().map(|m| m.body_bytes).sum();
    let nf = n as f64;
    let body_mean = mean(
        &packed
            .iter()
            .enumerate()
            .filter(|(i, _)| !is_down(*i))
            .map(|(_, p)| p.body_bytes as f64)
            .collect::<Vec<_>>(),
    );
    let mut stats = RoundStats {
        round,
        loss,
        dht_bytes_per_node: dht_total / nf,
        header_bytes_per_node: header_total / nf,
        body_bytes_per_node: body_total / nf,
        snapshot_bytes_per_node: snapshot_total / nf,
        pulls_clipped,
        bytes_per_node: (dht_total + header_total + body_total + snapshot_total) / nf,
        partners: match state.spec.partners {
            Partners::AllReduce | Partners::Oracle => avg(&|_, m| m.candidates as f64),
            _ => avg(&|_, m| m.accepted.len() as f64),
        },
        candidates: avg(&|_, m| m.candidates as f64),
        purity: if purity_values.is_empty() {
            f64::NAN
        } else {
            mean(&purity_values)
        },
        rejected: avg(&|_, m| m.rejected as f64),
        body_bytes: body_mean,
        header_bytes: mean(
            &packed
                .iter()
                .map(|p| p.header_bytes as f64)
                .collect::<Vec<_>>(),
        ),
        compression_ratio: dense_bytes as f64 / body_mean.max(1.0),
        searched: searches as f64 / nf,
        missed_merges: missed,
        hub_changes,
        members_per_hub_max: fan_in,
        tree_depth_max: depth,
        largest_tree_share: largest,
        ..RoundStats::default()
    };
    let acc = evaluate(cfg, &data.eval, &data.cluster, &state.params, &data.tracked)?;
    stats.accuracy = mean(&acc);
    stats.accuracy_sd = sd(&acc);
    Ok(stats)
}

/// [`Consensus`]: every node that merged someone fetches one of this round's accepted partners
/// as a snapshot (`kindred_distill::snapshot_partner`: one of the better-agreeing half, as the
/// node picks) and pulls toward it. Returns the bytes moved and the share of pulls
/// clipped. Hostile nodes serve their model corrupted by their attack.
#[allow(clippy::too_many_arguments)]
fn average_models(
    cfg: &LearnConfig,
    data: &Data,
    spec: &ModelSpec,
    state: &mut State,
    merged: &[Merged],
    packed: &[Packed],
    consensus: Consensus,
    round: u64,
) -> Result<(f64, f64), LearnError> {
    let n = cfg.nodes;
    let picks: Vec<Option<u32>> = merged
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let word = crate::rng::hash_words(cfg.seed, &[0xC0_5E, round, i as u64]);
            snapshot_partner(&m.accepted, word)
        })
        .collect();
    let mut wanted = vec![false; n];
    for &p in picks.iter().flatten() {
        if let Some(w) = wanted.get_mut(p as usize) {
            *w = true;
        }
    }
    let origin = &state.origin;
    // What each fetched node serves: its decoded snapshot and the bytes of the sealed packet.
    let served: Vec<Option<(Vec<f32>, usize)>> = state
        .params
        .par_iter()
        .enumerate()
        .map(|(i, p)| -> Result<_, LearnError> {
            if !wanted.get(i).copied().unwrap_or(false) {
                return Ok(None);
            }
            let mut model = p.clone();
            if let Some(Some(attack)) = data.hostile.get(i) {
                let mut cumulative: Vec<f32> = p.iter().zip(origin).map(|(x, o)| x - o).collect();
                corrupt(
                    &mut cumulative,
                    *attack,
                    cfg.arch,
                    node_word(cfg.seed, 0x5BAD, round, i),
                );
                for ((x, o), c) in model.iter_mut().zip(origin).zip(&cumulative) {
                    *x = o + c;
                }
            }
            let body = snapshot(&model, origin, spec)?;
            let bytes = kindred_proto::encode_body(&body).len()
                + packed.get(i).map_or(0, |x| x.header_bytes);
            Ok(Some((decode(&body, spec)?, bytes)))
        })
        .collect::<Result<_, _>>()?;
    let pulls: Vec<Option<bool>> = state
        .params
        .par_iter_mut()
        .zip(picks.par_iter())
        .zip(merged.par_iter())
        .map(|((p, pick), m)| -> Result<_, LearnError> {
            let Some((partner, _)) = pick.and_then(|k| served.get(k as usize)?.as_ref()) else {
                return Ok(None);
            };
            let reference = m
                .update
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum::<f64>()
                .sqrt();
            let done = pull(p, origin, partner, reference, &consensus.pull)?;
            Ok(Some(done.clipped))
        })
        .collect::<Result<_, _>>()?;
    let bytes: f64 = picks
        .iter()
        .flatten()
        .filter_map(|&k| served.get(k as usize)?.as_ref())
        .map(|(_, b)| REQUEST_BYTES + *b as f64)
        .sum();
    let done: Vec<f64> = pulls
        .iter()
        .flatten()
        .map(|&c| if c { 1.0 } else { 0.0 })
        .collect();
    Ok((
        bytes,
        if done.is_empty() {
            f64::NAN
        } else {
            mean(&done)
        },
    ))
}

/// Sample-weighted mean of the sent updates per group (fixed summation order).
fn group_means<'a>(
    sent: &(impl Fn(usize) -> &'a [f32] + Sync),
    n: usize,
    samples: &[u64],
    groups: &[usize],
    len: usize,
) -> Vec<Vec<f32>> {
    let g = groups.iter().copied().max().map_or(0, |m| m + 1);
    (0..g)
        .into_par_iter()
        .map(|grp| {
            let members: Vec<usize> = (0..n).filter(|&i| groups.get(i) == Some(&grp)).collect();
            // Claimed counts, bounded as every merge bounds them (`cap_samples`).
            let claims: Vec<u64> = members
                .iter()
                .map(|&i| samples.get(i).copied().unwrap_or(0))
                .collect();
            let weights = cap_samples(&claims, SynthConfig::default().max_samples_ratio);
            let total: f64 = weights.iter().sum::<f64>().max(1.0);
            let mut acc = vec![0f64; len];
            for (&i, &w) in members.iter().zip(&weights) {
                let w = w / total;
                for (a, &x) in acc.iter_mut().zip(sent(i)) {
                    *a += w * f64::from(x);
                }
            }
            acc.into_iter().map(|a| a as f32).collect()
        })
        .collect()
}

/// The routing models a round searches, and the hub order.
#[derive(Clone, Copy)]
struct Overlays<'a> {
    /// The pairwise exchange's (every band key, probes).
    semantic: Option<&'a Overlay>,
    /// The hub exchange's ([`crate::learn::HubConfig::keys`]).
    hub: Option<&'a Overlay>,
}

/// What every node put on the wire this round.
struct Exchange<'p, 'a> {
    packed: &'p [Packed],
    sent: &'p (dyn Fn(usize) -> &'a [f32] + Sync),
    samples: &'p [u64],
}

/// Merge node `i`'s own update with the sent updates of `peers` under the policy's rule.
fn merge_with<'a>(
    spec: &PolicySpec,
    i: usize,
    peers: &[u32],
    own: &'a [f32],
    ex: &Exchange<'_, 'a>,
    candidates: usize,
) -> Result<Merged, LearnError> {
    let (packed, sent, samples) = (ex.packed, ex.sent, ex.samples);
    let own_samples = samples.get(i).copied().unwrap_or(1);
    let refs: Vec<UpdateRef<'_>> = peers
        .iter()
        .map(|&p| UpdateRef {
            update: sent(p as usize),
            samples: samples.get(p as usize).copied().unwrap_or(1),
        })
        .collect();
    let body_bytes: f64 = peers
        .iter()
        .map(|&p| REQUEST_BYTES + packed.get(p as usize).map_or(0.0, |x| x.body_bytes as f64))
        .sum();
    let header_bytes: f64 = peers
        .iter()
        .map(|&p| {
            REQUEST_BYTES
                + packed
                    .get(p as usize)
                    .map_or(0.0, |x| x.header_bytes as f64)
        })
        .sum();
    let own_ref = UpdateRef {
        update: own,
        samples: own_samples,
    };
    let (update, accepted, rejected) = match spec.merge {
        Merge::Mean => {
            // Claims weigh as in the robust merge (`cap_samples`, the own claim uncapped): the
            // plain mean drops the norm and cosine rules, not the bound on claims.
            let claims: Vec<u64> = std::iter::once(own_samples)
                .chain(refs.iter().map(|r| r.samples))
                .collect();
            let weights = cap_samples(&claims, SynthConfig::default().max_samples_ratio);
            let own_w = own_samples.clamp(1, kindred_proto::MAX_SAMPLES) as f64;
            let total = own_w + weights.iter().skip(1).sum::<f64>();
            let mut acc: Vec<f64> = own.iter().map(|&x| f64::from(x) * own_w).collect();
            for (r, &w) in refs.iter().zip(weights.iter().skip(1)) {
                for (a, &x) in acc.iter_mut().zip(r.update) {
                    *a += f64::from(x) * w;
                }
            }
            let update = acc
                .into_iter()
                .map(|a| (a / total.max(1.0)) as f32)
                .collect();
            (update, peers.to_vec(), 0)
        }
        Merge::Robust(sc) => {
            let synthesis = synthesize(own_ref, &refs, &sc)?;
            let accepted: Vec<u32> = synthesis
                .accepted_by_agreement()
                .into_iter()
                .filter_map(|k| peers.get(k).copied())
                .collect();
            let rejected = synthesis.verdicts.len() - accepted.len();
            (synthesis.merged, accepted, rejected)
        }
    };
    Ok(Merged {
        update,
        accepted,
        rejected,
        candidates,
        header_bytes,
        body_bytes,
        ranked: Vec::new(),
        ..Merged::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learn::{Attack, Hostile, Setting};
    use kindred_trainer::TrainConfig;

    fn quiet(_: &str, _: u64, _: u64) {}

    #[test]
    fn a_relabelled_update_rolls_only_the_output_layers_rows() {
        let arch = Arch::Mlp { hidden: 3 };
        let len = arch.spec().unwrap().numel() as usize;
        let honest: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let mut relabelled = honest.clone();
        corrupt(&mut relabelled, Attack::Relabel, arch, 0);
        let head = len - CLASSES * 4;
        assert_eq!(relabelled[..head], honest[..head]);
        // Class 1's row is class 0's, class 0's the last class's; the biases likewise.
        assert_eq!(relabelled[head + 3..head + 6], honest[head..head + 3]);
        assert_eq!(relabelled[head..head + 3], honest[head + 27..head + 30]);
        assert_eq!(relabelled[head + 31], honest[head + 30]);
        assert_eq!(relabelled[head + 30], honest[len - 1]);
    }

    /// A round's bytes are the sum of its parts.
    fn assert_bytes_add_up(s: &RoundStats) {
        let parts = s.dht_bytes_per_node
            + s.header_bytes_per_node
            + s.body_bytes_per_node
            + s.snapshot_bytes_per_node;
        assert!((s.bytes_per_node - parts).abs() < 1e-6, "round {}", s.round);
    }

    fn small() -> LearnConfig {
        let mut c = LearnConfig::new(16, 3);
        c.setting = Setting::Label { clusters: 2 };
        c.train = TrainConfig {
            steps: 4,
            batch: 16,
            lr: 0.1,
        };
        c.eval_examples = 100;
        c.eval_nodes = 4;
        c.top_m = 3;
        c.policies = PolicySpec::standard(3);
        c
    }

    #[test]
    fn policies_run_and_account_their_traffic() {
        let cfg = small();
        let r = run(&cfg, &quiet).unwrap();
        assert_eq!(r.policies.len(), 5);
        assert_eq!(r.params, 50_890);
        let by = |name: &str| r.policies.iter().find(|p| p.name == name).unwrap();
        for p in &r.policies {
            assert_eq!(p.rounds.len(), 3);
            assert!((0.0..=1.0).contains(&p.final_accuracy), "{}", p.name);
            assert!(
                p.rounds
                    .iter()
                    .all(|s| s.accuracy.is_finite() && s.loss > 0.0)
            );
        }
        assert_eq!(by("local").bytes_per_node_round, 0.0);
        // All-reduce and oracle nodes hold one model per cluster: it is their consensus model.
        for name in ["allreduce", "oracle"] {
            let p = by(name);
            assert!(
                (p.consensus_accuracy - p.final_accuracy).abs() < 1e-12,
                "{name}: {} vs {}",
                p.consensus_accuracy,
                p.final_accuracy
            );
        }
        // Local nodes drift apart; averaging their models is a different model.
        let l = by("local");
        assert!(l.consensus_accuracy > 0.0 && l.consensus_accuracy != l.final_accuracy);
        // Ring all-reduce of the dense f32 update: 2·(n−1)/n of it per node.
        let dense = 4.0 * 50_890.0;
        let ar = by("allreduce").bytes_per_node_round;
        assert!((ar - 2.0 * 15.0 / 16.0 * dense).abs() < 1.0, "{ar}");
        let oracle = by("oracle").bytes_per_node_round;
        assert!((oracle - 2.0 * 7.0 / 8.0 * dense).abs() < 1.0, "{oracle}");
        // Kindred's packets are far smaller than the dense update; in its first exchange round
        // (round 2, after two local rounds) every node searches, and its cohort is at most its
        // cluster (8 nodes).
        let k = by("kindred");
        let last = k.rounds.last().unwrap();
        assert!(last.compression_ratio > 4.0, "{}", last.compression_ratio);
        assert!(last.dht_bytes_per_node > 0.0 && last.header_bytes > 0.0);
        assert!(k.rounds.iter().all(|s| s.partners <= 7.0));
        let g = by("gossip");
        assert!(
            g.rounds
                .iter()
                .all(|s| s.candidates == 3.0 && s.dht_bytes_per_node == 0.0)
        );
        // All-reduce purity is the share of same-cluster peers: (8 − 1) / 15.
        let pa = by("allreduce").rounds[0].purity;
        assert!((pa - 7.0 / 15.0).abs() < 1e-9, "{pa}");
    }

    #[test]
    fn semantic_nodes_search_the_dht_only_in_discovery_rounds() {
        let mut cfg = small();
        cfg.rounds = 5;
        // Long enough local training that same-task sketches pass the 0.5 cosine gate.
        cfg.train.steps = 12;
        cfg.policies = vec![PolicySpec::kindred_pairwise()];
        let r = run(&cfg, &quiet).unwrap();
        let rounds = &r.policies[0].rounds;
        // Rounds 0-2 are the warm-up: everyone announces and searches.
        for s in &rounds[..3] {
            assert_eq!(s.searched, 1.0, "round {}", s.round);
            assert!(s.dht_bytes_per_node > 0.0);
        }
        // Rounds 3 and 4: nodes follow the peers they found (only a node left with nobody to
        // follow searches), asking each for one header.
        let header = rounds[2].header_bytes;
        for s in &rounds[3..] {
            assert!(s.searched < 0.25, "round {}: {}", s.round, s.searched);
            assert!(s.dht_bytes_per_node < 0.25 * rounds[2].dht_bytes_per_node);
            assert!(s.header_bytes_per_node <= 10.0 * (REQUEST_BYTES + header) + 1.0);
            assert!(s.partners > 0.0 && s.purity == 1.0, "round {}", s.round);
        }
        // Searching every round costs more DHT traffic.
        cfg.discovery = kindred_routing::Discovery::EVERY_ROUND;
        let every = run(&cfg, &quiet).unwrap();
        let dht = |r: &LearnReport| r.policies[0].rounds[3].dht_bytes_per_node;
        assert!(dht(&every) > 4.0 * dht(&r).max(1.0));
    }

    #[test]
    fn snapshot_rounds_fetch_one_partner_model_per_merging_node() {
        let mut cfg = small();
        cfg.rounds = 4;
        cfg.train.steps = 12;
        cfg.policies = vec![
            PolicySpec::kindred_pairwise_no_snapshots(),
            PolicySpec::kindred_pairwise(),
        ];
        let r = run(&cfg, &quiet).unwrap();
        let (plain, snap) = (&r.policies[0], &r.policies[1]);
        assert!(
            plain
                .rounds
                .iter()
                .all(|s| s.snapshot_bytes_per_node == 0.0)
        );
        // Every other round (1 and 3), each node that merged somebody fetches one int8 model: at
        // most 1 byte per parameter plus framing, a header and the request.
        let model = r.params as f64;
        for s in &snap.rounds {
            if s.round % 2 == 1 {
                // At most one fetch per node, and most nodes merged somebody.
                assert!(
                    s.snapshot_bytes_per_node > 0.5 * model
                        && s.snapshot_bytes_per_node < 1.1 * model,
                    "round {}: {}",
                    s.round,
                    s.snapshot_bytes_per_node
                );
                assert_eq!(s.pulls_clipped, 0.0, "honest partners are not clipped");
            } else {
                assert_eq!(s.snapshot_bytes_per_node, 0.0);
            }
            assert_bytes_add_up(s);
        }
    }

    #[test]
    fn same_seed_same_learning_run() {
        let mut cfg = small();
        cfg.policies = vec![
            PolicySpec::kindred(),
            PolicySpec::kindred_pairwise(),
            PolicySpec::oracle(),
        ];
        cfg.rounds = 2;
        let strip = |mut r: LearnReport| {
            r.seconds = 0.0;
            r.policies.iter_mut().for_each(|p| p.seconds = 0.0);
            r
        };
        // Compared through Debug: NaN purities (no partner merged) compare unequal otherwise.
        let a = format!("{:?}", strip(run(&cfg, &quiet).unwrap()));
        let b = format!("{:?}", strip(run(&cfg, &quiet).unwrap()));
        assert_eq!(a, b);
    }

    #[test]
    fn hub_exchange_finds_one_hub_per_task_and_moves_two_updates_a_round() {
        let mut cfg = small();
        // Rounds 0-1 are local; hubs search in exchange rounds 0-2 (rounds 2-4) and then every
        // 10th. Two members whose join the hub refused in round 3 took its model without that
        // round's merge, and take it again in round 5 (`Exchange::lineage`): round 6 is a plain
        // round.
        cfg.rounds = 7;
        cfg.train.steps = 12;
        cfg.policies = vec![PolicySpec::kindred(), PolicySpec::kindred_pairwise()];
        let r = run(&cfg, &quiet).unwrap();
        let (hub, pairwise) = (&r.policies[0], &r.policies[1]);
        // While nodes train alone they send nothing and merge nobody, and still learn.
        for s in &hub.rounds[..2] {
            assert_eq!(s.bytes_per_node, 0.0, "round {}", s.round);
            assert_eq!(s.partners, 0.0, "round {}", s.round);
            assert!(s.purity.is_nan() && s.accuracy > 0.2, "round {}", s.round);
        }
        // Members merge only with their own task, and each cohort holds one model: the nodes'
        // accuracy is their consensus model's.
        for s in &hub.rounds[2..] {
            assert_eq!(s.purity, 1.0, "round {}", s.round);
            assert!(s.partners > 2.0, "round {}: {}", s.round, s.partners);
            assert_bytes_add_up(s);
        }
        assert!(
            (hub.final_accuracy - hub.consensus_accuracy).abs() < 0.02,
            "{} vs {}",
            hub.final_accuracy,
            hub.consensus_accuracy
        );
        // Once nobody searches, a round is a push and an answer: about two bodies and two
        // headers per node, far below fetching a body per partner.
        let last = hub.rounds.last().unwrap();
        assert_eq!(last.dht_bytes_per_node, 0.0);
        let two = 2.0 * (last.body_bytes + last.header_bytes + 95.0) + 2.0 * REQUEST_BYTES;
        assert!(
            last.bytes_per_node < 1.2 * two,
            "{} vs {two}",
            last.bytes_per_node
        );
        assert!(hub.bytes_per_node_round < 0.5 * pairwise.bytes_per_node_round);
    }

    #[test]
    fn bounded_hubs_make_each_task_one_tree_that_applies_one_merge() {
        let mut cfg = small();
        cfg.rounds = 7;
        cfg.train.steps = 12;
        cfg.hub.fanout = Some(2);
        cfg.policies = vec![PolicySpec::kindred()];
        let r = run(&cfg, &quiet).unwrap();
        let hub = &r.policies[0];
        // Two tasks of 8 nodes: no hub merges more than 2 pushes, so the trees are at least
        // 2 deep, and every node of a task applies its root's merge (one model per task).
        assert_eq!(hub.members_per_hub_max, 2);
        assert!(hub.tree_depth_max >= 2, "{}", hub.tree_depth_max);
        for s in &hub.rounds[2..] {
            assert_eq!(s.purity, 1.0, "round {}", s.round);
            assert_bytes_add_up(s);
        }
        let last = hub.rounds.last().unwrap();
        assert!(last.partners > 6.0, "{}", last.partners);
        assert!(
            (hub.final_accuracy - hub.consensus_accuracy).abs() < 0.02,
            "{} vs {}",
            hub.final_accuracy,
            hub.consensus_accuracy
        );
    }

    #[test]
    fn hub_exchange_keeps_rotated_tasks_apart() {
        // Rotated tasks' updates sit closer together than permuted labels': a member that
        // joined another task's hub while models were young is refused by its data when it
        // fetches the hub's model, and a hub measures pushers against its own task's anchor.
        // Without local rounds, as here, nodes meet while models are young.
        let mut cfg = small();
        cfg.nodes = 32;
        cfg.setting = Setting::Rotation { clusters: 4 };
        cfg.rounds = 8;
        cfg.train.steps = 12;
        cfg.hub.local_rounds = 0;
        cfg.policies = vec![PolicySpec::kindred()];
        let r = run(&cfg, &quiet).unwrap();
        // Before both checks (a hub measured pushers only against each other; a member whose
        // data refused the hub's model still applied its merges) this run stayed at 0.65-0.80
        // purity from round 3 to its end. With them it reaches 1.0 by round 5.
        for s in &r.policies[0].rounds[5..] {
            assert_eq!(s.purity, 1.0, "round {}", s.round);
            assert!(s.partners > 2.0, "round {}: {}", s.round, s.partners);
        }
    }

    #[test]
    fn nodes_that_trained_alone_form_pure_cohorts_from_their_first_exchange() {
        // `kindred-sim learn --nodes 64 --setting rotation --seed 3 --policies kindred
        // --rounds 4`: nodes train alone in rounds 0-1 and first push in round 2.
        let mut cfg = LearnConfig::new(64, 4);
        cfg.seed = 3;
        cfg.setting = Setting::Rotation { clusters: 4 };
        cfg.eval_examples = 100;
        cfg.eval_nodes = 4;
        cfg.policies = vec![PolicySpec::kindred()];
        let r = run(&cfg, &quiet).unwrap();
        for s in &r.policies[0].rounds[2..] {
            assert_eq!(s.purity, 1.0, "round {}", s.round);
            assert!(s.partners > 2.0, "round {}: {}", s.round, s.partners);
        }
        // Meeting in round 0, when rotated digits' first updates look alike, nodes of one
        // rotation merge in another's cohort: purity 0.35 in round 0 (their data refuses those
        // hubs from round 1 on).
        cfg.hub.local_rounds = 0;
        let r = run(&cfg, &quiet).unwrap();
        let round0 = &r.policies[0].rounds[0];
        assert!(round0.purity < 0.99, "{}", round0.purity);
    }

    #[test]
    fn a_denser_hub_answers_with_more_bytes_and_members_push_the_same() {
        let mut cfg = small();
        // Rounds 0-1 are local; from round 2 members push at their density and hubs answer at
        // theirs.
        cfg.rounds = 5;
        cfg.train.steps = 8;
        cfg.policies = vec![PolicySpec::kindred()];
        let base = run(&cfg, &quiet).unwrap();
        cfg.hub.density = Some(0.2);
        let dense = run(&cfg, &quiet).unwrap();
        let (b, d) = (
            base.policies[0].rounds.last().unwrap(),
            dense.policies[0].rounds.last().unwrap(),
        );
        // The members' packets are distilled at their own density either way; the answers,
        // one per member, carry five times the top-k entries.
        assert!(
            (d.body_bytes - b.body_bytes).abs() < 0.05 * b.body_bytes,
            "{} vs {}",
            d.body_bytes,
            b.body_bytes
        );
        assert!(
            d.body_bytes_per_node > 1.5 * b.body_bytes_per_node,
            "{} vs {}",
            d.body_bytes_per_node,
            b.body_bytes_per_node
        );
    }

    #[test]
    fn hub_exchange_runs_through_lost_messages_and_crashed_hubs() {
        let mut cfg = small();
        cfg.rounds = 8;
        cfg.policies = vec![PolicySpec::kindred()];
        let clean = run(&cfg, &quiet).unwrap();
        cfg.hub.faults = crate::learn::Faults {
            msg_loss: 0.2,
            hub_crash: 0.5,
            down_rounds: 2,
            hostile_low_rank: false,
        };
        let faulty = run(&cfg, &quiet).unwrap();
        let (clean, faulty) = (&clean.policies[0], &faulty.policies[0]);
        assert_eq!(clean.missed_merges, 0);
        assert!(faulty.missed_merges > 0, "{}", faulty.missed_merges);
        assert!(faulty.hub_changes_per_node > clean.hub_changes_per_node);
        for s in &faulty.rounds[2..] {
            // Nobody merges another task's update, whatever was lost.
            assert!(s.purity.is_nan() || s.purity == 1.0, "round {}", s.round);
            assert_bytes_add_up(s);
        }
        assert!(faulty.final_accuracy > 0.5, "{}", faulty.final_accuracy);
    }

    #[test]
    fn only_hub_candidates_announce_while_cohorts_form() {
        let mut cfg = small();
        cfg.rounds = 5;
        cfg.train.steps = 12;
        cfg.policies = vec![PolicySpec::kindred()];
        let quiet_start = run(&cfg, &quiet).unwrap();
        cfg.hub.candidates = 1;
        let everyone = run(&cfg, &quiet).unwrap();
        let (q, e) = (&quiet_start.policies[0], &everyone.policies[0]);
        let first = usize::try_from(cfg.hub.local_rounds).unwrap();
        let (q0, e0) = (&q.rounds[first], &e.rounds[first]);
        assert!(
            q0.dht_bytes_per_node < 0.8 * e0.dht_bytes_per_node,
            "{} vs {}",
            q0.dht_bytes_per_node,
            e0.dht_bytes_per_node
        );
        // The nodes that only looked up still found their cohorts.
        let last = q.rounds.last().unwrap();
        assert_eq!(last.purity, 1.0);
        assert!(last.partners > 2.0, "{}", last.partners);
    }

    #[test]
    fn hostile_updates_are_rejected_by_the_robust_merge() {
        let mut cfg = small();
        cfg.policies = vec![PolicySpec::gossip(6)];
        cfg.hostile = Some(Hostile {
            fraction: 0.3,
            attacks: vec![Attack::Scale(100.0), Attack::SignFlip],
        });
        let r = run(&cfg, &quiet).unwrap();
        assert!(r.hostile > 0);
        let rejected: f64 = r.policies[0].rounds.iter().map(|s| s.rejected).sum();
        assert!(rejected > 0.0, "robust merge rejects corrupted updates");
    }

    /// A body with every payload kind the wire has, for a 4-layer spec of 8 values each.
    fn every_payload() -> (ModelSpec, PacketBody) {
        use kindred_proto::{DType, LayerSpec};
        let spec = ModelSpec::new(
            ["dense32", "dense16", "int8", "topk", "topk4", "sign"]
                .iter()
                .map(|n| LayerSpec::new(*n, [8], DType::F32))
                .collect(),
        )
        .unwrap();
        let v = [0.5f32, -0.25, 0.0, 1.0, -1.0, 0.125, -0.5, 2.0];
        let body = PacketBody {
            layers: vec![
                LayerPayload::Dense(DenseValues::F32(v.to_vec())),
                LayerPayload::Dense(DenseValues::F16(
                    v.iter().map(|&x| half::f16::from_f32(x)).collect(),
                )),
                LayerPayload::Dense(DenseValues::Int8 {
                    values: vec![1, -2, 3, -4, 5, -6, 7, -8],
                    scale: 0.01,
                }),
                LayerPayload::TopK(TopK {
                    len: 8,
                    indices: vec![1, 5],
                    values: vec![-100, 20],
                    scale: 0.01,
                }),
                LayerPayload::TopK4(TopK4 {
                    len: 8,
                    indices: vec![0, 3, 6],
                    codes: vec![0x29, 0x05],
                    scale: 0.5,
                    ratio: 0.5,
                }),
                LayerPayload::Sign(SignBits {
                    len: 8,
                    words: vec![0b1010_0101],
                    scale: 0.3,
                }),
            ],
        };
        (spec, body)
    }

    #[test]
    fn maximal_bodies_pass_every_check_at_the_largest_values() {
        let (spec, body) = every_payload();
        let big = maximal(&body);
        // A receiver accepts it: sealed (a claim of MAX_SAMPLES), verified, decoded.
        let key = ed25519::Keypair::generate();
        let sealed = seal(
            &key,
            &spec,
            HeaderFields {
                round: 1,
                unix_ms: 0,
                samples: kindred_proto::MAX_SAMPLES,
                loss: 0.5,
                embedding: Embedding::default(),
            },
            &big,
        )
        .unwrap();
        let header = kindred_proto::decode_header(&sealed.header_bytes).unwrap();
        assert_eq!(header.header().samples, kindred_proto::MAX_SAMPLES);
        let received =
            kindred_proto::decode_body(header.header(), &spec, &sealed.body_bytes).unwrap();
        let dense = decode(&received, &spec).unwrap();
        assert!(dense.iter().all(|x| x.is_finite()));
        let layer = |k: usize| &dense[8 * k..8 * (k + 1)];
        // Same signs, top-k support and sign bits as the honest body; every value maximal.
        let honest = decode(&body, &spec).unwrap();
        for (x, h) in dense.iter().zip(&honest) {
            assert!(*h == 0.0 || x.signum() == h.signum(), "{x} for {h}");
        }
        assert!(layer(0).iter().all(|x| x.abs() == f32::MAX));
        assert!(layer(1).iter().all(|x| x.abs() == 65504.0));
        assert!(layer(2).iter().all(|x| x.abs() > 3.0e38));
        assert_eq!(layer(3).iter().filter(|x| x.abs() > 3.0e38).count(), 2);
        assert_eq!(layer(4).iter().filter(|x| x.abs() == f32::MAX).count(), 3);
        assert!(layer(5).iter().all(|x| x.abs() == f32::MAX));
        // One step larger and a receiver refuses the int8 scale.
        let s = max_int8_scale();
        assert!((s * 127.0).is_finite());
        assert!(!(f32::from_bits(s.to_bits() + 1) * 127.0).is_finite());
    }

    /// Node 0's own update and three peers', each along its own axis (so the merge's value on
    /// axis `k` is update `k`'s weight), the last claiming `claim` samples.
    fn weights_with_liar(merge: Merge, partners: Partners, claim: u64) -> Vec<f32> {
        let updates: Vec<Vec<f32>> = (0..4)
            .map(|k| (0..4).map(|j| if j == k { 1.0 } else { 0.0 }).collect())
            .collect();
        let samples = [100, 100, 100, claim];
        let packed: Vec<Packed> = (0..4)
            .map(|_| Packed {
                sent: None,
                embedding: Embedding::default(),
                margins: [0.0; SIMHASH_BITS],
                header_bytes: 0,
                body_bytes: 0,
            })
            .collect();
        let sent = |i: usize| -> &[f32] { &updates[i] };
        if partners == Partners::AllReduce {
            return group_means(&sent, 4, &samples, &[0; 4], 4).remove(0);
        }
        let spec = PolicySpec {
            merge,
            ..PolicySpec::kindred()
        };
        let ex = Exchange {
            packed: &packed,
            sent: &sent,
            samples: &samples,
        };
        merge_with(&spec, 0, &[1, 2, 3], &updates[0], &ex, 3)
            .unwrap()
            .update
    }

    #[test]
    fn every_merge_path_caps_an_inflated_claim() {
        let ratio = SynthConfig::default().max_samples_ratio;
        // Claims 100, 100, 100 and a liar's: it weighs `ratio` claims of 100.
        let cap = ratio / (3.0 + ratio);
        for claim in [u64::MAX, kindred_proto::MAX_SAMPLES, 10_000] {
            for (merge, partners) in [
                (Merge::Robust(SynthConfig::default()), Partners::Hub),
                (Merge::Mean, Partners::Hub),
                (Merge::Mean, Partners::AllReduce),
            ] {
                let w = weights_with_liar(merge, partners, claim);
                assert!((w[3] - cap).abs() < 1e-6, "{merge:?} {partners:?}: {w:?}");
                assert!((w[0] - 1.0 / (3.0 + ratio)).abs() < 1e-6, "{w:?}");
            }
        }
        // Equal honest claims: an equal mean.
        let w = weights_with_liar(Merge::Mean, Partners::Hub, 100);
        assert!(w.iter().all(|&x| (x - 0.25).abs() < 1e-6), "{w:?}");
    }

    #[test]
    fn inflated_and_maximal_attacks_run_under_every_merge() {
        let mut cfg = small();
        cfg.policies = vec![
            PolicySpec::kindred(),
            PolicySpec::kindred_plain_merge(),
            PolicySpec::gossip(3),
            PolicySpec::allreduce(),
        ];
        cfg.hostile = Some(Hostile {
            fraction: 0.3,
            attacks: vec![
                Attack::MaxFinite,
                Attack::InflateSamples(2.0),
                Attack::InflateNoise,
            ],
        });
        let r = run(&cfg, &quiet).unwrap();
        assert!(r.hostile >= 3, "{}", r.hostile);
        for p in &r.policies {
            assert!(p.final_accuracy.is_finite(), "{}", p.name);
        }
        let acc = |name: &str| {
            r.policies
                .iter()
                .find(|p| p.name == name)
                .map_or(f64::NAN, |p| p.final_accuracy)
        };
        // The largest finite values take a mean over every node (all-reduce) to chance; the
        // robust pairwise merge rejects them by norm.
        assert!(acc("allreduce") < 0.2, "{}", acc("allreduce"));
        assert!(acc("gossip") > 0.3, "{}", acc("gossip"));
        let rejected: f64 = r.policies[2].rounds.iter().map(|s| s.rejected).sum();
        assert!(rejected > 0.0);
    }
}
