//! The semantic workload: synthetic update embeddings with task clusters, hashed with the real
//! SimHash and keyed with the real band keys.
//!
//! An embedding lives in the space the real pipeline SimHashes (the count-sketch of the update),
//! of dimension `dim`. Node `i` belongs to task cluster `c(i)` and has a position `zᵢ` in a
//! `latent_dim`-dimensional space of within-task variation (its data mix), and its embedding is
//!
//! ```text
//! xᵢ = μ_c(i) + spread · A zᵢ + noise · εᵢ        (then normalised)
//! ```
//!
//! with random task centres `μ_c` (norm ≈ 1), a random `dim × latent_dim` map `A`, `zᵢ ~ N(0, I)`
//! and isotropic per-node noise `εᵢ` (minibatch noise, norm ≈ 1). Different tasks are nearly
//! orthogonal; within a task, nodes whose data mixes are close have close updates, so nearest
//! neighbours are well defined and get closer as the network grows. The run reports the cosine of
//! each querier's true k-th neighbour next to the recall, so the workload's difficulty is visible.

use kindred_kernels::SimHasher;
use kindred_proto::SimHash;
use kindred_routing::keys::{KeyConfig, ShardPolicy, next_shard_count};
use rayon::prelude::*;

/// Parameters of the synthetic embeddings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    /// Task clusters.
    pub clusters: usize,
    /// Embedding (sketch) dimension.
    pub dim: usize,
    /// Dimension of within-task variation.
    pub latent_dim: usize,
    /// Scale of within-task variation.
    pub spread: f32,
    /// Scale of per-node noise.
    pub noise: f32,
}

impl Default for Workload {
    /// 16 tasks in 64 dimensions, 8 latent dimensions at scale 0.3, noise 0.1.
    fn default() -> Self {
        Self {
            clusters: 16,
            dim: 64,
            latent_dim: 8,
            spread: 0.3,
            noise: 0.1,
        }
    }
}

/// Normalised embeddings of every node, and their task clusters.
#[derive(Debug, Clone)]
pub struct Embeddings {
    dim: usize,
    vecs: Vec<f32>,
    cluster: Vec<u16>,
}

impl Embeddings {
    /// Embeddings of `n` nodes from `seed`.
    pub fn generate(n: usize, w: &Workload, seed: u64) -> Self {
        let dim = w.dim.max(1);
        let d = w.latent_dim;
        let clusters = w.clusters.max(1);
        let scale = 1.0 / (dim as f64).sqrt();
        let mut rng = crate::rng::stream(seed, &[0xE1B]);
        let centres: Vec<f32> = (0..clusters * dim)
            .map(|_| (rng.next_gaussian() * scale) as f32)
            .collect();
        let map: Vec<f32> = (0..dim * d)
            .map(|_| (rng.next_gaussian() * scale) as f32)
            .collect();
        let mut vecs = vec![0f32; n * dim];
        let mut cluster = vec![0u16; n];
        vecs.par_chunks_mut(dim)
            .zip(cluster.par_iter_mut())
            .enumerate()
            .for_each(|(i, (x, c))| {
                let mut r = crate::rng::stream(seed, &[0xE1B, i as u64]);
                let ci = (r.next_u64() % clusters as u64) as usize;
                *c = ci as u16;
                let z: Vec<f32> = (0..d).map(|_| r.next_gaussian() as f32).collect();
                for (j, v) in x.iter_mut().enumerate() {
                    let mut acc = centres.get(ci * dim + j).copied().unwrap_or(0.0);
                    for (l, zl) in z.iter().enumerate() {
                        acc += w.spread * map.get(j * d + l).copied().unwrap_or(0.0) * zl;
                    }
                    acc += w.noise * (r.next_gaussian() * scale) as f32;
                    *v = acc;
                }
                let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                x.iter_mut().for_each(|v| *v /= norm);
            });
        Self { dim, vecs, cluster }
    }

    /// Dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Node `i`'s unit vector.
    pub fn vec(&self, i: u32) -> &[f32] {
        let a = i as usize * self.dim;
        self.vecs.get(a..a + self.dim).unwrap_or(&[])
    }

    /// Node `i`'s task cluster.
    pub fn cluster(&self, i: u32) -> u16 {
        self.cluster.get(i as usize).copied().unwrap_or(0)
    }

    /// Cosine similarity of nodes `i` and `j`.
    #[inline]
    pub fn cosine(&self, i: u32, j: u32) -> f32 {
        dot(self.vec(i), self.vec(j))
    }

    /// Bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.vecs.len() * 4 + self.cluster.len() * 2
    }
}

/// Dot product in 8 lanes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + ar.iter().zip(br).map(|(x, y)| x * y).sum::<f32>()
}

/// SimHash signatures (and, on demand, margins) of embeddings, by the kernels' SimHasher.
#[derive(Debug, Clone)]
pub struct Signatures {
    hasher: SimHasher,
    sigs: Vec<SimHash>,
}

/// Why signatures could not be computed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkloadError {
    /// The SimHash kernel refused the input.
    #[error("SimHash failed: {0}")]
    SimHash(#[from] kindred_kernels::SimHashError),
}

impl Signatures {
    /// Hash the embeddings of `nodes` (others get an all-zero signature) with the network-wide
    /// hyperplanes drawn from `seed`.
    ///
    /// # Errors
    /// [`WorkloadError::SimHash`] for an unusable dimension.
    pub fn compute(
        emb: &Embeddings,
        nodes: &[u32],
        n: usize,
        seed: u64,
    ) -> Result<Self, WorkloadError> {
        let hasher = SimHasher::new(seed, emb.dim())?;
        let hashed: Vec<Result<(u32, SimHash), WorkloadError>> = nodes
            .par_iter()
            .map(|&i| Ok((i, SimHash(hasher.hash(emb.vec(i))?.bits))))
            .collect();
        let mut sigs = vec![SimHash::default(); n];
        for h in hashed {
            let (i, s) = h?;
            if let Some(slot) = sigs.get_mut(i as usize) {
                *slot = s;
            }
        }
        Ok(Self { hasher, sigs })
    }

    /// Node `i`'s signature.
    pub fn sig(&self, i: u32) -> SimHash {
        self.sigs.get(i as usize).copied().unwrap_or_default()
    }

    /// The signature of any vector of the embeddings' dimension, and its per-bit margins.
    ///
    /// # Errors
    /// [`WorkloadError::SimHash`] if hashing fails.
    pub fn hash(&self, v: &[f32]) -> Result<(SimHash, Vec<f32>), WorkloadError> {
        let h = self.hasher.hash(v)?;
        Ok((SimHash(h.bits), h.margins.to_vec()))
    }

    /// Per-bit margins of node `i`'s signature (for multi-probe).
    ///
    /// # Errors
    /// [`WorkloadError::SimHash`] if hashing fails.
    pub fn margins(&self, emb: &Embeddings, i: u32) -> Result<Vec<f32>, WorkloadError> {
        Ok(self.hasher.hash(emb.vec(i))?.margins.to_vec())
    }
}

/// Steady-state shard counts of hot bands.
///
/// In the real system a node learns a band's shard count from the providers its lookups saw in
/// earlier windows ([`next_shard_count`], applied window after window). With a stable workload
/// that process settles at the fixed point computed here from the true number of announcers of
/// each `(band, value)`, given that a lookup of one shard sees at most `cap` of them (libp2p-kad
/// answers with at most `k` providers, and holders list them in the same order).
#[derive(Debug, Clone)]
pub struct Shards {
    /// Sorted `((band, value), shards)` for bands with more than one shard.
    hot: Vec<((u16, u64), u32)>,
}

impl Shards {
    /// Shard counts for the band values of `sigs` of `publishers` under `keys`.
    pub fn steady_state(
        sigs: &Signatures,
        publishers: &[u32],
        keys: KeyConfig,
        policy: ShardPolicy,
        cap: usize,
    ) -> Self {
        let list: Vec<SimHash> = publishers.iter().map(|&i| sigs.sig(i)).collect();
        Self::from_signatures(&list, keys, policy, cap)
    }

    /// Shard counts for the band values of the announced signatures `sigs`.
    pub fn from_signatures(
        sigs: &[SimHash],
        keys: KeyConfig,
        policy: ShardPolicy,
        cap: usize,
    ) -> Self {
        let mut bv: Vec<(u16, u64)> = sigs
            .par_iter()
            .flat_map_iter(|s| (0..keys.bands()).map(move |b| (b as u16, keys.band_value(s, b))))
            .collect();
        bv.par_sort_unstable();
        let mut hot = Vec::new();
        let mut i = 0;
        while i < bv.len() {
            let mut j = i;
            while bv.get(j) == bv.get(i) {
                j += 1;
            }
            let providers = j - i;
            let s = fixed_point(providers, policy, cap);
            if s > 1
                && let Some(&k) = bv.get(i)
            {
                hot.push((k, s));
            }
            i = j;
        }
        Self { hot }
    }

    /// Shards of `(band, value)` (1 unless hot).
    pub fn get(&self, band: u16, value: u64) -> u32 {
        self.hot
            .binary_search_by_key(&(band, value), |e| e.0)
            .ok()
            .and_then(|i| self.hot.get(i))
            .map_or(1, |e| e.1)
    }

    /// Number of hot `(band, value)` pairs.
    pub fn hot_count(&self) -> usize {
        self.hot.len()
    }
}

/// The shard count [`next_shard_count`] settles at for `providers` announcers when each shard
/// reports at most `cap`.
pub fn fixed_point(providers: usize, policy: ShardPolicy, cap: usize) -> u32 {
    let mut s = 1u32;
    for _ in 0..16 {
        let seen = providers.min(cap.saturating_mul(s as usize));
        let next = next_shard_count(s, seen, policy);
        if next == s {
            break;
        }
        s = next;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clusters_are_tight_inside_and_orthogonal_across() {
        let e = Embeddings::generate(2000, &Workload::default(), 3);
        let (mut same, mut other) = (Vec::new(), Vec::new());
        for i in 0..400u32 {
            let j = i + 1000;
            let c = e.cosine(i, j) as f64;
            if e.cluster(i) == e.cluster(j) {
                same.push(c);
            } else {
                other.push(c);
            }
        }
        let m = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        assert!(m(&same) > 0.4, "same-task mean {}", m(&same));
        assert!(m(&other).abs() < 0.1, "cross-task mean {}", m(&other));
        assert!((e.cosine(5, 5) - 1.0).abs() < 1e-5);
    }

    #[test]
    fn shard_fixed_point() {
        let p = ShardPolicy {
            threshold: 20,
            max_shards: 16,
        };
        assert_eq!(fixed_point(5, p, 64), 1);
        assert_eq!(fixed_point(30, p, 64), 2);
        assert_eq!(fixed_point(300, p, 64), 16);
        assert_eq!(fixed_point(100_000, p, 64), 16);
        // A lookup that sees at most `threshold` providers per shard splits as long as every
        // shard is saturated.
        let p = ShardPolicy {
            threshold: 5,
            max_shards: 16,
        };
        assert_eq!(fixed_point(4, p, 5), 1);
        assert_eq!(fixed_point(12, p, 5), 4);
        assert_eq!(fixed_point(1000, p, 5), 16);
    }
}
