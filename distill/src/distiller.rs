//! The per-node distillation state machine: residuals in, packet body + embedding out.
//!
//! [`Distiller::distill`] is one round:
//!
//! 1. embed the update: one read of it (per-layer count-sketches, then SimHash), which also
//!    rejects a wrong length or a NaN before any state changes;
//! 2. per layer, one fused pass over memory: `residual += update` with the statistics of the
//!    result and the top-k candidates above a threshold sampled just before (see
//!    `kindred_kernels::Kernels::accumulate_fused`);
//! 3. the [`Policy`] plans each layer from those statistics and the round;
//! 4. each layer is encoded from its residual (dense f16, top-k + int8, or sign), and what was
//!    *not* delivered exactly, including rounding and quantisation error, stays in the residual
//!    (error feedback): `sent + new residual = update + old residual` up to the residual's
//!    rounding;
//! 5. the round counter advances.
//!
//! The residual is held in bf16: only its large entries are ever sent, and they are sent from
//! the f32 sums of the fused pass (the candidates' values), so 8 bits of mantissa cost nothing
//! measurable (BENCHMARKS.md) and halve what a node holds for error feedback (a hub holds two).
//! The kernels widen it a cache-sized chunk at a time, and a top-k layer's encoding writes only
//! the entries it sends. A layer without a sampled top-k threshold (a small layer, or any under
//! a byte budget) goes through the pass in f32 and is rounded once encoded; a large layer that
//! the policy plans dense or sign after all is encoded from its sum as rounded to bf16.
//!
//! It is sans-IO: no clock, no network, no files. The node persists [`Distiller::state`] and the
//! simulator runs thousands of distillers with one shared [`Embedder`].

use std::sync::Arc;

use half::{bf16, f16};
use kindred_kernels::{
    AccumulateError, Backend, Candidates, Kernels, Rounding, SIMHASH_BITS, Stats, narrow_bf16, rng,
    widen_bf16,
};
use kindred_proto::{
    DenseValues, Embedding, LayerPayload, ModelSpec, PacketBody, PayloadKind, SignBits, TopK,
    TopK4, encoded_layer_len,
};

use crate::embed::{Embedded, Embedder, EmbeddingConfig};
use crate::error::{ConfigError, DistillError, EmbedError};
use crate::layout::Layout;
use crate::policy::{LayerPlan, Policy, TopKValues, k_for};
use crate::source::LayerSource;

/// Largest finite f16: dense f16 payloads clamp to it and error feedback keeps the excess.
const F16_MAX: f32 = 65504.0;

/// What one layer became this round.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerReport {
    /// The layer's name in the spec.
    pub name: String,
    /// The encoding used.
    pub kind: PayloadKind,
    /// Elements of the layer.
    pub numel: u64,
    /// Values carried (dense: all; top-k: entries sent; sign: all, at one bit).
    pub carried: u64,
    /// `carried / numel`.
    pub density: f32,
    /// Encoded bytes of this layer's payload.
    pub bytes: usize,
    /// Statistics of `update + residual` that the policy decided on.
    pub stats: Stats,
}

/// What a round of distillation produced, for logs, metrics and benchmarks.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The round this body belongs to (the distiller's counter before it advanced).
    pub round: u64,
    /// Whether the policy was still in warm-up.
    pub warmup: bool,
    /// One entry per layer, in model order.
    pub layers: Vec<LayerReport>,
    /// Encoded bytes of the whole body (exactly what `kindred_proto::encode_body` produces).
    pub body_bytes: usize,
    /// Bytes of the update in f32.
    pub f32_bytes: u64,
    /// `f32_bytes / body_bytes`.
    pub ratio: f32,
    /// Layers whose residual overflowed f32 and was reset to zero this round (normally 0).
    pub residual_resets: usize,
}

/// The result of [`Distiller::distill`].
#[derive(Debug, Clone, PartialEq)]
#[must_use = "the residuals already account for what this body sends"]
pub struct Distilled {
    /// The packet body, ready for `kindred_proto::seal`.
    pub body: PacketBody,
    /// The update's embedding, for the packet header.
    pub embedding: Embedding,
    /// Margin of each SimHash bit, for routing's multi-probe order.
    pub margins: [f32; SIMHASH_BITS],
    /// What was sent, layer by layer.
    pub report: Report,
}

/// Per-node distillation state: residuals, the round counter and the embedding's running mean.
///
/// ```
/// use kindred_distill::{decode, Distiller, EmbeddingConfig, Policy};
/// use kindred_proto::{DType, LayerSpec, ModelSpec};
/// let spec = ModelSpec::new(vec![
///     LayerSpec::new("w", [100, 100], DType::F32),
///     LayerSpec::new("b", [100], DType::F32),
/// ])?;
/// let mut distiller = Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default())?;
/// let update: Vec<f32> = (0..10_100).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
/// let out = distiller.distill(&update)?;
/// let sent = decode(&out.body, &spec)?;
/// // Error feedback: what was not sent waits in the residual (held in bf16: 8 bits of mantissa).
/// for ((s, r), u) in sent.iter().zip(distiller.residual()).zip(&update) {
///     assert!((s + r - u).abs() <= 1e-6 + r.abs() / 256.0);
/// }
/// assert!(out.report.ratio > 4.0); // round 0 is warm-up at 25% density
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Distiller {
    pub(crate) spec: ModelSpec,
    pub(crate) layout: Layout,
    pub(crate) policy: Policy,
    pub(crate) embedder: Arc<Embedder>,
    pub(crate) backend: Backend,
    /// The error-feedback residual, flat in model order, in bf16 (module documentation).
    pub(crate) residual: Vec<bf16>,
    /// Running mean of accepted peer updates; empty until the first one.
    pub(crate) mean: Vec<f32>,
    pub(crate) mean_count: u64,
    pub(crate) round: u64,
}

impl Distiller {
    /// A fresh distiller (zero residuals, round 0, no running mean).
    ///
    /// # Errors
    /// [`ConfigError`] when the policy or embedding configuration is out of range.
    pub fn new(
        spec: ModelSpec,
        policy: Policy,
        embedding: EmbeddingConfig,
    ) -> Result<Self, ConfigError> {
        Self::with_embedder(spec, policy, Arc::new(Embedder::new(embedding)?))
    }

    /// A fresh distiller sharing an existing [`Embedder`] (its SimHash matrix is drawn once).
    ///
    /// # Errors
    /// [`ConfigError`] when the policy is out of range.
    pub fn with_embedder(
        spec: ModelSpec,
        policy: Policy,
        embedder: Arc<Embedder>,
    ) -> Result<Self, ConfigError> {
        policy.validate()?;
        let layout = Layout::new(&spec);
        Ok(Self {
            residual: zeroed_residual(layout.len()),
            spec,
            layout,
            policy,
            embedder,
            backend: Backend::cpu(),
            mean: Vec::new(),
            mean_count: 0,
            round: 0,
        })
    }

    /// Use another kernel backend for distillation and for the embedding (results are identical
    /// on every backend). The embedder is copied (its hyperplanes included) when it is shared.
    pub fn with_backend(mut self, backend: Backend) -> Self {
        let embedder = Arc::unwrap_or_clone(self.embedder).with_backend(backend.clone());
        self.embedder = Arc::new(embedder);
        self.backend = backend;
        self
    }

    /// The model spec.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Where each layer sits in a flat update.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The shared embedder.
    pub fn embedder(&self) -> &Arc<Embedder> {
        &self.embedder
    }

    /// The next round to be distilled.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// The error-feedback residual: everything computed but not yet sent, flat in model order,
    /// widened to f32 (a copy: the distiller holds it in bf16).
    pub fn residual(&self) -> Vec<f32> {
        let mut wide = vec![0.0; self.residual.len()];
        widen_bf16(&self.residual, &mut wide);
        wide
    }

    /// L2 norm of the residual (without widening a copy of it).
    pub fn residual_norm(&self) -> f64 {
        self.residual
            .iter()
            .map(|r| f64::from(r.to_f32()).powi(2))
            .sum::<f64>()
            .sqrt()
    }

    /// The running mean of accepted peer updates, once one has been accepted.
    pub fn running_mean(&self) -> Option<&[f32]> {
        (self.mean_count > 0).then_some(self.mean.as_slice())
    }

    /// Peer updates folded into the running mean so far.
    pub fn accepted_peers(&self) -> u64 {
        self.mean_count
    }

    /// Drop the residual (e.g. after the model was replaced by a checkpoint, or when a hub's
    /// merge distiller stops serving a cohort). Its memory goes back to the allocator: a fresh
    /// zeroed vector, whose pages a large model's allocation leaves unmapped until written.
    ///
    /// ```
    /// use kindred_distill::{Distiller, EmbeddingConfig, Policy};
    /// use kindred_proto::{DType, LayerSpec, ModelSpec};
    ///
    /// let spec = ModelSpec::new(vec![LayerSpec::new("w", [100, 100], DType::F32)])?;
    /// let mut d = Distiller::new(spec, Policy::default(), EmbeddingConfig::default())?;
    /// let update: Vec<f32> = (0..10_000).map(|i| (i % 97) as f32 * 1e-3).collect();
    /// d.distill(&update)?;
    /// assert!(d.residual().iter().any(|&r| r != 0.0));
    /// d.reset_residual();
    /// assert!(d.residual().iter().all(|&r| r == 0.0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reset_residual(&mut self) {
        let len = self.residual.len();
        // Freed before the new one is allocated: never two residuals at once.
        self.residual = Vec::new();
        self.residual = zeroed_residual(len);
    }

    /// The embedding `update` would get now, without changing any state.
    ///
    /// # Errors
    /// [`EmbedError`] on a length mismatch or a non-finite value.
    pub fn embed(&self, update: &[f32]) -> Result<Embedded, EmbedError> {
        self.embedder
            .embed(&self.layout, update, self.running_mean())
    }

    /// The embedding the weighted sum `Σ coefficient · vector` would get now, formed a layer at
    /// a time ([`Embedder::embed_sum`]), without changing any state.
    ///
    /// # Errors
    /// [`EmbedError`] on a length mismatch or a non-finite value.
    pub fn embed_sum(&self, terms: &[(&[f32], f32)]) -> Result<Embedded, EmbedError> {
        self.embedder
            .embed_sum(&self.layout, terms, self.running_mean())
    }

    /// The embedding an update read a layer at a time would get now ([`Embedder::embed_layers`]),
    /// without changing any state.
    ///
    /// # Errors
    /// [`EmbedError`] on a layer of the wrong length or a non-finite value.
    pub fn embed_from(&self, update: &mut impl LayerSource) -> Result<Embedded, EmbedError> {
        self.embedder
            .embed_layers(&self.layout, update, self.running_mean())
    }

    /// Fold an accepted peer update (decoded, dense) into the running mean that centres
    /// embeddings. This never touches the residuals: merged or peer updates must not feed back into
    /// error feedback.
    ///
    /// # Errors
    /// [`EmbedError`] on a length mismatch or a non-finite value (then nothing changes).
    pub fn accept_peer(&mut self, update: &[f32]) -> Result<(), EmbedError> {
        let expected = self.layout.len();
        if update.len() != expected {
            return Err(EmbedError::Length {
                expected,
                found: update.len(),
            });
        }
        if let Some((index, value)) = self.backend.find_non_finite(update) {
            let (layer, index) = self.locate(index);
            return Err(EmbedError::NonFinite {
                layer,
                index,
                value,
            });
        }
        if self.mean.len() != expected {
            self.mean = vec![0.0; expected];
        }
        self.mean_count = self.mean_count.saturating_add(1);
        let decay = self.embedder.config().mean_decay;
        let alpha = (1.0 / self.mean_count as f32).max(1.0 - decay);
        for (m, &p) in self.mean.iter_mut().zip(update) {
            *m += alpha * (p - *m);
        }
        Ok(())
    }

    /// Distill one update: see the module documentation for the steps.
    ///
    /// # Errors
    /// [`DistillError::Update`] for a wrong length or a non-finite value, detected before any
    /// state changes.
    pub fn distill(&mut self, update: &[f32]) -> Result<Distilled, DistillError> {
        let expected = self.layout.len();
        if update.len() != expected {
            return Err(EmbedError::Length {
                expected,
                found: update.len(),
            }
            .into());
        }
        let mut layers = update;
        self.distill_from(&mut layers)
    }

    /// [`Distiller::distill`] of an update read a layer at a time ([`LayerSource`]), each layer
    /// twice (the validating embedding pass, then the fused pass): a hub distills its merge
    /// this way, formed a layer at a time and never whole.
    ///
    /// ```
    /// use kindred_distill::{Distiller, EmbeddingConfig, Filled, Policy};
    /// use kindred_proto::{DType, LayerSpec, ModelSpec};
    ///
    /// let spec = ModelSpec::new(vec![LayerSpec::new("w", [100, 100], DType::F32)])?;
    /// let new = || Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default());
    /// let (mut whole, mut layered) = (new()?, new()?);
    /// let update: Vec<f32> = (0..10_000).map(|i| ((i * 7919) % 1000) as f32 * 1e-3).collect();
    /// let mut source = Filled::new(|start: usize, out: &mut [f32]| {
    ///     out.copy_from_slice(&update[start..start + out.len()])
    /// });
    /// assert_eq!(layered.distill_from(&mut source)?.body, whole.distill(&update)?.body);
    /// assert_eq!(layered.residual(), whole.residual());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`Distiller::distill`]: a layer of the wrong length or a non-finite value is refused
    /// before any state changes.
    pub fn distill_from(
        &mut self,
        update: &mut impl LayerSource,
    ) -> Result<Distilled, DistillError> {
        // The embedding pass reads the whole update first (a count-sketch per layer, compute-bound
        // at about memory speed) and rejects a NaN or infinity before any residual is touched:
        // it is the validation pass, so the fused pass below need not check again.
        let embedded = self
            .embedder
            .embed_layers(&self.layout, update, self.running_mean())?;
        self.distill_layers(update, embedded)
    }

    /// [`Distiller::distill_from`] of an update its caller has already checked to be finite
    /// (the node's API checks every value of an upload as it arrives): no validating embedding
    /// pass, so each layer is read once. The result carries no embedding of the update (an empty
    /// [`Distilled::embedding`], zero margins): a node keys on its cumulative update instead.
    ///
    /// # Errors
    /// A layer of the wrong length, or a non-finite value the caller let through
    /// ([`DistillError::Accumulate`]): both found layer by layer, after the layers before took
    /// their update (nothing is planned or sent).
    pub fn distill_checked_from(
        &mut self,
        update: &mut impl LayerSource,
    ) -> Result<Distilled, DistillError> {
        let none = Embedded {
            embedding: Embedding::default(),
            margins: [0.0; SIMHASH_BITS],
        };
        self.distill_layers(update, none)
    }

    /// The fused pass, the plan and the encoding of every layer (steps 2-5 of the module
    /// documentation) of an update whose embedding pass is done.
    fn distill_layers(
        &mut self,
        update: &mut impl LayerSource,
        embedded: Embedded,
    ) -> Result<Distilled, DistillError> {
        let round = self.round;
        let layer_count = self.layout.layers();
        let mut stats = Vec::with_capacity(layer_count);
        let mut passes: Vec<Accumulated> = Vec::with_capacity(layer_count);
        let mut resets = 0;
        let ranges: Vec<_> = self.layout.ranges().collect();
        for (layer, range) in ranges.iter().enumerate() {
            let fused_k = self.fused_k(layer, round);
            let seed = self.sample_seed(round, layer);
            let u = update.layer(range.clone());
            let r = self.residual.get_mut(range.clone()).unwrap_or_default();
            if u.len() != r.len() {
                // A source that read differently the second time; nothing is planned yet, but
                // the layers before this one took their update.
                return Err(EmbedError::Length {
                    expected: self.layout.len(),
                    found: range.start + u.len(),
                }
                .into());
            }
            // A layer with a sampled threshold (a large top-k layer) accumulates in place, in
            // bf16; any other keeps `update + residual` in f32 until it is encoded.
            let threshold = fused_k.and_then(|k| self.backend.sample_threshold_bf16(r, u, k, seed));
            let fused = match threshold {
                Some(t) => self
                    .backend
                    .accumulate_fused_bf16(r, u, Some(t))
                    .map(|f| (f.stats, Accumulated::InPlace(f.candidates))),
                None => {
                    let mut wide = vec![0.0; r.len()];
                    widen_bf16(r, &mut wide);
                    let fused = self.backend.accumulate_fused(&mut wide, u, None, None);
                    fused.map(|f| (f.stats, Accumulated::Wide(wide)))
                }
            };
            match fused {
                Ok((s, pass)) => {
                    stats.push(s);
                    passes.push(pass);
                }
                Err(AccumulateError::Overflow { .. }) => {
                    // The update is finite, so a residual grown past f32 overflowed: the only
                    // sane recovery is to restart this layer's error feedback from the update.
                    tracing::warn!(
                        layer,
                        "residual overflowed f32; resetting it to this update"
                    );
                    resets += 1;
                    stats.push(self.backend.stats(u).unwrap_or_default());
                    passes.push(Accumulated::Wide(u.to_vec()));
                }
                Err(source) => return Err(DistillError::Accumulate { layer, source }),
            }
        }
        // A layer widened whole to be encoded; freed with the round.
        let mut wide = Vec::new();
        let plans = self.policy.plan(self.spec.layers(), &stats, round);
        let mut layers = Vec::with_capacity(plans.len());
        let mut reports = Vec::with_capacity(plans.len());
        for (layer, (((plan, range), s), pass)) in
            plans.iter().zip(ranges).zip(&stats).zip(passes).enumerate()
        {
            let payload = self.encode_layer(layer, *plan, range, round, pass, &mut wide)?;
            let numel = payload.numel();
            let carried = payload.carried();
            reports.push(LayerReport {
                name: self
                    .spec
                    .layers()
                    .get(layer)
                    .map(|l| l.name().to_owned())
                    .unwrap_or_default(),
                kind: payload.kind(),
                numel,
                carried,
                density: if numel > 0 {
                    (carried as f64 / numel as f64) as f32
                } else {
                    0.0
                },
                bytes: encoded_layer_len(&payload),
                stats: *s,
            });
            layers.push(payload);
        }
        let body_bytes = varint_len(layers.len()) + reports.iter().map(|r| r.bytes).sum::<usize>();
        let f32_bytes = self.spec.f32_bytes();
        let report = Report {
            round,
            warmup: self.policy.in_warmup(round),
            layers: reports,
            body_bytes,
            f32_bytes,
            ratio: (f32_bytes as f64 / body_bytes.max(1) as f64) as f32,
            residual_resets: resets,
        };
        tracing::debug!(round, body_bytes, ratio = report.ratio, "distilled update");
        self.round = round.saturating_add(1);
        let Embedded { embedding, margins } = embedded;
        Ok(Distilled {
            body: PacketBody { layers },
            embedding,
            margins,
            report,
        })
    }

    /// The top-k size to collect candidates for during the fused pass, when the layer will
    /// probably be top-k and the sampled path is on (in byte-budget mode `k` is only known after
    /// every layer's statistics, so selection runs as its own pass).
    fn fused_k(&self, layer: usize, round: u64) -> Option<usize> {
        if !self.policy.sampled_topk || self.policy.byte_budget.is_some() {
            return None;
        }
        let spec = self.spec.layers().get(layer)?;
        let density = self.policy.density_at(round);
        if self.policy.is_small(spec) || density >= 1.0 {
            return None;
        }
        let len = self.layout.range(layer)?.len();
        Some(k_for(len, density))
    }

    fn sample_seed(&self, round: u64, layer: usize) -> u64 {
        rng::hash_index(self.policy.seed ^ round, layer as u64)
    }

    /// (layer, position in layer) of a flat index.
    fn locate(&self, index: usize) -> (usize, usize) {
        let offsets = self.layout.offsets();
        let layer = offsets.partition_point(|&o| o <= index).saturating_sub(1);
        (layer, index - offsets.get(layer).copied().unwrap_or(0))
    }

    /// Encode one layer from its residual and leave the unsent remainder in it. A top-k layer
    /// with its fused pass's candidates touches only the entries it sends; a layer kept in f32
    /// is encoded from it and rounded; any other is widened into `wide`, encoded, and rounded
    /// back (a large layer planned dense or sign after all, or a sample that under-shot).
    fn encode_layer(
        &mut self,
        layer: usize,
        plan: LayerPlan,
        range: std::ops::Range<usize>,
        round: u64,
        pass: Accumulated,
        wide: &mut Vec<f32>,
    ) -> Result<LayerPayload, DistillError> {
        let candidates = match (plan, pass) {
            (_, Accumulated::Wide(mut exact)) => {
                let payload = self.encode_wide(layer, plan, round, None, &mut exact);
                narrow_bf16(&exact, self.residual.get_mut(range).unwrap_or_default());
                return payload;
            }
            (LayerPlan::TopK { k }, Accumulated::InPlace(c)) if c.len() >= k => {
                let stored = self.residual.get(range.clone()).unwrap_or_default();
                let sel = self
                    .backend
                    .topk_candidates_bf16(stored, c, k)
                    .map_err(|source| DistillError::TopK { layer, source })?;
                let (backend, residual) = (&self.backend, &mut self.residual);
                let stored = residual.get_mut(range).unwrap_or_default();
                let len = stored.len();
                let values = self.policy.topk_values;
                let payload = quantize_topk(backend, layer, len, sel, values, |i, v| {
                    if let Some(slot) = stored.get_mut(i) {
                        *slot = bf16::from_f32(v);
                    }
                })?;
                if !self.policy.error_feedback {
                    stored.fill(bf16::ZERO);
                }
                return Ok(payload);
            }
            (_, Accumulated::InPlace(c)) => Some(c),
        };
        let stored = self.residual.get(range.clone()).unwrap_or_default();
        wide.resize(stored.len(), 0.0);
        widen_bf16(stored, wide);
        let payload = self.encode_wide(layer, plan, round, candidates, wide);
        narrow_bf16(wide, self.residual.get_mut(range).unwrap_or_default());
        payload
    }

    /// Encode one layer from `r`, its residual in f32, leaving the unsent remainder in it.
    fn encode_wide(
        &self,
        layer: usize,
        plan: LayerPlan,
        round: u64,
        candidates: Option<Candidates>,
        r: &mut [f32],
    ) -> Result<LayerPayload, DistillError> {
        let ef = self.policy.error_feedback;
        let seed = self.sample_seed(round, layer);
        // Layers are < 2^32 elements (validated spec), so lengths fit u32.
        let len = r.len() as u32;
        let payload = match plan {
            LayerPlan::DenseF16 => {
                let mut values = Vec::with_capacity(r.len());
                for v in r.iter_mut() {
                    let h = f16::from_f32(v.clamp(-F16_MAX, F16_MAX));
                    values.push(h);
                    *v -= h.to_f32();
                }
                LayerPayload::Dense(DenseValues::F16(values))
            }
            LayerPlan::TopK { k } => {
                let backend = &self.backend;
                let sel = match candidates {
                    // The loop below writes every selected entry.
                    Some(c) => backend.topk_candidates(r, c, k),
                    None if self.policy.sampled_topk => backend.topk_sampled(r, k, seed),
                    None => backend.topk_exact(r, k),
                }
                .map_err(|source| DistillError::TopK { layer, source })?;
                // Put back what quantisation lost (the selection may have zeroed the entry).
                quantize_topk(
                    backend,
                    layer,
                    r.len(),
                    sel,
                    self.policy.topk_values,
                    |i, v| {
                        if let Some(slot) = r.get_mut(i) {
                            *slot = v;
                        }
                    },
                )?
            }
            LayerPlan::Sign => {
                let mut words = vec![0u64; r.len().div_ceil(64)];
                let scale = self
                    .backend
                    .sign_pack(r, &mut words)
                    .map_err(|source| DistillError::Sign { layer, source })?;
                for v in r.iter_mut() {
                    *v -= scale.copysign(*v);
                }
                LayerPayload::Sign(SignBits { len, words, scale })
            }
        };
        if !ef {
            r.fill(0.0);
        }
        Ok(payload)
    }
}

/// Where a layer's `update + residual` is after the fused pass.
enum Accumulated {
    /// In the bf16 residual, with the candidates above the sampled threshold (in f32).
    InPlace(Candidates),
    /// In f32, to be encoded from and then rounded into the residual.
    Wide(Vec<f32>),
}

/// A zero residual of `len` entries, its pages left unmapped until written (as `vec![0.0; n]`
/// does for f32).
fn zeroed_residual(len: usize) -> Vec<bf16> {
    bytemuck::zeroed_vec(len)
}

/// The top-k payload of a selection, its values quantised as `values` says; `put_back(i, v)`
/// receives what each selected entry leaves in the residual (what quantisation lost; all of it
/// for an entry that quantises to 0).
fn quantize_topk(
    backend: &Backend,
    layer: usize,
    len: usize,
    sel: kindred_kernels::Selection,
    values: TopKValues,
    mut put_back: impl FnMut(usize, f32),
) -> Result<LayerPayload, DistillError> {
    if values == TopKValues::Log4 {
        return Ok(LayerPayload::TopK4(quantize_log4(len, &sel, put_back)));
    }
    let mut q = vec![0i8; sel.values.len()];
    let scale = backend
        .quantize_i8(&sel.values, Rounding::Nearest, &mut q)
        .map_err(|source| DistillError::Quantize { layer, source })?;
    let mut indices = Vec::with_capacity(q.len());
    let mut values = Vec::with_capacity(q.len());
    for ((&i, &v), &qi) in sel.indices.iter().zip(&sel.values).zip(&q) {
        put_back(i as usize, v - f32::from(qi) * scale);
        // An entry that quantises to 0 carries nothing: keep it all in the residual.
        if qi != 0 {
            indices.push(i);
            values.push(qi);
        }
    }
    let payload = LayerPayload::TopK(TopK {
        // Layers are < 2^32 elements (validated spec), so lengths fit u32.
        len: len as u32,
        indices,
        values,
        scale,
    });
    Ok(payload)
}

/// The 4-bit payload of a selection ([`TopK4`]): eight log-spaced magnitudes from the smallest
/// non-zero selected magnitude to the largest, each value rounded to the nearest of them (by
/// comparison with the seven midpoints, no logarithm per entry). A zero entry carries nothing.
fn quantize_log4(
    len: usize,
    sel: &kindred_kernels::Selection,
    mut put_back: impl FnMut(usize, f32),
) -> TopK4 {
    let (mut smallest, mut largest) = (f32::INFINITY, 0f32);
    for &v in &sel.values {
        let m = v.abs();
        if m > 0.0 {
            smallest = smallest.min(m);
            largest = largest.max(m);
        }
    }
    // Layers are < 2^32 elements (validated spec), so lengths fit u32.
    let len = len as u32;
    if !(largest > 0.0 && largest.is_finite()) {
        for (&i, &v) in sel.indices.iter().zip(&sel.values) {
            put_back(i as usize, v);
        }
        let (indices, codes) = (Vec::new(), Vec::new());
        return TopK4 {
            len,
            indices,
            codes,
            scale: 0.0,
            ratio: 1.0,
        };
    }
    let ratio = (smallest / largest)
        .powf(1.0 / 7.0)
        .clamp(f32::MIN_POSITIVE, 1.0);
    let levels = TopK4::levels(largest, ratio);
    let mut midpoints = [0f32; 7];
    for (j, m) in midpoints.iter_mut().enumerate() {
        *m = 0.5
            * (levels.get(j).copied().unwrap_or(0.0) + levels.get(j + 1).copied().unwrap_or(0.0));
    }
    // Each value's code in one pass without branches (it vectorises): the nearest level is the
    // number of midpoints below the magnitude.
    let unpacked: Vec<u8> = (sel.values.iter())
        .map(|&v| {
            let a = v.abs();
            let level = midpoints.iter().map(|&m| u8::from(m < a)).sum::<u8>();
            level | (u8::from(v < 0.0) << 3)
        })
        .collect();
    let mut values = [0f32; 16];
    for (code, slot) in (0u8..).zip(values.iter_mut()) {
        *slot = TopK4::decode_code(code, &levels);
    }
    let mut indices = Vec::with_capacity(sel.indices.len());
    let mut kept = Vec::with_capacity(sel.indices.len());
    for ((&i, &v), &code) in sel.indices.iter().zip(&sel.values).zip(&unpacked) {
        if v == 0.0 {
            put_back(i as usize, v);
            continue;
        }
        let sent = values.get(usize::from(code & 0xF)).copied().unwrap_or(0.0);
        put_back(i as usize, v - sent);
        indices.push(i);
        kept.push(code);
    }
    let codes = (kept.chunks(2))
        .map(|pair| pair.first().copied().unwrap_or(0) | (pair.get(1).copied().unwrap_or(0) << 4))
        .collect();
    TopK4 {
        len,
        indices,
        codes,
        scale: largest,
        ratio,
    }
}

/// Bytes of a LEB128 varint.
fn varint_len(mut v: usize) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use kindred_kernels::{SelectMethod, Selection};

    fn selection(values: &[f32]) -> Selection {
        Selection {
            indices: (0..values.len() as u32).map(|i| i * 2).collect(),
            values: values.to_vec(),
            threshold: 0.0,
            method: SelectMethod::Exact,
        }
    }

    #[test]
    fn four_bit_values_round_to_the_nearest_level_and_keep_the_rest() {
        let values = [0.01, -0.3, 0.0, 1.0, -0.02, 0.5, 0.07];
        let mut kept = [f32::NAN; 14];
        let t = quantize_log4(14, &selection(&values), |i, r| kept[i] = r);
        // The zero carries nothing; the levels span the smallest magnitude to the largest.
        assert_eq!(t.indices, [0, 2, 6, 8, 10, 12]);
        assert_eq!(t.scale, 1.0);
        assert!((t.ratio.powi(7) - 0.01).abs() < 1e-6);
        assert_eq!(t.codes.len(), 3);
        let levels = TopK4::levels(t.scale, t.ratio);
        for (j, &i) in t.indices.iter().enumerate() {
            let v = values[i as usize / 2];
            let sent = t.value(j).unwrap();
            assert_eq!(sent.signum(), v.signum());
            // Nearest of the eight magnitudes, and what it missed left behind.
            let best = levels
                .iter()
                .map(|l| (l - v.abs()).abs())
                .fold(f32::INFINITY, f32::min);
            assert!(
                ((sent.abs() - v.abs()).abs() - best).abs() < 1e-7,
                "{v}: {sent}"
            );
            assert_eq!(kept[i as usize], v - sent);
        }
        assert_eq!(kept[4], 0.0, "the zero stays whole in the residual");
        // Odd counts leave the last high nibble zero; a layer of zeros sends nothing.
        let odd = quantize_log4(6, &selection(&[0.5, -0.25, 0.125]), |_, _| ());
        assert_eq!(odd.codes.len(), 2);
        assert_eq!(odd.codes[1] >> 4, 0);
        let zeros = quantize_log4(6, &selection(&[0.0, 0.0]), |_, _| ());
        assert!(zeros.indices.is_empty() && zeros.codes.is_empty());
    }
}
