//! SimHash (Charikar, 2002): 256 random Gaussian hyperplanes, one bit per side.
//!
//! For vectors at angle θ each bit differs with probability θ/π, which is what makes LSH bands of
//! the signature good DHT rendezvous keys. The hyperplanes are a pure function of a seed and the
//! dimension, so every node that uses the network-wide seed computes the same signature for the
//! same vector; a [`SimHasher`] draws them once and is then reused for every vector (the
//! simulator hashes thousands of virtual nodes with one).
//!
//! Besides the bits, each hash reports the *margin* of every bit, `|⟨gᵢ, v⟩| / ‖v‖`: the bits with
//! the smallest margins are the ones a similar vector most likely disagrees on, so multi-probe
//! lookups flip them first.

use crate::error::SimHashError;
use crate::rng::SplitMix64;
use crate::types::SimHashOutput;

/// Bits of a signature.
pub const SIMHASH_BITS: usize = 256;

/// Largest input dimension a [`SimHasher`] accepts (its matrix is `256 × dim` f32: 16 MiB here).
pub const MAX_SIMHASH_DIM: usize = 1 << 14;

/// Salt mixed into the seed so that a SimHash and a count-sketch given the same network seed
/// still draw independent randomness.
const SIMHASH_SALT: u64 = 0x5348_4153_4849_4d53;

/// Seeded Gaussian hyperplanes for 256-bit SimHash of `dim`-dimensional vectors.
///
/// ```
/// use kindred_kernels::SimHasher;
/// let hasher = SimHasher::new(7, 4)?;
/// let a = hasher.hash(&[1.0, 2.0, 3.0, 4.0])?;
/// let b = hasher.hash(&[2.0, 4.0, 6.0, 8.0])?; // same direction: same bits
/// assert_eq!(a.bits, b.bits);
/// let c = hasher.hash(&[-1.0, -2.0, -3.0, -4.0])?; // opposite: every bit flips
/// assert!(a.bits.iter().zip(&c.bits).all(|(x, y)| x ^ y == 0xff));
/// # Ok::<(), kindred_kernels::SimHashError>(())
/// ```
#[derive(Clone)]
pub struct SimHasher {
    seed: u64,
    dim: usize,
    /// Row-major `SIMHASH_BITS × dim`.
    planes: Vec<f32>,
}

impl std::fmt::Debug for SimHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHasher")
            .field("seed", &self.seed)
            .field("dim", &self.dim)
            .finish_non_exhaustive()
    }
}

impl SimHasher {
    /// Draw the hyperplanes for `seed` and `dim`.
    ///
    /// # Errors
    /// [`SimHashError::DimOutOfRange`] unless `1 ≤ dim ≤ MAX_SIMHASH_DIM`.
    pub fn new(seed: u64, dim: usize) -> Result<Self, SimHashError> {
        if dim == 0 || dim > MAX_SIMHASH_DIM {
            return Err(SimHashError::DimOutOfRange {
                dim,
                max: MAX_SIMHASH_DIM,
            });
        }
        let mut rng = SplitMix64::new(seed ^ SIMHASH_SALT);
        let planes = (0..SIMHASH_BITS * dim)
            .map(|_| rng.next_gaussian() as f32)
            .collect();
        Ok(Self { seed, dim, planes })
    }

    /// The seed the hyperplanes were drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The input dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Hash one vector. Each projection is summed in a fixed order, so the result is a pure
    /// function of the seed and the vector.
    ///
    /// # Errors
    /// [`SimHashError`] when `v.len() != self.dim()` or `v` holds a NaN or an infinity.
    pub fn hash(&self, v: &[f32]) -> Result<SimHashOutput, SimHashError> {
        if v.len() != self.dim {
            return Err(SimHashError::LengthMismatch {
                expected: self.dim,
                found: v.len(),
            });
        }
        if let Some((index, &value)) = v.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(SimHashError::NonFinite { index, value });
        }
        let norm = v
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt();
        let mut out = SimHashOutput {
            bits: [0; 32],
            margins: [0.0; SIMHASH_BITS],
        };
        for (bit, (plane, margin)) in self
            .planes
            .chunks_exact(self.dim)
            .zip(out.margins.iter_mut())
            .enumerate()
        {
            let p = dot(plane, v);
            if p > 0.0
                && let Some(byte) = out.bits.get_mut(bit / 8)
            {
                *byte |= 1 << (bit % 8);
            }
            *margin = if norm > 0.0 {
                (f64::from(p.abs()) / norm) as f32
            } else {
                0.0
            };
        }
        Ok(out)
    }
}

/// Dot product with 8 independent lanes, combined in a fixed order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut ac = a.chunks_exact(8);
    let mut bc = b.chunks_exact(8);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}
