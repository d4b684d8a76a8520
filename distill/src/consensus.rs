//! Consensus: moving a node's model part of the way toward a partner's.
//!
//! Why: [`crate::synthesize`] merges *updates*, and a partner's update is computed at the
//! partner's parameters and pulls them toward the partner's data. Nothing pulls the nodes'
//! models toward each other, so each drifts toward its own shard, and past a few rounds a
//! partner's update is partly about a model the node no longer has. `kindred-sim learn` measures
//! the drift as the gap between the nodes' accuracy and their cluster's consensus model (the
//! mean of their parameters). Gossip averaging closes it: now and then a node fetches one
//! partner's model and moves a share of the way toward it.
//!
//! A [`snapshot`] is a model as its cumulative update from the swarm's common initial model,
//! in a packet body of int8 layers (one scale each): the same wire format, decoder and size
//! bounds as any outcome-packet body, at 1 byte per parameter or less (a layer whose quantised
//! values are mostly zero goes sparse). [`pull`] validates what came back and bounds the step
//! by the node's own motion this round, so a snapshot from a hostile peer moves a node no
//! farther than a clipped update would.
//!
//! ```
//! use kindred_distill::{PullConfig, decode, pull, snapshot};
//! use kindred_proto::{DType, LayerSpec, ModelSpec};
//!
//! let spec = ModelSpec::new(vec![LayerSpec::new("w", [4], DType::F32)])?;
//! let origin = vec![0.0; 4];
//! let partner = snapshot(&[1.0, 1.0, 1.0, 1.0], &origin, &spec)?;
//! let mut mine = vec![0.0; 4];
//! let p = pull(&mut mine, &origin, &decode(&partner, &spec)?, 10.0, &PullConfig::default())?;
//! assert_eq!(mine, vec![0.5; 4]);
//! assert!(!p.clipped);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use kindred_kernels::{Backend, Kernels, QuantizeError, Rounding};
use kindred_proto::{
    BodyEncoder, DenseValues, EncodedBody, LayerPayload, ModelSpec, PacketBody, TopK,
    encoded_layer_len,
};

use crate::layout::Layout;

/// Why a snapshot could not be made or used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConsensusError {
    /// Parameters, origin and snapshot differ in length.
    #[error("length {found}, expected {expected}")]
    Length {
        /// The node's parameter count.
        expected: usize,
        /// What was given.
        found: usize,
    },
    /// A value is NaN or infinite.
    #[error("non-finite value at {index}")]
    NonFinite {
        /// First offending position.
        index: usize,
    },
    /// An invalid [`PullConfig`].
    #[error("invalid pull configuration: {0}")]
    Config(&'static str),
}

/// How far a node moves toward a partner's model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PullConfig {
    /// Share of the distance to the partner's model covered, in (0, 1]. Default 0.5: the two
    /// models' average, the classic gossip-averaging step.
    pub share: f32,
    /// The step's norm is clipped to this many times `reference_norm` (the norm of the node's
    /// own merged update this round). Default 2: honest partners need 0.2-1.2 on MNIST
    /// (`kindred-sim learn --setting iid --policies kindred-pairwise --snapshot-every 1`), and a
    /// hostile snapshot moves a node at most twice its own round's motion.
    pub max_step_ratio: f32,
}

impl Default for PullConfig {
    fn default() -> Self {
        Self {
            share: 0.5,
            max_step_ratio: 2.0,
        }
    }
}

impl PullConfig {
    fn validate(&self) -> Result<(), ConsensusError> {
        if !(self.share > 0.0 && self.share <= 1.0) {
            return Err(ConsensusError::Config("share must be in (0, 1]"));
        }
        if !(self.max_step_ratio.is_finite() && self.max_step_ratio >= 0.0) {
            return Err(ConsensusError::Config(
                "max_step_ratio must be finite and not negative",
            ));
        }
        Ok(())
    }
}

/// What a [`pull`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pull {
    /// Norm of the step taken.
    pub step_norm: f64,
    /// Norm of the step before clipping.
    pub wanted_norm: f64,
    /// Whether the step was clipped.
    pub clipped: bool,
}

fn check_finite(values: &[f32]) -> Result<(), ConsensusError> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(ConsensusError::NonFinite { index }),
        None => Ok(()),
    }
}

/// Which merge partner to fetch a snapshot from: one of the better-agreeing half of
/// `by_agreement` (this round's merged partners, best first, as
/// [`crate::Synthesis::accepted_by_agreement`] orders them), chosen by `word`, a random word.
///
/// Why not any partner: in a node's first rounds a partner of another task can pass the
/// synthesis cosine gate at a cosine of 0.2-0.3 while the node's own task sits at 0.5-0.6, and
/// a pull toward that partner's model moves the node half way into the other task; its
/// embedding then follows its model, and it finds only that task from then on. In `kindred-sim
/// learn --nodes 1000 --setting label --seed 1` six nodes of 1,000 ended that way (below 6%
/// accuracy) with a pick among all partners, two with a pick among the better half. Why not
/// the best alone: pulling always toward the closest partner draws pairs of nodes into
/// near-copies of each other (1,000 nodes: 82.5% instead of 84.0%); the half keeps the pull
/// spread over the task.
///
/// ```
/// use kindred_distill::snapshot_partner;
/// let partners = ["a", "b", "c", "d", "e"];
/// for word in 0..64 {
///     let p = snapshot_partner(&partners, word).unwrap_or("none");
///     assert!(["a", "b", "c"].contains(&p));
/// }
/// assert_eq!(snapshot_partner::<&str>(&[], 7), None);
/// ```
pub fn snapshot_partner<T: Copy>(by_agreement: &[T], word: u64) -> Option<T> {
    snapshot_partners(by_agreement, word).next()
}

/// The partners to ask for a snapshot, in turn: [`snapshot_partner`]'s pick first, then the
/// rest of the better-agreeing half after it (wrapping round), each once.
///
/// Why: a pick can have nothing to serve (a partner that has not finished a round yet, or one
/// that refuses, or sends a stale or invalid snapshot); the next of the same half is as good a
/// choice, so a node asks it while the round's deadline allows rather than skip the pull.
///
/// ```
/// use kindred_distill::{snapshot_partner, snapshot_partners};
/// let partners = ["a", "b", "c", "d", "e"];
/// let order: Vec<_> = snapshot_partners(&partners, 4).collect();
/// assert_eq!(order, ["b", "c", "a"]);
/// assert_eq!(snapshot_partner(&partners, 4), Some("b"));
/// assert_eq!(snapshot_partners::<&str>(&[], 7).count(), 0);
/// ```
pub fn snapshot_partners<T: Copy>(by_agreement: &[T], word: u64) -> impl Iterator<Item = T> + '_ {
    let half = by_agreement.len().div_ceil(2);
    let first = match half {
        0 => 0,
        h => (word % h as u64) as usize,
    };
    // `(first + k) % half` is within the slice; `get` keeps that free of indexing.
    (0..half).filter_map(move |k| by_agreement.get((first + k) % half).copied())
}

fn check_len(expected: usize, found: usize) -> Result<(), ConsensusError> {
    if expected == found {
        Ok(())
    } else {
        Err(ConsensusError::Length { expected, found })
    }
}

/// The model `params` as a packet body: its cumulative update `params − origin`, one int8
/// layer per layer of `spec`, each with the scale `max |value| / 127` (`Kernels::quantize_i8`,
/// round to nearest). A layer goes as a sparse [`TopK`] of its non-zero quantised values when
/// that is smaller than dense int8; it decodes to the same values.
///
/// Why int8: a pull moves halfway toward the snapshot, so its error enters the model at half
/// of one quantisation step per layer, well under the minibatch noise of a round; f16 costs
/// twice the bytes for no accuracy (`kindred-sim learn --setting iid|label|rotation --seed
/// 1|2|3`, BENCHMARKS.md "Int8 snapshots").
///
/// # Errors
/// [`ConsensusError`] when lengths differ from `spec`, or a value is not finite.
pub fn snapshot(
    params: &[f32],
    origin: &[f32],
    spec: &ModelSpec,
) -> Result<PacketBody, ConsensusError> {
    let mut layers = Vec::with_capacity(spec.layers().len());
    snapshot_layers(params, origin, spec, |layer| layers.push(layer))?;
    Ok(PacketBody { layers })
}

/// [`snapshot`], encoded as each layer is quantised ([`BodyEncoder`]): the layers are never
/// held together, and the bytes once. What a node seals its model with
/// ([`kindred_proto::seal_snapshot_encoded`]): at 10^9 parameters the body alone is 1 GB.
///
/// ```
/// use kindred_distill::{snapshot, snapshot_encoded};
/// use kindred_proto::{DType, LayerSpec, ModelSpec, encode_body};
///
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [4], DType::F32)])?;
/// let (params, origin) = ([0.5, -1.0, 0.0, 2.0], [0.0; 4]);
/// let encoded = snapshot_encoded(&params, &origin, &spec)?;
/// assert_eq!(encoded.bytes, encode_body(&snapshot(&params, &origin, &spec)?));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// As [`snapshot`].
pub fn snapshot_encoded(
    params: &[f32],
    origin: &[f32],
    spec: &ModelSpec,
) -> Result<EncodedBody, ConsensusError> {
    // Dense int8 is the most a layer takes (a sparse one is sent only when smaller): room for
    // that is reserved, and only what the layers fill is ever touched.
    let most = spec
        .layers()
        .iter()
        .map(|l| l.numel() as usize + 16)
        .fold(0usize, usize::saturating_add);
    let mut encoder = BodyEncoder::new(spec.layers().len(), most);
    snapshot_layers(params, origin, spec, |layer| encoder.push(&layer))?;
    Ok(encoder.finish())
}

/// Quantise each layer of `params − origin` in turn, handing it to `each`.
fn snapshot_layers(
    params: &[f32],
    origin: &[f32],
    spec: &ModelSpec,
    mut each: impl FnMut(LayerPayload),
) -> Result<(), ConsensusError> {
    let layout = Layout::new(spec);
    check_len(layout.len(), params.len())?;
    check_len(layout.len(), origin.len())?;
    // The distiller's own int8 quantiser (`Kernels::quantize_i8`: max |x| / 127, vectorised,
    // refuses non-finite input, keeps 127 · scale finite as receivers require), a piece of a
    // layer at a time: the difference is never held in f32 beyond one piece (a large
    // model's embedding is a tenth of it or more).
    const PIECE: usize = 1 << 16;
    let backend = Backend::cpu();
    let mut diff = Vec::with_capacity(PIECE);
    for range in layout.ranges() {
        let start = range.start;
        let (Some(p), Some(o)) = (params.get(range.clone()), origin.get(range)) else {
            return Err(ConsensusError::Length {
                expected: layout.len(),
                found: params.len(),
            });
        };
        let abs_max = abs_max_of_difference(p, o)
            .map_err(|i| ConsensusError::NonFinite { index: start + i })?;
        let mut values = vec![0i8; p.len()];
        let mut scale = 0.0;
        for (k, ((p, o), q)) in p
            .chunks(PIECE)
            .zip(o.chunks(PIECE))
            .zip(values.chunks_mut(PIECE))
            .enumerate()
        {
            diff.clear();
            diff.extend(p.iter().zip(o).map(|(x, o)| x - o));
            scale = backend
                .quantize_i8_piece(&diff, abs_max, k * PIECE, Rounding::Nearest, q)
                .map_err(|e| match e {
                    QuantizeError::NonFinite { index, .. } => ConsensusError::NonFinite {
                        index: start + k * PIECE + index,
                    },
                    // Same lengths by construction; reported as such if that ever changes.
                    _ => ConsensusError::Length {
                        expected: diff.len(),
                        found: q.len(),
                    },
                })?;
        }
        each(smaller_int8(values, scale));
    }
    Ok(())
}

/// max |p − o| over a layer, or the position of the first difference that is not finite.
fn abs_max_of_difference(p: &[f32], o: &[f32]) -> Result<f32, usize> {
    // One pass without branches: `d · 0` is NaN exactly when `d` is not finite.
    let (max, probe) = p.iter().zip(o).fold((0f32, 0f32), |(m, z), (x, o)| {
        let d = x - o;
        (m.max(d.abs()), z + d * 0.0)
    });
    if max.is_finite() && !probe.is_nan() {
        return Ok(max);
    }
    Err(p
        .iter()
        .zip(o)
        .position(|(x, o)| !(x - o).is_finite())
        .unwrap_or(0))
}

/// The int8 layer `values · scale` as whichever payload is smaller on the wire: dense, or
/// sparse with exactly its non-zero values (a [`TopK`] whose zeros are the values that
/// quantised to zero). Both decode to the same numbers.
///
/// Why: a young model's cumulative update is a sum of a few sparse merges, and in any
/// heavy-tailed layer most values round to zero at `max |x| / 127`; a snapshot then costs
/// what it carries, not a byte per parameter.
fn smaller_int8(values: Vec<i8>, scale: f32) -> LayerPayload {
    // Sparse needs at least one byte per kept index and value: never smaller past half.
    if values.iter().filter(|&&v| v != 0).count() * 2 >= values.len() {
        return LayerPayload::Dense(DenseValues::Int8 { values, scale });
    }
    // A layer's length fits in u32: `ModelSpec` bounds it by `MAX_LAYER_ELEMS`.
    let (indices, kept): (Vec<u32>, Vec<i8>) = values
        .iter()
        .enumerate()
        .filter(|&(_, &v)| v != 0)
        .map(|(i, &v)| (i as u32, v))
        .unzip();
    let sparse = LayerPayload::TopK(TopK {
        len: values.len() as u32,
        indices,
        values: kept,
        scale,
    });
    let dense = LayerPayload::Dense(DenseValues::Int8 { values, scale });
    if encoded_layer_len(&sparse) < encoded_layer_len(&dense) {
        sparse
    } else {
        dense
    }
}

/// Move `params` a share of the way toward the partner model `origin + partner` (a decoded
/// [`snapshot`]), the step's norm clipped to `max_step_ratio · reference_norm`.
///
/// Nothing is changed on error.
///
/// # Errors
/// [`ConsensusError`] on a length mismatch, a non-finite input or an invalid configuration.
pub fn pull(
    params: &mut [f32],
    origin: &[f32],
    partner: &[f32],
    reference_norm: f64,
    config: &PullConfig,
) -> Result<Pull, ConsensusError> {
    config.validate()?;
    check_len(params.len(), origin.len())?;
    check_len(params.len(), partner.len())?;
    check_finite(partner)?;
    let share = f64::from(config.share);
    let wanted_norm = params
        .iter()
        .zip(origin)
        .zip(partner)
        .map(|((&x, &o), &c)| {
            let d = share * (f64::from(o) + f64::from(c) - f64::from(x));
            d * d
        })
        .sum::<f64>()
        .sqrt();
    let limit = f64::from(config.max_step_ratio) * reference_norm.max(0.0);
    let (scale, clipped) = if wanted_norm > limit {
        (
            if wanted_norm > 0.0 {
                limit / wanted_norm
            } else {
                0.0
            },
            true,
        )
    } else {
        (1.0, false)
    };
    let f = share * scale;
    for ((x, &o), &c) in params.iter_mut().zip(origin).zip(partner) {
        let target = f64::from(o) + f64::from(c);
        *x = (f64::from(*x) + f * (target - f64::from(*x))) as f32;
    }
    Ok(Pull {
        step_norm: wanted_norm * scale,
        wanted_norm,
        clipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode;
    use kindred_proto::{
        CompressionSummary, DType, HeaderFields, LayerSpec, decode_body, decode_header,
        encode_body, seal,
    };
    use libp2p_identity::ed25519;
    use proptest::prelude::*;

    fn spec() -> ModelSpec {
        ModelSpec::new(vec![
            LayerSpec::new("w", [3, 4], DType::F32),
            LayerSpec::new("b", [4], DType::F32),
        ])
        .unwrap()
    }

    #[test]
    fn a_snapshot_round_trips_the_cumulative_update_through_the_wire() {
        let spec = spec();
        let origin: Vec<f32> = (0..16).map(|i| i as f32 * 0.1).collect();
        let params: Vec<f32> = origin.iter().map(|o| o + 0.25).collect();
        let body = snapshot(&params, &origin, &spec).unwrap();
        let sealed = seal(
            &ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([7u8; 32]).unwrap()),
            &spec,
            HeaderFields {
                round: 3,
                unix_ms: 0,
                samples: 1,
                loss: 0.0,
                embedding: kindred_proto::Embedding::default(),
            },
            &body,
        )
        .unwrap();
        let bytes = &sealed.body_bytes;
        // One byte per parameter plus per-layer framing and scales.
        assert!(bytes.len() >= 16 && bytes.len() < 32, "{}", bytes.len());
        let header = decode_header(&sealed.header_bytes).unwrap();
        let back = decode_body(header.header(), &spec, bytes).unwrap();
        let back = decode(&back, &spec).unwrap();
        assert!(back.iter().all(|&c| (c - 0.25).abs() < 1e-3), "{back:?}");
    }

    #[test]
    fn a_snapshot_carries_any_finite_range_and_refuses_non_finite_values() {
        let spec = spec();
        let origin = vec![0.0; 16];
        let mut params = vec![0.0; 16];
        // Far past f16's range: int8 with a scale carries it, to half a step per layer.
        params[13] = 1e6;
        params[12] = -3e5;
        let back = decode(&snapshot(&params, &origin, &spec).unwrap(), &spec).unwrap();
        let step = 1e6 / 127.0;
        assert!((back[13] - 1e6).abs() <= 1.0, "{}", back[13]);
        assert!((back[12] + 3e5).abs() <= step / 2.0, "{}", back[12]);
        params[13] = f32::NAN;
        assert_eq!(
            snapshot(&params, &origin, &spec),
            Err(ConsensusError::NonFinite { index: 13 })
        );
        params[13] = f32::MAX;
        params[12] = -f32::MAX;
        // The difference itself overflows: refused, not sent as infinity.
        let far = vec![-f32::MAX; 16];
        assert_eq!(
            snapshot(&params, &far, &spec),
            Err(ConsensusError::NonFinite { index: 13 })
        );
        assert!(matches!(
            snapshot(&params[..15], &origin, &spec),
            Err(ConsensusError::Length { .. })
        ));
        // Past the first layer: the index is still exact, and each layer has its own scale, so
        // a large value in one does not wash out a small one in another.
        let spec = ModelSpec::new(vec![
            LayerSpec::new("a", [3000], DType::F32),
            LayerSpec::new("b", [3, 3000], DType::F32),
        ])
        .unwrap();
        let origin = vec![0.5; 12_000];
        let mut params = origin.clone();
        params[9_001] = f32::INFINITY;
        assert_eq!(
            snapshot(&params, &origin, &spec),
            Err(ConsensusError::NonFinite { index: 9_001 })
        );
        params[9_001] = 0.25;
        params[7] = 1e4;
        let body = snapshot(&params, &origin, &spec).unwrap();
        let back = decode(&body, &spec).unwrap();
        assert_eq!(back[9_001], -0.25);
        assert!((back[7] - (1e4 - 0.5)).abs() < 1e-2);
        assert!(
            back.iter()
                .enumerate()
                .all(|(i, &x)| i == 9_001 || i == 7 || x == 0.0)
        );
    }

    #[test]
    fn a_mostly_zero_layer_goes_sparse_and_decodes_to_the_same_values() {
        let spec = ModelSpec::new(vec![
            LayerSpec::new("sparse", [1000], DType::F32),
            LayerSpec::new("dense", [100], DType::F32),
        ])
        .unwrap();
        let origin = vec![0.0; 1100];
        let mut params = origin.clone();
        // 50 of 1,000 values moved, one far enough that small ones quantise to zero too.
        for i in (0..1000).step_by(20) {
            params[i] = 0.01 * (i as f32 + 20.0);
        }
        params[3] = 1e-6;
        for (i, p) in params[1000..].iter_mut().enumerate() {
            *p = 1.0 + i as f32 * 0.01;
        }
        let body = snapshot(&params, &origin, &spec).unwrap();
        // Encoded a layer at a time, the same bytes and summary.
        let encoded = snapshot_encoded(&params, &origin, &spec).unwrap();
        assert_eq!(encoded.bytes, encode_body(&body));
        assert_eq!(encoded.compression, CompressionSummary::of(&body));
        let LayerPayload::TopK(t) = &body.layers[0] else {
            panic!("{:?}", body.layers[0].kind())
        };
        // Index 3 rounds to zero at this scale: it is not carried, as dense int8 would carry 0.
        assert_eq!(t.indices.len(), 50);
        assert!(matches!(
            body.layers[1],
            LayerPayload::Dense(DenseValues::Int8 { .. })
        ));
        assert!(
            encode_body(&body).len() < 1100 / 2,
            "{}",
            encode_body(&body).len()
        );
        // The same values as the dense int8 layer: zeros are exact, the rest within half a step.
        let back = decode(&body, &spec).unwrap();
        let step = 0.01 * 1000.0 / 127.0;
        for (i, (b, p)) in back.iter().zip(&params).take(1000).enumerate() {
            if i % 20 == 0 {
                assert!((b - p).abs() <= step / 2.0 + 1e-6, "{i}: {b} vs {p}");
            } else {
                assert_eq!(*b, 0.0, "{i}");
            }
        }
    }

    proptest! {
        #[test]
        fn a_snapshot_is_within_half_a_step_of_the_model(
            params in prop::collection::vec(-100.0f32..100.0, 16),
            origin in prop::collection::vec(-100.0f32..100.0, 16),
            moved in prop::collection::vec(prop::bool::weighted(0.3), 16),
        ) {
            // Parameters that did not move make mostly-zero layers, which go sparse.
            let params: Vec<f32> = params
                .iter()
                .zip(&origin)
                .zip(&moved)
                .map(|((&p, &o), &m)| if m { p } else { o })
                .collect();
            let spec = spec();
            let back = decode(&snapshot(&params, &origin, &spec).unwrap(), &spec).unwrap();
            for (i, &m) in moved.iter().enumerate() {
                prop_assert!(m || back[i] == 0.0, "{i}: {}", back[i]);
            }
            for range in [0..12, 12..16] {
                let max = range.clone().map(|i| (params[i] - origin[i]).abs()).fold(0f32, f32::max);
                for i in range {
                    let want = params[i] - origin[i];
                    // Half a step, plus f32 rounding of the difference and the product.
                    prop_assert!((back[i] - want).abs() <= max / 254.0 * 1.001 + 1e-5);
                }
            }
        }
    }

    #[test]
    fn a_far_snapshot_moves_the_node_no_farther_than_the_clip() {
        let origin = vec![0.0; 4];
        let mut mine = vec![0.0; 4];
        // Half the way to (100, 0, 0, 0) is a step of 50; the clip allows 2 · 5 = 10.
        let p = pull(
            &mut mine,
            &origin,
            &[100.0, 0.0, 0.0, 0.0],
            5.0,
            &PullConfig::default(),
        )
        .unwrap();
        assert!(p.clipped);
        assert!((p.wanted_norm - 50.0).abs() < 1e-9);
        assert!((p.step_norm - 10.0).abs() < 1e-9);
        assert!((mine[0] - 10.0).abs() < 1e-5 && mine[1] == 0.0);
    }

    #[test]
    fn bad_snapshots_and_configurations_change_nothing() {
        let origin = vec![0.0; 3];
        let mut mine = vec![1.0; 3];
        let cfg = PullConfig::default();
        assert_eq!(
            pull(&mut mine, &origin, &[0.0, f32::INFINITY, 0.0], 1.0, &cfg),
            Err(ConsensusError::NonFinite { index: 1 })
        );
        assert!(matches!(
            pull(&mut mine, &origin, &[0.0; 2], 1.0, &cfg),
            Err(ConsensusError::Length { .. })
        ));
        let bad = PullConfig { share: 0.0, ..cfg };
        assert!(matches!(
            pull(&mut mine, &origin, &[0.0; 3], 1.0, &bad),
            Err(ConsensusError::Config(_))
        ));
        assert_eq!(mine, vec![1.0; 3]);
    }

    proptest! {
        #[test]
        fn snapshot_partners_are_the_better_half_each_once_starting_at_the_pick(
            n in 0usize..40,
            word in any::<u64>(),
        ) {
            let partners: Vec<usize> = (0..n).collect();
            let order: Vec<usize> = snapshot_partners(&partners, word).collect();
            let half = n.div_ceil(2);
            prop_assert_eq!(order.len(), half);
            prop_assert_eq!(order.first().copied(), snapshot_partner(&partners, word));
            let mut sorted = order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..half).collect::<Vec<_>>());
        }

        #[test]
        fn a_pull_never_overshoots_the_partner_nor_the_clip(
            mine in prop::collection::vec(-10.0f32..10.0, 1..32),
            shift in -10.0f32..10.0,
            share in 0.01f32..=1.0,
            reference in 0.0f64..5.0,
        ) {
            let origin = vec![0.0; mine.len()];
            let partner: Vec<f32> = mine.iter().map(|x| x + shift).collect();
            let mut after = mine.clone();
            let cfg = PullConfig { share, max_step_ratio: 2.0 };
            let p = pull(&mut after, &origin, &partner, reference, &cfg).unwrap();
            prop_assert!(p.step_norm <= 2.0 * reference + 1e-6);
            prop_assert!(p.step_norm <= p.wanted_norm + 1e-6);
            for ((a, m), t) in after.iter().zip(&mine).zip(&partner) {
                // Every coordinate moves toward the partner and stops short of it.
                prop_assert!((a - m).abs() <= (t - m).abs() + 1e-4);
                prop_assert!((t - a).abs() <= (t - m).abs() + 1e-4);
            }
        }
    }
}
