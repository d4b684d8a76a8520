//! The selective-compression policy: which encoding each layer gets this round.
//!
//! The decision is made per layer and per round from statistics of `update + residual` (what
//! would be sent if nothing were compressed), computed by the fused accumulate kernel:
//!
//! 1. **Small or 1-D tensors** (biases, norm scales, anything with at most
//!    [`Policy::dense_max_elems`] elements) go dense f16: they cost little and are sensitive.
//! 2. **Relative variance** `v = var(layer) / var(model)` (the model figure weighted by element
//!    count over the large layers) picks among the rest: `v ≥ τ_high` → dense f16 (a layer carrying
//!    far more signal per element than the others), `v ≤ τ_low` → 1-bit sign once past warm-up
//!    (a layer that barely moves, where one scale and the signs describe it well enough), otherwise
//!    top-k, its values in int8 or 4 bits ([`TopKValues`]).
//! 3. **Warm-up**: during the first rounds top-k density follows [`Policy::warmup`] (e.g. 25% →
//!    … → 1.5%) before settling at [`Policy::density`]; early updates are large and
//!    unstructured, and error feedback needs a few rounds to build up. Sign is never used during
//!    warm-up.
//! 4. **Byte budget** ([`Policy::byte_budget`]): instead of a fixed density, top-k layers share the
//!    bytes left after dense and sign layers, in proportion to their energy (`n · rms`), with the
//!    cost per entry estimated from the index gaps its density implies.

use kindred_kernels::Stats;
use kindred_proto::{LayerSpec, PayloadKind};

use crate::error::ConfigError;

/// The encoding chosen for one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LayerPlan {
    /// Every value, as f16.
    DenseF16,
    /// The `k` largest magnitudes, quantised as [`Policy::topk_values`] says.
    TopK {
        /// Entries to keep (≥ 1, ≤ the layer's size).
        k: usize,
    },
    /// One sign bit per value and one scale.
    Sign,
}

impl LayerPlan {
    /// The payload kind this plan produces.
    pub fn kind(&self) -> PayloadKind {
        match self {
            Self::DenseF16 => PayloadKind::Dense,
            Self::TopK { .. } => PayloadKind::TopK,
            Self::Sign => PayloadKind::Sign,
        }
    }
}

/// How the values of a top-k layer are quantised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TopKValues {
    /// One byte each with one scale per layer (`kindred_proto::TopK`).
    #[default]
    Int8,
    /// Four bits each: a sign and one of eight log-spaced magnitudes from the layer's smallest
    /// selected magnitude to its largest (`kindred_proto::TopK4`). An entry then costs 1.5 bytes
    /// instead of 2 (its index delta and its value), and error feedback sends the coarser
    /// rounding in later rounds: on the hub exchange's iid run 4 bits at 6.7% beat int8 at 5%
    /// for the same bytes (BENCHMARKS.md).
    Log4,
}

impl TopKValues {
    /// Bytes of one value on the wire.
    pub fn bytes(self) -> f64 {
        match self {
            Self::Int8 => 1.0,
            Self::Log4 => 0.5,
        }
    }
}

/// Compression policy. [`Policy::default`] documents the defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Layers with at most this many elements, and every 1-D layer, go dense f16. Default 4096.
    pub dense_max_elems: usize,
    /// τ_low: large layers whose relative variance is at or below this go 1-bit sign after
    /// warm-up. Default 0.02. Set to a negative value to never use sign.
    pub tau_low: f32,
    /// τ_high: large layers whose relative variance is at or above this go dense f16.
    /// Default 50.
    pub tau_high: f32,
    /// Top-k density per warm-up round (round 0 first); a density of 1 or more means dense.
    /// Default `[0.25, 0.125, 0.0625, 0.03]`.
    pub warmup: Vec<f32>,
    /// Top-k density after warm-up. Default 0.02 (2%): on IID shards, where compression is
    /// all that separates it from the dense all-reduce, `selective+allreduce` lost 0.7 point
    /// to it at 1% and 0.4 at 2% (`kindred-sim learn --setting iid --nodes 64 --policies
    /// allreduce,selective+allreduce`, seeds 4-6, 2,000 held-out digits), for 21% more bytes.
    pub density: f32,
    /// How top-k values are quantised. Default [`TopKValues::Int8`].
    pub topk_values: TopKValues,
    /// Target body size in bytes: when set, top-k densities are chosen to meet it instead of
    /// following [`Policy::warmup`] / [`Policy::density`]. Default `None`.
    pub byte_budget: Option<usize>,
    /// Keep what was not sent in the residual (error feedback). Turning it off exists to measure
    /// what error feedback is worth; a real node keeps it on. Default `true`.
    pub error_feedback: bool,
    /// Use the sampled (DGC) top-k instead of the exact one. Both select the same entries; sampled
    /// is faster on large layers. Default `true`.
    pub sampled_topk: bool,
    /// Seed for top-k sampling (mixed with the round and layer). Default 0.
    pub seed: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            dense_max_elems: 4096,
            tau_low: 0.02,
            tau_high: 50.0,
            warmup: vec![0.25, 0.125, 0.0625, 0.03],
            density: 0.02,
            topk_values: TopKValues::Int8,
            byte_budget: None,
            error_feedback: true,
            sampled_topk: true,
            seed: 0,
        }
    }
}

/// Bytes of framing per layer on the wire (variant tag, lengths, scale), an upper estimate.
const LAYER_OVERHEAD: usize = 16;

impl Policy {
    /// The policy of the hub exchange's packets and merges: top-k at [`Policy::HUB_DENSITY`]
    /// with 4-bit values ([`TopKValues::Log4`]) from the first round (no dense warm-up: the
    /// exchange starts after the node's local rounds), otherwise the defaults.
    ///
    /// ```
    /// use kindred_distill::{Policy, TopKValues};
    /// let hub = Policy::hub();
    /// assert!(hub.warmup.is_empty() && hub.density == Policy::HUB_DENSITY);
    /// assert_eq!(hub.topk_values, TopKValues::Log4);
    /// assert!(hub.validate().is_ok());
    /// ```
    pub fn hub() -> Self {
        Self {
            density: Self::HUB_DENSITY,
            topk_values: TopKValues::Log4,
            warmup: Vec::new(),
            ..Self::default()
        }
    }

    /// Top-k density of the hub exchange's packets ([`Policy::hub`]): 6.7%, a third more than
    /// the default. A member moves two compressed updates a round whatever its cohort's size,
    /// against one per partner in the pairwise exchange, so it can afford denser ones. On iid
    /// (`kindred-sim learn --nodes 64 --setting iid`, seeds 1-3) the gap to the full-precision
    /// all-reduce was −0.53 point at 5% in int8 and −0.40 at 6.7% in 4 bits, for the same
    /// bytes (about 19 KB per node per round; BENCHMARKS.md).
    pub const HUB_DENSITY: f32 = 0.067;

    /// Check that every field is in range.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, reason| Err(ConfigError::Policy { field, reason });
        let density_ok = |d: f32| d.is_finite() && d > 0.0;
        if !density_ok(self.density) || self.density > 1.0 {
            return bad("density", "must be in (0, 1]");
        }
        if !self.warmup.iter().all(|&d| density_ok(d)) {
            return bad("warmup", "every density must be finite and positive");
        }
        if self.tau_low.is_nan() || self.tau_high.is_nan() || self.tau_low > self.tau_high {
            return bad("tau_low", "must be a number no larger than tau_high");
        }
        if self.byte_budget == Some(0) {
            return bad("byte_budget", "must be positive");
        }
        Ok(())
    }

    /// Whether `round` is still in warm-up.
    pub fn in_warmup(&self, round: u64) -> bool {
        round < self.warmup.len() as u64
    }

    /// The top-k density for `round` (outside byte-budget mode): the warm-up's density for
    /// that round, never below [`Policy::density`] (a warm-up is a denser start, so a step of it
    /// below the settled density is skipped at that density).
    pub fn density_at(&self, round: u64) -> f32 {
        usize::try_from(round)
            .ok()
            .and_then(|r| self.warmup.get(r))
            .map_or(self.density, |&w| w.max(self.density))
    }

    /// Whether a layer always goes dense f16 (1-D, or at most [`Policy::dense_max_elems`]).
    pub fn is_small(&self, layer: &LayerSpec) -> bool {
        layer.is_1d() || layer.numel() <= self.dense_max_elems as u64
    }

    /// Plan every layer of a round from the statistics of `update + residual`.
    ///
    /// `layers` and `stats` are in model order and of equal length.
    pub fn plan(&self, layers: &[LayerSpec], stats: &[Stats], round: u64) -> Vec<LayerPlan> {
        // Element-weighted mean variance of the large layers: the yardstick of "relative variance".
        let (mut weighted, mut elems) = (0.0f64, 0.0f64);
        for (layer, s) in layers.iter().zip(stats) {
            if !self.is_small(layer) {
                weighted += f64::from(s.variance) * s.len as f64;
                elems += s.len as f64;
            }
        }
        let reference = if elems > 0.0 { weighted / elems } else { 0.0 };
        let warm = self.in_warmup(round);
        let density = self.density_at(round);
        let mut plans: Vec<LayerPlan> = layers
            .iter()
            .zip(stats)
            .map(|(layer, s)| {
                if self.is_small(layer) {
                    return LayerPlan::DenseF16;
                }
                let rel = if reference > 0.0 {
                    (f64::from(s.variance) / reference) as f32
                } else {
                    1.0
                };
                if rel >= self.tau_high {
                    LayerPlan::DenseF16
                } else if !warm && rel <= self.tau_low {
                    LayerPlan::Sign
                } else if density >= 1.0 {
                    LayerPlan::DenseF16
                } else {
                    LayerPlan::TopK {
                        k: k_for(s.len, density),
                    }
                }
            })
            .collect();
        if let Some(budget) = self.byte_budget {
            apply_budget(&mut plans, stats, budget, self.topk_values);
        }
        plans
    }
}

/// `k` for a density: at least 1, at most the layer.
pub(crate) fn k_for(len: usize, density: f32) -> usize {
    ((len as f64 * f64::from(density)).ceil() as usize).clamp(1, len.max(1))
}

/// Expected bytes of the LEB128 varint of an index gap when kept entries are spread at random
/// with mean gap `gap` (geometric gaps: `P(gap ≥ 2^(7j)) ≈ exp(−2^(7j) / gap)`).
fn varint_bytes(gap: f64) -> f64 {
    let g = gap.max(1.0);
    1.0 + [128.0f64, 16_384.0, 2_097_152.0, 268_435_456.0]
        .iter()
        .map(|&t| (-t / g).exp())
        .sum::<f64>()
}

/// Estimated encoded bytes of a layer under a plan, top-k values at `values`.
pub(crate) fn estimate_bytes(plan: LayerPlan, len: usize, values: TopKValues) -> usize {
    LAYER_OVERHEAD
        + match plan {
            LayerPlan::DenseF16 => 2 * len,
            LayerPlan::Sign => len.div_ceil(64) * 8,
            LayerPlan::TopK { k } => {
                let gap = len as f64 / k.max(1) as f64;
                (k as f64 * (values.bytes() + varint_bytes(gap))).ceil() as usize
            }
        }
}

/// Re-split top-k entries so the whole body meets `budget` bytes.
fn apply_budget(plans: &mut [LayerPlan], stats: &[Stats], budget: usize, values: TopKValues) {
    let fixed: usize = plans
        .iter()
        .zip(stats)
        .filter(|(p, _)| !matches!(p, LayerPlan::TopK { .. }))
        .map(|(p, s)| estimate_bytes(*p, s.len, values))
        .sum();
    let topk: Vec<usize> = plans
        .iter()
        .enumerate()
        .filter(|(_, p)| matches!(p, LayerPlan::TopK { .. }))
        .map(|(i, _)| i)
        .collect();
    if topk.is_empty() {
        return;
    }
    let available = budget.saturating_sub(fixed + LAYER_OVERHEAD * topk.len()) as f64;
    // Energy share of each top-k layer: n · rms.
    let energy: Vec<f64> = topk
        .iter()
        .map(|&i| {
            stats
                .get(i)
                .map_or(0.0, |s| s.len as f64 * f64::from(s.mean_square()).sqrt())
        })
        .collect();
    let total: f64 = energy.iter().sum();
    // Cost per entry depends on the density it buys; three fixed-point rounds settle it.
    let mut cost: Vec<f64> = vec![values.bytes() + 1.0; topk.len()];
    let mut ks: Vec<usize> = vec![1; topk.len()];
    for _ in 0..3 {
        for (j, &i) in topk.iter().enumerate() {
            let len = stats.get(i).map_or(1, |s| s.len);
            let share = if total > 0.0 {
                energy.get(j).copied().unwrap_or(0.0) / total
            } else {
                1.0 / topk.len() as f64
            };
            let c = cost.get(j).copied().unwrap_or(values.bytes() + 1.0);
            let k = ((available * share / c).floor() as usize).clamp(1, (len / 2).max(1));
            if let Some(slot) = ks.get_mut(j) {
                *slot = k;
            }
            if let Some(slot) = cost.get_mut(j) {
                *slot = values.bytes() + varint_bytes(len as f64 / k as f64);
            }
        }
    }
    // The last pass priced each `k` at the previous pass's density, so the estimate can
    // overshoot by a few bytes: take entries from the largest layer until it fits.
    let len_of = |j: usize| topk.get(j).and_then(|&i| stats.get(i)).map_or(1, |s| s.len);
    for _ in 0..64 {
        let total = fixed
            + ks.iter()
                .enumerate()
                .map(|(j, &k)| estimate_bytes(LayerPlan::TopK { k }, len_of(j), values))
                .sum::<usize>();
        let largest = ks.iter_mut().filter(|k| **k > 1).max_by_key(|k| **k);
        match largest {
            Some(k) if total > budget => *k -= (total - budget).div_ceil(2).min(*k - 1),
            _ => break,
        }
    }
    for (&i, &k) in topk.iter().zip(&ks) {
        if let Some(p) = plans.get_mut(i) {
            *p = LayerPlan::TopK { k };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kindred_proto::DType;

    fn stats(len: usize, variance: f32) -> Stats {
        Stats {
            len,
            variance,
            ..Stats::default()
        }
    }

    fn layers() -> Vec<LayerSpec> {
        vec![
            LayerSpec::new("big", [1000, 100], DType::F32),
            LayerSpec::new("quiet", [1000, 100], DType::F32),
            LayerSpec::new("loud", [100, 100], DType::F32),
            LayerSpec::new("bias", [1000], DType::F32),
            LayerSpec::new("small", [10, 10], DType::F32),
        ]
    }

    #[test]
    fn defaults_follow_the_documented_rules() {
        let p = Policy::default();
        p.validate().unwrap_or_else(|e| panic!("{e}"));
        let s = [
            stats(100_000, 1.0),
            stats(100_000, 0.001),
            stats(10_000, 500.0),
            stats(1000, 1.0),
            stats(100, 1.0),
        ];
        let warm = p.plan(&layers(), &s, 0);
        assert_eq!(warm[0], LayerPlan::TopK { k: 25_000 });
        assert_eq!(warm[1], LayerPlan::TopK { k: 25_000 }, "no sign in warm-up");
        // "loud" has 21x the average variance: below the default τ_high of 50 ...
        assert_eq!(warm[2], LayerPlan::TopK { k: 2500 });
        // ... and above a τ_high of 10.
        let strict = Policy {
            tau_high: 10.0,
            ..Policy::default()
        };
        assert_eq!(
            strict.plan(&layers(), &s, 0)[2],
            LayerPlan::DenseF16,
            "τ_high"
        );
        assert_eq!(warm[3], LayerPlan::DenseF16, "1-D");
        assert_eq!(warm[4], LayerPlan::DenseF16, "small");
        let later = p.plan(&layers(), &s, 10);
        assert_eq!(later[0], LayerPlan::TopK { k: 2000 });
        assert_eq!(later[1], LayerPlan::Sign, "τ_low after warm-up");
        let densities: Vec<f32> = (0..7).map(|r| p.density_at(r)).collect();
        assert_eq!(densities, [0.25, 0.125, 0.0625, 0.03, 0.02, 0.02, 0.02]);
        // A settled density above a warm-up step replaces that step.
        let dense = Policy {
            density: 0.04,
            ..Policy::default()
        };
        let densities: Vec<f32> = (0..5).map(|r| dense.density_at(r)).collect();
        assert_eq!(densities, [0.25, 0.125, 0.0625, 0.04, 0.04]);
    }

    #[test]
    fn byte_budget_is_met_and_split_by_energy() {
        let p = Policy {
            byte_budget: Some(20_000),
            tau_low: -1.0,
            ..Policy::default()
        };
        let s = [
            stats(100_000, 4.0),
            stats(100_000, 1.0),
            stats(10_000, 1.0),
            stats(1000, 1.0),
            stats(100, 1.0),
        ];
        let plans = p.plan(&layers(), &s, 10);
        let bytes: usize = plans
            .iter()
            .zip(&s)
            .map(|(pl, st)| estimate_bytes(*pl, st.len, p.topk_values))
            .sum();
        assert!(bytes <= 20_000 && bytes > 16_000, "{bytes}");
        match (plans[0], plans[1]) {
            (LayerPlan::TopK { k: a }, LayerPlan::TopK { k: b }) => {
                assert!(a > b * 3 / 2, "louder layer gets more entries: {a} vs {b}");
            }
            other => panic!("{other:?}"),
        }
    }

    proptest::proptest! {
        /// Whatever the budget and the layers' energies, the plan's estimate stays within the
        /// budget whenever one entry per top-k layer fits.
        #[test]
        fn a_byte_budget_is_never_exceeded(
            budget in 1_000usize..300_000,
            variances in proptest::collection::vec(0.001f32..100.0, 5),
            log4: bool,
        ) {
            let values = if log4 { TopKValues::Log4 } else { TopKValues::Int8 };
            let p = Policy {
                byte_budget: Some(budget),
                topk_values: values,
                tau_low: -1.0,
                ..Policy::default()
            };
            let lens = [100_000, 100_000, 10_000, 1000, 100];
            let s: Vec<Stats> = lens.iter().zip(&variances).map(|(&n, &v)| stats(n, v)).collect();
            let plans = p.plan(&layers(), &s, 10);
            let bytes: usize = plans
                .iter()
                .zip(&s)
                .map(|(pl, st)| estimate_bytes(*pl, st.len, values))
                .sum();
            let least: usize = plans
                .iter()
                .zip(&s)
                .map(|(pl, st)| match pl {
                    LayerPlan::TopK { .. } => {
                        estimate_bytes(LayerPlan::TopK { k: 1 }, st.len, values)
                    }
                    other => estimate_bytes(*other, st.len, values),
                })
                .sum();
            proptest::prop_assert!(bytes <= budget.max(least), "{bytes} > {budget}");
        }
    }

    #[test]
    fn bad_fields_are_rejected() {
        for p in [
            Policy {
                density: 0.0,
                ..Policy::default()
            },
            Policy {
                warmup: vec![f32::NAN],
                ..Policy::default()
            },
            Policy {
                tau_low: 2.0,
                tau_high: 1.0,
                ..Policy::default()
            },
            Policy {
                byte_budget: Some(0),
                ..Policy::default()
            },
        ] {
            assert!(p.validate().is_err(), "{p:?}");
        }
    }
}
