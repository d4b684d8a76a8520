//! The round engine: one node's model, distiller and store, and what happens in one round.
//!
//! ```text
//! train → distill → seal → store → announce → look up → headers → rank → bodies → verify
//!       → synthesize → apply → seal snapshot → [fetch a partner's snapshot → pull] → checkpoint
//! ```
//!
//! Merging updates alone lets nodes' models drift apart (a partner's update is computed at the
//! partner's parameters), so every few rounds the node also fetches one merged partner's model
//! snapshot and moves part of the way toward it ([`Engine::pull_toward`]); it serves its own
//! ([`Engine::seal_snapshot`]) to partners doing the same.
//!
//! The engine owns no clock and no socket: [`Engine::make_packet`] and [`Engine::merge`] are the
//! two halves of a round around the network exchange, and the driver ([`crate::run`]) decides
//! when each runs. Every round ends in [`Engine::checkpoint`], which commits model parameters and
//! distiller state to the store in one atomic step, so a node killed at any instant restarts
//! from its last completed round.

use std::sync::Arc;

use kindred_distill::{
    ConsensusError, Distiller, DistillerState, EmbeddingConfig, Filled, HeadScores, Policy, Pull,
    PullConfig, SynthConfig, Update, UpdateBuilder, UpdateRef, UpdateView, Verdict, decode,
    decode_iter, decode_update, pull, snapshot_encoded, synthesize,
};
use kindred_proto::{
    Embedding, HeaderFields, ModelSpec, OutcomePacket, PacketBody, PacketId, SealedPacket, seal,
    seal_snapshot_encoded,
};
use libp2p_identity::{PeerId, PublicKey, ed25519};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::config::{NodeConfig, TrainerKind};
use crate::merged::MergedUpdate;
use crate::staged::StagedUpdate;
use crate::store::{RoundState, Store};
use crate::trainer::{Examples, Mnist, Model, Split, TrainConfig};

/// Fraction of the digits held out for evaluation.
pub(crate) const EVAL_FRACTION: f64 = 0.2;

/// Why the engine failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The training data could not be loaded.
    #[error(transparent)]
    Data(#[from] crate::trainer::DataError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] crate::trainer::ModelError),
    /// Distillation failed.
    #[error("distillation failed: {0}")]
    Distill(String),
    /// Sealing our own packet failed (a bug: the distiller produced an invalid body).
    #[error("sealing failed: {0}")]
    Seal(#[from] kindred_proto::SealError),
    /// A checkpoint in the store does not fit the configured model.
    #[error("checkpoint does not match the configured model: {0}")]
    Checkpoint(String),
    /// The external trainer's update could not be read back from its staging file.
    #[error("staged update: {0}")]
    Staged(String),
    /// No update arrived from the external trainer for this round.
    #[error("no update from the external trainer")]
    NoUpdate,
    /// A model snapshot could not be made, or a partner's could not be used.
    #[error("model snapshot: {0}")]
    Snapshot(#[from] ConsensusError),
}

/// Where a round's update comes from.
#[derive(Debug)]
enum Source {
    /// The built-in candle trainer.
    Builtin(Box<Builtin>),
    /// A local process that pushes updates through the API; the engine keeps the last merged
    /// update for it to fetch.
    External { pending: Option<ExternalUpdate> },
}

/// The built-in trainer's state.
#[derive(Debug)]
struct Builtin {
    model: Model,
    train: Examples,
    eval: Examples,
    config: TrainConfig,
    rng: StdRng,
}

/// An update pushed by an external trainer.
#[derive(Debug)]
pub struct ExternalUpdate {
    /// The update, flat in spec order.
    pub update: UpdateValues,
    /// Samples behind it.
    pub samples: u64,
    /// Its training loss.
    pub loss: f32,
}

/// Where an external trainer's update is.
#[derive(Debug)]
pub enum UpdateValues {
    /// In memory.
    InMemory(Vec<f32>),
    /// In the node's staging file (what the API writes): read a layer at a time, never whole,
    /// by the hub exchange.
    Staged(StagedUpdate),
}

impl UpdateValues {
    /// Values in the update.
    pub fn len(&self) -> usize {
        match self {
            Self::InMemory(v) => v.len(),
            Self::Staged(s) => s.len(),
        }
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Have a staged update read back into the page cache ahead of its use
    /// ([`StagedUpdate::prefetch`]); nothing to do for one in memory.
    pub fn prefetch(&self) {
        if let Self::Staged(s) = self {
            s.prefetch();
        }
    }
}

impl From<Vec<f32>> for UpdateValues {
    fn from(v: Vec<f32>) -> Self {
        Self::InMemory(v)
    }
}

/// Our half of a round: the sealed packet and what went into it.
#[derive(Debug)]
pub struct Outgoing {
    /// The sealed packet (already stored).
    pub packet: SealedPacket,
    /// SimHash margins for multi-probe lookups.
    pub margins: Vec<f32>,
    /// The update as peers will decode it (shared with the exchange, which merges it), kept
    /// as its nonzero entries when it is a sparse packet.
    pub sent: Arc<Update>,
    /// This round's full local update (our own contribution to a pairwise merge; the hub
    /// exchange merges `sent` and empties this once the packet is made).
    pub full: Vec<f32>,
    /// Training loss.
    pub loss: f32,
    /// Samples behind the update.
    pub samples: u64,
    /// The distiller's own step (compression and error feedback, not training, embedding or
    /// sealing): wall seconds, and the process's CPU seconds over it (all threads; `None` where
    /// the platform does not say).
    pub distill_time: (f64, Option<f64>),
}

/// A verified peer packet to merge.
#[derive(Debug, Clone)]
pub struct PeerPacket {
    /// The sender.
    pub sender: PeerId,
    /// Its packet id.
    pub id: PacketId,
    /// Samples behind it.
    pub samples: u64,
    /// Its decoded body.
    pub body: kindred_proto::PacketBody,
}

/// What merging did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MergeReport {
    /// Peers merged, the one whose update agrees most with the own update first.
    pub partners: Vec<PeerId>,
    /// Rejected peers with the reason label.
    pub rejected: Vec<(PeerId, &'static str)>,
    /// The merged update (own contribution included).
    pub merged: Vec<f32>,
}

impl MergeReport {
    /// L2 norm of the merged update: the yardstick a snapshot pull's step is clipped to.
    pub fn merged_norm(&self) -> f64 {
        self.merged
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt()
    }
}

/// One node's learning state.
#[derive(Debug)]
pub struct Engine {
    keypair: ed25519::Keypair,
    peer_id: PeerId,
    spec: Arc<ModelSpec>,
    distiller: Distiller,
    source: Source,
    store: Store,
    synth: SynthConfig,
    /// The distillation policy of its packets (and, as a hub, of its merges).
    policy: Policy,
    /// Whether a round needs its full own update after the packet (the pairwise exchange
    /// merges it; the hub exchange merges what it sent).
    keep_full: bool,
    /// Where the node started: the initial parameters (built-in trainer) or zeros (external).
    origin: Vec<f32>,
    /// Where the current round starts: the model parameters (built-in trainer) or the sum of all
    /// merged updates applied so far (external trainer). `base − origin` is the node's cumulative
    /// update, whose embedding is what routing keys on.
    base: Vec<f32>,
    /// Last completed round, if any.
    last_round: Option<u64>,
    /// What was restored from the store at start-up.
    restored: Option<Restored>,
}

/// What a node restored from its store at start-up.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Restored {
    /// The committed round it resumed after.
    pub round: u64,
    /// The distiller's own round counter (updates distilled so far).
    pub distiller_round: u64,
    /// L2 norm of the restored error-feedback residual.
    pub residual_norm: f64,
}

impl Engine {
    /// Open the node's store and restore its identity, last checkpoint and distiller state, or
    /// start fresh from the configured seed.
    ///
    /// # Errors
    /// [`EngineError`] when the store, the data or a checkpoint cannot be used.
    pub fn open(store: Store, config: &NodeConfig) -> Result<Self, EngineError> {
        let keypair = store.identity_or_create()?;
        let peer_id = PublicKey::from(keypair.public()).to_peer_id();
        let t = &config.trainer;
        // Only the built-in trainer needs a model here; an external one needs its spec.
        let mut model = match (t.kind, t.model.arch()) {
            (TrainerKind::Builtin, Some(arch)) => Some(Model::new(arch, t.seed)?),
            (TrainerKind::Builtin, None) => {
                return Err(EngineError::Model(crate::trainer::ModelError::Arch(
                    "a synthetic model needs an external trainer".into(),
                )));
            }
            (TrainerKind::External, _) => None,
        };
        let spec = Arc::new(match &model {
            Some(m) => m.spec().clone(),
            None => t.spec()?,
        });
        let policy = config.packet_policy();
        let mut distiller =
            Distiller::new((*spec).clone(), policy.clone(), Self::embedding_config())
                .map_err(|e| EngineError::Distill(e.to_string()))?
                .with_backend(kindred_kernels::Backend::detect());
        let origin = match &model {
            Some(m) => m.params()?,
            None => vec![0.0; spec.numel() as usize],
        };
        // Zeros until restored or set from the model below: allocated, not copied (a large
        // external model's pages stay untouched until its first merge).
        let mut base = vec![0.0; origin.len()];

        let mut last_round = None;
        let mut restored = None;
        if let Some(state) = store.round_state()? {
            let params = store.get_blob(&state.checkpoint)?;
            let params = params_from_bytes(&params, &spec)?;
            let residuals = store.get_blob(&state.residuals)?;
            let distiller_state = DistillerState::from_bytes(&residuals, &spec)
                .map_err(|e| EngineError::Checkpoint(e.to_string()))?;
            distiller
                .restore(distiller_state)
                .map_err(|e| EngineError::Checkpoint(e.to_string()))?;
            match &mut model {
                Some(m) => m.set_params(&params)?,
                None => base = params,
            }
            last_round = Some(state.round);
            let residual_norm = distiller.residual_norm();
            restored = Some(Restored {
                round: state.round,
                distiller_round: distiller.round(),
                residual_norm,
            });
            tracing::info!(round = state.round, residual_norm, %peer_id, "restored checkpoint");
        }

        let source = match model {
            Some(model) => {
                let mnist = Mnist::load()?;
                let split = Split::new(mnist.len(), EVAL_FRACTION, t.seed);
                let task = t.task();
                let train = Examples::new(&mnist, &split.shard(t.shard, t.shards), task);
                let eval = Examples::new(&mnist, &split.eval, task);
                Source::Builtin(Box::new(Builtin {
                    model,
                    train,
                    eval,
                    config: t.train(),
                    // Different per node and per restart point, reproducible for a given state.
                    rng: StdRng::seed_from_u64(
                        t.seed ^ seed_of(&peer_id) ^ last_round.unwrap_or(0),
                    ),
                }))
            }
            None => Source::External { pending: None },
        };
        if let Source::Builtin(b) = &source {
            base = b.model.params()?;
        }
        Ok(Self {
            keypair,
            peer_id,
            spec,
            distiller,
            source,
            store,
            synth: SynthConfig::for_node(config.snapshot_every > 0),
            policy,
            keep_full: config.exchange == crate::config::ExchangeKind::Pairwise,
            origin,
            base,
            last_round,
            restored,
        })
    }

    /// This node's identity.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The identity keypair (also the libp2p identity, so packets are served by their sender).
    pub fn keypair(&self) -> &ed25519::Keypair {
        &self.keypair
    }

    /// The model spec.
    pub fn spec(&self) -> &Arc<ModelSpec> {
        &self.spec
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The last completed round.
    pub fn last_round(&self) -> Option<u64> {
        self.last_round
    }

    /// What was restored from the store at start-up (`None` for a fresh node).
    pub fn restored(&self) -> Option<Restored> {
        self.restored
    }

    /// Whether updates come from an external trainer.
    pub fn is_external(&self) -> bool {
        matches!(self.source, Source::External { .. })
    }

    /// Hand the engine an update from the external trainer for the next round.
    ///
    /// # Errors
    /// [`EngineError::Checkpoint`] when the update does not fit the model.
    pub fn push_external(&mut self, update: ExternalUpdate) -> Result<(), EngineError> {
        if update.update.len() as u64 != self.spec.numel() {
            return Err(EngineError::Checkpoint(format!(
                "update has {} values, the model has {}",
                update.update.len(),
                self.spec.numel()
            )));
        }
        if let Source::External { pending } = &mut self.source {
            *pending = Some(update);
        }
        Ok(())
    }

    /// Whether an external update is waiting.
    pub fn has_pending_external(&self) -> bool {
        matches!(&self.source, Source::External { pending: Some(_) })
    }

    /// First half of round `round`: train (or take the external update), distill, seal and store
    /// our packet.
    ///
    /// # Errors
    /// [`EngineError`] when training, distillation, sealing or storing fails, or
    /// [`EngineError::NoUpdate`] when an external trainer has not pushed an update.
    pub fn make_packet(&mut self, round: u64, unix_ms: u64) -> Result<Outgoing, EngineError> {
        let (update, loss, samples) = match &mut self.source {
            Source::Builtin(b) => {
                self.base = b.model.params()?;
                let stats = b.model.train(&b.train, &b.config, &mut b.rng)?;
                let after = b.model.params()?;
                let update: Vec<f32> = after.iter().zip(&self.base).map(|(a, b)| a - b).collect();
                (UpdateValues::InMemory(update), stats.loss, stats.samples)
            }
            Source::External { pending } => {
                let p = pending.take().ok_or(EngineError::NoUpdate)?;
                (p.update, p.loss, p.samples)
            }
        };
        let update = match update {
            UpdateValues::Staged(s) if self.keep_full => {
                UpdateValues::InMemory(s.to_vec().map_err(|e| EngineError::Staged(e.to_string()))?)
            }
            u => u,
        };
        let distill_err = |e: &dyn std::fmt::Display| EngineError::Distill(e.to_string());
        let timer = (std::time::Instant::now(), crate::metrics::CpuTimes::now());
        let distill_time = |(t0, cpu0): (std::time::Instant, Option<crate::metrics::CpuTimes>)| {
            let cpu = cpu0.and_then(|c0| Some(crate::metrics::CpuTimes::now()?.since(&c0)));
            (t0.elapsed().as_secs_f64(), cpu)
        };
        // Key on where this node's model is heading: its cumulative update including this round.
        // One round's update is mostly minibatch noise once training converges; the cumulative
        // update keeps the task's signal (same-task nodes stay at high cosine, other tasks low).
        // Summed a layer at a time: no fourth model-sized vector at the round's peak.
        let (distilled, distill_time, embedded, full) = match update {
            UpdateValues::InMemory(update) => {
                let distilled = self
                    .distiller
                    .distill(&update)
                    .map_err(|e| distill_err(&e))?;
                let time = distill_time(timer);
                let terms = [
                    (&self.base[..], 1.0),
                    (&self.origin[..], -1.0),
                    (&update, 1.0),
                ];
                let embedded = self
                    .distiller
                    .embed_sum(&terms)
                    .map_err(|e| distill_err(&e))?;
                (distilled, time, embedded, update)
            }
            UpdateValues::Staged(staged) => {
                // The distiller reads each layer from the file's mapping, in place; the key's
                // pass reads it again into a buffer of the largest layer's size, adding the
                // cumulative update's other terms. A failed read (the node's own disk) is a zero
                // layer for the key and this round's error: the round sends no packet, and what
                // the distiller took as sent is lost to error feedback.
                let mut failed = None;
                let mut read = |start: usize, out: &mut [f32]| {
                    if let Err(e) = staged.read(start, out) {
                        out.fill(0.0);
                        failed.get_or_insert(e);
                    }
                };
                // The API checked every value as it arrived: one read of each layer.
                let mut mapped = staged
                    .layers()
                    .map_err(|e| EngineError::Staged(e.to_string()))?;
                let distilled = self
                    .distiller
                    .distill_checked_from(&mut mapped)
                    .map_err(|e| distill_err(&e))?;
                drop(mapped);
                let time = distill_time(timer);
                // `update + (base − origin)`: the sum `embed_sum` forms in the other arm.
                let (base, origin) = (&self.base, &self.origin);
                let mut cumulative = Filled::new(|start: usize, out: &mut [f32]| {
                    read(start, out);
                    let range = start..start + out.len();
                    let b = base.get(range.clone()).unwrap_or_default();
                    let o = origin.get(range).unwrap_or_default();
                    for ((x, b), o) in out.iter_mut().zip(b).zip(o) {
                        *x += b - o;
                    }
                });
                let embedded = self
                    .distiller
                    .embed_from(&mut cumulative)
                    .map_err(|e| distill_err(&e))?;
                drop(cumulative);
                if let Some(e) = failed {
                    return Err(EngineError::Staged(e.to_string()));
                }
                (distilled, time, embedded, Vec::new())
            }
        };
        let sent = decode_update(&distilled.body, &self.spec)
            .map_err(|e| EngineError::Distill(e.to_string()))?;
        let fields = HeaderFields {
            round,
            unix_ms,
            samples,
            loss: if loss.is_finite() { loss } else { f32::MAX },
            embedding: embedded.embedding,
        };
        let packet = seal(&self.keypair, &self.spec, fields, &distilled.body)?;
        self.store
            .put_packet(packet.id(), &packet.header_bytes, &packet.body_bytes)?;
        Ok(Outgoing {
            packet,
            margins: embedded.margins.to_vec(),
            sent: Arc::new(sent),
            full,
            loss,
            samples,
            distill_time,
        })
    }

    /// Second half of a round: merge our sent update with the verified peer packets, apply the
    /// result to the model, and remember accepted peers in the embedding's running mean.
    ///
    /// # Errors
    /// [`EngineError`] when decoding our own state or applying the merge fails; a bad peer is
    /// a rejection in the report, never an error.
    pub fn merge(
        &mut self,
        own: &Outgoing,
        peers: &[PeerPacket],
    ) -> Result<MergeReport, EngineError> {
        let mut decoded = Vec::with_capacity(peers.len());
        let mut report = MergeReport::default();
        for p in peers {
            match decode(&p.body, &self.spec) {
                Ok(update) => decoded.push((p, update)),
                Err(_) => report.rejected.push((p.sender, "decode")),
            }
        }
        let refs: Vec<UpdateRef<'_>> = decoded
            .iter()
            .map(|(p, u)| UpdateRef {
                update: u,
                samples: p.samples,
            })
            .collect();
        let synthesis = synthesize(
            UpdateRef {
                update: &own.full,
                samples: own.samples,
            },
            &refs,
            &self.synth,
        )
        .map_err(|e| EngineError::Distill(e.to_string()))?;
        for ((p, update), verdict) in decoded.iter().zip(&synthesis.verdicts) {
            match verdict {
                Verdict::Accepted { .. } => {
                    let _ = self.distiller.accept_peer(update);
                }
                Verdict::Rejected(r) => report.rejected.push((p.sender, r.reason())),
            }
        }
        report.partners = synthesis
            .accepted_by_agreement()
            .into_iter()
            .filter_map(|i| decoded.get(i).map(|(p, _)| p.sender))
            .collect();
        match &mut self.source {
            Source::Builtin(b) => {
                let model = &mut b.model;
                model.set_params(&self.base)?;
                model.apply_update(&synthesis.merged)?;
                self.base = model.params()?;
            }
            Source::External { .. } => {
                for (b, m) in self.base.iter_mut().zip(&synthesis.merged) {
                    *b += m;
                }
            }
        }
        report.merged = synthesis.merged;
        Ok(report)
    }

    /// Seal the node's model as it stands (its cumulative update since the swarm's common
    /// initial model, int8 with one scale per layer, `kindred_distill::snapshot`) as the snapshot
    /// peers fetch; call
    /// after [`Engine::merge`].
    ///
    /// # Errors
    /// [`EngineError::Snapshot`] when a parameter is not finite (the model has diverged),
    /// [`EngineError::Seal`] when the snapshot is over the wire's body limit.
    pub fn seal_snapshot(&self, round: u64, unix_ms: u64) -> Result<SealedPacket, EngineError> {
        // Encoded as each layer is quantised: the body's bytes are the only copy of it.
        let body = snapshot_encoded(&self.base, &self.origin, &self.spec)?;
        let fields = HeaderFields {
            round,
            unix_ms,
            samples: 0,
            loss: 0.0,
            // Snapshots are fetched from a known partner, never routed: no embedding.
            embedding: Embedding::default(),
        };
        Ok(seal_snapshot_encoded(
            &self.keypair,
            &self.spec,
            fields,
            body,
        )?)
    }

    /// Which of this round's merge `partners` (best agreement first, as
    /// [`MergeReport::partners`]) to ask for a snapshot, in turn: one at random of the
    /// better-agreeing half first, then the rest of that half
    /// (`kindred_distill::snapshot_partners`), the same order for a given node and round.
    pub fn snapshot_partners(&self, round: u64, partners: &[PeerId]) -> Vec<PeerId> {
        use rand::Rng;
        let mut rng = StdRng::seed_from_u64(seed_of(&self.peer_id) ^ round.rotate_left(29));
        kindred_distill::snapshot_partners(partners, rng.random()).collect()
    }

    /// Move the model toward a partner's verified snapshot (`kindred_distill::pull`): `config`'s
    /// share of the way, the step clipped relative to this round's merged update in `report`,
    /// to which the step is added (an external trainer applies it with the merge).
    ///
    /// # Errors
    /// [`EngineError::Distill`] when the snapshot's layers do not fit the model,
    /// [`EngineError::Snapshot`] when a value is not finite, [`EngineError::Model`] when the
    /// built-in model cannot take the pulled parameters; nothing changes then, so the node can
    /// try another partner's snapshot (`run::pull_in_turn`).
    pub fn pull_toward(
        &mut self,
        partner: &OutcomePacket,
        report: &mut MergeReport,
        config: &PullConfig,
    ) -> Result<Pull, EngineError> {
        let cumulative =
            decode(&partner.body, &self.spec).map_err(|e| EngineError::Distill(e.to_string()))?;
        let reference = report.merged_norm();
        let mut pulled = self.base.clone();
        let done = pull(&mut pulled, &self.origin, &cumulative, reference, config)?;
        if let Source::Builtin(b) = &mut self.source
            && let Err(e) = b.model.set_params(&pulled)
        {
            // A failure part-way may have set some layers: put the model back as it was.
            if let Err(restore) = b.model.set_params(&self.base) {
                tracing::error!(error = %restore, "cannot restore the model after a failed pull");
            }
            return Err(e.into());
        }
        for ((m, after), before) in report.merged.iter_mut().zip(&pulled).zip(&self.base) {
            *m += after - before;
        }
        self.base = pulled;
        Ok(done)
    }

    /// The swarm's common initial model (zeros for an external trainer).
    pub fn origin(&self) -> &[f32] {
        &self.origin
    }

    /// Where the current round started: the model's parameters (built-in trainer) or the sum
    /// of the merged updates applied so far (external trainer).
    pub fn base(&self) -> &[f32] {
        &self.base
    }

    /// The robust merge's settings.
    pub fn synth_config(&self) -> &SynthConfig {
        &self.synth
    }

    /// A distiller like the node's own (same spec, policy, embedding and backend), fresh: what
    /// a hub distills its merges with, with error feedback of their own.
    ///
    /// # Errors
    /// [`EngineError::Distill`] if the spec does not fit a distiller (it fits the node's own).
    pub fn new_distiller(&self) -> Result<Distiller, EngineError> {
        Ok(Distiller::new(
            (*self.spec).clone(),
            self.policy.clone(),
            Self::embedding_config(),
        )
        .map_err(|e| EngineError::Distill(e.to_string()))?
        .with_backend(kindred_kernels::Backend::detect()))
    }

    fn embedding_config() -> EmbeddingConfig {
        // The embedding is of the node's cumulative update (see `base`), which already separates
        // tasks; centring it by peer updates would remove exactly that signal.
        EmbeddingConfig {
            center: false,
            ..EmbeddingConfig::default()
        }
    }

    /// How far the output layers of a hub's `merge` and of the node's `own` update point at the
    /// labels of its training shard, on the features of the model where the round started
    /// (`kindred_trainer::Model::head_alignment`); `None` for an external trainer (no data
    /// here), `NaN` for updates that are not finite. What a member's check of its hub's merge
    /// reads (`kindred_distill::check_head`).
    ///
    /// # Errors
    /// [`EngineError::Model`] on a tensor failure.
    pub fn head_scores(
        &mut self,
        merge: &Update,
        own: &Update,
    ) -> Result<Option<HeadScores>, EngineError> {
        let Source::Builtin(b) = &mut self.source else {
            return Ok(None);
        };
        let head = |u: &Update| {
            let mut head = vec![0.0; b.model.head_len()];
            u.fill(u.len().saturating_sub(head.len()), &mut head);
            head
        };
        let (merge, own) = (head(merge), head(own));
        let before = b.model.params()?;
        b.model.set_params(&self.base)?;
        let scores = match b.model.head_alignment([&merge, &own], &b.train) {
            Err(crate::trainer::ModelError::NonFinite) => Ok([f32::NAN; 2]),
            other => other,
        };
        b.model.set_params(&before)?;
        let [merge, own] = scores?;
        Ok(Some(HeadScores {
            merge,
            own,
            examples: b.train.len(),
        }))
    }

    /// Accuracy of model parameters `params` on the node's own training shard, the model left
    /// as it was; `None` for an external trainer (no data here), `NaN` for parameters that are
    /// not finite. What the hub exchange's checks by data score.
    ///
    /// # Errors
    /// [`EngineError::Model`] on a tensor failure.
    pub fn shard_accuracy(&mut self, params: &[f32]) -> Result<Option<f32>, EngineError> {
        let Source::Builtin(b) = &mut self.source else {
            return Ok(None);
        };
        let before = b.model.params()?;
        let score = match b.model.set_params(params) {
            Ok(()) => b.model.accuracy(&b.train),
            Err(crate::trainer::ModelError::NonFinite) => Ok(f32::NAN),
            Err(e) => Err(e),
        };
        b.model.set_params(&before)?;
        Ok(Some(score?))
    }

    /// End a round by applying `update` to where it started (the hub exchange's own update or
    /// a hub's merge), after taking `adopt` first if given (a hub's model, as its cumulative
    /// update since the common initial model). Returns what changed: the update an external
    /// trainer applies to follow.
    ///
    /// `adopt` is the hub's snapshot body as fetched, decoded a layer at a time
    /// ([`kindred_distill::decode_iter`]). With an external trainer the change an adoption
    /// makes (every parameter) goes to a staging file, so no model-sized vector is allocated
    /// beyond the node's own; the built-in trainer's small model takes it in memory.
    ///
    /// # Errors
    /// [`EngineError::Model`] when the model cannot take the parameters, or
    /// [`EngineError::Checkpoint`] when `adopt` does not decode to the model's size; nothing
    /// changes then.
    pub fn apply(
        &mut self,
        adopt: Option<&PacketBody>,
        update: Option<UpdateView<'_>>,
    ) -> Result<MergedUpdate, EngineError> {
        if matches!(self.source, Source::External { .. }) {
            let Some(body) = adopt else {
                // In place, and only where the update is nonzero does anything change: a
                // merge's few percent of entries.
                let hint = match update {
                    Some(UpdateView::Sparse(s)) => s.indices().len(),
                    _ => 0,
                };
                let mut delta = UpdateBuilder::with_capacity(self.base.len(), hint);
                for (i, u) in update.into_iter().flat_map(|u| u.nonzero()) {
                    if let Some(b) = self.base.get_mut(i) {
                        let n = *b + u;
                        delta.push(i, n - *b);
                        *b = n;
                    }
                }
                return Ok(delta.finish().into());
            };
            return self.adopt_staged(body, update);
        }
        // The built-in trainer's (small) model: the next parameters whole, every one read
        // before anything changes.
        let next = match adopt {
            Some(body) => {
                let mut values = decode_iter(body, &self.spec).map_err(hub_model_error)?;
                let next: Vec<f32> = adopted_model(&self.origin, values.by_ref(), update).collect();
                if let Some(e) = values.error() {
                    return Err(hub_model_error(e.clone()));
                }
                next
            }
            None => {
                let mut next = self.base.clone();
                for (i, u) in update.into_iter().flat_map(|u| u.nonzero()) {
                    if let Some(n) = next.get_mut(i) {
                        *n += u;
                    }
                }
                next
            }
        };
        if let Source::Builtin(b) = &mut self.source
            && let Err(e) = b.model.set_params(&next)
        {
            if let Err(restore) = b.model.set_params(&self.base) {
                tracing::error!(error = %restore, "cannot restore the model after a failed apply");
            }
            return Err(e.into());
        }
        let delta = next.iter().zip(&self.base).map(|(n, b)| n - b).collect();
        self.base = next;
        Ok(Update::from_dense(delta).into())
    }

    /// An external trainer's node adopting its hub's model: every parameter changes, to
    /// `origin + cumulative (+ update)`. The change is computed a piece at a time into a staging
    /// file (what the trainer fetches), then the model set, decoding the hub's body once for
    /// each pass: neither the hub's model in f32 nor the change is ever whole in memory (at
    /// 10^9 parameters each would be 4 GB beside the node's own), and a body that does not
    /// decode leaves the model as it was.
    fn adopt_staged(
        &mut self,
        body: &PacketBody,
        update: Option<UpdateView<'_>>,
    ) -> Result<MergedUpdate, EngineError> {
        const PIECE: usize = 1 << 16;
        let staging_error = |e: std::io::Error| EngineError::Staged(e.to_string());
        let staged = StagedUpdate::create(&self.store.staging_dir(), self.base.len())
            .map_err(staging_error)?;
        let mut values = decode_iter(body, &self.spec).map_err(hub_model_error)?;
        let (mut piece, mut at) = (Vec::with_capacity(PIECE), 0);
        for (n, b) in adopted_model(&self.origin, values.by_ref(), update).zip(&self.base) {
            piece.push(n - b);
            if piece.len() == PIECE {
                staged
                    .write_le(at, &kindred_distill::f32_le_bytes(&piece))
                    .map_err(staging_error)?;
                at += PIECE;
                piece.clear();
            }
        }
        staged
            .write_le(at, &kindred_distill::f32_le_bytes(&piece))
            .map_err(staging_error)?;
        if let Some(e) = values.error() {
            return Err(hub_model_error(e.clone()));
        }
        if at + piece.len() != self.base.len() {
            return Err(EngineError::Checkpoint(format!(
                "the hub's model has {} values, this one {}",
                at + piece.len(),
                self.base.len()
            )));
        }
        let values = decode_iter(body, &self.spec).map_err(hub_model_error)?;
        for (b, n) in self
            .base
            .iter_mut()
            .zip(adopted_model(&self.origin, values, update))
        {
            *b = n;
        }
        Ok(MergedUpdate::Staged(staged))
    }

    /// Held-out accuracy of the built-in model (`None` for an external trainer).
    ///
    /// # Errors
    /// [`EngineError::Model`] on a tensor failure.
    pub fn accuracy(&self) -> Result<Option<f32>, EngineError> {
        match &self.source {
            Source::Builtin(b) => Ok(Some(b.model.accuracy(&b.eval)?)),
            Source::External { .. } => Ok(None),
        }
    }

    /// Commit round `round`: parameters (or, for an external trainer, the sum of the merged
    /// updates applied) and distiller state as blobs, written from memory without copies, then
    /// one atomic round record; old packets and blobs are swept.
    ///
    /// # Errors
    /// [`EngineError::Store`] when writing fails; the previous round stays committed then.
    pub fn checkpoint(&mut self, round: u64) -> Result<(), EngineError> {
        // `base` is already the state after this round's merge: model parameters (built-in) or
        // the cumulative merged update (external).
        let id = self.spec.id();
        let params = kindred_distill::f32_le_bytes(&self.base);
        let checkpoint = self.store.put_blob_parts(&[PARAMS_MAGIC, &id.0, &params])?;
        let residuals = self
            .store
            .put_blob_parts(&self.distiller.encoded_state().parts())?;
        self.store.commit_round(RoundState {
            round,
            checkpoint,
            residuals,
        })?;
        self.last_round = Some(round);
        // Keep our packets of this and the previous round (peers may still fetch them).
        let keep_from = round.saturating_sub(1);
        self.store.sweep(|header| {
            kindred_proto::decode_header(header).is_ok_and(|h| h.header().round >= keep_from)
        })?;
        Ok(())
    }
}

/// A hub's model that cannot be adopted.
fn hub_model_error(e: kindred_distill::DecodeError) -> EngineError {
    EngineError::Checkpoint(format!("the hub's model: {e}"))
}

/// `origin + cumulative (+ update)` element by element: the model an adoption sets.
fn adopted_model<'a>(
    origin: &'a [f32],
    cumulative: impl Iterator<Item = f32> + 'a,
    update: Option<UpdateView<'a>>,
) -> impl Iterator<Item = f32> + 'a {
    let mut entries = update.into_iter().flat_map(|u| u.nonzero()).peekable();
    origin
        .iter()
        .zip(cumulative)
        .enumerate()
        .map(move |(i, (o, c))| {
            let mut n = o + c;
            if let Some((_, u)) = entries.next_if(|&(j, _)| j == i) {
                n += u;
            }
            n
        })
}

/// A per-peer seed component.
fn seed_of(peer: &PeerId) -> u64 {
    let h = blake3::hash(&peer.to_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or_default())
}

const PARAMS_MAGIC: &[u8; 8] = b"KDPARAM1";

/// Decode a checkpoint: magic, model id, little-endian f32 values (as [`Engine::checkpoint`]
/// writes them).
fn params_from_bytes(bytes: &[u8], spec: &ModelSpec) -> Result<Vec<f32>, EngineError> {
    let bad = |m: &str| EngineError::Checkpoint(m.to_string());
    let rest = bytes
        .strip_prefix(PARAMS_MAGIC.as_slice())
        .ok_or_else(|| bad("not a parameter checkpoint"))?;
    let rest = rest
        .strip_prefix(spec.id().0.as_slice())
        .ok_or_else(|| bad("checkpoint is of another model"))?;
    if rest.len() as u64 != spec.numel() * 4 {
        return Err(bad("checkpoint length does not match the model"));
    }
    Ok(rest
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory removed when dropped.
    struct Dir(std::path::PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// An engine with an external trainer (no data needed) in a fresh directory.
    fn external(name: &str) -> (Engine, Dir) {
        external_with(name, NodeConfig::default())
    }

    /// [`external`] with `config` otherwise.
    fn external_with(name: &str, mut config: NodeConfig) -> (Engine, Dir) {
        let dir = std::env::temp_dir().join(format!(
            "kindred-engine-{name}-{:016x}",
            rand::random::<u64>()
        ));
        let store = Store::open(&dir).unwrap_or_else(|e| panic!("{e}"));
        config.trainer.kind = TrainerKind::External;
        let engine = Engine::open(store, &config).unwrap_or_else(|e| panic!("{e}"));
        (engine, Dir(dir))
    }

    /// Push `update` (32 samples) and distill this round's packet.
    fn packet(engine: &mut Engine, round: u64, update: Vec<f32>) -> Outgoing {
        engine
            .push_external(ExternalUpdate {
                update: update.into(),
                samples: 32,
                loss: 1.0,
            })
            .unwrap_or_else(|e| panic!("{e}"));
        engine
            .make_packet(round, 0)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// One round on `update` with no peers: the merged update is the node's own.
    fn round(engine: &mut Engine, round: u64, update: Vec<f32>) -> MergeReport {
        let out = packet(engine, round, update);
        engine.merge(&out, &[]).unwrap_or_else(|e| panic!("{e}"))
    }

    /// An update staged on disk (what the API hands over) makes the packet the same update in
    /// memory makes: body, embedding and margins, round after round with the model moving.
    #[test]
    fn a_staged_update_makes_the_packet_the_same_update_in_memory_makes() {
        let (mut memory, _d1) = external("in-memory");
        let (mut staged, d2) = external("staged");
        let n = memory.spec().numel() as usize;
        for round in 0..3u64 {
            let update: Vec<f32> = (0..n)
                .map(|i| (i as f32 * 0.11 + round as f32).sin() * 1e-2)
                .collect();
            let file = StagedUpdate::create(&d2.0.join("staging"), n).unwrap();
            let le: Vec<u8> = update.iter().flat_map(|v| v.to_le_bytes()).collect();
            file.write_le(0, &le).unwrap();
            staged
                .push_external(ExternalUpdate {
                    update: UpdateValues::Staged(file),
                    samples: 32,
                    loss: 1.0,
                })
                .unwrap();
            let b = staged.make_packet(round, 0).unwrap();
            let a = packet(&mut memory, round, update);
            assert_eq!(a.packet.body_bytes, b.packet.body_bytes, "round {round}");
            assert_eq!(
                (&a.sent, &a.margins),
                (&b.sent, &b.margins),
                "round {round}"
            );
            let embedding = |o: &Outgoing| {
                let h = kindred_proto::decode_header(&o.packet.header_bytes).unwrap();
                h.header().embedding.clone()
            };
            assert_eq!(embedding(&a), embedding(&b), "round {round}");
            assert!(b.full.is_empty(), "the hub exchange keeps no full update");
            for e in [&mut memory, &mut staged] {
                e.apply(None, Some(a.sent.view())).unwrap();
            }
        }
        let left = std::fs::read_dir(d2.0.join("staging")).unwrap().count();
        assert_eq!(left, 0, "each staged update's file is gone once distilled");
    }

    /// `density` sets how many entries a packet's top-k layers keep (the small dense layers
    /// are the same either way).
    #[test]
    fn the_configured_density_sets_the_share_a_packet_keeps() {
        let (mut dense, _d1) = external("default-density");
        let sparse_config = NodeConfig {
            density: 0.01,
            ..NodeConfig::default()
        };
        let (mut sparse, _d2) = external_with("sparse", sparse_config);
        let n = dense.spec().numel() as usize;
        let update: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e-2).collect();
        let a = packet(&mut dense, 0, update.clone());
        let b = packet(&mut sparse, 0, update);
        let kept = |o: &Outgoing| o.sent.view().nonzero().count() as f64;
        // Entries of the top-k layers (the others go dense at any density).
        let topk: f64 = (dense.spec().layers().iter())
            .filter(|l| !Policy::hub().is_small(l))
            .map(|l| l.numel() as f64)
            .sum();
        let extra = kept(&a) - kept(&b);
        let expected = topk * f64::from(Policy::HUB_DENSITY - 0.01);
        assert!(
            (extra - expected).abs() < 0.05 * expected,
            "{extra} vs {expected}"
        );
        assert!(b.packet.body_bytes.len() * 2 < a.packet.body_bytes.len());
    }

    #[test]
    fn an_external_apply_changes_the_model_as_the_dense_arithmetic_does_and_returns_the_change() {
        let (mut e, _d) = external("apply");
        let n = e.spec().numel() as usize;
        let wave = |phase: f32| -> Vec<f32> {
            (0..n)
                .map(|i| (i as f32 * 0.37 + phase).sin() * 1e-2)
                .collect()
        };
        // A sparse merge: every 40th entry.
        let merge: Vec<f32> = wave(0.0)
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 40 == 0 { v } else { 0.0 })
            .collect();
        let before = e.base.clone();
        let delta = e.apply(None, Some(merge.as_slice().into())).unwrap();
        assert!(matches!(&delta, MergedUpdate::Kept(u) if u.is_sparse()));
        let expected: Vec<f32> = before.iter().zip(&merge).map(|(b, u)| b + u).collect();
        assert_eq!(e.base, expected);
        let change: Vec<f32> = expected.iter().zip(&before).map(|(a, b)| a - b).collect();
        assert_eq!(delta.to_dense().unwrap(), change);
        // Adopting a hub's model (its cumulative update, as a body of f32 layers) and applying
        // a merge on top of it, the merge dense, then kept as its nonzero entries.
        let cumulative = wave(1.0);
        let mut rest = cumulative.as_slice();
        let layers = e.spec().layers().iter().map(|l| {
            let (layer, tail) = rest.split_at(l.numel() as usize);
            rest = tail;
            kindred_proto::LayerPayload::Dense(kindred_proto::DenseValues::F32(layer.to_vec()))
        });
        let hub_model = PacketBody {
            layers: layers.collect(),
        };
        // One that does not fit the model changes nothing.
        let (base, short) = (e.base.clone(), PacketBody::default());
        assert!(matches!(
            e.apply(Some(&short), Some(merge.as_slice().into())),
            Err(EngineError::Checkpoint(_))
        ));
        assert_eq!(e.base, base);
        let dense_merge = wave(2.0);
        let sparse_merge: Vec<f32> = dense_merge
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 7 == 3 { v } else { 0.0 })
            .collect();
        for merge in [Update::Dense(dense_merge), Update::from_dense(sparse_merge)] {
            let before = e.base.clone();
            let delta = e.apply(Some(&hub_model), Some(merge.view())).unwrap();
            // Every parameter changed: in a staging file, removed with the change.
            assert!(matches!(delta, MergedUpdate::Staged(_)));
            let expected: Vec<f32> = e
                .origin
                .iter()
                .zip(&cumulative)
                .zip(merge.to_dense())
                .map(|((o, c), u)| (o + c) + u)
                .collect();
            assert_eq!(e.base, expected);
            let change: Vec<f32> = expected.iter().zip(&before).map(|(a, b)| a - b).collect();
            assert_eq!(delta.to_dense().unwrap(), change);
            drop(delta);
            let staging = e.store.staging_dir();
            assert_eq!(std::fs::read_dir(staging).unwrap().count(), 0);
        }
    }

    #[test]
    fn a_pull_moves_halfway_to_a_partners_snapshot_and_joins_the_merged_update() {
        let ((mut a, _da), (mut b, _db)) = (external("a"), external("b"));
        let n = a.spec().numel() as usize;
        let wave = |scale: f32| -> Vec<f32> {
            (0..n)
                .map(|i| scale * (i as f32 * 0.37).sin() * 1e-2)
                .collect()
        };
        let merged_a = round(&mut a, 3, wave(1.0)).merged;
        let mut report = round(&mut b, 3, wave(0.6));

        let sealed = a.seal_snapshot(3, 0).unwrap_or_else(|e| panic!("{e}"));
        // A snapshot is not a packet: it verifies only as a snapshot, and as `a`'s.
        assert!(kindred_proto::decode_header(&sealed.header_bytes).is_err());
        let snapshot =
            OutcomePacket::decode_snapshot(&sealed.header_bytes, &sealed.body_bytes, a.spec())
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(snapshot.header.header().sender, a.peer_id());

        let own = report.merged.clone();
        let done = b
            .pull_toward(&snapshot, &mut report, &PullConfig::default())
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!done.clipped);
        // b's model is now halfway between the two, up to int8 rounding of a's snapshot (half a
        // step of at most max |a| / 127, halved again by the pull), and the step is part of what
        // b's trainer applies this round.
        let step = merged_a.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
        for ((m, o), a) in report.merged.iter().zip(&own).zip(&merged_a) {
            let want = 0.5 * (o + a);
            assert!((m - want).abs() <= 0.25 * step + 1e-6, "{m} vs {want}");
        }
        let ratio = done.step_norm
            / own
                .iter()
                .map(|&x| f64::from(x).powi(2))
                .sum::<f64>()
                .sqrt();
        assert!((ratio - 1.0 / 3.0).abs() < 0.01, "{ratio}");

        // A snapshot of another model is refused, and changes nothing.
        let mut wrong = snapshot.clone();
        wrong.body.layers.pop();
        let before = report.merged.clone();
        assert!(
            b.pull_toward(&wrong, &mut report, &PullConfig::default())
                .is_err()
        );
        assert_eq!(report.merged, before);
    }

    #[test]
    fn a_distant_snapshot_is_clipped_to_twice_the_merged_update() {
        let ((mut a, _da), (mut b, _db)) = (external("far-a"), external("far-b"));
        let n = a.spec().numel() as usize;
        round(&mut a, 1, vec![0.5; n]);
        let mut report = round(&mut b, 1, vec![1e-3; n]);
        let sealed = a.seal_snapshot(1, 0).unwrap_or_else(|e| panic!("{e}"));
        let snapshot =
            OutcomePacket::decode_snapshot(&sealed.header_bytes, &sealed.body_bytes, a.spec())
                .unwrap_or_else(|e| panic!("{e}"));
        let reference = report.merged_norm();
        let done = b
            .pull_toward(&snapshot, &mut report, &PullConfig::default())
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(done.clipped);
        assert!((done.step_norm - 2.0 * reference).abs() < 1e-3 * reference);
    }

    #[test]
    fn partners_come_best_agreement_first_and_the_snapshot_is_from_the_better_half() {
        let mut engines: Vec<(Engine, Dir)> = ["own", "near", "far", "away"]
            .iter()
            .map(|name| external(&format!("agree-{name}")))
            .collect();
        let n = engines[0].0.spec().numel() as usize;
        let wave = |f: f32, i: usize| (i as f32 * f).sin() * 1e-2;
        // The own update, the same plus a little or a lot of another wave, and its opposite.
        let updates: Vec<Vec<f32>> = [(1.0, 0.3), (1.0, 1.5), (-1.0, 0.0)]
            .iter()
            .map(|&(own, other)| {
                (0..n)
                    .map(|i| own * wave(0.37, i) + other * wave(1.91, i))
                    .collect()
            })
            .collect();
        let mut peers = Vec::new();
        for ((engine, _), update) in engines.iter_mut().skip(1).zip(updates) {
            let out = packet(engine, 2, update);
            let packet = OutcomePacket::decode(
                &out.packet.header_bytes,
                &out.packet.body_bytes,
                engine.spec(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            peers.push(PeerPacket {
                sender: engine.peer_id(),
                id: packet.id(),
                samples: 32,
                body: packet.body,
            });
        }
        let ids: Vec<PeerId> = peers.iter().map(|p| p.sender).collect();
        // Handed over worst first: "far", "away", "near".
        let order = [1, 2, 0];
        let handed: Vec<PeerPacket> = order.iter().map(|&k| peers[k].clone()).collect();
        let own = &mut engines[0].0;
        let out = packet(own, 2, (0..n).map(|i| wave(0.37, i)).collect());
        let report = own.merge(&out, &handed).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(report.partners, vec![ids[0], ids[1]]);
        assert_eq!(report.rejected, vec![(ids[2], "cosine")]);
        for round in 0..16 {
            assert_eq!(own.snapshot_partners(round, &report.partners), vec![ids[0]]);
        }
    }
}
