//! Synthesis: the robust merge of a node's own update with its most similar peers' updates.
//!
//! Peers were chosen by embedding similarity, but a header can lie and a body can be poisoned, so
//! the merge re-checks every peer on the decoded update itself, against the node's own update:
//!
//! 1. **Validity**: the right length, finite values, a positive sample count, a non-zero norm.
//! 2. **Norm**: the reference norm is the lower median of the norms of the own update and all
//!    peers (the node's own update counts, so one scaled peer can never move the reference). A
//!    peer above `reject_norm_ratio ×` the reference is *rejected* (a ×100 scaled update is);
//!    one above `clip_norm_ratio ×` is scaled down to that norm.
//! 3. **Cosine gate**: the exact cosine between the peer's update and the node's own update,
//!    taken over the coordinates the peer sent (all of them for a dense peer, its top-k for a
//!    sparse one), must reach `min_cosine`; a sign-flipped or unrelated update is rejected. When
//!    the peers' cosines are themselves at noise level (late in training), the gate moves down
//!    to their median minus a few robust spreads, so honest noise is not rejected as dissent.
//! 4. **Merge** of the own update and the accepted peers: a weighted mean with weight
//!    `samples × cosine^similarity_power` (the own update has cosine 1), or a coordinate-wise
//!    trimmed mean that discards the extremes of every coordinate. A peer's `samples` is a
//!    claim from its header, so it is bounded first ([`cap_samples`]): at most
//!    [`kindred_proto::MAX_SAMPLES`], and at most [`SynthConfig::max_samples_ratio`] times the
//!    lower median of the claims of every merged update, the own included. Whatever a peer
//!    claims, it weighs at most that many median peers.
//!
//! Each peer gets a [`Verdict`] saying why it was accepted or rejected, so the node can count
//! rejects by reason. Synthesis is a pure function: it never touches a [`crate::Distiller`]'s
//! residuals, so merged results never feed back into anyone's error feedback.

use kindred_proto::MAX_SAMPLES;

use crate::error::SynthError;
use crate::update::{Update, UpdateView};

/// A dense update and the training samples behind it: the node's own, or a peer's.
#[derive(Debug, Clone, Copy)]
pub struct UpdateRef<'a> {
    /// The dense update, flat in model order (a peer's from [`crate::decode`]).
    pub update: &'a [f32],
    /// Training samples behind it (a peer's from its packet header).
    pub samples: u64,
}

/// What [`synthesize`] reads of a peer: its update, dense or sparse, and the training samples
/// behind it. A hub keeps its members' pushes sparse ([`PeerUpdate`]); the dense
/// [`UpdateRef`] serves the rest.
pub trait Contribution {
    /// The update.
    fn update(&self) -> UpdateView<'_>;
    /// Training samples behind it (from its packet header).
    fn samples(&self) -> u64;
}

impl Contribution for UpdateRef<'_> {
    fn update(&self) -> UpdateView<'_> {
        UpdateView::Dense(self.update)
    }

    fn samples(&self) -> u64 {
        self.samples
    }
}

/// A peer's update as decoded ([`crate::decode_update`]), sparse or dense, and the training
/// samples behind it.
#[derive(Debug, Clone, Copy)]
pub struct PeerUpdate<'a> {
    /// The update.
    pub update: &'a Update,
    /// Training samples behind it.
    pub samples: u64,
}

impl Contribution for PeerUpdate<'_> {
    fn update(&self) -> UpdateView<'_> {
        self.update.view()
    }

    fn samples(&self) -> u64 {
        self.samples
    }
}

/// How the accepted updates are combined.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MergeRule {
    /// Weighted mean, weights `samples × cosine^similarity_power`.
    WeightedMean,
    /// Per coordinate, drop the `trim` fraction of smallest and of largest values (rounded down)
    /// and average the rest, unweighted.
    TrimmedMean {
        /// Fraction trimmed from each end, in `[0, 0.5)`.
        trim: f32,
    },
}

/// Synthesis parameters. [`SynthConfig::default`] documents the defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthConfig {
    /// Peers whose exact cosine with the own update is below this are rejected. Default 0.0
    /// (anything pointing away from the own update), lowered to the peers' noise level by
    /// [`SynthConfig::noise_spreads`].
    pub min_cosine: f32,
    /// When the peers' cosines are mostly noise, the gate moves down to their median minus this
    /// many robust spreads (1.4826 × the median absolute deviation), if that is below
    /// `min_cosine`; 0 keeps the gate at `min_cosine`. Needs at least
    /// [`SynthConfig::SPREAD_PEERS`] peers past the norm rules. Default 3.
    ///
    /// Why: late in training a round's update is mostly the node's own minibatch noise, and
    /// honest peers of the same task sit at cosine 0 ± 0.035 (`kindred-sim learn --setting iid
    /// --nodes 64`, round 29; 0.83 in round 1). A fixed gate at 0 then rejects half of them for
    /// no protection (a sign-flipped honest update is as close to 0), and a node merges 7.6 of
    /// its 16 partners instead of 15.7. While the peers agree (median 0.5, spread 0.05) the gate
    /// stays at `min_cosine`, so a flipped update at −0.5 is rejected.
    ///
    /// Only for nodes that pull model snapshots ([`SynthConfig::for_node`]): without them the
    /// nodes' models drift apart, a late peer update is partly about a model the node no longer
    /// has, and the fixed gate is what keeps the ones that disagree out (iid, 64 nodes, no
    /// snapshots: 84.4% with 3, 87.7% with 0; with snapshots 90.0% against 89.8%, 3 seeds).
    pub noise_spreads: f32,
    /// Peers with a norm above this multiple of the reference norm are scaled down to it.
    /// Default 2.
    pub clip_norm_ratio: f32,
    /// Peers with a norm above this multiple of the reference norm are rejected. Default 10.
    pub reject_norm_ratio: f32,
    /// Exponent of the cosine in the weights. Default 0: every accepted peer weighs by its
    /// samples alone. The gate already removed the peers that disagree; weighting the rest by a
    /// sparse peer's support cosine (typically 0.2-0.5 for an honest same-task peer) shrinks
    /// every partner toward nothing and the merge toward local training (`kindred-sim learn
    /// --setting label --nodes 64`, seed 1: 87.2% with exponent 1, 88.5% with 0).
    pub similarity_power: f32,
    /// The merge rule. Default [`MergeRule::WeightedMean`].
    pub rule: MergeRule,
    /// Most weight one peer's claimed `samples` buys, as a multiple of the lower median of the
    /// claims of every merged update (the own update and the accepted peers): each peer's
    /// claim is clamped to [`kindred_proto::MAX_SAMPLES`] and then to this multiple
    /// ([`cap_samples`]). The own claim is clamped to `MAX_SAMPLES` only. At least 1;
    /// `f32::INFINITY` turns the cap off. Default 2.
    ///
    /// Why a cap relative to the median: a header can claim any count, and without a bound one
    /// peer claiming `MAX_SAMPLES` (2^32) takes all but 4·10⁻⁷ of a merge with 16 updates of
    /// 100 samples, drowning the own update and every honest peer. The median of the merged
    /// claims is honest while most merged updates are, so a liar weighs at most this many
    /// median peers, and with the norm clip (a merged peer is at most
    /// [`SynthConfig::clip_norm_ratio`], 2, times the reference norm) one peer moves a
    /// weighted mean of itself and `k` median peers by at most `2r / (r + k)` reference norms.
    /// The cost: an honest node with more than `r` times the median's data merges at the cap
    /// rather than at its full weight (a 2:1 spread of shard sizes merges unchanged).
    ///
    /// Why 2: `kindred-sim learn --nodes 64 --setting label --hostile 0.2 --attacks poisoning
    /// --policies kindred --max-samples-ratio R` (its hostile nodes scale ×10, flip, send noise,
    /// claim `MAX_SAMPLES` with an honest-looking ×2 update or with noise, or send the largest
    /// finite values), seeds 1-3: honest nodes lost 0.89 point against the clean run without
    /// the cap (0.31, 1.21, 1.15), 0.25 with R = 4 (0.06, 0.38, 0.31), 0.08 with R = 2
    /// (−0.02, 0.16, 0.11); with only the inflating attacks (`--attacks
    /// inflate-noise,inflate:2,inflate:-1`) 1.22 without the cap, 0.23 with 4, 0.11 with 2.
    /// Honest claims are equal there, so the clean run is the same for every R.
    pub max_samples_ratio: f32,
}

impl SynthConfig {
    /// The defaults for a node that pulls model snapshots now and then (`pulls_snapshots`), or
    /// for one that does not, whose gate stays at `min_cosine` ([`SynthConfig::noise_spreads`]).
    ///
    /// ```
    /// use kindred_distill::SynthConfig;
    /// assert_eq!(SynthConfig::for_node(true), SynthConfig::default());
    /// assert_eq!(SynthConfig::for_node(false).noise_spreads, 0.0);
    /// ```
    pub fn for_node(pulls_snapshots: bool) -> Self {
        let default = Self::default();
        Self {
            noise_spreads: if pulls_snapshots {
                default.noise_spreads
            } else {
                0.0
            },
            ..default
        }
    }

    /// The settings of a hub of the hub exchange merging the pushes of `members` members: the
    /// defaults, except that a cohort too small for the noise-aware gate (fewer than
    /// [`SynthConfig::SPREAD_PEERS`] members) has no cosine gate at all, only the norm rules.
    ///
    /// Why: a hub's own update is one member's like the others, and late in training honest
    /// updates of one task sit at cosine 0 ± 0.035 with each other. In a cohort of a few the
    /// spread cannot be read, so a gate at 0 left about half of the members out of each merge,
    /// and a member whose update is left out finds the merge orthogonal to its own and refuses
    /// it (`check_aggregate`): `kindred demo` (cohorts of 4) lost its cohorts to refusals by
    /// round 12, and a gate at −0.1 still left members out. A small cohort's members were each
    /// admitted by the hub's gate on their embeddings and check the merge on their own data, so
    /// the merge's cosine gate adds little there.
    ///
    /// ```
    /// use kindred_distill::SynthConfig;
    /// assert_eq!(SynthConfig::for_hub(16), SynthConfig::default());
    /// assert_eq!(SynthConfig::for_hub(3).min_cosine, -1.0);
    /// ```
    pub fn for_hub(members: usize) -> Self {
        if members >= Self::SPREAD_PEERS {
            return Self::default();
        }
        Self {
            min_cosine: -1.0,
            ..Self::default()
        }
    }

    /// Fewest peers (past the norm rules) whose cosines [`SynthConfig::noise_spreads`] reads a
    /// spread from.
    pub const SPREAD_PEERS: usize = 5;

    /// Check every field's range; [`synthesize`] does too, so a bad setting fails early.
    ///
    /// # Errors
    /// [`SynthError::Config`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), SynthError> {
        let bad = |field, reason| Err(SynthError::Config { field, reason });
        if !(self.min_cosine.is_finite() && (-1.0..=1.0).contains(&self.min_cosine)) {
            return bad("min_cosine", "must be in [-1, 1]");
        }
        if !(self.noise_spreads.is_finite() && self.noise_spreads >= 0.0) {
            return bad("noise_spreads", "must be finite and at least 0");
        }
        if !(self.clip_norm_ratio.is_finite() && self.clip_norm_ratio > 0.0) {
            return bad("clip_norm_ratio", "must be positive");
        }
        if !(self.reject_norm_ratio.is_finite() && self.reject_norm_ratio >= self.clip_norm_ratio) {
            return bad("reject_norm_ratio", "must be at least clip_norm_ratio");
        }
        if !(self.similarity_power.is_finite() && self.similarity_power >= 0.0) {
            return bad("similarity_power", "must be non-negative");
        }
        if let MergeRule::TrimmedMean { trim } = self.rule
            && !(trim.is_finite() && (0.0..0.5).contains(&trim))
        {
            return bad("rule", "trim must be in [0, 0.5)");
        }
        // +inf (no cap) passes.
        if self.max_samples_ratio.is_nan() || self.max_samples_ratio < 1.0 {
            return bad("max_samples_ratio", "must be at least 1");
        }
        Ok(())
    }
}

impl Default for SynthConfig {
    fn default() -> Self {
        Self {
            min_cosine: 0.0,
            noise_spreads: 3.0,
            clip_norm_ratio: 2.0,
            reject_norm_ratio: 10.0,
            similarity_power: 0.0,
            rule: MergeRule::WeightedMean,
            max_samples_ratio: 2.0,
        }
    }
}

/// Why a peer update was rejected.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Rejection {
    /// Its length is not the own update's.
    Length {
        /// Own update length.
        expected: usize,
        /// Peer update length.
        found: usize,
    },
    /// It holds a NaN or an infinity.
    NonFinite {
        /// First offending position.
        index: usize,
    },
    /// It claims zero training samples.
    NoSamples,
    /// It is all zero.
    ZeroNorm,
    /// Its norm is too far above the reference.
    NormTooLarge {
        /// Peer norm / reference norm.
        ratio: f32,
    },
    /// It points away from the own update.
    CosineBelowGate {
        /// Its cosine with the own update.
        cosine: f32,
    },
}

impl Rejection {
    /// A stable, low-cardinality label for metrics (`rejects_total{reason=…}`).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Length { .. } => "length",
            Self::NonFinite { .. } => "non_finite",
            Self::NoSamples => "no_samples",
            Self::ZeroNorm => "zero_norm",
            Self::NormTooLarge { .. } => "norm",
            Self::CosineBelowGate { .. } => "cosine",
        }
    }
}

/// What happened to one peer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Merged.
    Accepted {
        /// Its exact cosine with the own update.
        cosine: f32,
        /// Its share of the weighted mean (0 under a trimmed mean).
        weight: f32,
        /// Whether its norm was clipped.
        clipped: bool,
    },
    /// Not merged.
    Rejected(Rejection),
}

impl Verdict {
    /// Whether the peer was merged.
    pub fn is_accepted(&self) -> bool {
        matches!(self, Self::Accepted { .. })
    }
}

/// The merged update and a verdict per peer.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub struct Synthesis<M = Vec<f32>> {
    /// The merged update, flat in model order ([`synthesize`]), or what [`synthesize_with`]'s
    /// caller made of it.
    pub merged: M,
    /// One verdict per peer, in the order given.
    pub verdicts: Vec<Verdict>,
    /// Peers merged.
    pub accepted: usize,
    /// The reference norm peers were compared against.
    pub reference_norm: f32,
}

impl<M> Synthesis<M> {
    /// Rejections counted by [`Rejection::reason`], in first-seen order.
    pub fn rejects_by_reason(&self) -> Vec<(&'static str, usize)> {
        let mut counts: Vec<(&'static str, usize)> = Vec::new();
        for v in &self.verdicts {
            if let Verdict::Rejected(r) = v {
                match counts.iter_mut().find(|(reason, _)| *reason == r.reason()) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((r.reason(), 1)),
                }
            }
        }
        counts
    }

    /// The accepted peers' indices, the one whose update agrees most with the own update
    /// (highest cosine) first; ties keep the order given.
    ///
    /// ```
    /// use kindred_distill::{synthesize, SynthConfig, UpdateRef};
    /// let own = [1.0f32, 1.0, 0.0];
    /// let (near, far, away) = ([1.0f32, 0.9, 0.0], [1.0f32, 0.0, 1.0], [-1.0f32, -1.0, 0.0]);
    /// let peers = [&far, &away, &near].map(|u| UpdateRef { update: u, samples: 1 });
    /// let out = synthesize(UpdateRef { update: &own, samples: 1 }, &peers, &SynthConfig::default())?;
    /// assert_eq!(out.accepted_by_agreement(), vec![2, 0]);
    /// # Ok::<(), kindred_distill::SynthError>(())
    /// ```
    pub fn accepted_by_agreement(&self) -> Vec<usize> {
        let mut accepted: Vec<(usize, f32)> = self
            .verdicts
            .iter()
            .enumerate()
            .filter_map(|(i, v)| match v {
                Verdict::Accepted { cosine, .. } => Some((i, *cosine)),
                Verdict::Rejected(_) => None,
            })
            .collect();
        accepted.sort_by(|a, b| b.1.total_cmp(&a.1));
        accepted.into_iter().map(|(i, _)| i).collect()
    }
}

/// `‖v‖`, summed in f64 in position order (zeros add nothing, so either form gives the same).
fn norm(v: UpdateView<'_>) -> f64 {
    let mut sq = 0f64;
    v.nonzero()
        .for_each(|(_, x)| sq += f64::from(x) * f64::from(x));
    sq.sqrt()
}

/// Cosine between `peer` and `own` restricted to the coordinates the peer sent (its non-zero
/// entries), with `peer_norm = ‖peer‖`. For a dense peer this is the plain cosine; for a top-k
/// or sign-sparse one it asks "does the own update agree where the peer spoke?", which the plain
/// cosine cannot: a 1% top-k update has a cosine of ~0.1 with any dense update, agreeing or not.
/// `None` when the own update is zero on the peer's support.
fn support_cosine(own: UpdateView<'_>, peer: UpdateView<'_>, peer_norm: f64) -> Option<f64> {
    let (mut dot, mut own_sq) = (0f64, 0f64);
    peer.nonzero().for_each(|(i, y)| {
        let x = own.get(i);
        dot += f64::from(x) * f64::from(y);
        own_sq += f64::from(x) * f64::from(x);
    });
    (own_sq > 0.0 && peer_norm > 0.0).then(|| dot / (own_sq.sqrt() * peer_norm))
}

/// Merge the node's `own` update with `peers` under `config`.
///
/// ```
/// use kindred_distill::{synthesize, SynthConfig, UpdateRef};
/// let own = [1.0f32, 0.0, 1.0];
/// let good = [1.0f32, 0.2, 0.8];
/// let scaled: Vec<f32> = good.iter().map(|x| x * 100.0).collect();
/// let flipped: Vec<f32> = good.iter().map(|x| -x).collect();
/// let peers = [
///     UpdateRef { update: &good, samples: 10 },
///     UpdateRef { update: &scaled, samples: 10 },
///     UpdateRef { update: &flipped, samples: 10 },
/// ];
/// let own = UpdateRef { update: &own, samples: 10 };
/// let out = synthesize(own, &peers, &SynthConfig::default())?;
/// assert!(out.verdicts[0].is_accepted());
/// assert!(!out.verdicts[1].is_accepted());
/// assert!(!out.verdicts[2].is_accepted());
/// assert_eq!(out.accepted, 1);
/// # Ok::<(), kindred_distill::SynthError>(())
/// ```
///
/// # Errors
/// [`SynthError`] when the own update is not finite or the configuration is out of range;
/// problems with peers are verdicts, not errors.
pub fn synthesize<O: Contribution, C: Contribution>(
    own: O,
    peers: &[C],
    config: &SynthConfig,
) -> Result<Synthesis, SynthError> {
    synthesize_with(own, peers, config, |m| m.to_vec())
}

/// [`synthesize`], with the merged update handed to `merge` to read a range at a time
/// ([`MergeFill`]) rather than built whole: a hub distills its merge from it
/// ([`crate::Distiller::distill_from`]) with no model-sized vector for the merge itself.
///
/// ```
/// use kindred_distill::{synthesize, synthesize_with, SynthConfig, UpdateRef};
/// let own = [1.0f32, 0.0, 1.0, 0.5];
/// let peer = [0.8f32, 0.2, 1.2, 0.4];
/// let peers = [UpdateRef { update: &peer, samples: 10 }];
/// let own = UpdateRef { update: &own, samples: 10 };
/// let config = SynthConfig::default();
/// // The second half of the merge, without the first.
/// let half = synthesize_with(own, &peers, &config, |m| {
///     let mut out = vec![0.0; 2];
///     m.fill(2, &mut out);
///     out
/// })?;
/// assert_eq!(half.merged, synthesize(own, &peers, &config)?.merged[2..]);
/// # Ok::<(), kindred_distill::SynthError>(())
/// ```
///
/// # Errors
/// As [`synthesize`].
pub fn synthesize_with<O: Contribution, C: Contribution, M>(
    own: O,
    peers: &[C],
    config: &SynthConfig,
    merge: impl FnOnce(&MergeFill<'_>) -> M,
) -> Result<Synthesis<M>, SynthError> {
    config.validate()?;
    let own_samples = own.samples();
    let own = own.update();
    if let Some(index) = own.first_non_finite() {
        return Err(SynthError::OwnNonFinite { index });
    }
    let own_norm = norm(own);

    // Pass 1: validity and norms.
    let mut verdicts: Vec<Option<Verdict>> = Vec::with_capacity(peers.len());
    let mut norms = Vec::with_capacity(peers.len());
    for p in peers {
        let reject = |r| Some(Verdict::Rejected(r));
        let update = p.update();
        let v = if update.len() != own.len() {
            reject(Rejection::Length {
                expected: own.len(),
                found: update.len(),
            })
        } else if let Some(index) = update.first_non_finite() {
            reject(Rejection::NonFinite { index })
        } else if p.samples() == 0 {
            reject(Rejection::NoSamples)
        } else {
            None
        };
        let n = if v.is_none() { norm(update) } else { 0.0 };
        let v = if v.is_none() && n == 0.0 {
            reject(Rejection::ZeroNorm)
        } else {
            v
        };
        verdicts.push(v);
        norms.push(n);
    }

    // Reference norm: lower median of the own norm and the valid peers' norms.
    let mut pool: Vec<f64> = std::iter::once(own_norm)
        .chain(
            norms
                .iter()
                .zip(&verdicts)
                .filter(|(_, v)| v.is_none())
                .map(|(&n, _)| n),
        )
        .collect();
    pool.sort_by(f64::total_cmp);
    let reference = pool.get((pool.len() - 1) / 2).copied().unwrap_or(own_norm);

    // Pass 2: norm rule, then each surviving peer's cosine with the own update.
    let mut cosines: Vec<Option<f32>> = vec![None; peers.len()];
    for ((p, (v, &n)), c) in peers
        .iter()
        .zip(verdicts.iter_mut().zip(&norms))
        .zip(cosines.iter_mut())
    {
        if v.is_some() {
            continue;
        }
        let ratio = if reference > 0.0 {
            n / reference
        } else {
            f64::INFINITY
        };
        if ratio > f64::from(config.reject_norm_ratio) {
            *v = Some(Verdict::Rejected(Rejection::NormTooLarge {
                ratio: ratio as f32,
            }));
            continue;
        }
        *c = Some(if own_norm > 0.0 {
            // Zero own update on the peer's support: no evidence of agreement.
            support_cosine(own, p.update(), n).unwrap_or(0.0) as f32
        } else {
            // Nothing to compare with: trust the norm check alone.
            1.0
        });
    }
    let gate = cosine_gate(&cosines, config);

    // Pass 3: cosine gate and clipping.
    let mut accepted: Vec<(usize, f64, f32)> = Vec::new(); // (peer, scale, cosine)
    for (i, ((v, &n), c)) in verdicts.iter_mut().zip(&norms).zip(&cosines).enumerate() {
        let Some(cosine) = *c else {
            continue;
        };
        if cosine < gate {
            *v = Some(Verdict::Rejected(Rejection::CosineBelowGate { cosine }));
            continue;
        }
        let clip = f64::from(config.clip_norm_ratio) * reference;
        let (scale, clipped) = if n > clip {
            (clip / n, true)
        } else {
            (1.0, false)
        };
        *v = Some(Verdict::Accepted {
            cosine,
            weight: 0.0,
            clipped,
        });
        accepted.push((i, scale, cosine));
    }

    let rule = match config.rule {
        MergeRule::WeightedMean => {
            let own_claim = own_samples.clamp(1, MAX_SAMPLES);
            let own_w = own_claim as f64;
            // Claims of every merged update, the own first: peers' claims capped against them.
            let claims: Vec<u64> = std::iter::once(own_claim)
                .chain(
                    accepted
                        .iter()
                        .map(|&(i, _, _)| peers.get(i).map_or(0, Contribution::samples)),
                )
                .collect();
            let capped = cap_samples(&claims, config.max_samples_ratio);
            let weights: Vec<f64> = accepted
                .iter()
                .zip(capped.iter().skip(1))
                .map(|(&(_, _, c), &samples)| {
                    samples * f64::from(c.max(0.0)).powf(f64::from(config.similarity_power))
                })
                .collect();
            let total = own_w + weights.iter().sum::<f64>();
            for (&(i, _, _), &w) in accepted.iter().zip(&weights) {
                if let Some(Some(Verdict::Accepted { weight, .. })) = verdicts.get_mut(i) {
                    *weight = (w / total) as f32;
                }
            }
            let factors: Vec<(UpdateView<'_>, f64)> = accepted
                .iter()
                .zip(&weights)
                .filter_map(|(&(i, scale, _), &w)| Some((peers.get(i)?.update(), w * scale)))
                .collect();
            Rule::Weighted {
                own,
                own_w,
                factors,
                total,
            }
        }
        MergeRule::TrimmedMean { trim } => {
            let rows: Vec<(UpdateView<'_>, f32)> =
                std::iter::once((own, 1.0f32))
                    .chain(accepted.iter().filter_map(|&(i, scale, _)| {
                        peers.get(i).map(|p| (p.update(), scale as f32))
                    }))
                    .collect();
            let m = rows.len();
            let cut = ((m as f32 * trim).floor() as usize).min((m - 1) / 2);
            Rule::Trimmed { rows, cut }
        }
    };
    let merged = merge(&MergeFill {
        len: own.len(),
        rule,
    });

    let verdicts: Vec<Verdict> = verdicts
        .into_iter()
        .map(|v| v.unwrap_or(Verdict::Rejected(Rejection::ZeroNorm)))
        .collect();
    let n_accepted = accepted.len();
    tracing::debug!(
        peers = peers.len(),
        accepted = n_accepted,
        reference_norm = reference,
        "synthesized update"
    );
    Ok(Synthesis {
        merged,
        verdicts,
        accepted: n_accepted,
        reference_norm: reference as f32,
    })
}

/// The merged update of a [`synthesize_with`] call, read a range at a time: each element is
/// computed as [`synthesize`] computes it, whatever the ranges.
#[derive(Debug)]
pub struct MergeFill<'a> {
    len: usize,
    rule: Rule<'a>,
}

#[derive(Debug)]
enum Rule<'a> {
    /// `(own_w · own + Σ factor · peer) / total`, summed in f64, the own update first.
    Weighted {
        own: UpdateView<'a>,
        own_w: f64,
        factors: Vec<(UpdateView<'a>, f64)>,
        total: f64,
    },
    /// Per coordinate, the mean of the scaled rows left after cutting `cut` from each end.
    Trimmed {
        rows: Vec<(UpdateView<'a>, f32)>,
        cut: usize,
    },
}

impl MergeFill<'_> {
    /// Elements of the merged update.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the merged update has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Write the merged update's elements `start..start + out.len()` into `out` (zeros past
    /// its end).
    pub fn fill(&self, start: usize, out: &mut [f32]) {
        let end = start.saturating_add(out.len()).min(self.len);
        let (out, past) = out.split_at_mut(end.saturating_sub(start).min(out.len()));
        past.fill(0.0);
        match &self.rule {
            Rule::Weighted {
                own,
                own_w,
                factors,
                total,
            } => {
                // Each element summed in f64 (own first, then the peers in order), a block at a
                // time: a model-sized f64 accumulator would be twice the merge's memory.
                const BLOCK: usize = 1 << 14;
                let mut acc = vec![0f64; BLOCK.min(out.len())];
                for (at, out) in (start..).step_by(BLOCK).zip(out.chunks_mut(BLOCK)) {
                    let acc = &mut acc[..out.len()];
                    acc.fill(0.0);
                    own.add_scaled(at, *own_w, acc);
                    for &(update, f) in factors {
                        update.add_scaled(at, f, acc);
                    }
                    for (o, &a) in out.iter_mut().zip(acc.iter()) {
                        *o = (a / total) as f32;
                    }
                }
            }
            Rule::Trimmed { rows, cut } => {
                let m = rows.len();
                let keep = m.saturating_sub(2 * cut);
                let mut column = vec![0f32; m];
                for (j, o) in (start..).zip(out.iter_mut()) {
                    for (c, (row, scale)) in column.iter_mut().zip(rows) {
                        *c = row.get(j) * scale;
                    }
                    column.sort_by(f32::total_cmp);
                    *o = column.iter().skip(*cut).take(keep).sum::<f32>() / keep as f32;
                }
            }
        }
    }

    /// The whole merged update.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut merged = vec![0f32; self.len];
        self.fill(0, &mut merged);
        merged
    }

    /// The merged update as a [`crate::LayerSource`], formed a layer at a time.
    pub fn source(&self) -> crate::Filled<impl FnMut(usize, &mut [f32]) + '_> {
        crate::Filled::new(|start, out: &mut [f32]| self.fill(start, out))
    }
}

/// The merge weights of sample-count `claims`: each claim clamped to
/// [`kindred_proto::MAX_SAMPLES`], then to `max_ratio` times the lower median of the clamped
/// claims (taken as at least 1), in the order given. A `max_ratio` that is NaN or below 1 is
/// taken as 1; `f32::INFINITY` leaves the clamp to `MAX_SAMPLES` alone.
///
/// This is the rule every sample-weighted merge applies to claims it cannot check
/// ([`synthesize`] to its peers' under [`SynthConfig::max_samples_ratio`]; a plain mean or an
/// all-reduce of claimed counts should apply it to every claim), so a peer claiming
/// `u64::MAX` weighs no more than `max_ratio` median peers.
///
/// ```
/// use kindred_distill::cap_samples;
/// // Three honest claims of 100 and one liar: the liar weighs two median claims.
/// assert_eq!(cap_samples(&[100, 100, u64::MAX, 100], 2.0), vec![100.0, 100.0, 200.0, 100.0]);
/// // Honest claims within the ratio are unchanged.
/// assert_eq!(cap_samples(&[100, 300, 50], 4.0), vec![100.0, 300.0, 50.0]);
/// ```
pub fn cap_samples(claims: &[u64], max_ratio: f32) -> Vec<f64> {
    let clamped: Vec<u64> = claims.iter().map(|&c| c.min(MAX_SAMPLES)).collect();
    let mut sorted = clamped.clone();
    sorted.sort_unstable();
    let median = sorted
        .get(sorted.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(1)
        .max(1) as f64;
    let ratio = if max_ratio >= 1.0 {
        f64::from(max_ratio)
    } else {
        1.0
    };
    let cap = ratio * median;
    clamped.iter().map(|&c| (c as f64).min(cap)).collect()
}

/// The cosine below which a peer is rejected: `min_cosine`, or lower when the peers' cosines
/// (`None`: rejected by the norm rules) show that agreement is at noise level
/// ([`SynthConfig::noise_spreads`]).
fn cosine_gate(cosines: &[Option<f32>], config: &SynthConfig) -> f32 {
    let mut c: Vec<f32> = cosines.iter().flatten().copied().collect();
    if config.noise_spreads <= 0.0 || c.len() < SynthConfig::SPREAD_PEERS {
        return config.min_cosine;
    }
    let median = |v: &mut Vec<f32>| {
        v.sort_by(f32::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let mid = median(&mut c);
    let mut deviations: Vec<f32> = c.iter().map(|x| (x - mid).abs()).collect();
    let spread = 1.4826 * median(&mut deviations);
    config.min_cosine.min(mid - config.noise_spreads * spread)
}
