//! What a member accepts from its hub: the check on a merged update it did not merge itself.
//!
//! In the hub exchange (`kindred_routing::cohort`) one member merges the cohort's updates and
//! every other member applies the result. A hostile hub can send anything back, so a member
//! checks the merged update against its own before applying it:
//!
//! - **Length and finiteness**: the model's length, every value finite.
//! - **Direction**: the cosine with the member's own update must reach
//!   [`AggregateCheck::min_cosine`]. An honest merge of `c` updates contains the member's own
//!   (weight about `1/c`) and the task's common direction, so it leans toward the own update
//!   even when single updates are mostly minibatch noise (cosine about `1/√c` then); a
//!   sign-flipped merge points away, random noise sits at `±1/√len`.
//! - **Norm**: at most [`AggregateCheck::max_norm_ratio`] times the own update's norm.
//!   Averaging shrinks noise, so an honest merge is shorter than a member's own update; a
//!   scaled one is not.
//!
//! A member whose check fails applies its own update for the round and bans the hub for a
//! while (`kindred_routing::exchange::ExchangeConfig::ban_rounds`).
//!
//! - **Output layer** (a node with its own data): the merge's output layer must point at the
//!   member's own labels about as well as its own update's does ([`check_head`]). Another
//!   task's merge, its classes in another order, keeps the direction and the norm of an honest
//!   one (the first layer dominates both) and costs a member's data about as little in one
//!   round; its output layer's rows point at the wrong classes' features. One round's output
//!   layer is noisy, so a member bans a hub only at its second merge in a row that fails this
//!   check (it applies its own update both times).
//!
//! Before a member first pushes to a hub it also asks its own data about the hub's model
//! ([`check_by_data`]): another task's model, or a corrupted one, keeps little of what the
//! member's own training gained on its shard. The same rule checks each merge a node applies,
//! the model plus the merge against the model plus its own update.

use crate::update::UpdateView;

/// Thresholds of [`check_aggregate`]. [`AggregateCheck::default`] documents the defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AggregateCheck {
    /// Lowest cosine between the merged update and the member's own. Default 0.01, 2.3 times
    /// the `1/√len` spread of a random update's cosine for a 50,890-parameter model. The lowest
    /// cosine of an honest merge of 64 members, distilled again by the hub, with a member's sent
    /// update was 0.021-0.037 in rounds 15, 20 and 25 (`kindred-sim learn --setting iid --seed 1
    /// --policies kindred-hub`, now `kindred`, `RUST_LOG=kindred_simulator=debug`).
    pub min_cosine: f32,
    /// Largest norm of the merged update, as a multiple of the own update's. Default 2.
    pub max_norm_ratio: f32,
}

impl Default for AggregateCheck {
    fn default() -> Self {
        Self {
            min_cosine: 0.01,
            max_norm_ratio: 2.0,
        }
    }
}

/// Why a merged update was refused.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AggregateRejection {
    /// Not the own update's length.
    #[error("merged update has {found} values, expected {expected}")]
    Length {
        /// The own update's length.
        expected: usize,
        /// The merged update's.
        found: usize,
    },
    /// A NaN or infinity, or an own update of zero norm to compare with.
    #[error("merged update or own update is not finite and non-zero")]
    NotFinite,
    /// Points away from the own update.
    #[error("merged update's cosine {0} with the own update is below the minimum")]
    Direction(f32),
    /// Too long.
    #[error("merged update is {0} times the own update's norm")]
    Norm(f32),
    /// The member's own data refuses the model: it keeps only this share of the member's own
    /// gain over the common initial model ([`check_by_data`]).
    #[error("the model keeps {0} of the own model's gain on the member's data")]
    Data(f32),
    /// The merge's output layer does not point at the member's labels: its alignment with
    /// them ([`check_head`]) is this, below the minimum and well below the own update's.
    #[error("the merge's output layer aligns {0} with the member's labels")]
    Head(f32),
}

impl AggregateRejection {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Length { .. } => "length",
            Self::NotFinite => "not_finite",
            Self::Direction(_) => "direction",
            Self::Norm(_) => "norm",
            Self::Data(_) => "data",
            Self::Head(_) => "head",
        }
    }
}

/// Check a hub's merged update `aggregate` against the member's own update `own`; returns the
/// cosine between them when it passes.
///
/// ```
/// use kindred_distill::{AggregateCheck, AggregateRejection, check_aggregate};
///
/// let own = [1.0f32, 0.5, -0.25, 0.0];
/// let merged = [0.4f32, 0.3, 0.0, 0.1];
/// let check = AggregateCheck::default();
/// assert!(check_aggregate(&own, &merged, &check).is_ok());
/// let flipped: Vec<f32> = merged.iter().map(|x| -x).collect();
/// assert!(matches!(check_aggregate(&own, &flipped, &check), Err(AggregateRejection::Direction(_))));
/// let scaled: Vec<f32> = merged.iter().map(|x| 10.0 * x).collect();
/// assert!(matches!(check_aggregate(&own, &scaled, &check), Err(AggregateRejection::Norm(_))));
/// ```
///
/// # Errors
/// [`AggregateRejection`] saying which rule failed.
pub fn check_aggregate<'o, 'a>(
    own: impl Into<UpdateView<'o>>,
    aggregate: impl Into<UpdateView<'a>>,
    check: &AggregateCheck,
) -> Result<f32, AggregateRejection> {
    let (own, aggregate) = (own.into(), aggregate.into());
    if aggregate.len() != own.len() {
        return Err(AggregateRejection::Length {
            expected: own.len(),
            found: aggregate.len(),
        });
    }
    // Each sum in position order; zeros add nothing, so sparse updates give the dense
    // figures.
    let own2: f64 = own
        .nonzero()
        .map(|(_, o)| f64::from(o) * f64::from(o))
        .sum();
    let (mut dot, mut agg2) = (0f64, 0f64);
    for (i, a) in aggregate.nonzero() {
        let (o, a) = (f64::from(own.get(i)), f64::from(a));
        dot += o * a;
        agg2 += a * a;
    }
    if !(dot.is_finite() && own2.is_finite() && agg2.is_finite()) || own2 == 0.0 {
        return Err(AggregateRejection::NotFinite);
    }
    let ratio = (agg2 / own2).sqrt() as f32;
    if ratio > check.max_norm_ratio {
        return Err(AggregateRejection::Norm(ratio));
    }
    let cosine = if agg2 == 0.0 {
        0.0
    } else {
        (dot / (own2 * agg2).sqrt()) as f32
    };
    if cosine < check.min_cosine {
        return Err(AggregateRejection::Direction(cosine));
    }
    Ok(cosine)
}

/// Whether a member joining a cohort adopts its hub's model `hub_model` in place of its own
/// `own_model` (both trained from `origin`): only if the two differ by at most `max_ratio`
/// times the member's own cumulative update `own_model − origin`. Models of one task trained
/// from one origin differ by less than either has moved; a scaled, flipped or random model
/// differs by more. Returns the ratio when it passes.
///
/// The hub's model is read once, in order, so a caller holding it as an update from `origin`
/// (what a snapshot carries) passes `origin + update` without building it.
///
/// ```
/// use kindred_distill::check_adoption;
///
/// let origin = [0.0, 0.0, 0.0];
/// let own = [1.0, 0.5, -0.5];
/// assert!(check_adoption(&own, [0.8, 0.6, -0.4], &origin, 1.0).is_ok());
/// assert!(check_adoption(&own, [-1.0, -0.5, 0.5], &origin, 1.0).is_err()); // flipped
/// ```
///
/// # Errors
/// [`AggregateRejection::Length`], [`AggregateRejection::NotFinite`] (also for a member that
/// has not moved from `origin`), or [`AggregateRejection::Norm`] with the ratio.
pub fn check_adoption(
    own_model: &[f32],
    hub_model: impl IntoIterator<Item = f32>,
    origin: &[f32],
    max_ratio: f32,
) -> Result<f32, AggregateRejection> {
    if origin.len() != own_model.len() {
        return Err(AggregateRejection::Length {
            expected: own_model.len(),
            found: origin.len(),
        });
    }
    let mut hub_model = hub_model.into_iter();
    let (mut moved, mut apart, mut read) = (0f64, 0f64, 0usize);
    for ((&o, h), &z) in own_model.iter().zip(hub_model.by_ref()).zip(origin) {
        moved += (f64::from(o) - f64::from(z)).powi(2);
        apart += (f64::from(h) - f64::from(o)).powi(2);
        read += 1;
    }
    let found = read + hub_model.count();
    if found != own_model.len() {
        return Err(AggregateRejection::Length {
            expected: own_model.len(),
            found,
        });
    }
    if !(moved.is_finite() && apart.is_finite()) || moved == 0.0 {
        return Err(AggregateRejection::NotFinite);
    }
    let ratio = (apart / moved).sqrt() as f32;
    if ratio > max_ratio {
        return Err(AggregateRejection::Norm(ratio));
    }
    Ok(ratio)
}

/// Accuracies on a member's own training shard: of the common initial model all members
/// started from, of the member's own model, and of a model it is offered (its hub's). What
/// [`check_by_data`] compares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardScores {
    /// The common initial model's (the swarm's `origin`): what the shard scores untrained.
    pub origin: f32,
    /// The member's own model's.
    pub own: f32,
    /// The offered model's.
    pub offered: f32,
}

impl ShardScores {
    /// The share of the member's own gain over the initial model that the offered model keeps
    /// on the member's data: `(offered − origin) / (own − origin)`. `None` when the own model has
    /// not gained (nothing to measure against) or a score is not finite.
    ///
    /// ```
    /// use kindred_distill::ShardScores;
    /// let s = ShardScores { origin: 0.1, own: 0.9, offered: 0.5 };
    /// assert!((s.gain_share().unwrap() - 0.5).abs() < 1e-6);
    /// assert_eq!(ShardScores { origin: 0.1, own: 0.1, offered: 0.5 }.gain_share(), None);
    /// ```
    pub fn gain_share(&self) -> Option<f32> {
        let gain = self.own - self.origin;
        let share = (self.offered - self.origin) / gain;
        (gain > 0.0 && share.is_finite()).then_some(share)
    }
}

/// Lowest share of its own gain that a member's data must see a hub's model keep
/// ([`check_by_data`]). Measured after two rounds of local training
/// (`kindred-sim learn --nodes 64 --setting iid|rotation|label --seed 1..8`, the shares of every
/// model a joining member checked): a model of the member's own task kept 0.49-1.29 (iid, whose
/// 125-digit shards its own model fits most closely, 0.49-1.21), a model of another rotation
/// 0.27 at most (−0.04 to 0.27). A hostile hub's scaled, flipped or noisy model keeps about
/// nothing.
pub const MIN_GAIN_SHARE: f32 = 0.4;

/// Whether a member's own data accepts a model it is offered: the offered model must keep at
/// least `min_share` of the gain the member's own training made over the common initial model on
/// the member's shard ([`ShardScores::gain_share`]). Returns the share, or `None` when the own
/// model has not gained yet and the data cannot tell (the member then relies on the other checks).
///
/// Why a share of the gain and not a drop in accuracy: a member's own model fits its shard, the
/// more so the smaller the shard, so a model of its own task trained on other shards scores
/// below it on that shard by an amount that depends on the shard's size (iid, 125 digits: up to
/// 39 points; rotation, 500 digits: up to 25), while another task's model loses 40-80 points.
/// Measured against what the member gained over the untrained model, the two sit apart on every
/// setting (see [`MIN_GAIN_SHARE`]).
///
/// ```
/// use kindred_distill::{AggregateRejection, MIN_GAIN_SHARE, ShardScores, check_by_data};
///
/// // Its own task's model, trained on other shards: 55% of the member's gain kept.
/// let same = ShardScores { origin: 0.10, own: 0.85, offered: 0.51 };
/// assert!(check_by_data(same, MIN_GAIN_SHARE).is_ok());
/// // Another task's model barely beats the untrained one on this member's data.
/// let other = ShardScores { origin: 0.10, own: 0.80, offered: 0.22 };
/// assert!(matches!(check_by_data(other, MIN_GAIN_SHARE), Err(AggregateRejection::Data(_))));
/// ```
///
/// # Errors
/// [`AggregateRejection::Data`] with the share when it is below `min_share`;
/// [`AggregateRejection::NotFinite`] when a score is not a finite number.
pub fn check_by_data(
    scores: ShardScores,
    min_share: f32,
) -> Result<Option<f32>, AggregateRejection> {
    let ShardScores {
        origin,
        own,
        offered,
    } = scores;
    if !(origin.is_finite() && own.is_finite() && offered.is_finite()) {
        return Err(AggregateRejection::NotFinite);
    }
    match scores.gain_share() {
        Some(share) if share < min_share => Err(AggregateRejection::Data(share)),
        share => Ok(share),
    }
}

/// How far a merge's output layer may align with the member's own labels below what the
/// member's own update reaches before it is refused ([`check_head`]; the trainer measures both,
/// `kindred_trainer::Model::head_alignment`). A merge at [`MIN_HEAD_ALIGNMENT`] or above always
/// passes; one below 0, pointing away from the member's labels, never does.
///
/// Measured on every merge a member checked (`kindred-sim learn --nodes 64 --setting
/// iid|label|rotation --seed 2 --policies kindred`, 1,626-1,736 checks a run, 2026-11-29):
/// honest merges 0.29-0.91 (1st percentile 0.37-0.50), steady from the first round to the last;
/// the same merges with the output layer's rows rolled by one class, another task's merge,
/// −0.35 to 0.11 (99th percentile at most 0.03); the member's own update 1st percentile
/// 0.05-0.10, min −0.02: one round's update is minibatch noise late in training. A merge of a
/// cohort of two is noisier: in the node's NAT test (`tests/tests/nat_swarm.rs`, cohorts of
/// two, 8 runs, 251 honest merges, 2026-11-30) they read 0.009-0.84, 250 of them at most 0.14
/// below the member's own update and one 0.13 against the member's 0.38. The rule refuses that
/// one (0.4%), and 0-0.7% of the rolled merges pass it (in rounds where the member's own
/// update barely pointed at its labels either): so a refusal by it alone is a doubt, and the
/// exchange bans a hub at its second doubtful merge in a row
/// (`kindred_routing::exchange::MergeVerdict::Doubt`).
pub const HEAD_MARGIN: f32 = 0.2;

/// Alignment at or above which a merge's output layer always passes [`check_head`].
pub const MIN_HEAD_ALIGNMENT: f32 = 0.2;

/// Fewest labelled examples from which a member's class means tell an honest merge's output
/// layer from another task's ([`check_head`]). Shards of 125 digits separated them at every
/// merge ([`MIN_HEAD_ALIGNMENT`]); from shards of 8 (`kindred-sim learn --nodes 1000`) the class
/// means are mostly sampling noise, and honest merges fell to about 0 in a cohort's first rounds.
pub const MIN_HEAD_EXAMPLES: usize = 100;

/// How the output layers of a merge and of the member's own update align with the member's
/// labels (`kindred_trainer::Model::head_alignment`), on how many examples. What
/// [`check_head`] reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadScores {
    /// The merge's alignment.
    pub merge: f32,
    /// The member's own update's.
    pub own: f32,
    /// Labelled examples both were measured on.
    pub examples: usize,
}

/// Whether a member accepts a merge by its output layer: refused when it points away from
/// the member's labels (alignment below 0), or aligns with them less than
/// [`MIN_HEAD_ALIGNMENT`] and more than [`HEAD_MARGIN`] below the member's own update. Returns
/// the merge's alignment, or `None` when there are fewer than [`MIN_HEAD_EXAMPLES`] examples
/// and the data cannot tell.
///
/// ```
/// use kindred_distill::{AggregateRejection, HeadScores, check_head};
///
/// let at = |merge, own| HeadScores { merge, own, examples: 500 };
/// assert_eq!(check_head(at(0.6, 0.3)), Ok(Some(0.6)));
/// // A noisy round: the member's own update barely points at its labels either.
/// assert_eq!(check_head(at(0.1, 0.15)), Ok(Some(0.1)));
/// // Another task's classes: its rows point at other classes' features.
/// assert_eq!(check_head(at(-0.1, 0.05)), Err(AggregateRejection::Head(-0.1)));
/// assert_eq!(check_head(at(0.05, 0.3)), Err(AggregateRejection::Head(0.05)));
/// // Eight examples cannot tell.
/// let few = HeadScores { examples: 8, ..at(-0.1, 0.3) };
/// assert_eq!(check_head(few), Ok(None));
/// ```
///
/// # Errors
/// [`AggregateRejection::Head`] with the merge's alignment, [`AggregateRejection::NotFinite`]
/// for NaN.
pub fn check_head(scores: HeadScores) -> Result<Option<f32>, AggregateRejection> {
    let HeadScores {
        merge,
        own,
        examples,
    } = scores;
    if !(merge.is_finite() && own.is_finite()) {
        return Err(AggregateRejection::NotFinite);
    }
    if examples < MIN_HEAD_EXAMPLES {
        return Ok(None);
    }
    if merge < 0.0 || (merge < MIN_HEAD_ALIGNMENT && merge < own - HEAD_MARGIN) {
        return Err(AggregateRejection::Head(merge));
    }
    Ok(Some(merge))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_adoption_check_counts_the_hub_model_it_reads() {
        let (own, origin) = ([1.0f32, 0.5, -0.5], [0.0f32; 3]);
        let length = |found| Err(AggregateRejection::Length { expected: 3, found });
        assert_eq!(check_adoption(&own, [1.0, 0.5], &origin, 1.0), length(2));
        assert_eq!(check_adoption(&own, [1.0; 5], &origin, 1.0), length(5));
        assert_eq!(check_adoption(&own, [1.0; 3], &origin[..2], 1.0), length(2));
        // The same verdict from the model or from the origin plus its update.
        let origin = [0.25f32, -0.5, 1.0];
        let own = [1.25f32, 0.0, 0.5];
        let update = [0.9f32, 0.6, -0.4];
        let model: Vec<f32> = origin.iter().zip(&update).map(|(o, u)| o + u).collect();
        let from_update = origin.iter().zip(&update).map(|(o, u)| o + u);
        assert_eq!(
            check_adoption(&own, model.iter().copied(), &origin, 1.0),
            check_adoption(&own, from_update, &origin, 1.0)
        );
        assert!(check_adoption(&own, model, &origin, 1.0).is_ok());
    }

    #[test]
    fn bad_shapes_and_values_are_refused() {
        let c = AggregateCheck::default();
        assert!(matches!(
            check_aggregate(&[1.0f32, 2.0], &[1.0f32], &c),
            Err(AggregateRejection::Length {
                expected: 2,
                found: 1
            })
        ));
        assert_eq!(
            check_aggregate(&[1.0f32, 2.0], &[f32::NAN, 1.0], &c),
            Err(AggregateRejection::NotFinite)
        );
        assert_eq!(
            check_aggregate(&[0.0f32, 0.0], &[1.0f32, 1.0], &c),
            Err(AggregateRejection::NotFinite)
        );
        assert_eq!(
            check_aggregate(&[1.0f32, 0.0], &[0.0f32, 0.0], &c),
            Err(AggregateRejection::Direction(0.0))
        );
    }

    #[test]
    fn the_data_check_reads_the_share_of_the_own_gain() {
        let at = |offered| ShardScores {
            origin: 0.1,
            own: 0.6,
            offered,
        };
        // 0.3 − 0.1 is 40% of 0.6 − 0.1: exactly at the bound passes.
        assert!(check_by_data(at(0.3), MIN_GAIN_SHARE).is_ok());
        assert!(matches!(
            check_by_data(at(0.29), MIN_GAIN_SHARE),
            Err(AggregateRejection::Data(s)) if (s - 0.38).abs() < 1e-5
        ));
        // Worse than the untrained model: a negative share.
        assert!(matches!(
            check_by_data(at(0.05), MIN_GAIN_SHARE),
            Err(AggregateRejection::Data(s)) if s < 0.0
        ));
        // Better than the member's own model.
        assert_eq!(check_by_data(at(0.85), MIN_GAIN_SHARE), Ok(Some(1.5)));
        // No gain of its own yet: the data cannot tell.
        let untrained = ShardScores {
            origin: 0.1,
            own: 0.1,
            offered: 0.0,
        };
        assert_eq!(check_by_data(untrained, MIN_GAIN_SHARE), Ok(None));
        let nan = ShardScores {
            origin: 0.1,
            own: f32::NAN,
            offered: 0.5,
        };
        assert_eq!(
            check_by_data(nan, MIN_GAIN_SHARE),
            Err(AggregateRejection::NotFinite)
        );
    }

    proptest! {
        /// A share at or above the bound passes and one below it fails, whatever the scores.
        #[test]
        fn the_data_check_agrees_with_the_share(
            origin in 0.0f32..1.0,
            gain in 0.01f32..1.0,
            offered in -0.5f32..1.5,
            min_share in 0.0f32..1.0,
        ) {
            let scores = ShardScores { origin, own: origin + gain, offered };
            let share = scores.gain_share();
            prop_assert!(share.is_some());
            let share = share.unwrap_or_default();
            match check_by_data(scores, min_share) {
                Ok(s) => prop_assert!(s == Some(share) && share >= min_share),
                Err(AggregateRejection::Data(s)) => prop_assert!(s == share && share < min_share),
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }

        /// The mean of the own update and `k` others that share a common direction passes; its
        /// negation and a ×10 copy do not.
        #[test]
        fn an_honest_mean_passes_and_its_corruptions_do_not(
            seed in any::<u64>(),
            k in 1usize..64,
        ) {
            let len = 2_000;
            let mut rng = kindred_kernels::rng::SplitMix64::new(seed);
            let common: Vec<f32> = (0..len).map(|_| rng.next_gaussian() as f32).collect();
            let mut noisy = || -> Vec<f32> {
                common.iter().map(|c| 0.5 * c + rng.next_gaussian() as f32).collect()
            };
            let own = noisy();
            let mut mean = own.clone();
            for _ in 0..k {
                for (m, x) in mean.iter_mut().zip(noisy()) {
                    *m += x;
                }
            }
            mean.iter_mut().for_each(|m| *m /= (k + 1) as f32);
            let c = AggregateCheck::default();
            prop_assert!(check_aggregate(&own, &mean, &c).is_ok());
            let flipped: Vec<f32> = mean.iter().map(|x| -x).collect();
            prop_assert!(check_aggregate(&own, &flipped, &c).is_err());
            let scaled: Vec<f32> = mean.iter().map(|x| 10.0 * x).collect();
            prop_assert!(check_aggregate(&own, &scaled, &c).is_err());
        }
    }
}
