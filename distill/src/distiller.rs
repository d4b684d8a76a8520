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
//!    (error feedback): `sent + new residual = update + old residual` up to f32 rounding;
//! 5. the round counter advances.
//!
//! It is sans-IO: no clock, no network, no files. The node persists [`Distiller::state`] and the
//! simulator runs thousands of distillers with one shared [`Embedder`].

use std::sync::Arc;

use half::f16;
use kindred_kernels::{
    AccumulateError, Backend, Candidates, Kernels, Rounding, SIMHASH_BITS, Stats, rng,
};
use kindred_proto::{
    DenseValues, Embedding, LayerPayload, ModelSpec, PacketBody, PayloadKind, SignBits, TopK,
    encoded_layer_len,
};

use crate::embed::{Embedded, Embedder, EmbeddingConfig};
use crate::error::{ConfigError, DistillError, EmbedError};
use crate::layout::Layout;
use crate::policy::{LayerPlan, Policy, k_for};
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
/// // Error feedback: what was not sent waits in the residual.
/// for ((s, r), u) in sent.iter().zip(distiller.residual()).zip(&update) {
///     assert!((s + r - u).abs() <= 1e-6);
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
    pub(crate) residual: Vec<f32>,
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
            residual: vec![0.0; layout.len()],
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

    /// The error-feedback residual: everything computed but not yet sent, flat in model order.
    pub fn residual(&self) -> &[f32] {
        &self.residual
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
        self.residual = vec![0.0; len];
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
        let round = self.round;
        let layer_count = self.layout.layers();
        let mut stats = Vec::with_capacity(layer_count);
        let mut candidates: Vec<Option<Candidates>> = Vec::with_capacity(layer_count);
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
            let threshold = fused_k.and_then(|k| self.backend.sample_threshold(r, u, k, seed));
            match self.backend.accumulate_fused(r, u, None, threshold) {
                Ok(fused) => {
                    stats.push(fused.stats);
                    candidates.push(threshold.map(|_| fused.candidates));
                }
                Err(AccumulateError::Overflow { .. }) => {
                    // The update is finite, so a residual grown past f32 overflowed: the only
                    // sane recovery is to restart this layer's error feedback from the update.
                    tracing::warn!(
                        layer,
                        "residual overflowed f32; resetting it to this update"
                    );
                    r.copy_from_slice(u);
                    resets += 1;
                    stats.push(self.backend.stats(r).unwrap_or_default());
                    candidates.push(None);
                }
                Err(source) => return Err(DistillError::Accumulate { layer, source }),
            }
        }
        let plans = self.policy.plan(self.spec.layers(), &stats, round);
        let mut layers = Vec::with_capacity(plans.len());
        let mut reports = Vec::with_capacity(plans.len());
        for (layer, (((plan, range), s), cand)) in plans
            .iter()
            .zip(ranges)
            .zip(&stats)
            .zip(candidates)
            .enumerate()
        {
            let payload = self.encode_layer(layer, *plan, range, round, cand)?;
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

    /// Encode one layer from its residual and leave the unsent remainder in it.
    fn encode_layer(
        &mut self,
        layer: usize,
        plan: LayerPlan,
        range: std::ops::Range<usize>,
        round: u64,
        candidates: Option<Candidates>,
    ) -> Result<LayerPayload, DistillError> {
        let ef = self.policy.error_feedback;
        let seed = self.sample_seed(round, layer);
        let r = self.residual.get_mut(range).unwrap_or_default();
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
                let mut q = vec![0i8; sel.values.len()];
                let scale = backend
                    .quantize_i8(&sel.values, Rounding::Nearest, &mut q)
                    .map_err(|source| DistillError::Quantize { layer, source })?;
                let mut indices = Vec::with_capacity(q.len());
                let mut values = Vec::with_capacity(q.len());
                for ((&i, &v), &qi) in sel.indices.iter().zip(&sel.values).zip(&q) {
                    // Put back what quantisation lost (the selection may have zeroed the entry).
                    if let Some(slot) = r.get_mut(i as usize) {
                        *slot = v - f32::from(qi) * scale;
                    }
                    // An entry that quantises to 0 carries nothing: keep it all in the residual.
                    if qi != 0 {
                        indices.push(i);
                        values.push(qi);
                    }
                }
                LayerPayload::TopK(TopK {
                    len,
                    indices,
                    values,
                    scale,
                })
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

/// Bytes of a LEB128 varint.
fn varint_len(mut v: usize) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}
